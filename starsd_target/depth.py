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

**Where the draft daemon stops chains itself** (its WELCOME says ``stops_drafts``; greedy
generations): a round asks for the cap and sends ``min_survival()``, and the daemon stops the
chain once the chance that all its drafts are kept falls below it, each draft's chance from the
draft model's own probability of its pick (or, for a token copied from the context, how often
copies were kept), calibrated on the session's outcomes (``starsd_draftd.backends.base.Stopping``).
That follows the text token by token, where the geometric model above sees one mean acceptance:
a run copied from the context goes on to the cap, a guess the draft is unsure of ends the chain.
The threshold is the marginal rule: one more draft, kept with chance ``s``, adds ``s`` tokens and
costs ``c + v`` seconds (``v``: the verification forward's cost per token verified, from a
weighted regression over the rounds' lengths), so it pays while ``s / (c + v)`` exceeds the
rate the rounds reach, ``R``: ``min_survival = R * (c + v)``.

**No drafts at all** (``PlainOrDrafts``, the target daemon's ``--adaptive-speculation``,
experimental and off by default: docs/bench.md shows no gain yet on the demo pair): a round that
asks for none keeps one token, starts at once (no wire, no draft daemon) and shares one forward
with the other generations' rounds. The choice is the target's, for all its adaptive generations
together: one generation drafting while another does not slows the other's rounds (a 5-token
verification beside its 1-token step), and plain rounds are only as cheap as they can be when
all are plain. Each generation measures the tokens per second of its rounds of each kind
(weighted tokens over weighted seconds, each round's wall time from the end of the one before;
a generation's first drafted round and the first after plain ones are not counted, as they pay
the draft daemon's catch-up); where the sum of their rates without drafts beats the sum with by
``SWITCH_MARGIN``, they all run without (and the reverse). The model above is not used for this:
it predicts a round's length well enough to choose ``d``, but not the rate a plain round reaches
beside the others. Each side is measured only while chosen, so the other is probed: after
``PROBE_FIRST`` rounds per generation, every generation runs ``PROBE_ROUNDS`` rounds the other
way, all at once so that plain rounds share their forward as they would; each probe that
confirms the choice doubles the wait, up to ``PROBE_MAX``. A generation that has not yet been
measured drafting drafts.

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
PROBE_FIRST = 8  # rounds per generation before a probe round goes the other way,
PROBE_MAX = 128  # doubling after each probe that confirmed the choice, up to this
PROBE_ROUNDS = 3  # rounds per generation a probe goes the other way
RATE_SMOOTHING = 0.1  # weight of a new round in the measured rates (rounds vary in tokens kept)
PRIOR_MIN_SURVIVAL = 0.2  # until its rounds are measured (the demo pair's rule settles near 0.2)
MIN_SURVIVAL_RANGE = (0.02, 0.9)  # the rule's threshold is kept within these
SLOPE_DISCOUNT = 0.95  # weight of older rounds in the verification cost's regression
# the least variance (tokens verified squared) of the rounds' lengths for a slope: below it they are
# about all one length (a fixed depth, every draft kept) and the slope is noise
SLOPE_MIN_VARIANCE = 0.05


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
        # for adaptive speculation, its rounds with drafts and without as weighted (tokens,
        # seconds, rounds so far), None before the first: a mean of the rounds until there are
        # 1 / RATE_SMOOTHING of them (one odd first round does not linger), then exponential
        self.drafted: tuple[float, float, int] | None = None
        self.alone: tuple[float, float, int] | None = None
        # its next round with drafts pays a catch-up at the draft daemon, not counted: the first
        # one carries the prompt's prefill there, one after plain rounds the tokens they added
        self.catching_up = True
        self.last = 0  # the length chosen last
        # the verification forward's seconds against the tokens it verified, weighted sums of
        # (weight, n, t, n*n, n*t): its slope is the cost of one more token verified
        self._verify = [0.0] * 5

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
        n = proposed + 1  # tokens the verification forward ran over
        self._verify = [SLOPE_DISCOUNT * x + y for x, y in
                        zip(self._verify, (1.0, n, times.verify_forward, n * n, n * times.verify_forward))]
        # per token drafted: a chain the daemon stopped early cost what it drafted, not what was asked
        c = (times.draft_forward + times.draft_queue) / min(asked, proposed)
        f = max(times.wall - times.draft_forward - times.draft_queue, 0.0)
        self.per_token_s = _ewma(self.per_token_s, c)
        self.fixed_s = _ewma(self.fixed_s, f)
        self._drafted_round(kept + 1, times.wall)

    def observe_plain(self, times: RoundTimes) -> None:
        """A round this controller chose to run without drafts (``choose`` gave 0), ``times`` its parts."""
        self.alone = _ewma2(self.alone, 1, times.wall)
        self.catching_up = True

    def observe_fallback(self, times: RoundTimes) -> None:
        """A round that asked for drafts and verified without them (none came in time): one
        token for its wait, on the drafted side's rate."""
        self._drafted_round(1, times.wall)

    def _drafted_round(self, tokens: int, wall: float) -> None:
        if not self.catching_up:
            self.drafted = _ewma2(self.drafted, tokens, wall)
        self.catching_up = False

    def drafted_rate(self) -> float | None:
        """Measured tokens per second of its rounds with drafts (None: none yet)."""
        return _rate_of(self.drafted)

    def plain_rate(self) -> float | None:
        """Measured tokens per second of its rounds without drafts (None: none yet)."""
        return _rate_of(self.alone)

    def verify_slope(self) -> float | None:
        """Seconds the verification forward costs per token verified (None: the rounds measured
        so far do not vary enough in length to tell)."""
        w, n, t, nn, nt = self._verify
        if w <= 0.0:
            return None
        var = nn / w - (n / w) ** 2
        if var < SLOPE_MIN_VARIANCE:
            return None
        return max((nt / w - (n / w) * (t / w)) / var, 0.0)

    def min_survival(self) -> float:
        """The threshold a round that asks the daemon to stop its chain sends (the module's
        docstring): the measured rate times what one more draft costs."""
        rate = self.drafted_rate()
        if rate is None or self.per_token_s is None:
            return PRIOR_MIN_SURVIVAL
        cost = self.per_token_s + (self.verify_slope() or 0.0)
        lo, hi = MIN_SURVIVAL_RANGE
        return min(max(rate * cost, lo), hi)

    def choose(self, cap: int) -> int:
        """The draft length for the next round, in 1..cap (0 when cap is 0)."""
        if cap <= 1 or self.per_token_s is None or self.fixed_s is None:
            self.last = cap
            return cap
        a, c, f = self.acceptance, self.per_token_s, max(self.fixed_s, 1e-6)
        best = max(range(1, cap + 1), key=lambda d: (expected_tokens(a, d) / (f + c * d), -d))
        self.last = best
        return best


class PlainOrDrafts:
    """Target-wide: whether the adaptive generations' next rounds ask for drafts or run on the
    target alone (see the module's docstring). ``plain_for(key, members)`` before one of them
    asks: ``members`` maps every adaptive generation (its key) to its controller."""

    def __init__(self):
        self.plain = False  # the choice stands at no drafts (probe rounds aside)
        self.streak = 0  # rounds, all generations together, since the last probe or switch
        self.probe_after = PROBE_FIRST  # rounds per generation before the next probe
        self.probing: dict = {}  # generations in a probe: rounds of it left
        self.switches = 0  # changes of the choice,
        self.probes = 0  # and probe waves, for STATS and tests

    def plain_for(self, key, members: dict) -> bool:
        self.probing = {k: n for k, n in self.probing.items() if k in members}  # those that finished
        if key in self.probing:  # a probe round goes the other way
            return self._probe_round(key)
        if members[key].drafted_rate() is None:
            return False  # this generation has not drafted a round yet: it does now
        spec = plain = 0.0
        both = True  # every generation measured both ways (those yet to draft aside)
        for ctl in members.values():
            rate, alone = ctl.drafted_rate(), ctl.plain_rate()
            if rate is None:
                continue
            if alone is None:
                both = False
                continue
            spec, plain = spec + rate, plain + alone
        if both and ((spec > plain * (1.0 + SWITCH_MARGIN)) if self.plain
                     else (plain > spec * (1.0 + SWITCH_MARGIN))):
            self.plain, self.streak, self.probe_after = not self.plain, 0, PROBE_FIRST
            self.switches += 1
            return self.plain
        self.streak += 1
        if self.streak > self.probe_after * len(members):  # measure the other side, all at once
            self.streak = 0
            self.probe_after = min(2 * self.probe_after, PROBE_MAX)
            self.probing = dict.fromkeys(members, PROBE_ROUNDS)
            self.probes += 1
            return self._probe_round(key)
        return self.plain

    def _probe_round(self, key) -> bool:
        """One of ``key``'s probe rounds: the other way."""
        self.probing[key] -= 1
        if self.probing[key] <= 0:
            del self.probing[key]
        return not self.plain


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


def _ewma2(old: tuple[float, float, int] | None, tokens: float, seconds: float) -> tuple[float, float, int]:
    if old is None:
        return float(tokens), seconds, 1
    n = old[2] + 1
    w = max(RATE_SMOOTHING, 1.0 / n)
    return old[0] + w * (tokens - old[0]), old[1] + w * (seconds - old[1]), n


def _rate_of(m: tuple[float, float, int] | None) -> float | None:
    return None if m is None else m[0] / max(m[1], 1e-6)
