"""The analytic model against cases computed by hand."""

import math

import pytest

from starsd_draftd.bench import plan as M
from starsd_draftd.bench.plan import Plan

# S = 5, V = 10, R = 3, d = 4, a = 0.8:
#   E = 1 + .8 + .64 + .512 + .4096 = 3.3616
#   (V + R) / S = 2.6  ->  N_full = 3 + 1 = 4
#   N = 1..3: T = S + V + R = 18 (idle 13, 8, 3);  N >= 4: T = 5 N (idle 0)
CASE = dict(draft_ms=5.0, verify_ms=10.0, rtt_ms=3.0, depth=4, acceptance=0.8)


def test_expected_tokens_per_round_by_hand():
    assert M.expected_tokens_per_round(0.8, 4) == pytest.approx(3.3616)
    assert M.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert M.expected_tokens_per_round(1.0, 4) == 5.0
    assert M.expected_tokens_per_round(0.0, 4) == 1.0
    with pytest.raises(ValueError):
        M.expected_tokens_per_round(1.5, 4)


def test_acceptance_inverts_expected_tokens():
    assert M.acceptance_for_tokens_per_round(3.3616, 4) == pytest.approx(0.8, abs=1e-9)
    assert M.acceptance_for_tokens_per_round(1.0, 4) == pytest.approx(0.0, abs=1e-9)
    assert M.acceptance_for_tokens_per_round(5.0, 4) == pytest.approx(1.0, abs=1e-9)
    with pytest.raises(ValueError):
        M.acceptance_for_tokens_per_round(6.0, 4)


def test_service_time_linear_in_depth():
    assert M.service_time_ms(4, 1.0, 1.0) == 5.0
    linear = Plan(verify_ms=10, rtt_ms=3, depth=4, acceptance=0.8, draft_base_ms=1.0, draft_per_token_ms=1.0)
    assert linear.service_ms == 5.0
    assert Plan(verify_ms=10, rtt_ms=3, depth=4, acceptance=0.8, draft_ms=7.0, draft_base_ms=1.0).service_ms == 7.0


def test_round_time_idle_and_n_full_by_hand():
    p = Plan(**CASE)
    assert [p.idle_ms(n) for n in range(1, 7)] == pytest.approx([13, 8, 3, 0, 0, 0])
    assert [p.round_ms(n) for n in range(1, 7)] == pytest.approx([18, 18, 18, 20, 25, 30])
    assert p.n_full == 4
    # T = N S + T_idle = max(N S, S + V + R) for every N
    for n in range(1, 20):
        assert p.round_ms(n) == pytest.approx(max(n * 5.0, 18.0))
        assert p.round_ms(n) == pytest.approx(n * 5.0 + p.idle_ms(n))


def test_n_full_at_an_exact_tie():
    # (V + R) / S = 3 exactly: at N = 4 the three others' service (15) exactly covers V + R.
    assert M.n_full(5.0, 12.0, 3.0) == 4
    assert M.idle_ms(4, 5.0, 12.0, 3.0) == 0.0
    assert M.idle_ms(3, 5.0, 12.0, 3.0) == pytest.approx(5.0)
    # float noise around the tie does not move N_full
    assert M.n_full(0.1, 0.2, 0.1) == 4  # 0.3 / 0.1 = 2.9999999999999996 in floats
    assert M.n_full(5.0, 0.0, 0.0) == 1  # nothing to wait for: one target keeps it busy
    with pytest.raises(ValueError):
        M.n_full(0.0, 1.0, 1.0)


def test_throughput_busy_fraction_by_hand():
    p = Plan(**CASE)
    assert p.tokens_per_round == pytest.approx(3.3616)
    assert p.per_target_tps(1) == pytest.approx(3.3616 / 18 * 1000)  # 186.76
    assert p.system_tps(2) == pytest.approx(2 * 3.3616 / 18 * 1000)
    assert p.system_tps(4) == pytest.approx(672.32)
    assert p.system_tps(10) == pytest.approx(672.32)  # saturated: E / S
    assert p.saturated_system_tps == pytest.approx(672.32)
    assert p.per_target_tps(8) == pytest.approx(3.3616 / 40 * 1000)
    assert p.busy_fraction(1) == pytest.approx(5 / 18)
    assert p.busy_fraction(3) == pytest.approx(15 / 18)
    assert p.busy_fraction(4) == 1.0
    assert p.rounds_per_s(4) == pytest.approx(200.0)


def test_baselines_and_break_even_by_hand():
    p = Plan(**CASE)  # V1 defaults to V = 10
    assert p.standalone_tps == pytest.approx(100.0)
    assert p.colocated_tps == pytest.approx(3.3616 / 15 * 1000)
    # E V1 = 33.616 >= S + V + R = 18, floor(33.616 / 5) = 6: N = 6 gives 3.3616 / 30 > 0.1, N = 7 does not
    assert p.break_even_n == 6
    assert p.per_target_tps(6) >= p.standalone_tps > p.per_target_tps(7)
    fast = Plan(**CASE, single_ms=4.0)  # E V1 = 13.45 < 18: even one target is slower than standalone
    assert fast.standalone_tps == pytest.approx(250.0)
    assert fast.break_even_n == 0
    assert fast.row(1)["speedup_vs_standalone"] == pytest.approx(186.7555 / 250, rel=1e-4)


def test_table_and_summary_fields():
    p = Plan(**CASE)
    rows = p.table(5)
    assert [r["n"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["busy_fraction"] == 1.0 and rows[3]["idle_ms"] == 0.0
    s = p.summary()
    assert s["n_full"] == 4 and s["service_ms"] == 5.0 and math.isclose(s["tokens_per_round"], 3.3616)
    text = M.format_plan(p, 6)
    assert "N_full" in text and "<- N_full" in text


def test_invalid_plans_are_refused():
    with pytest.raises(ValueError):
        Plan(verify_ms=10, rtt_ms=3, depth=0, acceptance=0.8, draft_ms=5)
    with pytest.raises(ValueError):
        Plan(verify_ms=10, rtt_ms=3, depth=4, acceptance=0.8)  # S(d) = 0
    with pytest.raises(ValueError):
        Plan(verify_ms=10, rtt_ms=-1, depth=4, acceptance=0.8, draft_ms=5)
    with pytest.raises(ValueError):
        M.round_ms(0, 5, 10, 3)


# ---------------------------------------------------------------- lookahead drafting
# S(d) = 1 + d: S = S(4) = 5, S_a = S(5) = 6, V = 10, R = 3, W = V + R = 13 (S_a <= W, so X = 0), d = 4, a = 0.8.
#   N = 1, h = 0.3: T_1 = 13 + 0.3 * 0 + 0.7 * 5 = 16.5
#   L = min(S_a, W) = 6, D = h (S - X) = 1.5, f(N) = min(1, T_idle(N) / (N L - (N - 1) D)):
#   N = 2: f = 8 / 10.5, T = W + S - f D = 18 - 8/7;  N = 3: f = 3 / 15 = 0.2, T = 18 - 0.3 = 17.7;  N >= 4: f = 0
LIN = dict(verify_ms=10.0, rtt_ms=3.0, depth=4, acceptance=0.8, draft_base_ms=1.0, draft_per_token_ms=1.0)


def test_lookahead_at_hit_rate_zero_is_todays_model_exactly():
    for p in (Plan(**CASE), Plan(**LIN), Plan(**LIN, hit_rate=0.0)):
        for n in range(1, 20):
            la = p.lookahead(n)
            assert la.coverage == 0.0 and la.round_ms == p.round_ms(n) and la.idle_ms == p.idle_ms(n)
            assert la.wait_ms == la.busy_ms == p.service_ms
            assert p.lookahead_per_target_tps(n) == p.per_target_tps(n)
            assert "lookahead" not in p.row(n) and "adaptive" not in p.row(n)
    assert "lookahead" not in Plan(**CASE).summary()
    assert "LA tok/s" not in M.format_plan(Plan(**CASE), 6) and "AD d" not in M.format_plan(Plan(**CASE), 6)


def test_lookahead_one_target_by_hand():
    p = Plan(**LIN, hit_rate=0.3)
    assert p.ahead_ms == 6.0
    assert p.lookahead_round_one_ms == pytest.approx(16.5)
    la = p.lookahead(1)
    assert la.coverage == 1.0 and la.round_ms == pytest.approx(16.5) and la.wait_ms == pytest.approx(3.5)
    assert la.busy_ms == pytest.approx(9.5) and la.idle_ms == pytest.approx(7.0)  # 3.5 + the 6 ms lookahead
    assert p.lookahead_per_target_tps(1) == pytest.approx(3.3616 / 16.5 * 1000)
    # every request a hit and the lookahead done within V + R: the round is just V + R
    assert M.lookahead_round_one_ms(5.0, 6.0, 10.0, 3.0, 1.0) == 13.0
    assert M.lookahead_round(1, 5.0, 6.0, 10.0, 3.0, 1.0).round_ms == pytest.approx(13.0)
    assert Plan(**LIN, hit_rate=1.0).lookahead(1).round_ms == pytest.approx(13.0)
    # lookahead longer than the return trip (S_a = 6 > W = 4): a hit waits for the remaining 2 ms
    #   T_1 = 4 + 0.5 * 2 + 0.5 * 5 = 7.5; the server never idles (4 ms ahead, then 2 or 5 ms)
    assert M.lookahead_round_one_ms(5.0, 6.0, 3.0, 1.0, 0.5) == pytest.approx(7.5)
    la = M.lookahead_round(1, 5.0, 6.0, 3.0, 1.0, 0.5)
    assert la.coverage == 1.0 and la.round_ms == pytest.approx(7.5) and la.busy_ms == pytest.approx(7.5)
    assert la.idle_ms == 0.0
    # S given directly: S_a = S (d + 1) / d = 6.25
    assert Plan(**CASE, hit_rate=0.5).ahead_ms == pytest.approx(6.25)


def test_lookahead_many_targets_by_hand_and_fading_out():
    p = Plan(**LIN, hit_rate=0.3)
    two, three = p.lookahead(2), p.lookahead(3)
    assert two.coverage == pytest.approx(8 / 10.5) and two.round_ms == pytest.approx(18 - 8 / 7)
    assert three.coverage == pytest.approx(0.2) and three.round_ms == pytest.approx(17.7)
    for la, n in ((two, 2), (three, 3)):  # partial coverage: the lookahead fills the idle time exactly
        assert n * la.busy_ms == pytest.approx(la.round_ms) and la.idle_ms == 0.0
    row = p.row(2)["lookahead"]
    assert row["per_target_tps"] == pytest.approx(3.3616 / (18 - 8 / 7) * 1000)
    assert row["system_tps"] == pytest.approx(2 * row["per_target_tps"])
    assert row["ratio_vs_fixed"] == pytest.approx(18 / (18 - 8 / 7)) and row["busy_fraction"] == pytest.approx(1.0)
    assert p.n_full == 4
    coverage = [p.lookahead(n).coverage for n in range(1, 30)]
    assert coverage == sorted(coverage, reverse=True)  # fades out as load grows
    for h in (0.3, 1.0):
        q = Plan(**LIN, hit_rate=h)
        for n in range(1, 30):
            la = q.lookahead(n)
            assert la.round_ms <= q.round_ms(n) + 1e-12
            if n >= q.n_full:  # a loaded server has no idle time: nothing ahead, today's T = N S
                assert la.coverage == 0.0 and la.round_ms == q.round_ms(n) == n * q.service_ms
                assert q.row(n)["lookahead"]["ratio_vs_fixed"] == 1.0


def test_hit_rate_helper_ceiling_and_validation():
    assert M.lookahead_hit_rate(0.8, 4, 0.5) == pytest.approx(0.2048)
    assert Plan(**LIN, hit_rate=0.2).hit_rate_ceiling == pytest.approx(0.4096)
    with pytest.raises(ValueError):
        Plan(**LIN, hit_rate=1.5)
    with pytest.raises(ValueError):
        M.lookahead_round(1, 5.0, 4.0, 10.0, 3.0, 0.5)  # S_a < S
    with pytest.raises(ValueError):
        M.lookahead_hit_rate(0.8, 4, -0.1)
    s = Plan(**LIN, hit_rate=0.3).summary()["lookahead"]
    assert s["ahead_ms"] == 6.0 and s["round_one_ms"] == pytest.approx(16.5) and s["hit_rate"] == 0.3
    assert "h exceeds alpha^d" in M.format_plan(Plan(**LIN, hit_rate=0.9), 4)
    assert "h exceeds" not in M.format_plan(Plan(**LIN, hit_rate=0.3), 4)


# ---------------------------------------------------------------- adaptive depth
def test_best_depth_by_hand():
    # S(d) = 1 + d, W = 13, a = 0.8, h = 0. N = 1: E / T = 1.8/15, 2.44/16, 2.952/17, 3.3616/18: d = 4.
    # N = 4: d = 4: T = max(20, 18) = 20 -> 0.168; d = 3: T = max(16, 17) = 17 -> 0.1736; d = 2: 2.44/16 = 0.1525
    assert M.best_depth(1, 0.8, 4, 1.0, 1.0, 10.0, 3.0) == 4
    assert M.best_depth(4, 0.8, 4, 1.0, 1.0, 10.0, 3.0) == 3
    assert M.depth_tokens_per_ms(4, 0.8, 3, 1.0, 1.0, 10.0, 3.0) == pytest.approx(2.952 / 17)
    for n in (1, 4, 9):
        rates = [M.depth_tokens_per_ms(n, 0.8, d, 1.0, 1.0, 10.0, 3.0, 0.3) for d in range(1, 9)]
        assert M.best_depth(n, 0.8, 8, 1.0, 1.0, 10.0, 3.0, 0.3) == 1 + rates.index(max(rates))


def test_best_depth_extremes():
    # everything accepted and drafting cheap next to V + R: the deepest allowed
    assert M.best_depth(1, 1.0, 8, 0.1, 0.01, 10.0, 3.0) == 8
    assert M.best_depth(1, 0.999, 16, 0.1, 0.01, 10.0, 3.0, 0.5) == 16
    # nothing accepted: E = 1 at any depth, so the cheapest depth; ties (free tokens) go to d = 1 too
    assert M.best_depth(1, 0.0, 8, 0.1, 0.01, 10.0, 3.0) == 1
    assert M.best_depth(50, 0.0, 8, 1.0, 1.0, 10.0, 3.0) == 1
    assert M.best_depth(1, 0.0, 8, 1.0, 0.0, 10.0, 3.0) == 1
    with pytest.raises(ValueError):
        M.best_depth(1, 0.5, 0, 1.0, 1.0, 10.0, 3.0)


def test_adaptive_depth_never_loses_to_the_fixed_depth():
    for h in (0.0, 0.3):
        p = Plan(**dict(LIN, depth=8), hit_rate=h)
        for n in range(1, 40):
            ad = p.adaptive_row(n)
            assert 1 <= ad["depth"] <= 8
            assert ad["per_target_tps"] >= p.per_target_tps(n) - 1e-9 and ad["ratio_vs_fixed"] >= 1.0 - 1e-12
            assert ad["per_target_tps"] >= p.lookahead_per_target_tps(n) - 1e-9
            assert ad["system_tps"] == pytest.approx(n * ad["per_target_tps"])
    p = Plan(**LIN)
    assert p.adaptive_row(4)["depth"] == 3 and p.adaptive_row(4)["round_ms"] == pytest.approx(17.0)
    assert p.adaptive_row(4)["ratio_vs_fixed"] == pytest.approx((2.952 / 17) / (3.3616 / 20))
    assert p.at_depth(3).service_ms == 4.0 and p.at_depth(4) is p
    rows = p.table(5, adaptive=True)
    assert [r["adaptive"]["depth"] for r in rows] == [p.best_depth(n) for n in range(1, 6)]
    text = M.format_plan(p, 5, adaptive=True)
    assert "AD d" in text and "AD tok/s" in text and "LA tok/s" not in text


def test_adaptive_depth_needs_the_linear_service_model():
    p = Plan(**CASE)
    with pytest.raises(ValueError, match="draft-base-ms"):
        p.best_depth(1)
    with pytest.raises(ValueError):
        p.at_depth(3)
    assert p.row(1)["per_target_tps"] == pytest.approx(3.3616 / 18 * 1000)  # the fixed depth still works


# ---------------------------------------------------------------- CLI
def test_plan_cli_with_lookahead_and_adaptive_depth():
    import json

    from click.testing import CliRunner

    from starsd_draftd.bench.cli import plan as plan_cli

    base = ["--draft-base-ms", "1", "--draft-per-token-ms", "1", "--verify-ms", "10", "--rtt-ms", "3",
            "--acceptance", "0.8", "--n-max", "6"]
    res = CliRunner().invoke(plan_cli, base)
    assert res.exit_code == 0, res.output
    assert "LA tok/s" not in res.output and "AD d" not in res.output
    res = CliRunner().invoke(plan_cli, base + ["--hit-rate", "0.3", "--adaptive-depth"])
    assert res.exit_code == 0, res.output
    assert "T_1 = V + R + h max(0, S_a - V - R) + (1 - h) S = 16.500 ms" in res.output
    for col in ("cover", "LA tok/s", "LA sys tok/s", "LA x", "AD d", "AD tok/s", "AD sys tok/s", "AD x"):
        assert col in res.output
    row1 = next(line for line in res.output.splitlines() if line.startswith("  1 "))
    assert "100.0%" in row1 and "203.7" in row1 and "1.09x" in row1  # 3.3616 / 16.5 ms; 18 / 16.5
    res = CliRunner().invoke(plan_cli, base + ["--adaptive-depth", "--json"], env={"STARSD_DRAFTD_HIT_RATE": "0.3"})
    out = json.loads(res.output)
    assert out["params"]["hit_rate"] == 0.3 and out["lookahead"]["round_one_ms"] == pytest.approx(16.5)
    assert out["table"][0]["lookahead"]["round_ms"] == pytest.approx(16.5)
    assert out["table"][3]["lookahead"]["coverage"] == 0.0
    assert [r["adaptive"]["depth"] for r in out["table"]][:4] == [4, 4, 4, 3]
    res = CliRunner().invoke(plan_cli, base + ["--no-adaptive-depth", "--json"])
    assert "adaptive" not in json.loads(res.output)["table"][0]
    res = CliRunner().invoke(plan_cli, ["--draft-ms", "5", "--verify-ms", "10", "--acceptance", "0.8",
                                        "--adaptive-depth"])
    assert res.exit_code == 1 and "--draft-base-ms" in res.output
    res = CliRunner().invoke(plan_cli, base + ["--hit-rate", "1.5"])
    assert res.exit_code == 2
