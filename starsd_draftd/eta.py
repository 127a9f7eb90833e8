"""When a queued draft request will be answered: the estimate its acknowledgement (ACK) carries.

The batcher reports each batch's seconds with the forwards it ran (``steps``, the deepest
request's drafts) and the prompt tokens it fed beyond one a request (``fed``: a new session's
prompt, a round's newly verified tokens); from those this keeps a smoothed cost of a draft
step and of a fed token, and when the batch now computing is expected to end. The ingress's
thread asks ``eta_s`` for a request it has just queued: what is left of the running batch, the
batches queued before it, and its own. A target waits about that long for the reply (plus a
margin) where it would otherwise guess; its ``--draft-timeout`` caps a bad estimate.
"""

from __future__ import annotations

import time

STEP_S = 0.05  # a draft forward, until one is measured (a 0.5B model on one CPU core takes about this)
TOKEN_S = 0.002  # a fed prompt token, until a prefill is measured
SMOOTHING = 0.2  # weight of each new measure
PREFILL_MIN = 16  # fed tokens from which a batch measures a token's cost (fewer: a step's)


class ServiceEstimate:
    def __init__(self, batch_max: int):
        self.batch_max = max(1, batch_max)
        self.step_s: float | None = None
        self.token_s: float | None = None
        self.busy_until = 0.0  # perf_counter when the work now computing is expected to end (0: none)

    def cost_s(self, steps: int, fed: int) -> float:
        """A batch's expected seconds: ``steps`` forwards and ``fed`` prompt tokens."""
        return steps * (self.step_s or STEP_S) + fed * (self.token_s or TOKEN_S)

    def started(self, steps: int, fed: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.busy_until = now + self.cost_s(steps, fed)

    def finished(self, seconds: float, steps: int, fed: int) -> None:
        """A batch of ``steps`` forwards and ``fed`` prompt tokens took ``seconds``."""
        self.busy_until = 0.0
        if seconds <= 0:
            return
        if fed < PREFILL_MIN:
            if steps > 0:
                self.step_s = self._smooth(self.step_s, seconds / steps)
        elif steps == 0 or self.step_s is not None:  # a prefill chunk alone, or drafting whose steps are known
            self.token_s = self._smooth(self.token_s, max(0.0, seconds - steps * (self.step_s or 0.0)) / fed)

    @staticmethod
    def _smooth(old: float | None, sample: float) -> float:
        return sample if old is None else old + SMOOTHING * (sample - old)

    def eta_s(self, ahead: int, fed_ahead: int, steps: int, fed: int, now: float | None = None) -> float:
        """Seconds until a request just queued is answered: ``ahead`` requests (holding
        ``fed_ahead`` prompt tokens) before it, ``steps`` drafts and ``fed`` tokens of its own."""
        now = time.perf_counter() if now is None else now
        left = max(0.0, self.busy_until - now)
        return left + self.cost_s(steps * (ahead // self.batch_max + 1), fed_ahead + fed)
