"""The target's round policy (starsd_target.round_plan) on plain values: no scheduler, no model."""

import pytest

from common.verify import SamplingParams
from starsd_target.depth import AdaptiveDepth, MIN_SURVIVAL_RANGE, PRIOR_MIN_SURVIVAL
from starsd_target.profile import split_round
from starsd_target.round_plan import RoundPlan, crowded_round, keeps_cap, plan_round

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8)
SEEDED = SamplingParams(temperature=0.8, seed=7)


def _measured(per_token_s: float, fixed_s: float, acceptance: float) -> AdaptiveDepth:
    """A controller whose costs and acceptance are set as if measured."""
    d = AdaptiveDepth(prior=acceptance)
    d.per_token_s, d.fixed_s = per_token_s, fixed_s
    return d


def test_no_session_or_no_room_asks_for_nothing_and_is_not_plain():
    for plan in (plan_round(5, session=False), plan_round(0, session=True)):
        assert plan == RoundPlan(wanted=False)
        assert not plan.drafts and not plan.plain and not plan.crowded


def test_a_crowded_round_asks_for_no_drafts_and_is_plain():
    plan = plan_round(5, session=True, crowded=True, trees=True, budget=16, depth=AdaptiveDepth())
    assert plan.wanted and plan.crowded and plan.plain and not plan.drafts
    assert (plan.depth, plan.budget, plan.min_survival) == (0, 0, 0.0)


def test_the_tree_budget_is_asked_for_where_the_daemon_drafts_trees_and_keeps_the_depth():
    depth = _measured(per_token_s=1.0, fixed_s=0.001, acceptance=0.1)  # would choose a length of 1
    plan = plan_round(5, session=True, trees=True, budget=16, depth=depth)
    assert plan.drafts and (plan.depth, plan.budget, plan.min_survival) == (5, 16, 0.0)
    assert depth.last == 0  # the controller was not asked: adaptive depth models chains
    chain = plan_round(5, session=True, trees=False, budget=16)
    assert (chain.depth, chain.budget) == (5, 0)


def test_greedy_trees_the_daemon_prunes_carry_the_thresholds():
    """Where the daemon stops greedy drafts itself, a tree request carries the chain's
    thresholds: the daemon drops the nodes that do not pay their verified row."""
    depth = _measured(per_token_s=1.0, fixed_s=0.001, acceptance=0.1)
    depth.drafted, depth._verify = (3.0, 0.1, 5), (1.0, 3.0, 0.06, 10.0, 0.19)  # v: 10 ms a token verified
    plan = plan_round(5, session=True, trees=True, budget=16, stops_drafts=True, greedy_drafts=True, depth=depth)
    assert (plan.depth, plan.budget) == (5, 16) and depth.last == 0
    chain = plan_round(5, session=True, stops_drafts=True, greedy_drafts=True, depth=depth)
    assert (plan.min_survival, plan.min_chance) == (chain.min_survival, chain.min_chance) and plan.min_survival > 0
    sampled = plan_round(5, session=True, trees=True, budget=16, stops_drafts=True, greedy_drafts=False, depth=depth)
    assert (sampled.budget, sampled.min_survival, sampled.min_chance) == (16, 0.0, 0.0)


def test_greedy_chains_the_daemon_stops_ask_for_the_cap_with_min_survival():
    depth = _measured(per_token_s=1.0, fixed_s=0.001, acceptance=0.1)
    plan = plan_round(6, session=True, stops_drafts=True, greedy_drafts=True, depth=depth)
    assert plan.drafts and plan.depth == 6 and plan.budget == 0
    assert plan.min_survival == PRIOR_MIN_SURVIVAL  # no rate measured yet
    assert plan.min_chance == 0.0  # nor the verification's cost per token: the daemon uses min_survival
    lo, hi = MIN_SURVIVAL_RANGE
    depth.drafted = (3.0, 0.01, 5)  # a measured rate of 300 tokens/s: the threshold hits its ceiling
    assert plan_round(6, session=True, stops_drafts=True, greedy_drafts=True, depth=depth).min_survival == hi
    depth.drafted, depth._verify = (3.0, 0.1, 5), (1.0, 3.0, 0.06, 10.0, 0.19)  # v: 10 ms a token verified
    both = plan_round(6, session=True, stops_drafts=True, greedy_drafts=True, depth=depth)
    assert both.min_chance == pytest.approx(30.0 * 0.01) and both.min_chance < both.min_survival
    depth.per_token_s = 0.0  # a copied chain's threshold is never above a drafted one's
    depth._verify = [1.0, 3.0, 0.06, 10.0, 0.24]  # v: 60 ms a token, past the ceiling
    capped = plan_round(6, session=True, stops_drafts=True, greedy_drafts=True, depth=depth)
    assert capped.min_chance == capped.min_survival == hi
    depth.per_token_s = 1.0
    # sampled drafting, or a daemon that does not stop chains: the controller picks the length
    for kw in ({"stops_drafts": True, "greedy_drafts": False}, {"stops_drafts": False, "greedy_drafts": True}):
        p = plan_round(6, session=True, depth=depth, **kw)
        assert p.min_survival == 0.0 and p.min_chance == 0.0 and p.depth == 1


def test_adaptive_depth_chooses_the_length_within_the_cap():
    cheap = _measured(per_token_s=1e-4, fixed_s=0.05, acceptance=0.9)
    costly = _measured(per_token_s=1.0, fixed_s=0.001, acceptance=0.1)
    assert plan_round(8, session=True, depth=cheap).depth == 8
    assert plan_round(8, session=True, depth=costly).depth == 1
    assert costly.last == 1  # the choice is recorded in the controller
    unmeasured = AdaptiveDepth()
    assert plan_round(8, session=True, depth=unmeasured).depth == 8  # the cap until a round is measured
    assert plan_round(8, session=True).depth == 8  # no controller: the cap every round


def test_a_controller_that_observed_rounds_changes_the_plan():
    depth = AdaptiveDepth()
    times = split_round(1.0, 0.9, (0.0, 0.9), 0.05, 0.0)  # drafting takes most of the round
    for _ in range(5):
        depth.observe(8, 8, 0, times)  # every draft rejected, each costing a lot
    assert plan_round(8, session=True, depth=depth).depth < 8


def test_a_controller_that_finds_drafting_does_not_pay_plans_plain_rounds():
    """Drafts never kept, a round with them 30 ms against 10 ms alone: after the rounds it
    judges by, the plan is a plain round (wanted, no request), whether the target or the daemon
    would have chosen the chain's length."""
    from starsd_target.depth import MIN_JUDGED_ROUNDS

    for stops in (False, True):
        depth = AdaptiveDepth(pause_unpaid=True)
        for _ in range(MIN_JUDGED_ROUNDS + 1):
            depth.observe(4, 4, 0, split_round(0.030, 0.010, (0.0, 0.010), 0.020, 0.0))
        depth.observe_plain(split_round(0.010, 0.0, None, 0.010, 0.0))
        plan = plan_round(4, session=True, stops_drafts=stops, greedy_drafts=True, depth=depth)
        assert plan.wanted and plan.plain and not plan.drafts and not plan.crowded


def test_seeded_sampled_generations_keep_the_cap_and_always_draft():
    assert keeps_cap(SEEDED) and not keeps_cap(SAMPLED) and not keeps_cap(GREEDY)
    assert not keeps_cap(SamplingParams(temperature=0.0, seed=7))  # greedy output does not follow the length
    # never held back by a crowded target
    assert not crowded_round(2, 8, True, SEEDED, batchable_active=10)
    # the scheduler gives it no controller, so its plan asks for the cap every round
    assert plan_round(8, session=True, depth=None).depth == 8


def test_crowded_round_counts_batchable_generations_past_the_limit():
    assert crowded_round(2, 8, True, GREEDY, batchable_active=3)
    assert crowded_round(2, 8, True, SAMPLED, batchable_active=3)
    assert not crowded_round(2, 8, True, GREEDY, batchable_active=2)
    assert not crowded_round(0, 8, True, GREEDY, batchable_active=10)  # 0: always draft
    assert not crowded_round(2, 1, True, GREEDY, batchable_active=10)  # batching off
    assert not crowded_round(2, 8, False, GREEDY, batchable_active=10)  # its cache is no pool row
