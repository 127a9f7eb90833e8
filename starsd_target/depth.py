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
rate the rounds reach, ``R``: ``min_survival = R * (c + v)``. A draft the daemon copies from text
already seen (its suffix index) costs no drafting, so the same rule gives it the lower floor
``min_chance = R * v`` (sent beside min_survival once ``v`` is measured): copied runs go on while
their chance pays for the verification alone.

**When drafting does not pay** (``pause_unpaid``, the target's ``--pause-unpaid-drafts``): a
draft the target rarely keeps, a daemon slow to answer, a target whose verification of a few rows
costs far more than one. Once MIN_JUDGED_ROUNDS rounds with drafts are measured, a round is run
without drafts (a plain round) while the rate the rounds with drafts reach is below PAY_SHARE of
the target alone's, one token per plain round (measured on the plain rounds once there are any;
before, the verification forward's cost at one row, from the regression below, plus the rest of
a round). Plain rounds come in runs, PROBE_FIRST long and doubling up to PROBE_MAX while drafting
still does not pay; after each run PROBE_ROUNDS rounds draft again (the first pays the daemon's
catch-up and is not counted), and drafting resumes if the last of them alone reaches the bar, so
that it does where the text turns to what the draft knows. Crowded plain rounds, batched with
other generations, say nothing of the target alone's rate and are not counted.

**Fill steps** (the target's ``--fill-steps``): while a generation's request is in flight and the
target has nothing else to run, it may take one step of its own, a fill step, whose token the
drafts then have to start with (the scheduler skips the drafts the fill steps confirmed and
verifies the rest). With ``r`` the wait still expected, ``s`` a fill step's cost and ``V(k)`` a
verification over ``k`` rows, waiting and verifying the ``d`` drafts left takes ``r + V(d + 1)``,
while a fill step and then, if its token is the first draft's (chance ``a``), a verification of
the other ``d - 1`` takes ``max(s, r) + a * V(d)``; both keep ``E(a, d)`` tokens on average, ``d``
the drafts the replies bring (fewer than asked where the daemon stops chains itself). So a
fill step is taken wherever the reply is still a step away (the target would idle through it), and
otherwise where ``s + a * V(d)`` is at most ``1 - FILL_GAIN`` of ``r + V(d + 1)`` (``fill_pays``).
``r`` is the sooner of what the last replies took (the daemon's reported queueing and drafting,
and the wire's time) and what the daemon's acknowledgement of this request said; ``s`` comes from
the fill steps measured, ``V`` from the regression below. Drafting hidden behind a fill step no
longer shows in the round's wait, so the length chosen grows until the drafts take about a step.

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
RATE_SMOOTHING = 0.1  # weight of a new round in the measured rates (rounds vary in tokens kept)
PRIOR_MIN_SURVIVAL = 0.2  # until its rounds are measured (the demo pair's rule settles near 0.2)
MIN_SURVIVAL_RANGE = (0.02, 0.9)  # the rule's threshold is kept within these
SLOPE_DISCOUNT = 0.95  # weight of older rounds in the verification cost's regression
# the least variance (tokens verified squared) of the rounds' lengths for a slope: below it they are
# about all one length (a fixed depth, every draft kept) and the slope is noise
SLOPE_MIN_VARIANCE = 0.05
MIN_JUDGED_ROUNDS = 8  # rounds with drafts measured before drafting may be judged not to pay
PAY_SHARE = 0.95  # drafting stops while its rate is below this share of the target alone's (a margin for noise)
PROBE_FIRST, PROBE_MAX = 4, 64  # plain rounds in a run: the first run's, and the most (doubling)
PROBE_ROUNDS = 2  # rounds with drafts after each run of plain ones (the first pays a catch-up)
# a fill step taken while the reply is less than a step away must be expected to shorten the round
# by this share: the model leaves out what lookahead saves a round that waits, and beside a draft
# daemon that answers in a few milliseconds (the demo's) steps it judged barely worth taking made
# the star slower
FILL_GAIN = 0.2


def expected_tokens(acceptance: float, depth: int) -> float:
    """E(a, d) = 1 + a + ... + a^d: tokens a round keeps on average (its own token included)."""
    return sum(acceptance ** i for i in range(depth + 1))


class AdaptiveDepth:
    """One generation's draft-length controller: ``choose(cap)`` before a round asks for
    drafts, ``observe(...)`` once it has been verified."""

    def __init__(self, prior: float = PRIOR_ACCEPTANCE, pause_unpaid: bool = False):
        self.kept = prior * PRIOR_ROUNDS  # discounted acceptances,
        self.trials = PRIOR_ROUNDS  # and discounted trials (acceptances plus rejections)
        self.per_token_s: float | None = None  # c
        self.fixed_s: float | None = None  # F
        # the rate its rounds with drafts reach (min_survival's R), as weighted (tokens, seconds,
        # rounds so far), None before the first: a mean of the rounds until there are
        # 1 / RATE_SMOOTHING of them (one odd first round does not linger), then exponential
        self.drafted: tuple[float, float, int] | None = None
        # its next round with drafts pays a catch-up at the draft daemon, not counted: the first
        # one carries the prompt's prefill there, one after plain rounds the tokens they added
        self.catching_up = True
        self.last = 0  # the length chosen last
        self.pause_unpaid = pause_unpaid  # drafts_pay judges (False: every round drafts)
        self.alone: tuple[float, float, int] | None = None  # (1, seconds, rounds) of its plain rounds
        self._other_s: float | None = None  # a drafted round's time beside its draft wait and forward
        self._plain_left = 0  # plain rounds still to run in the current run of them
        self._probe_left = 0  # rounds with drafts still to run before drafting is judged again
        self._run = PROBE_FIRST  # the next run's length of plain rounds
        self._last: tuple[int, float] | None = None  # the last counted round with drafts: tokens, seconds
        self._probed = False  # the rounds just run were a probe's
        # the verification forward's seconds against the tokens it verified, weighted sums of
        # (weight, n, t, n*n, n*t): its slope is the cost of one more token verified
        self._verify = [0.0] * 5
        # what the wait for a reply will be (fill_pays): the daemon's reported queueing and drafting
        # for a request, whole (not cut to the wait the target saw), and the wire's time
        self.reply_s: float | None = None
        self.wire_s: float | None = None
        self.drafts_sent: float | None = None  # drafts a reply brings (a daemon that stops chains sends fewer)
        self.fill_step_s: float | None = None  # a fill step's wall time

    @property
    def acceptance(self) -> float:
        return min(self.kept / self.trials, 0.999) if self.trials > 0 else PRIOR_ACCEPTANCE

    def observe(self, asked: int, proposed: int, kept: int, times: RoundTimes, tokens: int | None = None,
                rows: int | None = None) -> None:
        """A round that asked for ``asked`` drafts, got ``proposed`` and kept ``kept``; ``times``
        its parts. A round without a reply from the daemon teaches nothing about drafting.

        A reply with no drafts (the daemon stopped the chain before its first: nothing was likely
        enough for the thresholds sent) still counts in the rate and the verification's cost: a
        round that brought one token. Left out, a threshold set high by a few fast rounds early
        in a generation would never come down, and every later chain would stop empty.

        A round with fill steps (``times.fill``): ``kept`` counts the drafts they confirmed and
        those verified after them, ``tokens`` what the round added in all (default: ``kept`` + 1),
        ``rows`` the rows of the verification that ran over the drafts the steps did not reach (0:
        none ran; default: ``proposed`` + 1). Its draft wait is the target's idle wait alone, so
        ``c`` follows the drafting the steps did not hide."""
        if asked < 1 or not times.reported:
            return
        rows = proposed + 1 if rows is None else rows
        tokens = kept + 1 if tokens is None else tokens
        if rows:
            self._verified_forward(rows, times.verify_forward)
            # the round beside its draft wait, forwards and steps, for the target alone's rate (alone_rate)
            self._other_s = _ewma(self._other_s, max(times.wall - times.draft_wait - times.verify_forward - times.fill,
                                                     0.0))
        if not times.fill:  # the wire's time is seen whole only where no step stood in the wait
            self.wire_s = _ewma(self.wire_s, times.wire)
        if proposed < 1:
            self._drafted_round(tokens, times.wall)
            return
        self.kept = DISCOUNT * self.kept + kept
        self.trials = DISCOUNT * self.trials + kept + (1 if kept < proposed else 0)
        # per token drafted: a chain the daemon stopped early cost what it drafted, not what was asked
        c = (times.draft_forward + times.draft_queue) / min(asked, proposed)
        f = max(times.wall - times.draft_forward - times.draft_queue, 0.0)
        self.per_token_s = _ewma(self.per_token_s, c)
        self.fixed_s = _ewma(self.fixed_s, f)
        self._drafted_round(tokens, times.wall)

    def observe_reply(self, reported: tuple[float, float] | None, drafts: int) -> None:
        """What the daemon reported for a reply (queued, drafting), whole, and the drafts it
        brought: for the wait the next requests can expect (``expected_wait``) and what they bring."""
        if reported is not None:
            self.reply_s = _ewma(self.reply_s, max(sum(reported), 0.0))
        self.drafts_sent = _ewma(self.drafts_sent, float(drafts))

    def observe_fill_step(self, wall_s: float, forward_s: float) -> None:
        """A fill step: its cost, and a one-row point of the verification's regression."""
        self.fill_step_s = _ewma(self.fill_step_s, wall_s)
        self._verified_forward(1, forward_s)

    def _verified_forward(self, n: int, seconds: float) -> None:
        self._verify = [SLOPE_DISCOUNT * x + y for x, y in zip(self._verify, (1.0, n, seconds, n * n, n * seconds))]

    def expected_wait(self) -> float | None:
        """Seconds a request is expected to wait for its reply, as the last ones did (None: not
        measured yet). Per request, not per draft asked for: a daemon that stops chains itself
        drafts as far as it judges, whatever the length asked."""
        if self.reply_s is None or self.wire_s is None:
            return None
        return self.reply_s + self.wire_s

    def verify_s(self, rows: int) -> float | None:
        """A verification's forward over ``rows`` rows and the rest of its round, from the
        regression (None: not measured yet)."""
        w, n, t = self._verify[:3]
        if w <= 0.0 or self._other_s is None:
            return None
        slope = self.verify_slope() or 0.0
        return max(t / w + slope * (rows - n / w), 0.0) + self._other_s

    def fill_pays(self, remaining_s: float, asked: int, filled: int = 0) -> bool:
        """Whether a fill step pays now (the module's docstring), with ``remaining_s`` of the
        wait still expected for a request of ``asked`` drafts past which ``filled`` fill steps
        have gone. ``d`` is what the replies bring (a daemon that stops chains itself often sends
        fewer than asked, or none: then a step costs the round nothing). Not before a fill
        step's cost can be told."""
        step = self.fill_step_s
        if step is None:
            step = self.verify_s(1)
            if step is None:
                return False
        expected = asked if self.drafts_sent is None else min(asked, round(self.drafts_sent))
        drafts_left = expected - filled
        if remaining_s >= step or drafts_left < 1:
            return True  # the target would idle through the step, or the drafts are used up anyway
        wait = max(remaining_s, 0.0) + self.verify_s(drafts_left + 1)
        return step + self.acceptance * self.verify_s(drafts_left) <= (1.0 - FILL_GAIN) * wait

    def observe_fallback(self, times: RoundTimes) -> None:
        """A round that asked for drafts and verified without them (none came in time): one
        token for its wait, on the drafted side's rate."""
        self._drafted_round(1, times.wall)

    def _drafted_round(self, tokens: int, wall: float) -> None:
        if not self.catching_up:
            self.drafted = _ewma2(self.drafted, tokens, wall)
            self._last = (tokens, wall)
        self.catching_up = False

    def observe_plain(self, times: RoundTimes) -> None:
        """A round without drafts (by choice): one token for its time, the target alone's rate.
        The next round with drafts pays the draft daemon's catch-up."""
        self.alone = _ewma2(self.alone, 1, times.wall)
        self.catching_up = True

    def alone_rate(self) -> float | None:
        """Tokens per second the target alone would reach: measured on its plain rounds; before
        there are any, one token per a one-row verification forward (the regression's value at one
        row; at the mean length verified where the lengths do not vary) and the rest of a round.
        None: not measured yet."""
        if self.alone is not None:
            return _rate_of(self.alone)
        w, n, t = self._verify[:3]
        if w <= 0.0 or self._other_s is None:
            return None
        one_row = t / w - (self.verify_slope() or 0.0) * max(n / w - 1.0, 0.0)
        if one_row <= 0.0:  # a slope from noisy forwards: the mean forward instead, an upper bound
            one_row = t / w
        return 1.0 / max(one_row + self._other_s, 1e-6)

    def drafts_pay(self) -> bool:
        """Whether the next round asks for drafts (the module's docstring: when drafting does
        not pay); called once a round, it advances the runs of plain rounds and the probes.
        Always True where the controller does not judge (``pause_unpaid`` False)."""
        if not self.pause_unpaid:
            return True
        if self._plain_left > 0:
            self._plain_left -= 1
            if not self._plain_left:
                self._probe_left = PROBE_ROUNDS
            return False
        if self._probe_left > 0:
            self._probe_left -= 1
            self._probed = not self._probe_left
            return True
        rate, alone = self.drafted_rate(), self.alone_rate()
        if self._probed and self._last is not None and alone is not None:
            # judged on the probe's own round: the mean of the rounds counted so far (mostly
            # from before the pause) would take many probes to follow a text the draft now knows
            self._probed = False
            tokens, wall = self._last
            if tokens / max(wall, 1e-6) >= PAY_SHARE * alone:
                self.drafted = (float(tokens), wall, self.drafted[2])  # set wherever _last is
                self._run = PROBE_FIRST
                return True
        if rate is None or alone is None or self.drafted[2] < MIN_JUDGED_ROUNDS or rate >= PAY_SHARE * alone:
            self._run = PROBE_FIRST
            return True
        self._plain_left, self._run = self._run - 1, min(2 * self._run, PROBE_MAX)
        if not self._plain_left:
            self._probe_left = PROBE_ROUNDS
        return False

    def drafted_rate(self) -> float | None:
        """Measured tokens per second of its rounds with drafts (None: none yet)."""
        return _rate_of(self.drafted)

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

    def min_chance(self) -> float:
        """The threshold for drafts that cost no drafting (copied from text already seen): the
        measured rate times the verification's cost per token verified; 0 (none sent) until both
        are measured."""
        rate, slope = self.drafted_rate(), self.verify_slope()
        if rate is None or slope is None:
            return 0.0
        lo, hi = MIN_SURVIVAL_RANGE
        return min(max(rate * slope, lo), hi)

    def choose(self, cap: int) -> int:
        """The draft length for the next round, in 1..cap (0 when cap is 0)."""
        if cap <= 1 or self.per_token_s is None or self.fixed_s is None:
            self.last = cap
            return cap
        a, c, f = self.acceptance, self.per_token_s, max(self.fixed_s, 1e-6)
        best = max(range(1, cap + 1), key=lambda d: (expected_tokens(a, d) / (f + c * d), -d))
        self.last = best
        return best


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
