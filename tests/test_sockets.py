"""``WakingQueue``: a reply put by the scheduler's thread wakes the job socket's poll at once,
and no wake-up is lost between a poll and the replies it sends."""

import queue
import select
import threading

import pytest
import zmq

from common.sockets import WakingQueue


def readable(q: WakingQueue) -> bool:
    return bool(select.select([q.fd], [], [], 0)[0])


def test_a_put_wakes_a_poll_and_clear_keeps_the_items():
    q = WakingQueue()
    try:
        assert not readable(q)
        t = threading.Thread(target=q.put, args=(("client", "reply"),))
        t.start()
        t.join()
        poller = zmq.Poller()
        poller.register(q.fd, zmq.POLLIN)
        assert dict(poller.poll(0)).get(q.fd) == zmq.POLLIN  # as the job socket's loop polls it
        q.clear()
        assert not readable(q)
        assert q.get_nowait() == ("client", "reply")  # the wake-up went, the item stayed
        with pytest.raises(queue.Empty):
            q.get_nowait()
        q.put("late")  # after the clear, before the next poll: the next poll wakes for it
        assert readable(q)
        assert q.get(timeout=1) == "late"
    finally:
        q.close()


def test_puts_never_block_and_a_closed_queue_takes_items_quietly():
    q = WakingQueue()
    n = 100_000  # more wake-ups than a pipe holds: the rest are dropped, the reader is awake anyway
    t = threading.Thread(target=lambda: [q.put(i) for i in range(n)])
    t.start()
    t.join(60)
    assert not t.is_alive() and readable(q)
    assert [q.get_nowait() for _ in range(n)] == list(range(n))
    q.close()
    q.put("after")  # a job finishing during shutdown: no write to a closed descriptor, no error
    q.clear()
    q.close()
    assert q.get_nowait() == "after"
