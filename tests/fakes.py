"""Test doubles: a draft backend with no model, and a running in-process draft server."""

from __future__ import annotations

import contextlib
import threading

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


@contextlib.contextmanager
def running_server(backend: DraftBackend | None = None, **cfg):
    backend = backend or CountingBackend()
    ctx = zmq.Context()
    server = DraftServer(backend, ServerConfig(bind="tcp://127.0.0.1:0", **cfg), ctx)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, ctx
    finally:
        server.stop()
        thread.join(10)
        assert not thread.is_alive(), "server loop did not stop"
        ctx.destroy(linger=0)


class RawPeer:
    """A DEALER speaking raw frames, for protocol-level tests."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = make_socket(ctx, zmq.DEALER, SocketOptions())
        self.sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(P.encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float = 5.0) -> Message | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return P.decode(self.sock.recv_multipart())

    def hello(self, vocab: int = 259, tok: str = "fake-tok") -> Message:
        self.send(Message(MsgType.HELLO, {"vocab_size": vocab, "tokenizer": tok, "name": "raw"}))
        return self.recv()

    def open(self, sid: int, prompt: list[int], temperature: float = 0.0) -> None:
        self.send(Message(MsgType.OPEN, {"session": sid, "prompt": prompt, "sampling": {"temperature": temperature}}))

    def draft(self, sid: int, seq: int, accepted: int, new: list[int], pos: int, depth: int = 3) -> Message:
        self.send(Message(MsgType.DRAFT, {"session": sid, "seq": seq, "accepted": accepted, "new": new,
                                          "pos": pos, "depth": depth}))
        return self.recv()


def speculate(engine, client, prompt, max_tokens, params, timeout_s: float = 30.0, draft_params=None,
              on_round=None, adaptive_speculation: bool = False):
    """One generation through the draft link, driven as the daemons drive it (the scheduler with
    one job): the same rounds, deadlines and link rules as ``starsd-target generate``. Every
    round asks for drafts unless ``adaptive_speculation`` (off by default, as in the daemon)."""
    from starsd_target.scheduler import Job, Scheduler

    sched = Scheduler(engine, lambda: client, timeout_s, adaptive_speculation=adaptive_speculation)
    sched.on_round = on_round
    return sched.run_one(Job(list(prompt), max_tokens, params, draft_params=draft_params))


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
