"""The analytic model of a StarSD star (one draft server, N targets) as pure functions.

Notation (times in milliseconds):

* ``S = S(d)``: service time of one depth-``d`` draft request on the draft server. Either given,
  or ``S(d) = s0 + s1 * d`` (a fixed cost per request plus a cost per drafted token).
* ``V``: one verification round on a target: its forward over ``[last token, x_1..x_d]``.
* ``R``: everything else a round spends between the two machines: network round trip,
  serialization, queueing in the sockets.
* ``alpha``: probability that a draft token is accepted. The model assumes acceptances are
  i.i.d. Bernoulli(alpha) along the chain (the assumption of Leviathan et al. 2023): a round
  keeps the first ``n`` drafts with P(n) = alpha^n (1 - alpha) for n < d, alpha^d for n = d, and
  the target always adds one token of its own, so a round produces

      E(alpha, d) = sum_{i=0..d} alpha^i = (1 - alpha^(d+1)) / (1 - alpha)   (d + 1 when alpha = 1)

  tokens on average. Real acceptance is position- and text-dependent; the model is as good as
  this assumption (``acceptance_for_tokens_per_round`` inverts E for a measured mean).
* ``V1``: the target's single-token forward, the cost of one token in standalone decoding.

Progress and time are separate (as in the paper): each round yields E tokens, and its
duration follows from the queueing below.

Derivation of the round time. Each of N targets cycles through: wait in the draft server's
queue, be served (S), spend V + R verifying and returning, send its next request. The server
serves one request at a time, first come first served. Look at one target's cycle of length
T, measured from the start of its service to the start of its next service:

1. During T the server serves every one of the N targets exactly once (FIFO, and every target
   has exactly one request per cycle), so T >= N * S.
2. The target itself needs S (its own service) + V + R before it can be served again, so
   T >= S + V + R.
3. Both bounds are reached: with deterministic times FIFO settles into round robin. If
   (N - 1) * S >= V + R, a target's next request arrives before the server has finished the
   other N - 1 targets' services, so the server never waits and T = N * S. Otherwise the
   server finishes the others and then waits T_idle = V + R - (N - 1) * S for this target.

Hence the round time seen by the draft server (the paper's T = N * S(d) + T_idle):

    T(N) = N * S + T_idle(N),   T_idle(N) = max(0, V + R - (N - 1) * S)
         = max(N * S, S + V + R)

The server is fully loaded once the service time of the N - 1 *other* targets covers one
target's return time, (N - 1) * S >= V + R, i.e. from

    N_full = ceil((V + R) / S) + 1

on (the smallest such N). Below N_full the server idles T_idle per round and system
throughput grows linearly in N; from N_full on, T = N * S: system throughput is capped at
E / S, each extra target adds only queueing delay, and per-target throughput falls as
E / (N * S). Draft busy fraction is N * S / T(N).

Per target: E / T(N) tokens per ms; system: N * E / T(N). The standalone baseline is one
token per single-token forward, 1 / V1 per target (N / V1 for N targets, each on its own
accelerator). Co-located speculative decoding (draft and target on the same accelerator, no
network, strictly one after the other) runs a round in S + V, so E / (S + V) per target.
StarSD keeps beating standalone decoding while E / T(N) >= 1 / V1, up to ``break_even_n``.

Lookahead drafting (``hit_rate`` h > 0). Below N_full the server idles; it can spend that time
pre-drafting. Right after replying to a session, it drafts that session's next round as if the
target keeps all d drafts and its bonus token is the draft's own best guess: one extra step for
the guess, then d drafts after it, so the work ahead is

    S_a = S(d + 1)     (with S given directly rather than as s0 + s1 d: S_a = S (d + 1) / d,
                        the s0 = 0 extension, an upper bound on S(d + 1) for any s0 >= 0)

The session's next request is a *hit* with probability h: it brings one of the sequences drafted
ahead, so a pre-drafted round is exactly the one it asks for. With only the all-kept guess, i.i.d.
acceptance gives h = alpha^d g, with g the probability that the draft's guess of the next token is
right (``lookahead_hit_rate``); the daemon also guesses rejections at early positions (the draft's
second choice there), so measured rates can exceed alpha^d. The model takes h as an input, since
it is a property of the draft-target pair to measure (`starsd-draftd status` reports it). h = 0 is
today's design (no lookahead: all of it would be wasted). Its S_a counts one row: the daemon's
guesses share a batched forward, which on a CPU costs somewhat more than one row (more on the
guesses in docs/architecture.md, "Lookahead and adaptive draft length"). Write W = V + R for a session's return time.
Assumptions: (a) real requests come first: the lookahead runs only while no request waits, and a
request that misses cancels its session's lookahead at once (the work is dropped; cancelling at the
next step boundary instead costs at most one step, ignored); (b) on a hit, a lookahead that has not
finished is finished (the target waits for the remainder), otherwise the reply goes out at once,
with no service time; (c) a hit leaves the round's tokens unchanged (E: the next round's drafts are
the ones normal drafting would make, and under i.i.d. acceptance its outcome is independent of the
hit); (d) h is the same at every depth (in truth alpha^d g falls with d; see adaptive depth).

One target (N = 1), exactly. The lookahead starts when the reply goes out (time 0) and would end at
S_a; the next request arrives at W. Nothing else competes for the server, so on a hit the reply goes
out at max(W, S_a) = W + max(0, S_a - W); on a miss the lookahead (done or not) is dropped and the
request is served normally, replying at W + S. Every reply starts the same cycle afresh and rounds
hit independently, so the mean round time is

    T_1 = W + h * X + (1 - h) * S,    X = max(0, S_a - W)  (the part of S_a a hit waits for)

against S + W without lookahead: the saving is h (S - X), S whole when S_a <= W. (X > S, a lookahead
slower than a fresh request on a hit, needs W < S_a - S, a return trip shorter than one draft
step; the model then reports the loss rather than second-guessing the design.)

Many targets: a mean-value (fluid) approximation. Let f in [0, 1] be the fraction of rounds whose
lookahead the idle time can pay for ("covered" rounds; the others are served normally). A covered
round costs the server L = min(S_a, W) of lookahead inside the session's return window, where it
uses only idle time, and then h X + (1 - h) S while the target waits; an uncovered round costs S.
Per round, a target waits on the server and the server is busy, on average,

    S_wait(f) = S - f * D,          D = h (S - X)   (the mean saving of a covered round)
    S_busy(f) = S_wait(f) + f * L

and, by the two bounds of the derivation above with S_wait for the target's own service and S_busy
for the server's work per round,

    T(N) = max(N * S_busy(f), S_wait(f) + W).

Lookahead only fills idle time, so it may not push the work bound past the return bound:
N S_busy(f) <= S_wait(f) + W, i.e. (N - 1) S_wait(f) + N f L <= W, which is linear in f. The server
covers as many rounds as that allows:

    f(N) = min(1, T_idle(N) / (N L - (N - 1) D)),     T_idle(N) = max(0, W - (N - 1) S)  (as above)

(the denominator is > 0 whenever T_idle > 0: with S_a <= W it is N S_a - (N - 1) h S > 0, and
with S_a > W it is N W - (N - 1) h (S - S_a + W) >= W). Then:

* N = 1: f = 1 (W / L >= 1) and T = S_wait(1) + W = T_1, the exact result above.
* 1 < N < N_full: while f = 1, T = W + S - D, every round covered; once f < 1 the work bound
  meets the return bound, T = W + S - f D = N S_busy(f): the server never idles, and as N grows the
  idle time shrinks, f falls and lookahead fades out.
* N >= N_full: T_idle = 0, so f = 0 and T = max(N S, S + W) = N S, today's model exactly.

The approximation puts averages in place of the random mix of hits and misses: it ignores the
queueing that bunches of misses cause, and assumes a covered round's lookahead gets its share of
idle time within its own return window. It is exact at N = 1 and from N_full on, and optimistic in
between.

Adaptive depth. Each session can draft at its own depth d in 1..d_max. The model picks the d that
maximises tokens per unit time for that target, E(alpha, d) / T(N; d), with S = S(d) = s0 + s1 d
and S_a = S(d + 1) in T (``best_depth``; ties go to the smaller d). It needs S as a function of d,
so the linear service model. V is taken as independent of d (a forward over d + 1 tokens costs
about what one does on an accelerator, for small d), every session is assumed to use the same
depth (the symmetric star: N identical targets), and h is held fixed across depths (assumption
(d)): pass the hit rate of the depth the design runs at. Depth d_max itself is a candidate, so
in the model adaptive depth never does worse than the fixed depth d_max at the same hit rate (and,
whenever X <= S, lookahead never lengthens a round: T = W + S - f D <= today's T).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

_EPS = 1e-9  # slack for floating-point ties such as (N - 1) * S == V + R exactly


def service_time_ms(depth: int, base_ms: float, per_token_ms: float) -> float:
    """S(d) = s0 + s1 * d."""
    if depth < 1:
        raise ValueError("depth must be >= 1")
    if base_ms < 0 or per_token_ms < 0:
        raise ValueError("service times must be >= 0")
    return base_ms + per_token_ms * depth


def expected_tokens_per_round(acceptance: float, depth: int) -> float:
    """E = (1 - a^(d+1)) / (1 - a): kept drafts plus the target's own token, under i.i.d.
    Bernoulli(a) acceptance along the chain."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError("acceptance must lie in [0, 1]")
    if depth < 0:
        raise ValueError("depth must be >= 0")
    # The sum form equals the closed form and stays exact as a -> 1 (the quotient loses digits there).
    return float(sum(acceptance ** i for i in range(depth + 1)))


def acceptance_for_tokens_per_round(tokens_per_round: float, depth: int) -> float:
    """The i.i.d. acceptance a with E(a, d) equal to a measured mean tokens per round
    (E is increasing in a, from 1 at a = 0 to d + 1 at a = 1; solved by bisection)."""
    if not 1.0 <= tokens_per_round <= depth + 1:
        raise ValueError(f"tokens per round must lie in [1, {depth + 1}], got {tokens_per_round}")
    if tokens_per_round == depth + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, depth) < tokens_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def idle_ms(n: int, service_ms: float, verify_ms: float, rtt_ms: float) -> float:
    """T_idle(N) = max(0, V + R - (N - 1) * S): how long the draft server waits per round."""
    _check(n, service_ms, verify_ms, rtt_ms)
    idle = verify_ms + rtt_ms - (n - 1) * service_ms
    return idle if idle > _EPS else 0.0


def round_ms(n: int, service_ms: float, verify_ms: float, rtt_ms: float) -> float:
    """T(N) = N * S + T_idle(N) = max(N * S, S + V + R)."""
    return n * service_ms + idle_ms(n, service_ms, verify_ms, rtt_ms)


def n_full(service_ms: float, verify_ms: float, rtt_ms: float) -> int:
    """The smallest N with (N - 1) * S >= V + R: ceil((V + R) / S) + 1."""
    if service_ms <= 0:
        raise ValueError("a draft server with zero service time is never fully loaded")
    _check(1, service_ms, verify_ms, rtt_ms)
    return math.ceil((verify_ms + rtt_ms) / service_ms - _EPS) + 1


def _check(n: int, service_ms: float, verify_ms: float, rtt_ms: float) -> None:
    if n < 1:
        raise ValueError("N must be >= 1")
    if service_ms < 0 or verify_ms < 0 or rtt_ms < 0:
        raise ValueError("times must be >= 0")


def lookahead_hit_rate(acceptance: float, depth: int, guess_rate: float) -> float:
    """h = alpha^d * g under i.i.d. acceptance: all d drafts kept, and the draft's guess of the
    target's bonus token right (probability g)."""
    if not 0.0 <= guess_rate <= 1.0:
        raise ValueError("guess_rate must lie in [0, 1]")
    expected_tokens_per_round(acceptance, depth)  # validates acceptance and depth
    return acceptance ** depth * guess_rate


class LookaheadRound(NamedTuple):
    """One round of the lookahead model at N targets (times in ms, means per round)."""

    coverage: float  # f: fraction of rounds pre-drafted in idle time
    wait_ms: float   # S_wait(f): the target's mean wait on the server, beyond queueing
    busy_ms: float   # S_busy(f): the server's mean work per round, lookahead included
    round_ms: float  # T(N) = max(N * S_busy, S_wait + V + R)
    idle_ms: float   # T(N) - N * S_busy: server time left idle per round


def lookahead_round_one_ms(service_ms: float, ahead_ms: float, verify_ms: float, rtt_ms: float,
                           hit_rate: float) -> float:
    """The exact N = 1 round time T_1 = W + h * max(0, S_a - W) + (1 - h) * S, W = V + R."""
    _check_lookahead(1, service_ms, ahead_ms, verify_ms, rtt_ms, hit_rate)
    w = verify_ms + rtt_ms
    return w + hit_rate * max(0.0, ahead_ms - w) + (1.0 - hit_rate) * service_ms


def lookahead_round(n: int, service_ms: float, ahead_ms: float, verify_ms: float, rtt_ms: float,
                    hit_rate: float) -> LookaheadRound:
    """The fluid lookahead model (module docstring): coverage
    f = min(1, T_idle(N) / (N L - (N - 1) D)), L = min(S_a, W), D = h (S - max(0, S_a - W)),
    and T(N) = max(N * S_busy(f), S_wait(f) + W). h = 0 (or N >= N_full) gives f = 0 and today's
    T(N) exactly."""
    _check_lookahead(n, service_ms, ahead_ms, verify_ms, rtt_ms, hit_rate)
    w = verify_ms + rtt_ms
    slack = idle_ms(n, service_ms, verify_ms, rtt_ms)  # T_idle(N) without lookahead
    in_window = min(ahead_ms, w)                          # L
    saving = hit_rate * (service_ms - max(0.0, ahead_ms - w))  # D
    coverage = 0.0
    if hit_rate > 0.0 and slack > 0.0:
        coverage = min(1.0, slack / (n * in_window - (n - 1) * saving))  # denominator > 0 when slack > 0
    wait = service_ms - coverage * saving
    busy = wait + coverage * in_window
    if coverage == 0.0:  # exactly today's model, free of rounding
        t = round_ms(n, service_ms, verify_ms, rtt_ms)
    else:
        t = max(n * busy, wait + w)
    idle = t - n * busy
    return LookaheadRound(coverage, wait, busy, t, idle if idle > _EPS else 0.0)


def _check_lookahead(n: int, service_ms: float, ahead_ms: float, verify_ms: float, rtt_ms: float,
                     hit_rate: float) -> None:
    _check(n, service_ms, verify_ms, rtt_ms)
    if service_ms <= 0:
        raise ValueError("the draft service time S(d) must be > 0")
    if ahead_ms < service_ms:
        raise ValueError("the work ahead S_a = S(d + 1) cannot be less than S(d)")
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError("hit_rate must lie in [0, 1]")


def depth_tokens_per_ms(n: int, acceptance: float, depth: int, base_ms: float, per_token_ms: float,
                        verify_ms: float, rtt_ms: float, hit_rate: float = 0.0) -> float:
    """E(alpha, d) / T(N; d): one target's tokens per ms at depth d, with S = S(d), S_a = S(d + 1)
    and the lookahead model (today's T(N) when hit_rate = 0)."""
    t = lookahead_round(n, service_time_ms(depth, base_ms, per_token_ms),
                        service_time_ms(depth + 1, base_ms, per_token_ms), verify_ms, rtt_ms, hit_rate).round_ms
    return expected_tokens_per_round(acceptance, depth) / t


def best_depth(n: int, acceptance: float, max_depth: int, base_ms: float, per_token_ms: float,
               verify_ms: float, rtt_ms: float, hit_rate: float = 0.0) -> int:
    """The depth d in 1..max_depth maximising E(alpha, d) / T(N; d) with S(d) = base + per-token * d
    (ties go to the smaller d, the cheaper one)."""
    if max_depth < 1:
        raise ValueError("max_depth must be >= 1")
    if base_ms + per_token_ms <= 0:
        raise ValueError("the draft service time S(d) must be > 0")
    best, best_rate = 1, -1.0
    for d in range(1, max_depth + 1):
        rate = depth_tokens_per_ms(n, acceptance, d, base_ms, per_token_ms, verify_ms, rtt_ms, hit_rate)
        if rate > best_rate * (1.0 + 1e-12):
            best, best_rate = d, rate
    return best


@dataclass(frozen=True)
class Plan:
    """One deployment's parameters. ``draft_ms`` is S(d) when given; otherwise
    S(d) = draft_base_ms + draft_per_token_ms * depth. ``single_ms`` (V1) defaults to V.
    ``hit_rate`` h > 0 turns on lookahead drafting (0: today's design). For adaptive depth
    (``best_depth``, ``adaptive_row``) ``depth`` is the largest depth allowed."""

    verify_ms: float
    rtt_ms: float
    depth: int
    acceptance: float
    draft_ms: float | None = None
    draft_base_ms: float = 0.0
    draft_per_token_ms: float = 0.0
    single_ms: float | None = None
    hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError("hit_rate must lie in [0, 1]")
        if self.depth < 1:
            raise ValueError("depth must be >= 1")
        if self.verify_ms < 0 or self.rtt_ms < 0:
            raise ValueError("times must be >= 0")
        if self.single_ms is not None and self.single_ms <= 0:
            raise ValueError("single_ms must be > 0")
        if self.service_ms <= 0:
            raise ValueError("the draft service time S(d) must be > 0")
        expected_tokens_per_round(self.acceptance, self.depth)  # validates acceptance

    @property
    def service_ms(self) -> float:
        if self.draft_ms is not None:
            return self.draft_ms
        return service_time_ms(self.depth, self.draft_base_ms, self.draft_per_token_ms)

    @property
    def ahead_ms(self) -> float:
        """S_a = S(d + 1), the work of one lookahead (S (d + 1) / d when S is given directly)."""
        if self.draft_ms is not None:
            return self.draft_ms * (self.depth + 1) / self.depth
        return service_time_ms(self.depth + 1, self.draft_base_ms, self.draft_per_token_ms)

    @property
    def v1_ms(self) -> float:
        return self.verify_ms if self.single_ms is None else self.single_ms

    @property
    def tokens_per_round(self) -> float:
        return expected_tokens_per_round(self.acceptance, self.depth)

    @property
    def n_full(self) -> int:
        return n_full(self.service_ms, self.verify_ms, self.rtt_ms)

    def round_ms(self, n: int) -> float:
        return round_ms(n, self.service_ms, self.verify_ms, self.rtt_ms)

    def idle_ms(self, n: int) -> float:
        return idle_ms(n, self.service_ms, self.verify_ms, self.rtt_ms)

    def busy_fraction(self, n: int) -> float:
        return n * self.service_ms / self.round_ms(n)

    def per_target_tps(self, n: int) -> float:
        """Tokens per second of one target among N."""
        return 1000.0 * self.tokens_per_round / self.round_ms(n)

    def system_tps(self, n: int) -> float:
        return n * self.per_target_tps(n)

    def rounds_per_s(self, n: int) -> float:
        """Rounds per second of the whole system (equals the draft server's requests per second)."""
        return 1000.0 * n / self.round_ms(n)

    @property
    def standalone_tps(self) -> float:
        """One target decoding alone: one token per single-token forward."""
        return 1000.0 / self.v1_ms

    @property
    def colocated_tps(self) -> float:
        """Speculative decoding with draft and target on one accelerator: rounds of S + V."""
        return 1000.0 * self.tokens_per_round / (self.service_ms + self.verify_ms)

    @property
    def saturated_system_tps(self) -> float:
        """The ceiling E / S, reached from N_full on."""
        return 1000.0 * self.tokens_per_round / self.service_ms

    @property
    def break_even_n(self) -> int:
        """The largest N whose per-target throughput is still >= standalone decoding (0: never).
        Per-target throughput E / max(S + V + R, N S) is non-increasing in N, so this is
        floor(E V1 / S) when S + V + R <= E V1, and 0 otherwise."""
        budget = self.tokens_per_round * self.v1_ms
        if self.service_ms + self.verify_ms + self.rtt_ms > budget + _EPS:
            return 0
        return math.floor(budget / self.service_ms + _EPS)

    # ---------------------------------------------------------------- lookahead, adaptive depth
    def lookahead(self, n: int) -> LookaheadRound:
        """The lookahead model at this depth (today's round when hit_rate = 0)."""
        return lookahead_round(n, self.service_ms, self.ahead_ms, self.verify_ms, self.rtt_ms, self.hit_rate)

    def lookahead_per_target_tps(self, n: int) -> float:
        return 1000.0 * self.tokens_per_round / self.lookahead(n).round_ms

    @property
    def lookahead_round_one_ms(self) -> float:
        """T_1 = V + R + h * max(0, S_a - V - R) + (1 - h) * S, exact for one target."""
        return lookahead_round_one_ms(self.service_ms, self.ahead_ms, self.verify_ms, self.rtt_ms, self.hit_rate)

    @property
    def hit_rate_ceiling(self) -> float:
        """alpha^d: a hit needs every draft kept, so h above this contradicts i.i.d. acceptance."""
        return self.acceptance ** self.depth

    def at_depth(self, depth: int) -> Plan:
        """The same deployment drafting ``depth`` tokens a round (needs the linear S(d))."""
        if depth == self.depth:
            return self
        self._require_linear_service()
        return replace(self, depth=depth)

    def _require_linear_service(self) -> None:
        if self.draft_ms is not None:
            raise ValueError("adaptive depth needs S(d) as a function of d: give --draft-base-ms and "
                             "--draft-per-token-ms instead of --draft-ms")

    def best_depth(self, n: int) -> int:
        """The depth in 1..depth maximising one target's E / T(N; d), lookahead included when h > 0."""
        self._require_linear_service()
        return best_depth(n, self.acceptance, self.depth, self.draft_base_ms, self.draft_per_token_ms,
                          self.verify_ms, self.rtt_ms, self.hit_rate)

    def lookahead_row(self, n: int) -> dict:
        """Lookahead at this depth beside the fixed-depth design without it."""
        la = self.lookahead(n)
        tps = 1000.0 * self.tokens_per_round / la.round_ms
        return {"coverage": la.coverage, "round_ms": la.round_ms, "idle_ms": la.idle_ms,
                "busy_fraction": n * la.busy_ms / la.round_ms, "per_target_tps": tps, "system_tps": n * tps,
                "ratio_vs_fixed": tps / self.per_target_tps(n)}

    def adaptive_row(self, n: int) -> dict:
        """The best depth for N (at most ``depth``; lookahead included when h > 0) beside the
        fixed-depth design without lookahead."""
        d = self.best_depth(n)
        best = self.at_depth(d)
        la = best.lookahead(n)
        tps = 1000.0 * best.tokens_per_round / la.round_ms
        return {"depth": d, "service_ms": best.service_ms, "tokens_per_round": best.tokens_per_round,
                "coverage": la.coverage, "round_ms": la.round_ms, "per_target_tps": tps, "system_tps": n * tps,
                "ratio_vs_fixed": tps / self.per_target_tps(n)}

    def row(self, n: int, adaptive: bool = False) -> dict:
        """Today's fixed-depth round; with ``lookahead`` (when h > 0) and ``adaptive`` (when asked)
        beside it."""
        out = {
            "n": n,
            "round_ms": self.round_ms(n),
            "idle_ms": self.idle_ms(n),
            "busy_fraction": self.busy_fraction(n),
            "per_target_tps": self.per_target_tps(n),
            "system_tps": self.system_tps(n),
            "rounds_per_s": self.rounds_per_s(n),
            "speedup_vs_standalone": self.per_target_tps(n) / self.standalone_tps,
        }
        if self.hit_rate > 0:
            out["lookahead"] = self.lookahead_row(n)
        if adaptive:
            out["adaptive"] = self.adaptive_row(n)
        return out

    def table(self, n_max: int, adaptive: bool = False) -> list[dict]:
        if n_max < 1:
            raise ValueError("n_max must be >= 1")
        return [self.row(n, adaptive) for n in range(1, n_max + 1)]

    def summary(self) -> dict:
        out = self._summary()
        if self.hit_rate > 0:
            out["lookahead"] = {
                "hit_rate": self.hit_rate,
                "hit_rate_ceiling": self.hit_rate_ceiling,
                "ahead_ms": self.ahead_ms,
                "round_one_ms": self.lookahead_round_one_ms,
                "assumption": "fluid (mean-value) model: real requests first, a miss cancels its lookahead at once, "
                              "a hit waits for the rest of its lookahead; exact at N = 1 and from N_full on",
            }
        return out

    def _summary(self) -> dict:
        return {
            "params": asdict(self),
            "service_ms": self.service_ms,
            "single_ms": self.v1_ms,
            "tokens_per_round": self.tokens_per_round,
            "n_full": self.n_full,
            "saturated_system_tps": self.saturated_system_tps,
            "standalone_tps_per_target": self.standalone_tps,
            "colocated_tps_per_target": self.colocated_tps,
            "break_even_n": self.break_even_n,
            "assumption": "i.i.d. Bernoulli(acceptance) along the draft chain; deterministic times; FIFO draft server "
                          "serving one request at a time",
        }


def format_plan(plan: Plan, n_max: int, adaptive: bool = False) -> str:
    """A text table for the CLI; lookahead columns when h > 0, adaptive-depth ones when asked."""
    s = plan.summary()
    lines = [
        f"S(d) = {plan.service_ms:.3f} ms   V = {plan.verify_ms:.3f} ms   R = {plan.rtt_ms:.3f} ms   "
        f"d = {plan.depth}   acceptance = {plan.acceptance:.3f}   V1 = {plan.v1_ms:.3f} ms",
        f"tokens per round E = (1 - a^(d+1)) / (1 - a) = {s['tokens_per_round']:.3f}  (i.i.d. acceptance assumed)",
        "round time T = N * S(d) + T_idle,  T_idle = max(0, V + R - (N - 1) * S(d))",
        f"N_full = ceil((V + R) / S) + 1 = {s['n_full']}   saturated system throughput E / S = "
        f"{s['saturated_system_tps']:.1f} tok/s",
        f"standalone: {s['standalone_tps_per_target']:.1f} tok/s per target; co-located speculative: "
        f"{s['colocated_tps_per_target']:.1f} tok/s; StarSD beats standalone per target up to N = {s['break_even_n']}",
        "",
    ]
    lookahead = plan.hit_rate > 0
    if lookahead:
        la = s["lookahead"]
        ahead = "S(d+1)" if plan.draft_ms is None else "S (d+1) / d"
        lines[-1:-1] = [
            f"lookahead: hit rate h = {plan.hit_rate:.3f} (alpha^d = {la['hit_rate_ceiling']:.3f}), S_a = {ahead} = "
            f"{la['ahead_ms']:.3f} ms;  N = 1: T_1 = V + R + h max(0, S_a - V - R) + (1 - h) S = "
            f"{la['round_one_ms']:.3f} ms",
            "  cover = fraction of rounds the idle time pre-drafts (fluid model; none from N_full on); "
            "LA = lookahead at depth d",
        ]
        if plan.hit_rate > la["hit_rate_ceiling"] + _EPS:
            lines.insert(-1, "  note: h exceeds alpha^d, the most the all-kept guess allows under i.i.d. acceptance "
                             "(guesses of a rejection can hit too)")
    if adaptive:
        lines.insert(-1, f"adaptive depth: AD = per N the d in 1..{plan.depth} maximising E(a, d) / T(N; d)"
                         + (", lookahead included" if lookahead else "") + "; x = tok/s over the fixed-depth design")
    head = f"{'N':>3} {'T ms':>9} {'T_idle ms':>10} {'busy':>6} {'per-target tok/s':>17} {'system tok/s':>13} " \
           f"{'vs standalone':>14}"
    if lookahead:
        head += f" {'cover':>6} {'LA tok/s':>9} {'LA sys tok/s':>13} {'LA x':>6}"
    if adaptive:
        head += f" {'AD d':>4} {'AD tok/s':>9} {'AD sys tok/s':>13} {'AD x':>6}"
    lines += [head, "-" * len(head)]
    for r in plan.table(n_max, adaptive):
        mark = "  <- N_full" if r["n"] == s["n_full"] else ""
        line = (f"{r['n']:3d} {r['round_ms']:9.3f} {r['idle_ms']:10.3f} {100 * r['busy_fraction']:5.1f}% "
                f"{r['per_target_tps']:17.1f} {r['system_tps']:13.1f} {r['speedup_vs_standalone']:13.2f}x")
        if lookahead:
            la_r = r["lookahead"]
            line += (f" {100 * la_r['coverage']:5.1f}% {la_r['per_target_tps']:9.1f} {la_r['system_tps']:13.1f} "
                     f"{la_r['ratio_vs_fixed']:5.2f}x")
        if adaptive:
            ad = r["adaptive"]
            line += (f" {ad['depth']:4d} {ad['per_target_tps']:9.1f} {ad['system_tps']:13.1f} "
                     f"{ad['ratio_vs_fixed']:5.2f}x")
        lines.append(line + mark)
    return "\n".join(lines)
