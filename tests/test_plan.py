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
