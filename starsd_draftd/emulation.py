"""Accelerator emulation: timed stand-ins for the draft service and for target verification, so
the star's queueing is measured with real daemons, sockets and protocol on a machine without an
accelerator per target, and the timing trace everything here is measured with.

* ``EmulatedBackend`` is a draft backend whose service takes S(d) = s0 + s1 * d by sleeping
  (``time.sleep`` releases the GIL and uses no CPU, like a kernel running on an accelerator).
* ``EmulatedTarget`` is a target that speaks the real protocol through the real target-side
  client (``starsd_target.client.DraftClient``) to a real draft daemon, and "verifies" by sleeping
  V (+ an emulated network delay R), keeping a prefix of each draft drawn from a seeded
  Bernoulli(acceptance) chain.
* ``TracingBackend`` wraps any backend and records when each service starts and ends (and which
  session, at which verified length), on ``time.monotonic`` -- CLOCK_MONOTONIC, one clock for
  every process on a host -- so the bench can line the draft daemon's trace up with its targets'
  timestamps.

``python -m starsd_draftd.emulation serve`` runs a draft daemon with the emulated backend (or, with
``--backend model``, a real draft model) behind the tracer and writes the trace on exit. Everything
this mode produces is labelled "emulation".
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import click
import numpy as np
import torch
import zmq

from common.verify import SamplingParams, make_generator
from starsd_draftd.backends.base import Draft, DraftBackend, DraftRequest

log = logging.getLogger("starsd.bench")

EMULATION_LABEL = ("emulation: draft service and target verification are timed sleeps (no accelerator work); "
                   "daemons, sockets and protocol are real")
EMU_VOCAB = 32000
EMU_FINGERPRINT = "emulated-v1"
_Q_TABLE_MAX_BYTES = 64 << 20
EMU_SERVER_NAME = "starsd-draftd-emulation"


# ---------------------------------------------------------------- timed sleeps
class PacedSleep:
    """``time.sleep`` whose mean length is exact: the OS wakes a sleeper late (about 0.1 ms here,
    sometimes far more on a busy host), and each sleep's overshoot is taken off the following
    ones, at most half of each, so the emulated device's total busy time tracks the sum of
    the nominal times. Uses no CPU while waiting."""

    def __init__(self, sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter):
        self._sleep = sleep
        self._clock = clock
        self.debt = 0.0  # seconds slept beyond the nominal total so far

    def __call__(self, seconds: float) -> None:
        if seconds <= 0:
            return
        want = max(0.5 * seconds, seconds - self.debt)
        t0 = self._clock()
        self._sleep(want)
        self.debt += (self._clock() - t0) - seconds


# ---------------------------------------------------------------- the emulated draft service
@dataclass(frozen=True)
class ServiceModel:
    """S(d) = base_ms + per_token_ms * d."""

    base_ms: float = 1.0
    per_token_ms: float = 1.0

    def service_s(self, depth: int) -> float:
        return (self.base_ms + self.per_token_ms * depth) / 1000.0


@dataclass
class EmulatedState:
    params: SamplingParams
    generator: torch.Generator
    calls: int = 0


class EmulatedBackend(DraftBackend):
    """Sleeps S(d) per request and proposes d tokens (in sampling mode with a sparse q of
    ``q_topk`` entries per token, as a real model backend would send)."""

    name = "emulated"

    def __init__(self, service: ServiceModel, vocab_size: int = EMU_VOCAB, fingerprint: str = EMU_FINGERPRINT,
                 q_topk: int = 32, feature_size: int = 0, sleep: Callable[[float], None] | None = None):
        self.service = service
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.q_topk = min(q_topk, vocab_size)
        self.feature_size = feature_size
        self._sleep = sleep or PacedSleep()
        # This backend stands in for a zero-cost accelerator that hands back host arrays, so its
        # per-request CPU cost should be next to nothing: q is served from numpy tables built
        # once. The proposal row for draft token t is (t + 0..K-1) mod V; all rows are built (row
        # r for token r mod V; 64 extra rows for drafts that wrap around) and a draft's q_ids is
        # a contiguous slice of them. Large tables are computed per draft.
        weights = np.arange(self.q_topk, 0, -1, dtype=np.float32)
        q_probs = np.ascontiguousarray(np.broadcast_to(weights / weights.sum(), (64, self.q_topk)))
        self._q_probs = [q_probs[:d] for d in range(65)]  # a fixed, decreasing proposal; by depth, sliced once
        rows = self.vocab_size + 64
        self._q_table = None
        if rows * self.q_topk * 4 <= _Q_TABLE_MAX_BYTES:
            self._q_table = self._q_rows(0, rows)

    def _q_rows(self, start: int, n: int) -> np.ndarray:
        return ((np.arange(start, start + n)[:, None] + np.arange(self.q_topk)) % self.vocab_size).astype(np.int32)

    def new_state(self, params: SamplingParams) -> EmulatedState:
        return EmulatedState(params, make_generator(params.seed))

    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None) -> Draft:
        st: EmulatedState = state  # type: ignore[assignment]
        if not verified:
            raise ValueError("cannot draft after an empty sequence")
        delay = self.service.service_s(depth)
        if delay > 0:
            self._sleep(delay)
        st.calls += 1
        start = verified[-1] + 1
        if start + depth <= self.vocab_size:
            tokens = list(range(start, start + depth))
        else:
            tokens = [(start + i) % self.vocab_size for i in range(depth)]
        if st.params.greedy:
            return Draft(tokens)
        start = tokens[0]
        ids = self._q_table[start:start + depth] if self._q_table is not None else self._q_rows(start, depth)
        return Draft(tokens, ids, self._q_probs[depth])


# ---------------------------------------------------------------- the trace
@dataclass
class Trace:
    """What the draft daemon's backend did, on CLOCK_MONOTONIC (seconds).

    services: (start, end, requests served together) per backend call.
    requests: (session serial, start, end, verified length) per request.
    sessions: session serial -> the seed its target opened it with (names the session)."""

    services: list[tuple[float, float, int]] = field(default_factory=list)
    requests: list[tuple[int, float, float, int]] = field(default_factory=list)
    sessions: dict[int, int | None] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"clock": "CLOCK_MONOTONIC", "services": self.services, "requests": self.requests,
                "sessions": {str(k): v for k, v in self.sessions.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Trace":
        return cls([tuple(s) for s in d["services"]], [tuple(r) for r in d["requests"]],
                   {int(k): v for k, v in d["sessions"].items()})

    def dump(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> "Trace":
        return cls.from_json(json.loads(Path(path).read_text()))

    def serial_for_seed(self, seed: int) -> int | None:
        found = [k for k, v in self.sessions.items() if v == seed]
        return found[-1] if found else None


@dataclass
class _Traced:
    serial: int
    inner: object


class TracingBackend(DraftBackend):
    """Any backend, with the start and end of every service recorded (two clock reads each)."""

    def __init__(self, inner: DraftBackend, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.name = inner.name
        self.vocab_size = inner.vocab_size
        self.fingerprint = inner.fingerprint
        self.feature_size = inner.feature_size
        self.q_topk = getattr(inner, "q_topk", 0)  # the server reads it the same way
        self.trace = Trace()
        self._clock = clock
        self._serials = 0

    def new_state(self, params: SamplingParams) -> _Traced:
        self._serials += 1
        self.trace.sessions[self._serials] = params.seed
        return _Traced(self._serials, self.inner.new_state(params))

    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None) -> Draft:
        st: _Traced = state  # type: ignore[assignment]
        t0 = self._clock()
        try:
            return self.inner.draft(st.inner, verified, depth, new_features)
        finally:
            t1 = self._clock()
            self.trace.services.append((t0, t1, 1))
            self.trace.requests.append((st.serial, t0, t1, len(verified)))

    def draft_many(self, requests: list) -> list[Draft]:
        inner_requests = [DraftRequest(r.state.inner, r.verified, r.depth, r.new_features) for r in requests]
        t0 = self._clock()
        try:
            return self.inner.draft_many(inner_requests)
        finally:
            t1 = self._clock()
            self.trace.services.append((t0, t1, len(requests)))
            for r in requests:
                self.trace.requests.append((r.state.serial, t0, t1, len(r.verified)))

    def release(self, state: object) -> None:
        self.inner.release(state.inner)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- timing accounting
def services_between(services: list[tuple[float, float, int]], t0: float, t1: float) -> list[tuple[float, float, int]]:
    """Services that started and ended inside [t0, t1], in order."""
    return sorted(s for s in services if s[0] >= t0 and s[1] <= t1)


def idle_gaps(services: list[tuple[float, float, int]]) -> list[float]:
    """Seconds from the end of each service to the start of the next (the draft side's idle
    gaps; they include the server loop's own per-request work, which is not drafting)."""
    s = sorted(services)
    return [max(0.0, b[0] - a[1]) for a, b in zip(s, s[1:])]


class BusyIndex:
    """Busy time of a serial server within any interval, in O(log n) per query."""

    def __init__(self, services: list[tuple[float, float, int]]):
        merged: list[list[float]] = []
        for start, end, _ in sorted(services):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [m[0] for m in merged]
        self.ends = [m[1] for m in merged]
        self.prefix = [0.0]
        for s, e in merged:
            self.prefix.append(self.prefix[-1] + (e - s))

    def _upto(self, t: float) -> float:
        """Busy time in (-inf, t]."""
        i = bisect.bisect_right(self.starts, t)  # intervals starting at or before t
        if i == 0:
            return 0.0
        return self.prefix[i - 1] + (min(t, self.ends[i - 1]) - self.starts[i - 1])

    def busy(self, t0: float, t1: float) -> float:
        return max(0.0, self._upto(t1) - self._upto(t0)) if t1 > t0 else 0.0


# ---------------------------------------------------------------- the emulated target
@dataclass(frozen=True)
class TargetModel:
    """A target's timing: each round's verification takes verify_ms, plus rtt_ms of emulated
    network delay (on top of the real loopback); a round that gets no drafts costs single_ms."""

    verify_ms: float
    rtt_ms: float = 0.0
    depth: int = 4
    acceptance: float = 0.8
    single_ms: float | None = None

    @property
    def fallback_ms(self) -> float:
        return self.verify_ms if self.single_ms is None else self.single_ms


@dataclass
class Round:
    t_send: float  # DRAFT sent
    t_reply: float  # DRAFTED (or the failure) received
    t_done: float  # verification and emulated network delay over: the next request leaves now
    pos: int  # verified length the request stated
    drafted: int
    accepted: int
    fallback: bool

    @property
    def tokens(self) -> int:
        return self.accepted + 1

    @property
    def duration(self) -> float:
        return self.t_done - self.t_send


def acceptance_chain(rng: random.Random, acceptance: float, k: int) -> int:
    """How many of k drafts a target keeps when each is accepted with probability ``acceptance``
    independently, stopping at the first rejection."""
    n = 0
    while n < k and rng.random() < acceptance:
        n += 1
    return n


class EmulatedTarget:
    """One target's rounds against a real draft daemon: real client, real protocol, timed verification.

    Bookkeeping follows the protocol: each DRAFT says how many drafts of the last reply were
    kept (``accepted``), which tokens were verified since (``new``: the target's own token) and
    the verified length ``pos``; features (for a daemon with feature_size > 0) cover the newly
    verified positions. A round without drafts (timeout, error) re-opens the session."""

    def __init__(self, endpoint: str, model: TargetModel, seed: int, name: str = "", ctx: zmq.Context | None = None,
                 prompt_len: int = 16, temperature: float = 0.0, feature_size: int = 0, draft_timeout_s: float = 5.0,
                 vocab_size: int = EMU_VOCAB, fingerprint: str = EMU_FINGERPRINT,
                 sleep: Callable[[float], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.endpoint = endpoint
        self.model = model
        self.seed = seed
        self.name = name or f"emulated-{seed}"
        self.ctx = ctx
        self.prompt = [3 + (seed * 7 + i) % 200 for i in range(prompt_len)]
        self.params = SamplingParams(temperature=temperature, seed=seed)
        self.feature_size = feature_size
        self.draft_timeout_s = draft_timeout_s
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self._sleep = sleep or PacedSleep()
        self._clock = clock
        self.rounds: list[Round] = []
        self.error: BaseException | None = None

    def run(self, stop: threading.Event, max_rounds: int | None = None,
            handshake_timeout_s: float = 30.0) -> list[Round]:
        """Run rounds until ``stop`` is set (or ``max_rounds``); the socket lives in this thread."""
        from starsd_target.client import DraftClient, DraftReply

        client = DraftClient(self.endpoint, self.vocab_size, self.fingerprint, self.name, self.ctx,
                             feature_size=self.feature_size)
        rng = random.Random(self.seed)
        session, seq = 1, 0
        feats = None
        if self.feature_size:
            # as a target's feature buffer hands them over: a float16 wire array
            feats = np.zeros((4096 + len(self.prompt), self.feature_size), dtype=np.float16)
        try:
            client.handshake(handshake_timeout_s)
            verified = list(self.prompt)
            need_open = True
            accepted, new, sent_features = 0, [], 0
            while not stop.is_set() and (max_rounds is None or len(self.rounds) < max_rounds):
                if need_open and client.ready() and client.open(session, verified, self.params):
                    need_open = False
                    accepted, new, sent_features = 0, [], 0
                pos = len(verified)
                t_send = self._clock()
                reply = None
                if not need_open:
                    seq += 1
                    f = None if feats is None else feats[: pos - 1 - sent_features]
                    if client.request(session, seq, accepted, new, pos, self.model.depth, f):
                        reply = client.wait_draft(session, seq, self.draft_timeout_s)
                t_reply = self._clock()
                own = 3 + rng.randrange(self.vocab_size - 3)
                if isinstance(reply, DraftReply):
                    drafted = len(reply.tokens)
                    n = acceptance_chain(rng, self.model.acceptance, drafted)
                    self._sleep((self.model.verify_ms + self.model.rtt_ms) / 1000.0)
                    self.rounds.append(Round(t_send, t_reply, self._clock(), pos, drafted, n, False))
                    verified += list(reply.tokens[:n]) + [own]
                    accepted, new, sent_features = n, [own], pos - 1
                else:  # the round runs without drafts; the session is re-opened with the full prefix
                    log.warning("%s: no draft for the round at position %d (%s)", self.name, pos, reply)
                    self._sleep((self.model.fallback_ms + self.model.rtt_ms) / 1000.0)
                    self.rounds.append(Round(t_send, t_reply, self._clock(), pos, 0, 0, True))
                    verified.append(own)
                    need_open = True
            client.close_session(session)
        except BaseException as exc:  # handed to whoever joins this target
            self.error = exc
            raise
        finally:
            client.close()
        return self.rounds


# ---------------------------------------------------------------- the daemon for emulation runs
def server_config(**kw):
    """A ServerConfig; ``batch_max`` is dropped when this server has no batched drafting."""
    from starsd_draftd.server import ServerConfig

    names = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in kw.items() if k in names})


def run_traced_server(backend: DraftBackend, bind: str, depth: int, batch_max: int, trace_path: Path | None,
                      name: str, batch_window_s: float = 0.0) -> None:
    """Serve until SIGTERM, then write the trace. Without a trace path the backend is served as it
    is, as in production (the wire measurements want exactly that path)."""
    from starsd_draftd.server import DraftServer

    traced = TracingBackend(backend) if trace_path is not None else None
    ctx = zmq.Context()
    server = DraftServer(traced or backend, server_config(bind=bind, max_depth=depth, batch_max=batch_max, name=name,
                                               batch_window_s=batch_window_s), ctx)
    server.install_signal_handlers()
    server.serve_forever()
    if traced is not None:
        traced.trace.dump(trace_path)
    ctx.term()


def _option(*decls, **kw):
    from common.cliutil import env_options

    return env_options("STARSD_EMULATION")(*decls, **kw)


@click.group()
def main() -> None:
    """Helpers for `starsd-draftd bench`: a traced draft daemon for emulation and real-model runs."""


@main.command()
@_option("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint (loopback unless you add CURVE).")
@_option("--backend", type=click.Choice(["emulated", "model", "eagle"]), default="emulated",
         help="emulated: sleep S(d) per request (accelerator emulation). model: a real draft model (--model). "
              "eagle: an EAGLE head (--eagle-head) drafting for the target checkpoint --model.")
@_option("--draft-base-ms", type=click.FloatRange(0), default=1.0, help="Emulated S(d) = base + per-token * d: base.")
@_option("--draft-per-token-ms", type=click.FloatRange(0), default=1.0, help="Emulated S(d): cost per drafted token.")
@_option("--depth", type=click.IntRange(1, 64), default=8, help="Most draft tokens per request.")
@_option("--batch-max", type=click.IntRange(1), default=1,
         help="Sessions drafted together (1: one at a time, the paper's loop and the analytic model's).")
@_option("--batch-window-ms", type=click.FloatRange(0), default=0.0,
         help="Wait up to this long for sessions due back soon before drafting a batch (see starsd-draftd serve).")
@_option("--q-topk", type=click.IntRange(1), default=32, help="Entries of the sparse q sent in sampling mode.")
@_option("--feature-size", type=click.IntRange(0), default=0,
         help="Emulated backend only: take target features of this width with each request.")
@_option("--model", default="demo-draft", help="--backend model: the draft checkpoint; eagle: the target's.")
@_option("--eagle-head", default=None, help="--backend eagle: the head directory.")
@_option("--device", default="cpu", help="--backend model or eagle: device.")
@_option("--threads", type=click.IntRange(0), default=1, help="Torch CPU threads.")
@_option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="Write the service trace here on exit.")
@_option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", help="Logging.")
def serve(bind, backend, draft_base_ms, draft_per_token_ms, depth, batch_max, batch_window_ms, q_topk, feature_size,
          model, eagle_head, device, threads, trace, log_level) -> None:
    """Run a draft daemon behind the service tracer until SIGTERM."""
    from common.logs import setup_logging
    from common.models import set_torch_threads

    setup_logging(log_level)
    set_torch_threads(threads)
    if backend == "emulated":
        inner = EmulatedBackend(ServiceModel(draft_base_ms, draft_per_token_ms), q_topk=q_topk,
                                feature_size=feature_size)
        name = EMU_SERVER_NAME
    else:
        from starsd_draftd.cli import ServeConfig, build_backend

        inner = build_backend(ServeConfig(server=server_config(), model=model, backend=backend, eagle_head=eagle_head,
                                          base_model=model, device=device, q_topk=q_topk, threads=threads))
        name = "starsd-draftd-traced"
    run_traced_server(inner, bind, depth, batch_max, trace, name, batch_window_ms / 1000)


if __name__ == "__main__":
    sys.exit(main())
