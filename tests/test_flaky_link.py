"""A flaky network between a target and the draft daemon: a TCP fault proxy adds latency, resets
every connection every few seconds and stalls all traffic once for 2 s, while the target generates
back to back. Every output stays exactly the target's own greedy output, and speculation
resumes after each fault: ZeroMQ reconnects on its own; the new connection has a new routing
identity, so the client greets the daemon again (once its draft timed out, or on NO_HANDSHAKE)
and re-opens its session with the whole verified prefix (on UNKNOWN_SESSION)."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from dataclasses import dataclass

import pytest
import zmq

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import running_server, speculate
from faultproxy import FaultProxy
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import Backoff, DraftClient
from starsd_target.engine import GenerationStats, TargetEngine
from tiny_models import make_near_copy, reference_greedy


# ---------------------------------------------------------------- the proxy itself
class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
            self.server.closed.append("eof")
        except ConnectionResetError:
            self.server.closed.append("reset")


@pytest.fixture
def echo_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    server.closed = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _connect(proxy: FaultProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=10)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _bytes_each_way(deliveries) -> dict[str, int]:
    return {way: sum(d.size for d in deliveries if d.way == way) for way in ("up", "down")}


def test_proxy_adds_latency_and_keeps_byte_order(echo_server):
    with FaultProxy("127.0.0.1", echo_server.server_address[1], latency_s=0.1) as proxy:
        with _connect(proxy) as s:
            s.sendall(b"ping")
            assert _recv_exactly(s, 4) == b"ping"
            ping = list(proxy.deliveries)
            # many small writes come back whole and in order despite per-chunk delays
            payload = b"".join(i.to_bytes(4, "big") for i in range(5000))
            for i in range(0, len(payload), 700):
                s.sendall(payload[i: i + 700])
            assert _recv_exactly(s, len(payload)) == payload
    # the ping went up and came back down, and every chunk each way was held for the latency: read
    # from the proxy's own record of what it did, not from how long the test took
    assert _bytes_each_way(ping) == {"up": 4, "down": 4}, ping
    assert _bytes_each_way(proxy.deliveries) == {"up": 4 + len(payload), "down": 4 + len(payload)}
    for d in proxy.deliveries:
        assert d.due == pytest.approx(d.read_at + 0.1) and d.sent_at >= d.due, d


def test_proxy_reset_is_seen_by_both_sides_and_new_connections_work(echo_server):
    with FaultProxy("127.0.0.1", echo_server.server_address[1]) as proxy:
        s = _connect(proxy)
        s.sendall(b"hi")
        assert _recv_exactly(s, 2) == b"hi"
        assert proxy.reset_all() == 1
        with pytest.raises(ConnectionError):  # reset (or, at worst, closed) seen by the client
            while True:
                if not s.recv(100):
                    raise ConnectionError("closed")
        s.close()
        deadline = time.monotonic() + 5
        while not echo_server.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert echo_server.closed == ["reset"]  # the upstream side saw the reset too
        with _connect(proxy) as s2:
            s2.sendall(b"again")
            assert _recv_exactly(s2, 5) == b"again"
        assert proxy.connections == 2 and [e.kind for e in proxy.events] == ["reset"]


def test_proxy_stall_holds_bytes_then_delivers_them(echo_server):
    with FaultProxy("127.0.0.1", echo_server.server_address[1]) as proxy:
        with _connect(proxy) as s:
            s.sendall(b"warm")
            assert _recv_exactly(s, 4) == b"warm"
            proxy.stall(0.3)
            s.sendall(b"first")
            s.sendall(b"second")
            assert _recv_exactly(s, 11) == b"firstsecond"
            stall = proxy.events[-1]
            # nothing went through while stalled, either way: the proxy's record of what it did
            held = [d for d in proxy.deliveries if d.read_at >= stall.start]
            assert _bytes_each_way(held) == {"up": 11, "down": 11}, held
            assert all(d.sent_at >= stall.end for d in held), (stall, held)
            # and forwarding is normal again afterwards
            s.sendall(b"after")
            assert _recv_exactly(s, 5) == b"after"
    assert [e.kind for e in proxy.events] == ["stall"]


# ---------------------------------------------------------------- speculation through faults
PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n", "for i in range(10):"]
MAX_TOKENS = 96
ROUND_S = 0.03  # the shortest round (see RecordingDrafts)
MARGIN_S = 0.3  # "after a fault" means starting at least this long after it ended
INTO_GENERATION_S = 0.25  # faults strike this long after a generation started, so they hit mid-flight
GAP_S = 0.6  # at least this long between the end of one fault and the next


class RoundRecorder:
    """The scheduler's round observer for one generation: records each round that asked for
    drafts as [when it ended, got drafts, drafts kept].

    Rounds are paced to at least ROUND_S, as a real target's forward pass would pace them (the
    tiny test model verifies in about a millisecond): otherwise a generation cut by a fault would
    finish on its own before the link could come back, and recovery within one generation, with
    the session re-opened on the new connection, could not be observed."""

    def __init__(self):
        self.rounds: list[list] = []
        self._last = time.monotonic()

    def __call__(self, gen, kept, wanted, verify_s) -> None:
        if wanted:
            self.rounds.append([time.monotonic(), kept is not None, kept or 0])
        time.sleep(max(0.0, self._last + ROUND_S - time.monotonic()))
        self._last = time.monotonic()


@dataclass
class Run:
    prompt: int
    start: float
    end: float
    token_ids: list[int]
    stats: GenerationStats
    rounds: list[list]


@pytest.fixture(scope="module")
def near_draft(tiny_target, tmp_path_factory):
    return make_near_copy(tiny_target, tmp_path_factory.mktemp("near"), noise=0.02)


def _recovered(runs: list[Run], since: float) -> bool:
    """A finished generation that started after ``since`` (+ margin) kept some drafts."""
    return any(r.start > since + MARGIN_S and r.stats.accepted > 0 for r in list(runs))


def _inject_faults(proxy: FaultProxy, runs: list[Run], started: list[float], t0: float,
                   stop: threading.Event, done: threading.Event) -> None:
    """Resets every few seconds with one 2 s stall among them, each striking mid-generation. The
    next fault waits until speculation has come back after the previous one (on a slow machine
    the schedule stretches instead of faults piling up; if it never comes back, the test's
    deadline fails it)."""
    plan = [("reset", 0.0), ("reset", 0.0), ("stall", 2.0), ("reset", 0.0)]
    not_before, since = t0 + 1.5, t0 - 1.0
    try:
        for kind, seconds in plan:
            while not (time.monotonic() >= not_before and _recovered(runs, since)):
                if stop.wait(0.02):
                    return
            n = len(started)  # wait for the next generation to start, then strike during it
            while len(started) == n:
                if stop.wait(0.005):
                    return
            if stop.wait(max(0.0, started[-1] + INTO_GENERATION_S - time.monotonic())):
                return
            if kind == "reset":
                proxy.reset_all()
            else:
                proxy.stall(seconds)
            since = proxy.events[-1].end
            not_before = since + GAP_S
    finally:
        done.set()


@pytest.mark.slow
def test_generations_stay_exact_and_speculation_resumes_after_every_fault(tiny_target, near_draft, loaded_target):
    engine = TargetEngine(loaded_target, depth=4)
    prompts = [engine.encode(p) for p in PROMPTS]
    refs = [reference_greedy(tiny_target, ids, MAX_TOKENS) for ids in prompts]
    backend = ModelBackend(load_causal_lm(str(near_draft)))
    runs: list[Run] = []
    started: list[float] = []
    with running_server(backend) as (server, _), FaultProxy.for_endpoint(server.endpoint, latency_s=0.02) as proxy:
        ctx = zmq.Context()
        client = DraftClient(proxy.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, name="flaky",
                             ctx=ctx, backoff=Backoff(initial_s=0.1, cap_s=1.0))
        stop, faults_done = threading.Event(), threading.Event()
        t0 = time.monotonic()
        chaos = threading.Thread(target=_inject_faults, args=(proxy, runs, started, t0, stop, faults_done),
                                 daemon=True)
        chaos.start()
        try:
            hard_deadline = t0 + 120.0  # normally ~20 s; only reached if speculation never resumes
            i = 0
            while time.monotonic() < hard_deadline:
                rec = RoundRecorder()
                started.append(time.monotonic())
                res = speculate(engine, client, prompts[i % len(prompts)], MAX_TOKENS, SamplingParams(), 0.5,
                                on_round=rec)
                runs.append(Run(i % len(prompts), started[-1], time.monotonic(), res.token_ids, res.stats,
                                rec.rounds))
                i += 1
                if faults_done.is_set() and proxy.events and _recovered(runs, proxy.events[-1].end):
                    break
        finally:
            stop.set()
            chaos.join(10)
            client.close()
            ctx.destroy(linger=0)

    events = proxy.events
    timeline = [(round(r.start - t0, 2), round(r.end - t0, 2), r.stats.accepted, r.stats.fallback_rounds)
                for r in runs]
    faults = [(e.kind, round(e.start - t0, 2), round(e.end - t0, 2)) for e in events]
    assert [e.kind for e in events] == ["reset", "reset", "stall", "reset"], (faults, timeline)
    for r in runs:  # lossless through every fault
        assert r.token_ids == refs[r.prompt], f"generation of prompt {r.prompt} at {r.start - t0:.1f}s differs"
    assert sum(r.stats.fallback_rounds for r in runs) > 0, "no round fell back: the faults did not bite"
    assert any(r.end < events[0].start and r.stats.accepted > 0 for r in runs), "no speculation before faults"
    for k, e in enumerate(events):
        # every fault struck a generation in flight, and its rounds right after the fault got no drafts
        hit = [r for r in runs if r.start < e.start < r.end]
        assert len(hit) == 1, (e, faults, timeline)
        assert any(t > e.start and not got for t, got, _ in hit[0].rounds), (e, faults, timeline)
        # after each fault, a generation that started once it was over (and ended before the next
        # fault) kept drafts: the link came back every time
        next_start = events[k + 1].start if k + 1 < len(events) else float("inf")
        assert any(r.start > e.end + MARGIN_S and r.end < next_start and r.stats.accepted > 0 for r in runs), \
            f"no speculation after the {e.kind} at {e.start - t0:.1f}s; faults {faults}; runs {timeline}"
        if e.kind == "reset":
            # ... and already within the generation the reset cut: the client greeted the daemon
            # again on the new connection and re-opened the session with the whole prefix
            assert any(t > e.end and kept > 0 for t, _, kept in hit[0].rounds), \
                f"the generation cut by the reset at {e.start - t0:.1f}s never speculated again; {timeline}"
    resets = sum(e.kind == "reset" for e in events)
    assert client.reconnects >= 1 + resets  # the first greeting, then one more after each reset
    assert proxy.connections >= 1 + resets  # ZeroMQ reconnected by itself after each reset
