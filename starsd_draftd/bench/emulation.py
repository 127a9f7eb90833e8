"""Accelerator emulation: a draft backend whose service is a timed sleep S(d) = s0 + s1 * d
(``time.sleep`` releases the GIL and uses no CPU, like a kernel running on an accelerator).
Everything this mode produces is labelled "emulation"."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from common.verify import SamplingParams, make_generator
from starsd_draftd.backends.base import Draft, DraftBackend, Lookahead

log = logging.getLogger("starsd.bench")


EMULATION_LABEL = ("emulation: draft service and target verification are timed sleeps (no accelerator work); "
                   "daemons, sockets and protocol are real")
EMU_VOCAB = 32000
EMU_FINGERPRINT = "emulated-v1"
_Q_TABLE_MAX_BYTES = 64 << 20
EMU_SERVER_NAME = "starsd-draftd-emulation"


def emulated_guess(last_draft: int, vocab_size: int) -> int:
    """The emulated drafter's guess of a target's token after a round that kept every draft: the
    token after its last draft (what ``EmulatedTarget`` puts there with ``TargetModel.guess_rate``)."""
    return (last_draft + 1) % vocab_size


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

    def ahead_s(self, depth: int) -> float:
        """The work ahead for ``depth`` drafts: one forward for the guess of the target's next
        token, then the drafts after it, S(depth + 1) (the analytic model's S_a)."""
        return self.service_s(depth + 1)


@dataclass
class EmulatedState:
    params: SamplingParams
    generator: torch.Generator
    calls: int = 0


class EmulatedBackend(DraftBackend):
    """Sleeps S(d) per request and proposes d tokens (in sampling mode with a sparse q of
    ``q_topk`` entries per token, as a real model backend would send). The drafts after a
    sequence ending in token t are t + 1, t + 2, ... (mod the vocabulary).

    With ``lookahead``, greedy sessions are drafted ahead as the model backend does: the guess of
    the target's next token after an all-kept round is the token after the last draft (an
    emulated target with ``TargetModel.guess_rate`` g puts it there with probability g), and the
    work ahead sleeps S_a = S(d + 1) in d + 1 steps: the guess's forward (base + one token), then
    one token's time per draft."""

    name = "emulated"

    def __init__(self, service: ServiceModel, vocab_size: int = EMU_VOCAB, fingerprint: str = EMU_FINGERPRINT,
                 q_topk: int = 32, feature_size: int = 0, sleep: Callable[[float], None] | None = None,
                 lookahead: bool = False):
        self.service = service
        self.drafts_ahead = lookahead
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
        tokens = self._after(verified[-1], depth)
        if st.params.greedy:
            return Draft(tokens)
        start = tokens[0]
        ids = self._q_table[start:start + depth] if self._q_table is not None else self._q_rows(start, depth)
        return Draft(tokens, ids, self._q_probs[depth])

    def _after(self, token: int, depth: int) -> list[int]:
        start = token + 1
        if start + depth <= self.vocab_size:
            return list(range(start, start + depth))
        return [(start + i) % self.vocab_size for i in range(depth)]

    def lookahead(self, state: object, verified: list[int], draft: Draft, depth: int) -> Lookahead | None:
        st: EmulatedState = state  # type: ignore[assignment]
        if not self.drafts_ahead or not st.params.greedy or not draft.tokens:
            return None
        guess = emulated_guess(draft.tokens[-1], self.vocab_size)
        sequence = list(verified) + list(draft.tokens) + [guess]
        service = self.service

        def steps(task: Lookahead):  # one sleep per step: the last one returns the drafts
            self._sleep((service.base_ms + service.per_token_ms) / 1000.0)  # the guess's forward
            for _ in range(depth):
                yield
                self._sleep(service.per_token_ms / 1000.0)
            return [Draft(self._after(guess, depth))]

        return Lookahead(steps, [sequence], steps=depth + 1)

