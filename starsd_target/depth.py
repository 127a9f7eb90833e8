"""Adaptive draft length: per generation, the number of drafts a round asks for that maximises
expected tokens per second, from what its own rounds measured.

Model (the one ``starsd-draftd plan`` uses): with a per-token acceptance ``a``, a round that
asks for ``d`` drafts keeps on average ``E(a, d) = 1 + a + ... + a^d`` tokens (the target adds
one of its own), and lasts ``F + c * d``:

* ``c``, the cost of one more draft token on the round's critical path: the draft daemon's
  reported drafting and queueing time per token asked for. Queueing counts because, on a
  saturated daemon, a request waits for the other targets' drafting, which grows with their
  lengths as this one's grows with its own: so a saturated daemon drafts shorter. A round the
  daemon answered from work done ahead (lookahead) costs nearly nothing per token: an idle
  daemon drafts longer;
* ``F``, the rest of the round: the verification forward, the wire, the scheduler's work.

``a`` is estimated from the rounds' outcomes as a geometric chain cut off at the draft length
(kept n of d: n acceptances, and one rejection when n < d), with older rounds discounted so the
estimate follows the text (code the draft knows, prose it does not). ``c`` and ``F`` are
exponentially weighted means. The length is chosen in 1..the cap (``--depth``, or the request's
``max_draft_tokens``); until a round has been measured the cap is used. Greedy outputs do not
depend on it (every draft is verified). A seeded sampled generation keeps the cap every round:
the target's random draws follow its rounds, so a length chosen from measured times would make
the same seed give other tokens on a slower day (the scheduler applies this rule).
"""

from __future__ import annotations

from starsd_target.profile import RoundTimes

PRIOR_ACCEPTANCE = 0.6  # what a fresh generation assumes, worth PRIOR_ROUNDS rounds of evidence
PRIOR_ROUNDS = 2.0
DISCOUNT = 0.9  # weight of the previous estimate per round
SMOOTHING = 0.3  # weight of a new cost sample


def expected_tokens(acceptance: float, depth: int) -> float:
    """E(a, d) = 1 + a + ... + a^d: tokens a round keeps on average (its own token included)."""
    return sum(acceptance ** i for i in range(depth + 1))


class AdaptiveDepth:
    """One generation's draft-length controller: ``choose(cap)`` before a round asks for
    drafts, ``observe(...)`` once it has been verified."""

    def __init__(self, prior: float = PRIOR_ACCEPTANCE):
        self.kept = prior * PRIOR_ROUNDS  # discounted acceptances,
        self.trials = PRIOR_ROUNDS  # and discounted trials (acceptances plus rejections)
        self.per_token_s: float | None = None  # c
        self.fixed_s: float | None = None  # F
        self.last = 0  # the length chosen last

    @property
    def acceptance(self) -> float:
        return min(self.kept / self.trials, 0.999) if self.trials > 0 else PRIOR_ACCEPTANCE

    def observe(self, asked: int, proposed: int, kept: int, times: RoundTimes) -> None:
        """A round that asked for ``asked`` drafts, got ``proposed`` and kept ``kept``; ``times``
        its parts. A round without a reply from the daemon teaches nothing about drafting."""
        if asked < 1 or proposed < 1 or not times.reported:
            return
        self.kept = DISCOUNT * self.kept + kept
        self.trials = DISCOUNT * self.trials + kept + (1 if kept < proposed else 0)
        c = (times.draft_forward + times.draft_queue) / asked
        f = max(times.wall - times.draft_forward - times.draft_queue, 0.0)
        self.per_token_s = c if self.per_token_s is None else self.per_token_s + SMOOTHING * (c - self.per_token_s)
        self.fixed_s = f if self.fixed_s is None else self.fixed_s + SMOOTHING * (f - self.fixed_s)

    def choose(self, cap: int) -> int:
        """The draft length for the next round, in 1..cap (0 when cap is 0)."""
        if cap <= 1 or self.per_token_s is None or self.fixed_s is None:
            self.last = cap
            return cap
        a, c, f = self.acceptance, self.per_token_s, max(self.fixed_s, 1e-6)
        best = max(range(1, cap + 1), key=lambda d: (expected_tokens(a, d) / (f + c * d), -d))
        self.last = best
        return best
