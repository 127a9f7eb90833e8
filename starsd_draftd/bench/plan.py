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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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


@dataclass(frozen=True)
class Plan:
    """One deployment's parameters. ``draft_ms`` is S(d) when given; otherwise
    S(d) = draft_base_ms + draft_per_token_ms * depth. ``single_ms`` (V1) defaults to V."""

    verify_ms: float
    rtt_ms: float
    depth: int
    acceptance: float
    draft_ms: float | None = None
    draft_base_ms: float = 0.0
    draft_per_token_ms: float = 0.0
    single_ms: float | None = None

    def __post_init__(self) -> None:
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

    def row(self, n: int) -> dict:
        return {
            "n": n,
            "round_ms": self.round_ms(n),
            "idle_ms": self.idle_ms(n),
            "busy_fraction": self.busy_fraction(n),
            "per_target_tps": self.per_target_tps(n),
            "system_tps": self.system_tps(n),
            "rounds_per_s": self.rounds_per_s(n),
            "speedup_vs_standalone": self.per_target_tps(n) / self.standalone_tps,
        }

    def table(self, n_max: int) -> list[dict]:
        if n_max < 1:
            raise ValueError("n_max must be >= 1")
        return [self.row(n) for n in range(1, n_max + 1)]

    def summary(self) -> dict:
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


def format_plan(plan: Plan, n_max: int) -> str:
    """A text table for the CLI."""
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
    head = f"{'N':>3} {'T ms':>9} {'T_idle ms':>10} {'busy':>6} {'per-target tok/s':>17} {'system tok/s':>13} " \
           f"{'vs standalone':>14}"
    lines += [head, "-" * len(head)]
    for r in plan.table(n_max):
        mark = "  <- N_full" if r["n"] == s["n_full"] else ""
        lines.append(f"{r['n']:3d} {r['round_ms']:9.3f} {r['idle_ms']:10.3f} {100 * r['busy_fraction']:5.1f}% "
                     f"{r['per_target_tps']:17.1f} {r['system_tps']:13.1f} {r['speedup_vs_standalone']:13.2f}x{mark}")
    return "\n".join(lines)
