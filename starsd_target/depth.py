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
``max_draft_tokens``); until a round has been measured the cap is used.

**No drafts at all** (``plain``, the target daemon's ``--adaptive-speculation``): a round that
asks for none keeps one token and lasts ``T0``, the generation's own rounds on the target alone,
which run at once (no wire, no draft daemon) and share a forward with other generations' rounds.
Where ``1 / T0`` beats the best ``E(a, d) / (F + c d)``, the round runs without drafts: a target
batching several generations' decode steps, a draft daemon saturated by other targets, or a text
the draft does not know. ``T0`` is measured on such rounds, and estimated from the rounds with
drafts (their wall time less the draft wait: a slight over-estimate, since verifying 1 + d tokens
costs a little more than one); the lower of the two is used, as each is measured only on its own
kind of round and a high outlier in one must not rule that kind out for good. A choice holds
until the other side leads by ``SWITCH_MARGIN`` (no flapping on noise). While running without
drafts, ``a``, ``c`` and ``F`` are not measured: a probe round asks for drafts after
``PROBE_FIRST`` rounds, and each probe that confirms the choice doubles the wait, up to
``PROBE_MAX``.

Greedy outputs do not depend on the length (every draft is verified), and a round without drafts
samples from the target's own distribution. A seeded sampled generation keeps the cap every
round: the target's random draws follow its rounds, so a length chosen from measured times would
make the same seed give other tokens on a slower day (the scheduler applies this rule).
"""

from __future__ import annotations

from starsd_target.profile import RoundTimes

PRIOR_ACCEPTANCE = 0.6  # what a fresh generation assumes, worth PRIOR_ROUNDS rounds of evidence
PRIOR_ROUNDS = 2.0
DISCOUNT = 0.9  # weight of the previous estimate per round
SMOOTHING = 0.3  # weight of a new cost sample
SWITCH_MARGIN = 0.05  # drafts or none: the other side must lead by this much to change the choice
PROBE_FIRST = 8  # rounds without drafts before a probe round asks for them again,
PROBE_MAX = 128  # doubling after each probe that confirmed the choice, up to this


def expected_tokens(acceptance: float, depth: int) -> float:
    """E(a, d) = 1 + a + ... + a^d: tokens a round keeps on average (its own token included)."""
    return sum(acceptance ** i for i in range(depth + 1))


class AdaptiveDepth:
    """One generation's draft-length controller: ``choose(cap)`` before a round asks for
    drafts, ``observe(...)`` once it has been verified."""

    def __init__(self, prior: float = PRIOR_ACCEPTANCE, plain: bool = True):
        self.kept = prior * PRIOR_ROUNDS  # discounted acceptances,
        self.trials = PRIOR_ROUNDS  # and discounted trials (acceptances plus rejections)
        self.per_token_s: float | None = None  # c
        self.fixed_s: float | None = None  # F
        self.plain = plain  # a round may ask for no drafts at all
        self.alone_s: float | None = None  # T0, measured on rounds without drafts
        self.alone_guess_s: float | None = None  # T0 as estimated from rounds with drafts
        self.plain_streak = 0  # rounds without drafts since the last round that asked for some
        self.probe_after = PROBE_FIRST  # rounds without drafts before the next probe
        self.running_plain = False  # the choice stands at no drafts (probe rounds aside)
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
        self.per_token_s = _ewma(self.per_token_s, c)
        self.fixed_s = _ewma(self.fixed_s, f)
        self.alone_guess_s = _ewma(self.alone_guess_s, max(times.wall - times.draft_wait, 0.0))

    def observe_plain(self, times: RoundTimes) -> None:
        """A round this controller chose to run without drafts (``choose`` gave 0), ``times`` its parts."""
        self.alone_s = _ewma(self.alone_s, times.wall)

    def choose(self, cap: int) -> int:
        """The draft length for the next round, in 0..cap (0: no drafts; always 0 when cap is 0)."""
        if cap <= 0 or self.per_token_s is None or self.fixed_s is None:
            self.last = max(cap, 0)
            return self.last
        a, c, f = self.acceptance, self.per_token_s, max(self.fixed_s, 1e-6)
        best = max(range(1, cap + 1), key=lambda d: (expected_tokens(a, d) / (f + c * d), -d))
        choice = self._plain_or(best, expected_tokens(a, best) / (f + c * best))
        self.last = choice
        return choice

    def _plain_or(self, best: int, rate: float) -> int:
        """0 where a round without drafts is expected to produce more tokens per second than
        ``best`` drafts at ``rate``, else ``best``; with hysteresis and probe rounds."""
        # the lower of the two: a plain round that happened to carry another generation's prefill
        # chunk must not rule plain rounds out for good (they are measured only when chosen)
        alone = min((t for t in (self.alone_s, self.alone_guess_s) if t is not None), default=None)
        if not self.plain or alone is None:
            return best
        plain_rate = 1.0 / max(alone, 1e-6)
        if self.running_plain:
            if rate > plain_rate * (1.0 + SWITCH_MARGIN):  # drafts lead again (a probe showed it)
                self.running_plain, self.plain_streak, self.probe_after = False, 0, PROBE_FIRST
                return best
            self.plain_streak += 1
            if self.plain_streak > self.probe_after:  # re-measure the drafts' side
                self.plain_streak = 0
                self.probe_after = min(2 * self.probe_after, PROBE_MAX)
                return best
            return 0
        if plain_rate > rate * (1.0 + SWITCH_MARGIN):
            self.running_plain, self.plain_streak = True, 1
            return 0
        return best


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
