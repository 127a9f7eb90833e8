"""Test doubles: a draft backend with no model, and a running in-process draft server; and the
chi-square check that sampled outputs follow the target."""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time

import torch
import zmq

from common import protocol as P
from common.control import ControlClient
from common.protocol import Message, MsgType
from common.sockets import SocketOptions, make_socket
from common.verify import SamplingParams, logits_to_probs
from starsd_draftd.backends.base import Draft, DraftBackend
from starsd_draftd.server import DraftServer, ServerConfig


def nested(depth: int) -> object:
    """A value nested ``depth`` lists deep: hostile input for anything that walks headers."""
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


class CountingBackend(DraftBackend):
    """Drafts last_token+1, +2, ...: the reply reveals which prefix the session held."""

    name = "fake"

    def __init__(self, vocab_size: int = 259, fingerprint: str = "fake-tok", max_len: int | None = None):
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.max_len = max_len
        self.released = 0

    def new_state(self, params):
        return {"calls": 0}

    def draft(self, state, verified, depth, new_features=None):
        state["calls"] += 1
        return Draft([(verified[-1] + i + 1) % self.vocab_size for i in range(depth)])

    def release(self, state):
        self.released += 1


_frozen_lock = threading.Lock()
_frozen_depth = 0


@contextlib.contextmanager
def startup_frozen():
    """What the daemons do once they are loaded (``common.heap.freeze_startup_objects``), for a
    daemon served inside the test process: everything alive now leaves the garbage collector's
    reach until the last such block ends. After hundreds of tests the process holds millions of
    objects, and a full collection walking them took 120-250 ms here: long enough, in the middle of
    a generation, to miss a reply's deadline and run a round without drafts, which the
    end-to-end tests count as a failure. (Without a collection first: a freeze is instant, a
    collection of that heap is not.)"""
    global _frozen_depth
    with _frozen_lock:
        gc.freeze()  # in a nested block too: what the outer one made since it began
        _frozen_depth += 1
    try:
        yield
    finally:
        with _frozen_lock:
            _frozen_depth -= 1
            if not _frozen_depth:
                gc.unfreeze()


# how long a target in the test process waits for an acknowledgement at least, while a draft
# daemon is served in it (``running_server``): that daemon's socket thread shares the test
# process's GIL, and the suite runs two workers on two cores, so its acknowledgements came later
# than the product's 50 ms floor at times, and a round ran without drafts (which end-to-end tests
# count as a failure). The floor itself is tested on its own (tests/test_link.py).
IN_PROCESS_ACK_FLOOR_S = 0.25


@contextlib.contextmanager
def patient_acks():
    """``IN_PROCESS_ACK_FLOOR_S`` as the acknowledgement floor of draft clients and pools built in
    the block without a floor of their own; a TargetDaemon passes its config's ``ack_timeout_s``
    (give it ``IN_PROCESS_ACK_FLOOR_S`` there)."""
    from starsd_target import client

    before, client.ACK_FLOOR_S = client.ACK_FLOOR_S, max(client.ACK_FLOOR_S, IN_PROCESS_ACK_FLOOR_S)
    try:
        yield
    finally:
        client.ACK_FLOOR_S = before


@contextlib.contextmanager
def running_server(backend: DraftBackend | None = None, **cfg):
    backend = backend or CountingBackend()
    cfg.setdefault("drain_s", 0.0)  # a test's sessions are left open: stop at once unless a test drains
    cfg.setdefault("suffix", False)  # the backend's drafts are what a test checks, unless it asks for suffix drafts
    ctx = zmq.Context()
    server = DraftServer(backend, ServerConfig(bind="tcp://127.0.0.1:0", **cfg), ctx)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    with startup_frozen(), patient_acks():
        thread.start()
        try:
            yield server, ctx
        finally:
            server.stop()
            thread.join(10)
            assert not thread.is_alive(), "server loop did not stop"
            ctx.destroy(linger=0)


@contextlib.contextmanager
def serving(daemon, join_s: float = 30.0):
    """A TargetDaemon's job socket served in a thread, ready; stopped at the end, and its thread
    asserted gone."""
    ready = threading.Event()
    thread = threading.Thread(target=daemon.serve_forever, kwargs={"ready": ready, "notify_ready": False}, daemon=True)
    with startup_frozen():
        thread.start()
        try:
            assert ready.wait(30), "the job socket did not come up"
            yield daemon
        finally:
            daemon.stop()
            thread.join(join_s)
    assert not thread.is_alive(), "the job socket's thread did not stop"


def wait_http_health(base: str, why, alive=lambda: True, timeout_s: float = 60.0) -> None:
    """Until GET ``base``/health answers 200; ``why()`` (a log's end, say) explains a failure, and
    ``alive()`` false fails at once (the server's process died)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert alive(), why()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, why()
        time.sleep(0.2)


class RawPeer:
    """A DEALER speaking raw frames, for protocol-level tests (``curve``: its CURVE keys, if any)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, curve=None):
        self.sock = make_socket(ctx, zmq.DEALER, SocketOptions(curve=curve))
        self.sock.connect(endpoint)
        self.acks: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(P.encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 5.0, acks: bool = False) -> Message | None:
        """The next message; the ACKs that come before a draft request's reply are kept in
        ``self.acks`` and skipped unless ``acks``."""
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            msg = P.decode(self.sock.recv_multipart())
            if msg.type is not MsgType.ACK or acks:
                return msg
            self.acks.append(msg)
        return None

    def hello(self, vocab: int = 259, tok: str = "fake-tok") -> Message:
        self.send(Message(MsgType.HELLO, {"vocab_size": vocab, "tokenizer": tok, "name": "raw"}))
        return self.recv()

    def open(self, sid: int, prompt: list[int], temperature: float = 0.0) -> None:
        self.send(Message(MsgType.OPEN, {"session": sid, "prompt": prompt, "sampling": {"temperature": temperature}}))

    def draft(self, sid: int, seq: int, accepted: int, new: list[int], pos: int, depth: int = 3,
              **extra) -> Message:
        """A DRAFT (``extra``: its optional header fields) and its answer."""
        self.send(Message(MsgType.DRAFT, {"session": sid, "seq": seq, "accepted": accepted, "new": new,
                                          "pos": pos, "depth": depth, **extra}))
        return self.recv()


def speculate(engine, client, prompt, max_tokens, params, timeout_s: float = 30.0, draft_params=None,
              on_round=None, **scheduler_options):
    """One generation through the draft link, driven as the daemons drive it (the scheduler with
    one job): the same rounds, deadlines and link rules as ``starsd-target generate``. Without
    fill steps unless asked (``fill_steps=True``): the tests' tiny target steps faster than a
    round trip, so they would make most of its tokens, where these tests exercise the drafts."""
    from starsd_target.scheduler import Job, Scheduler

    scheduler_options.setdefault("fill_steps", False)
    sched = Scheduler(engine, lambda: client, timeout_s, **scheduler_options)
    sched.on_round = on_round
    return sched.run_one(Job(list(prompt), max_tokens, params, draft_params=draft_params))


def speculate_with(backend, engine, prompt, max_tokens, params, timeout_s: float = 30.0):
    """``speculate`` through a draft daemon serving ``backend`` in-process, its link opened and
    closed around the one generation."""
    from starsd_target.client import DraftClient

    target = engine.loaded
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, target.vocab_size, target.fingerprint, ctx=ctx)
        client.handshake(10)
        try:
            return speculate(engine, client, prompt, max_tokens, params, timeout_s)
        finally:
            client.close()


class LocalDrafts:
    """A draft backend in-process, behind the target engine's DraftSource interface."""

    feature_size = 0

    def __init__(self, backend: DraftBackend, params=None):
        from common.verify import SamplingParams

        self.backend = backend
        self.state = backend.new_state(params or SamplingParams())

    def propose(self, tokens, depth, features=None):
        return self.backend.draft(self.state, tokens, depth)

    def kept(self, n):
        pass

    def close(self):
        pass


def run_concurrently(target_eps, requests):
    """Send requests[i] to target i, all at the same time; return the RESULT headers."""
    results = [None] * len(target_eps)
    errors = []

    def one(i, ep):
        try:
            with ControlClient(ep) as cc:
                results[i] = cc.call(Message(MsgType.GENERATE, requests[i]), timeout_s=300).header
        except Exception as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, ep)) for i, ep in enumerate(target_eps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    assert not errors, errors
    return results


def exact_joint(model, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    """The target's own distribution over its first ``length`` sampled tokens (small support via top_k)."""
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float):
        if len(prefix) == length:
            out[prefix] = prob
            return
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1]
        p = logits_to_probs(logits, params)
        for t in torch.nonzero(p).flatten().tolist():
            walk(prefix + (t,), prob * float(p[t]))

    walk((), 1.0)
    return out


CHI2_Z = 3.0902  # alpha = 1e-3: the standard normal quantile the critical value is built from
DIVERGENCE = 0.05  # the chi-square divergence, sum over outcomes of (q - p)^2 / p, the tests are sized to reject


def chi2_critical(df: int) -> float:
    """The chi-square(df) quantile at alpha = 1e-3 (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + CHI2_Z * math.sqrt(2 / (9 * df))) ** 3


def samples_for(exact: dict, divergence: float = DIVERGENCE) -> int:
    """Samples for a chi-square test against ``exact`` that rejects a distribution ``divergence``
    away: the statistic of n samples from q averages about df + n * divergence, which reaches the
    critical value at this n (so such a q is rejected about half the time, and one twice as far
    about nine times in ten). More samples only find smaller deviations, at a cost per sample."""
    df = len(exact) - 1
    return math.ceil((chi2_critical(df) - df) / divergence)


def assert_follows(counts: dict, exact: dict, samples: int) -> None:
    """The sampled ``counts`` (outcome -> count, ``samples`` in all) follow ``exact`` (outcome ->
    probability): chi-square at alpha = 1e-3. Outcomes expected fewer than 5 times are pooled into
    one bin, as the test's chi-square approximation needs: alone, an outcome expected 0.03 times
    and seen once adds 36 to the statistic, which rejected a right distribution about one run in
    40. Prints the margin: the divergence whose statistic reaches the critical value on average
    with this many samples."""
    assert set(counts) <= set(exact), sorted(set(counts) - set(exact))
    bins = [(counts.get(k, 0), samples * v) for k, v in exact.items() if samples * v >= 5]
    rare = [(counts.get(k, 0), samples * v) for k, v in exact.items() if samples * v < 5]
    if rare:
        bins.append((sum(c for c, _ in rare), sum(e for _, e in rare)))
    chi2 = sum((c - e) ** 2 / e for c, e in bins)
    df = max(1, len(bins) - 1)
    critical = chi2_critical(df)
    print(f"chi-square {chi2:.1f} < {critical:.1f} (df {df}, {samples} samples): rejects a divergence "
          f"sum (q - p)^2 / p above about {(critical - df) / samples:.3f}")
    assert chi2 < critical, (chi2, critical, counts, exact)
