"""An emulated target: the real target-side client against a real draft daemon, "verifying" by
sleeping V (+ an emulated network delay R) and keeping a seeded Bernoulli(acceptance) prefix."""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zmq

from common.verify import SamplingParams
from starsd_draftd.bench.emulation import EMU_FINGERPRINT, EMU_VOCAB, PacedSleep, emulated_guess

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- the emulated target
@dataclass(frozen=True)
class TargetModel:
    """A target's timing: each round's verification takes verify_ms, plus rtt_ms of emulated
    network delay (on top of the real loopback); a round that gets no drafts costs single_ms.
    ``guess_rate`` g: after a round that keeps every draft, the probability that the target's
    own token is the emulated drafter's guess of it (the token after its last draft), which a
    lookahead daemon drafted ahead for; so under i.i.d. acceptance a request is a lookahead hit
    with probability acceptance^d * g. 0: the token is random, as before."""

    verify_ms: float
    rtt_ms: float = 0.0
    depth: int = 4
    acceptance: float = 0.8
    single_ms: float | None = None
    guess_rate: float = 0.0

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
                    if self.model.guess_rate and drafted and n == drafted:
                        guess = emulated_guess(reply.tokens[-1], self.vocab_size)
                        if rng.random() < self.model.guess_rate:
                            own = guess
                        elif own == guess:  # a miss stays a miss
                            own = 3 + (own - 2) % (self.vocab_size - 3)
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




def run_window(targets: list, warmup_s: float, window_s: float, kind: str, ready=None, at_open=None,
               at_close=None) -> tuple[float, float]:
    """Run each of ``targets`` (``run(stop)``) on a thread of its own: ``ready()`` once they are
    started (it may raise), then ``warmup_s``, then the measured window of ``window_s``:
    ``at_open()`` just before it opens, ``at_close()`` just after it closes; then stop and join them. A target that
    failed, or ran no round, raises RuntimeError naming it (``kind``: what it is). (w0, w1)."""
    stop = threading.Event()

    def body(t) -> None:
        try:
            t.run(stop)
        except Exception:  # recorded on the target, raised below in the caller's thread
            log.exception("%s target %s failed", kind, t.name)

    threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in targets]
    for th in threads:
        th.start()
    try:
        if ready is not None:
            ready()
        time.sleep(warmup_s)
        if at_open is not None:
            at_open()
        w0 = time.monotonic()
        time.sleep(window_s)
        w1 = time.monotonic()
        if at_close is not None:
            at_close()
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    failed = [t for t in targets if t.error is not None or not t.rounds]
    if failed:
        raise RuntimeError(f"{kind} target {failed[0].name} failed: {failed[0].error}")
    return w0, w1
