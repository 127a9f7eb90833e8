"""The target's draft link: every reply reaches the request that waits for it, the link's state
moves DOWN -> CONNECTING -> UP without ever blocking the round loop, and the wait for drafts
adapts to the measured round trip (RFC 6298's estimator), so a hung daemon costs rounds
milliseconds, not the configured timeout. Real sockets on 127.0.0.1; no assertion on time."""

import contextlib
import os
import signal
import threading
import time

import pytest
import zmq

from common import protocol as P
from common.models import load_causal_lm
from common.protocol import Message, MsgType
from common.sockets import SocketOptions, free_tcp_endpoint, make_socket
from common.verify import SamplingParams
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.server import DraftServer, ServerConfig
from starsd_target.client import Backoff, DraftClient, DraftReply, HandshakeRefused, LinkState
from starsd_target.drafts import RemoteDraftSession
from starsd_target.engine import TargetEngine
from starsd_target.rtt import ACK_FLOOR_S, RttEstimator
from starsd_target.scheduler import Job, Scheduler
from tiny_models import reference_greedy

PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n", "for i in range(10):",
           "while True:\n", "x = [1, 2, 3]\n", "print('hello')\n", "return None\n"]
CAP_S = 2.0  # the configured --draft-timeout: what a wait may never exceed


@pytest.fixture(scope="module")
def engine(loaded_target):
    return TargetEngine(loaded_target, depth=4)


# ---------------------------------------------------------------- the estimator
def test_deadline_is_the_cap_before_any_sample():
    assert RttEstimator(floor_s=0.005).deadline_s(2.0) == 2.0


def test_rtt_estimator_follows_rfc_6298():
    est = RttEstimator(floor_s=0.001)
    est.observe(0.040)  # first sample: srtt = R, rttvar = R / 2
    assert est.srtt == pytest.approx(0.040) and est.rttvar == pytest.approx(0.020)
    assert est.deadline_s(2.0) == pytest.approx(0.040 + 4 * 0.020)
    est.observe(0.020)  # rttvar = 3/4 rttvar + 1/4 |srtt - R|, then srtt = 7/8 srtt + 1/8 R
    rttvar = 0.75 * 0.020 + 0.25 * abs(0.040 - 0.020)
    srtt = 0.875 * 0.040 + 0.125 * 0.020
    assert est.rttvar == pytest.approx(rttvar) and est.srtt == pytest.approx(srtt)
    assert est.deadline_s(2.0) == pytest.approx(srtt + 4 * rttvar)


def test_deadline_is_clamped_between_floor_and_cap():
    fast = RttEstimator(floor_s=0.008)
    for _ in range(50):
        fast.observe(0.0002)
    assert fast.deadline_s(2.0) == 0.008
    slow = RttEstimator(floor_s=0.008)
    slow.observe(5.0)
    assert slow.deadline_s(2.0) == 2.0


# ---------------------------------------------------------------- routing and state, with a scripted daemon
class ScriptedDaemon:
    """A ROUTER the test answers by hand: the client's view of a draft daemon, message by message."""

    def __init__(self, ctx: zmq.Context, endpoint: str | None = None):
        self.sock = make_socket(ctx, zmq.ROUTER, SocketOptions())
        self.sock.bind(endpoint or "tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer: bytes | None = None

    def recv(self, timeout_s: float = 10.0) -> Message:
        assert self.sock.poll(int(timeout_s * 1000)), "nothing came from the target"
        self.peer, *frames = self.sock.recv_multipart()
        return P.decode(frames)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart([self.peer, *P.encode(msg)])

    def welcome(self, loaded, instance: str = "i1", vocab: int | None = None) -> None:
        self.send(Message(MsgType.WELCOME, {"vocab_size": vocab or loaded.vocab_size, "tokenizer": loaded.fingerprint,
                                            "backend": "scripted", "max_depth": 4, "q_topk": 0, "feature_size": 0,
                                            "instance": instance, "server": "scripted"}))

    def drafted(self, session: int, seq: int, tokens: list[int]) -> None:
        self.send(Message(MsgType.DRAFTED, {"session": session, "seq": seq, "tokens": tokens}))

    def close(self) -> None:
        self.sock.close(linger=0)


def _until(cond, client: DraftClient, limit: int = 500) -> bool:
    """Poll the client until ``cond()`` holds (each poll waits at most 20 ms for a message)."""
    for _ in range(limit):
        if cond():
            return True
        client.poll(0.02)
    return cond()


def _greet(daemon: ScriptedDaemon, client: DraftClient, loaded) -> None:
    assert _until(lambda: client.state is LinkState.CONNECTING, client)
    assert daemon.recv().type is MsgType.HELLO
    daemon.welcome(loaded)
    assert _until(lambda: client.up, client)


NO_BACKOFF = Backoff(0.0, 0.0)


@contextlib.contextmanager
def scripted(loaded_target, backoff=NO_BACKOFF):
    ctx = zmq.Context()
    daemon = ScriptedDaemon(ctx)
    client = DraftClient(daemon.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx,
                         backoff=backoff)
    try:
        yield daemon, client
    finally:
        client.close()
        daemon.close()
        ctx.destroy(linger=0)


def test_link_goes_down_connecting_up_without_waiting(loaded_target):
    with scripted(loaded_target) as (daemon, client):
        assert client.state is LinkState.DOWN
        assert _until(lambda: client.state is LinkState.CONNECTING, client)  # HELLO sent, nothing waited for
        assert daemon.recv().type is MsgType.HELLO
        assert not client.ready()  # no WELCOME yet: the round runs without drafts, at once
        daemon.welcome(loaded_target)
        assert _until(lambda: client.up, client)
        assert client.reconnects == 1 and client.welcome.instance == "i1"
        daemon.send(Message(MsgType.GOODBYE, {"instance": "i1"}))
        assert _until(lambda: client.state is not LinkState.UP, client)
        # with no backoff the next HELLO goes at once; a new instance answers
        assert _until(lambda: client.state is LinkState.CONNECTING, client)
        while daemon.recv().type is not MsgType.HELLO:
            pass
        daemon.welcome(loaded_target, instance="i2")
        assert _until(lambda: client.up, client)
        assert client.reconnects == 2 and client.welcome.instance == "i2"


def test_a_mismatched_welcome_is_a_refusal(loaded_target):
    with scripted(loaded_target, backoff=Backoff(10.0, 10.0)) as (daemon, client):
        assert _until(lambda: client.state is LinkState.CONNECTING, client)
        assert daemon.recv().type is MsgType.HELLO
        daemon.welcome(loaded_target, vocab=loaded_target.vocab_size + 1)
        assert _until(lambda: client.refusal is not None, client)
        assert isinstance(client.refusal, HandshakeRefused) and client.state is LinkState.DOWN


def test_every_reply_reaches_its_request_in_any_order(loaded_target):
    """The bug this link fixes: a new generation's send() used to read the socket and throw away
    the replies of the other generations in flight as stale."""
    with scripted(loaded_target) as (daemon, client):
        _greet(daemon, client, loaded_target)
        for sid in (1, 2, 3):
            assert client.request(sid, 1, 0, [5], 3, 4)
        for _ in range(3):
            assert daemon.recv().type is MsgType.DRAFT
        daemon.drafted(3, 1, [30])
        daemon.drafted(1, 1, [10])
        assert _until(lambda: client.heard_at > 0 and not client.waiting(1, 1), client)
        assert client.ready()  # what a new generation's send() does: it must not eat replies
        assert client.request(4, 1, 0, [5], 3, 4)
        daemon.recv()
        daemon.drafted(2, 1, [20])
        daemon.drafted(4, 1, [40])
        assert _until(lambda: not client.waiting(2, 1) and not client.waiting(4, 1), client)
        for sid in (4, 2, 1, 3):
            reply = client.take(sid, 1)
            assert isinstance(reply, DraftReply) and reply.tokens == [10 * sid]
        assert client.stale_replies == 0 and client.unexpected == 0
        # a reply whose session gave up on it is stale, and nothing else is
        assert client.request(1, 2, 0, [6], 4, 4)
        daemon.recv()
        client.abandon(1, 2)
        daemon.drafted(1, 2, [11])
        daemon.drafted(9, 9, [99])  # never asked for: unexpected, not stale
        assert _until(lambda: client.stale_replies + client.unexpected == 2, client)
        assert client.stale_replies == 1 and client.unexpected == 1
        assert client.take(1, 2) is None


def test_repeated_misses_take_the_link_down_one_does_not(loaded_target):
    with scripted(loaded_target, backoff=Backoff(10.0, 10.0)) as (daemon, client):
        _greet(daemon, client, loaded_target)
        client.miss()
        assert client.up  # one late reply: that round ran alone, the link stays up for everyone
        daemon.send(Message(MsgType.PONG, {"instance": "i1", "draining": False}))
        assert client.request(1, 1, 0, [5], 3, 4)
        daemon.recv()
        daemon.drafted(1, 1, [7])
        assert _until(lambda: client.take(1, 1) is not None, client)
        assert client.misses == 0 and client.up  # an answer ends the run of misses
        for _ in range(DraftClient.MISSES_TO_DOWN):
            client.miss()
        assert client.state is LinkState.DOWN and client.missed == 1 + DraftClient.MISSES_TO_DOWN


def test_a_request_waits_for_its_ack_a_round_trip_then_for_the_daemons_estimate(loaded_target):
    with scripted(loaded_target, backoff=Backoff(10.0, 10.0)) as (daemon, client):
        _greet(daemon, client, loaded_target)
        assert client.ack_rtt.samples == 1  # the WELCOME measured the round trip to the daemon's socket thread
        ack_wait = client.ack_deadline_s(CAP_S)
        assert ACK_FLOOR_S <= ack_wait < CAP_S
        assert client.request(1, 1, 0, [5], 3, 4)
        sent = client._pending[(1, 1)]
        assert daemon.recv().type is MsgType.DRAFT
        # not acknowledged: given up one acknowledgement's deadline after it was sent
        assert client.give_up_at((1, 1), sent, CAP_S) == pytest.approx(sent + ack_wait)
        daemon.send(Message(MsgType.ACK, {"session": 1, "seq": 1, "ahead": 2, "eta_us": 300_000}))
        assert _until(lambda: client.acked((1, 1)), client)
        acked_at = client._acks[(1, 1)][0]
        wait = client.ack_deadline_s(CAP_S)  # the ACK measured one more round trip
        assert client.ack_rtt.samples == 2
        # acknowledged: the daemon's estimate with slack, plus a round trip's deadline; within the cap
        assert client.give_up_at((1, 1), sent, CAP_S) == pytest.approx(acked_at + DraftClient.ETA_SLACK * 0.3 + wait)
        assert client.give_up_at((1, 1), sent, 0.1) == pytest.approx(sent + 0.1)
        client.patience = 4.0  # --draft-patience: the estimate counts four times
        assert client.give_up_at((1, 1), sent, CAP_S) == pytest.approx(acked_at + 4.0 * 0.3 + wait)
        client.patience = DraftClient.ETA_SLACK
        assert not client.expired((1, 1), sent, CAP_S)
        daemon.drafted(1, 1, [7])
        assert _until(lambda: client.take(1, 1) is not None, client)
        assert not client.acked((1, 1))  # answered: nothing of it is kept
        # an ACK for a request nobody waits for is dropped without a count
        daemon.send(Message(MsgType.ACK, {"session": 9, "seq": 9, "ahead": 0, "eta_us": 1}))
        client.poll(0.2)
        assert client.unexpected == 0 and not client.acked((9, 9))


def test_no_ack_makes_the_link_suspect_until_the_daemon_is_heard(loaded_target):
    with scripted(loaded_target, backoff=Backoff(10.0, 10.0)) as (daemon, client):
        _greet(daemon, client, loaded_target)
        drafts = RemoteDraftSession(client, client.next_session(), SamplingParams(), CAP_S)
        assert drafts.send([1, 2, 3], 4) == 1
        assert daemon.recv().type is MsgType.OPEN and daemon.recv().type is MsgType.DRAFT
        # the opening request, which carries the prompt, waits for its ACK a round trip as any other
        assert drafts.wake_at == pytest.approx(drafts.sent_at + client.ack_deadline_s(CAP_S))
        assert not drafts.expired(idle=False)  # with other rounds to verify the target never gives up early
        assert _until(lambda: drafts.expired(), client)
        assert drafts.resolve(None) is None
        assert client.suspect and client.unacked == 1 and client.up  # suspect, not down: one round ran alone
        # while suspect, a request is not waited for at all when the target is idle
        assert drafts.send([1, 2, 3, 4], 4) == 2
        assert daemon.recv().type is MsgType.DRAFT
        assert drafts.expired()
        drafts.resolve(None)
        assert client.unacked == 2
        # anything from the daemon ends the suspicion; an acknowledged request waits for its reply
        assert drafts.send([1, 2, 3, 4, 5], 4) == 3
        assert daemon.recv().type is MsgType.DRAFT
        daemon.send(Message(MsgType.ACK, {"session": drafts.session, "seq": 3, "ahead": 0, "eta_us": 200_000}))
        assert _until(lambda: not client.suspect, client)
        assert not drafts.expired()
        daemon.drafted(drafts.session, 3, [9, 9])
        assert _until(lambda: client.take(drafts.session, 3) is not None, client)
        assert client.misses == 0  # a reply ended the run of misses


def test_a_seeded_sampled_generation_waits_for_its_drafts_up_to_the_cap_while_the_daemon_answers(loaded_target):
    """A round without drafts draws other random numbers than one with them: a seeded generation
    that gave its request up by the round trip or the estimate would give other tokens on a
    busier host, so while the daemon has been answering it waits up to the cap, acknowledged or
    not; an unseeded one gives up by them. Once a request has gone unanswered, a seeded one is
    given up by the estimate too."""
    with scripted(loaded_target, backoff=Backoff(10.0, 10.0)) as (daemon, client):
        _greet(daemon, client, loaded_target)
        seeded = RemoteDraftSession(client, client.next_session(), SamplingParams(0.8, seed=7), CAP_S)
        unseeded = RemoteDraftSession(client, client.next_session(), SamplingParams(0.8), CAP_S)
        for drafts in (seeded, unseeded):
            assert drafts.send([1, 2, 3], 4) == 1
            assert daemon.recv().type is MsgType.OPEN and daemon.recv().type is MsgType.DRAFT
        daemon.send(Message(MsgType.ACK, {"session": unseeded.session, "seq": 1, "ahead": 0, "eta_us": 1_000}))
        assert _until(lambda: unseeded.expired(), client)  # past the estimate and a round trip
        # the seeded request, never acknowledged, is past the link's deadline too, and waits on
        assert client.expired((seeded.session, 1), seeded.sent_at, CAP_S)
        assert not seeded.expired() and seeded.wake_at == seeded.cap_at == pytest.approx(seeded.sent_at + CAP_S)
        daemon.send(Message(MsgType.ACK, {"session": seeded.session, "seq": 1, "ahead": 0, "eta_us": 1_000}))
        daemon.drafted(seeded.session, 1, [9, 9])
        assert _until(lambda: client.replied(seeded.session, 1), client)
        assert seeded.resolve(client.take(seeded.session, 1)).tokens == [9, 9]
        # a request that went unanswered: the next seeded one is given up by the estimate
        assert unseeded.resolve(None) is None and client.misses == 1 and client.up
        assert seeded.send([1, 2, 3, 9, 9, 4], 4) == 2
        assert daemon.recv().type is MsgType.DRAFT
        daemon.send(Message(MsgType.ACK, {"session": seeded.session, "seq": 2, "ahead": 0, "eta_us": 1_000}))
        assert _until(lambda: client.acked((seeded.session, 2)), client)
        assert seeded.wake_at == client.give_up_at((seeded.session, 2), seeded.sent_at, CAP_S) < seeded.cap_at
        assert _until(lambda: seeded.expired(), client)


# ---------------------------------------------------------------- many generations, a healthy daemon
@pytest.mark.slow
def test_concurrent_generations_keep_all_their_drafts(tiny_target, near_draft, engine, star):
    """More jobs than max_active, so generations start while others have replies in flight."""
    ep = star.draftd(near_draft)
    ctx = zmq.Context()
    try:
        client = DraftClient(ep, engine.loaded.vocab_size, engine.loaded.fingerprint, ctx=ctx)
        client.handshake(60)
        sched = Scheduler(engine, lambda: client, draft_timeout_s=CAP_S, max_active=4)
        sched.start()
        prompts = [engine.encode(p) for p in PROMPTS]
        futures = [sched.submit(Job(ids, 48, SamplingParams())) for ids in prompts]
        results = [f.result(300) for f in futures]
        sched.stop()
        client.close()
    finally:
        ctx.destroy(linger=0)
    for ids, r in zip(prompts, results):
        assert r.token_ids == reference_greedy(tiny_target, ids, 48)
        assert r.stats.fallback_rounds == 0, r.stats
        assert r.stats.accepted > 0
    assert client.stale_replies == 0 and client.unexpected == 0 and client.missed == 0
    assert client.reconnects == 1  # the link never went down


# ---------------------------------------------------------------- a hung daemon
@pytest.mark.slow
def test_a_stopped_draft_daemon_costs_rounds_an_adaptive_deadline_and_speculation_resumes(
        tiny_target, near_draft, engine, star):
    ctx = zmq.Context()
    rounds: list[tuple[str, LinkState, int | None]] = []  # (phase, link state after the round, drafts kept)
    miss_deadlines: list[float] = []
    phase = ["before"]
    proc = None
    try:
        ep = star.draftd(near_draft)
        proc = star.procs["draftd"]
        client = DraftClient(ep, engine.loaded.vocab_size, engine.loaded.fingerprint, ctx=ctx,
                             backoff=Backoff(0.02, 0.1))
        client.handshake(60)
        counted_miss = client.miss

        def miss(acked=True):  # the deadline the client had computed when it gave a request up
            miss_deadlines.append(client.ack_deadline_s(CAP_S))
            counted_miss(acked)
        client.miss = miss

        def on_round(gen, n, wanted, verify_s):
            time.sleep(0.003)  # a slower target's forward: the generation outlasts the fault
            rounds.append((phase[0], client.state, n))
            if phase[0] == "before" and sum(1 for r in rounds if r[2]) >= 10:
                os.kill(proc.pid, signal.SIGSTOP)  # TCP stays up; nothing answers
                phase[0] = "stopped"
            elif phase[0] == "stopped" and sum(1 for r in rounds if r[0] == "stopped" and r[1] is not LinkState.UP) >= 20:
                os.kill(proc.pid, signal.SIGCONT)
                phase[0] = "resumed"

        sched = Scheduler(engine, lambda: client, draft_timeout_s=CAP_S, max_active=1)
        sched.on_round = on_round
        prompt = engine.encode(PROMPTS[0])
        results = [sched.run_one(Job(prompt, 400, SamplingParams()))]
        hard_deadline = time.monotonic() + 120
        while not any(p == "resumed" and kept for p, _, kept in rounds) and time.monotonic() < hard_deadline:
            results.append(sched.run_one(Job(prompt, 400, SamplingParams())))  # only on a very slow machine
        client.close()
    finally:
        if proc is not None and phase[0] == "stopped":
            os.kill(proc.pid, signal.SIGCONT)
        ctx.destroy(linger=0)
    ref = reference_greedy(tiny_target, prompt, 400)
    assert all(r.token_ids == ref for r in results)
    stopped = [r for r in rounds if r[0] == "stopped"]
    assert results[0].stats.fallback_rounds >= DraftClient.MISSES_TO_DOWN
    # the requests the stopped daemon never answered were given up at the adaptive deadline, not the cap
    assert len(miss_deadlines) >= DraftClient.MISSES_TO_DOWN
    assert all(dl < CAP_S for dl in miss_deadlines), miss_deadlines
    assert client.missed == len(miss_deadlines)
    assert client.unacked >= 1  # given up because the daemon did not acknowledge them
    # ... then the link was down, and verification went on without drafts meanwhile
    assert sum(1 for _, state, kept in stopped if state is not LinkState.UP and kept is None) >= 20
    # after SIGCONT the link came back and drafts were kept again
    assert any(p == "resumed" and state is LinkState.UP and kept for p, state, kept in rounds)
    assert client.reconnects >= 2
    # the daemon answered the given-up requests once it ran again: those, and only those, are stale
    assert client.stale_replies <= client.missed and client.unexpected == 0


# ---------------------------------------------------------------- an unreachable daemon
@contextlib.contextmanager
def draft_server_at(endpoint: str, backend):
    """A draft server on ``endpoint``, once the socket closed there has let the port go."""
    ctx = zmq.Context()
    for _ in range(500):
        server = DraftServer(backend, ServerConfig(bind=endpoint), ctx)
        try:
            server.bind()
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.01)  # bind() closed the socket it could not bind
    else:
        raise RuntimeError(f"{endpoint} stayed in use")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_reconnecting_never_blocks_a_round(tiny_target, near_draft, engine):
    """A daemon that takes the connection and never answers (HELLOs queue up unanswered), then a
    real one on the same endpoint: rounds go on all along, and the WELCOME is taken mid-generation."""
    ep = free_tcp_endpoint()
    ctx = zmq.Context()
    backend = ModelBackend(load_causal_lm(str(near_draft)))
    black_hole = make_socket(ctx, zmq.ROUTER, SocketOptions())
    black_hole.bind(ep)
    client = DraftClient(ep, engine.loaded.vocab_size, engine.loaded.fingerprint, ctx=ctx,
                         backoff=Backoff(0.01, 0.05))
    blocking_calls = []
    client.handshake = lambda *a, **kw: blocking_calls.append(a)  # serving must never wait for a handshake
    rounds: list[tuple[str, LinkState, int, int | None]] = []  # (phase, state, HELLOs so far, drafts kept)
    phase = ["black hole"]

    def on_round(gen, n, wanted, verify_s):
        time.sleep(0.003)
        rounds.append((phase[0], client.state, client.hellos, n))

    sched = Scheduler(engine, lambda: client, draft_timeout_s=CAP_S, max_active=1)
    sched.on_round = on_round
    sched.start()
    prompt = engine.encode(PROMPTS[1])
    futures = [sched.submit(Job(prompt, 400, SamplingParams()))]
    try:
        deadline = time.monotonic() + 60  # a bound on the wait, not an assertion
        while time.monotonic() < deadline and not (len(rounds) >= 30 and client.hellos >= 2):
            time.sleep(0.005)
        black_hole.close(linger=0)
        with draft_server_at(ep, backend):
            phase[0] = "daemon up"
            while time.monotonic() < deadline + 60:
                futures[-1].result(120)
                if any(p == "daemon up" and kept for p, _, _, kept in rounds):
                    break
                futures.append(sched.submit(Job(prompt, 400, SamplingParams())))  # only on a very slow machine
            sched.stop()
    finally:
        client.close()
        ctx.destroy(linger=0)
    ref = reference_greedy(tiny_target, prompt, 400)
    assert all(f.result().token_ids == ref for f in futures)
    unanswered = [r for r in rounds if r[0] == "black hole"]
    assert len(unanswered) >= 30  # rounds went on while the link was connecting
    assert all(state is not LinkState.UP and kept is None for _, state, _, kept in unanswered)
    assert any(state is LinkState.CONNECTING for _, state, _, _ in unanswered)
    assert unanswered[-1][2] >= 2  # HELLO was retried on the backoff schedule, never waited for
    assert blocking_calls == []
    assert any(p == "daemon up" and state is LinkState.UP and kept for p, state, _, kept in rounds)
    assert futures[0].result().stats.fallback_rounds >= 30


def test_free_endpoints_are_not_handed_out_twice():
    """The kernel hands a just-closed port out again (about 4 times in 100 picks here): daemons
    started on endpoints picked one after another must not be given the same port."""
    eps = [free_tcp_endpoint() for _ in range(1000)]
    assert len(set(eps)) == len(eps)
