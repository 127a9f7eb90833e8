"""Fill steps: while a generation's drafts are on their way and the target has nothing else to
run, the target takes a step of its own where its measured costs say that pays; the drafts then
count only if they begin with its tokens. Output stays the target's own (greedy token for token,
sampled in distribution), and the drafts still do their part."""

import time

import pytest

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import assert_follows, exact_joint, running_server, samples_for, speculate
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import DraftClient
from starsd_target.depth import FILL_GAIN, AdaptiveDepth
from starsd_target.engine import TargetEngine
from starsd_target.profile import split_round
from test_adaptive_depth import OracleBackend
from tiny_models import make_near_copy

SLOW_DRAFT_S = 0.04  # a draft daemon's reply takes this long: many tiny-target steps


@pytest.fixture
def one_step_a_request(monkeypatch):
    """The scheduler's side of fill steps, apart from the rule that decides them (tested above
    on its own): one step a request, once the request is measured and acknowledged, whatever
    the machine's load makes of the timings."""
    monkeypatch.setattr(AdaptiveDepth, "fill_pays", lambda self, remaining_s, asked, filled=0: filled < 1)


class SlowOracle(OracleBackend):
    """The oracle drafter (always right, or always wrong) taking SLOW_DRAFT_S per request."""

    def draft(self, state, verified, depth, new_features=None):
        time.sleep(SLOW_DRAFT_S)
        return super().draft(state, verified, depth, new_features)


class SlowModel(ModelBackend):
    def draft_many(self, requests):
        time.sleep(0.004)  # a few steps of the tiny target: a fill step, then the drafts
        return super().draft_many(requests)


def _round(wall, forward, drafting, wire=0.001):
    """A measured round's parts: the daemon's drafting, the wire, the verification forward."""
    return split_round(wall, drafting + wire, (0.0, drafting), forward, 0.0)


def _measured(drafting: float, one_row: float, per_row: float, acceptance_kept: int = 2) -> AdaptiveDepth:
    """A controller that has seen rounds of 2 and 4 drafts (forwards of 3 and 5 rows costing
    ``one_row + per_row * (rows - 1)``), each reply ``drafting`` per draft, and a fill step."""
    ctl = AdaptiveDepth()
    for d in (2, 4) * 6:
        forward = one_row + per_row * d
        ctl.observe(d, d, min(acceptance_kept, d), _round(forward + drafting * d + 0.001, forward, drafting * d))
        ctl.observe_reply((0.0, drafting * 4), 4)  # the daemon drafts 4 whatever is asked
    ctl.observe_fill_step(one_row, one_row)
    return ctl


def test_a_fill_step_pays_while_the_reply_is_a_step_away_and_not_for_a_reply_about_to_come():
    fresh = AdaptiveDepth()
    assert not fresh.fill_pays(1.0, 4) and fresh.expected_wait() is None  # nothing measured: never
    # drafting costs 10 ms a draft, a target step 30 ms, each row 2 ms more; half the drafts kept
    ctl = _measured(drafting=0.010, one_row=0.030, per_row=0.002, acceptance_kept=1)
    assert ctl.expected_wait() == pytest.approx(0.041, abs=1e-3)  # 4 drafts and the wire
    assert ctl.verify_s(5) - ctl.verify_s(1) == pytest.approx(0.008, abs=1e-3)  # the regression's rows
    assert ctl.fill_pays(0.040, 4) and ctl.fill_pays(0.030, 4)  # the reply a step away or more
    assert not ctl.fill_pays(0.005, 4)  # 5 ms left: a step would hold the verification up by 25
    # in between: a step, then a verification of the drafts after it if the first is the step's
    # token, against the wait and a verification of all, with FILL_GAIN to spare
    for left in (0.010, 0.015, 0.020, 0.025, 0.029):
        step_first = 0.030 + ctl.acceptance * ctl.verify_s(4)
        assert ctl.fill_pays(left, 4) == (step_first <= (1 - FILL_GAIN) * (left + ctl.verify_s(5)))
    assert ctl.fill_pays(0.025, 4) and not ctl.fill_pays(0.020, 4)  # both sides of the rule are reached
    # drafts nearly always right: a step only where the target would idle through it; nearly never
    # right: a step even where the reply is about to come (the verification would keep one token)
    sure = _measured(drafting=0.010, one_row=0.030, per_row=0.002, acceptance_kept=2)
    assert not sure.fill_pays(0.029, 4) and sure.fill_pays(0.030, 4)
    wrong = _measured(drafting=0.010, one_row=0.030, per_row=0.002, acceptance_kept=0)
    assert wrong.fill_pays(0.005, 4)
    assert ctl.fill_pays(0.0, 4, 4)  # the fill steps used up the drafts asked for: stepping beats idling
    for _ in range(10):  # a daemon that ends its chains before their first draft: nothing to wait for
        ctl.observe_reply((0.0, 0.002), 0)
    assert ctl.fill_pays(0.005, 4)


def test_rounds_with_fill_steps_follow_the_drafting_they_did_not_hide():
    """A round whose drafting a fill step hid shows a short wait: the cost per draft falls, and
    longer chains are chosen."""
    ctl = _measured(drafting=0.010, one_row=0.030, per_row=0.002)
    before = ctl.choose(8)
    for _ in range(20):  # the fill step (30 ms) hid 4 drafts' 40 ms but for 10 ms
        times = split_round(0.030 + 0.010 + 0.038, 0.010, (0.0, 0.040), 0.038, 0.0, fill=0.030)
        ctl.observe(4, 4, 3, times, tokens=4, rows=4)
    assert ctl.per_token_s < 0.004 and ctl.choose(8) > before


def _slow_oracle_generation(loaded_target, right: bool, tokens: int = 64, **options):
    engine = TargetEngine(loaded_target, depth=4)
    prompt = engine.encode("def parse(line):\n    ")
    ref = engine.generate(prompt, tokens, SamplingParams()).token_ids
    backend = SlowOracle(loaded_target.vocab_size, loaded_target.fingerprint, prompt + ref, right)
    with running_server(backend, max_depth=4, lookahead=False) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        r = speculate(engine, client, prompt, tokens, SamplingParams(), 30, **{"fill_steps": True, **options})
        client.close()
    return ref, r


@pytest.mark.parametrize("right", [True, False], ids=["always-right", "always-wrong"])
def test_a_slow_draft_daemon_is_hidden_behind_fill_steps_and_the_output_is_the_targets(loaded_target, right,
                                                                                       one_step_a_request):
    ref, r = _slow_oracle_generation(loaded_target, right)
    s = r.stats
    assert r.token_ids == ref and s.fallback_rounds == 0 and s.invalid_drafts == 0
    assert s.fill_steps > 0, s
    if right:  # drafts that begin with the fill steps' tokens: those are confirmed, the rest verified
        assert s.fill_confirmed > 0 and s.accepted > s.fill_confirmed, s
        assert s.generated > s.fill_steps + (s.rounds - s.fill_steps)  # drafts kept beyond a token a forward
    else:
        assert s.fill_confirmed == 0 and s.accepted == 0, s
    ref, off = _slow_oracle_generation(loaded_target, right, fill_steps=False)
    assert off.token_ids == ref and off.stats.fill_steps == 0 and off.stats.fallback_rounds == 0


def test_at_a_fixed_depth_a_fill_step_takes_the_first_drafts_place(loaded_target, one_step_a_request,
                                                                    monkeypatch):
    """Not a timing assertion: the work each way, at a pinned chain length (the controller's
    choice follows the host's timings). A fill step's token is the one the first draft would
    have confirmed, so the target asks the same requests and keeps the same tokens, and each
    step ran while its request's drafts were on their way: its forward is the wait's, not the
    round's."""
    monkeypatch.setattr(AdaptiveDepth, "choose", lambda self, cap, *a, **k: min(3, cap))
    ref, on = _slow_oracle_generation(loaded_target, True)
    _, off = _slow_oracle_generation(loaded_target, True, fill_steps=False)
    assert on.token_ids == off.token_ids == ref
    requests = [r.stats.profile.counts["draft_wait"] for r in (on, off)]
    assert requests[0] == requests[1] == off.stats.rounds, requests  # every request waited on, each way
    assert on.stats.accepted == off.stats.accepted and on.stats.fallback_rounds == off.stats.fallback_rounds == 0
    assert 0 < on.stats.fill_steps < requests[0] and off.stats.fill_steps == 0
    assert on.stats.fill_confirmed == on.stats.fill_steps  # every step's token was the first draft


def test_seeded_generations_take_no_fill_steps(loaded_target, one_step_a_request):
    engine = TargetEngine(loaded_target, depth=4)
    prompt = engine.encode("def parse(line):\n    ")
    params = SamplingParams(temperature=1.0, seed=7)
    ref = engine.generate(prompt, 24, params).token_ids
    backend = SlowOracle(loaded_target.vocab_size, loaded_target.fingerprint, prompt + ref, True)
    with running_server(backend, max_depth=4) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        r = speculate(engine, client, prompt, 24, params, 30, fill_steps=True)
        client.close()
    assert r.stats.fill_steps == 0


def test_sampled_output_with_fill_steps_follows_the_target(tiny_target, loaded_target, tmp_path,
                                                           one_step_a_request):
    """Unseeded sampled generations beside a slow drafter: fill steps sample the target's own
    distribution, and drafts that begin with their tokens are a proposal for what follows them,
    so the first three tokens still follow the target's joint distribution."""
    backend = SlowModel(load_causal_lm(str(make_near_copy(tiny_target, tmp_path / "near", noise=0.05))))
    params = SamplingParams(temperature=1.5, top_k=2)
    engine = TargetEngine(loaded_target, depth=3)
    prompt = engine.encode("x = 1\nx = 1\nx = ")
    length = 3
    exact = exact_joint(loaded_target.model, prompt, params, length)
    samples = samples_for(exact)
    counts: dict[tuple, int] = {}
    fills = confirmed = accepted = 0
    with running_server(backend, max_depth=3, lookahead=False) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        for _ in range(samples):
            r = speculate(engine, client, prompt, 3 * length, params, 30, fill_steps=True)
            assert r.stats.fallback_rounds == 0 and r.stats.invalid_drafts == 0
            first = tuple(r.token_ids[:length])
            counts[first] = counts.get(first, 0) + 1
            fills += r.stats.fill_steps
            confirmed += r.stats.fill_confirmed
            accepted += r.stats.accepted
        client.close()
    assert fills > samples and confirmed > 0 and accepted > confirmed, (fills, confirmed, accepted)
    assert_follows(counts, exact, samples)


@pytest.mark.parametrize("tokens", [7, 8])
def test_fill_steps_that_end_a_generation_are_in_its_round_profile(loaded_target, monkeypatch, tokens):
    """Up to three steps a request, drafts always right but slow: the last tokens come from
    fill steps, and the round they end is profiled with their time (it was lost: a generation
    ended by its fill steps reported steps taken and no time in them)."""
    monkeypatch.setattr(AdaptiveDepth, "fill_pays", lambda self, remaining_s, asked, filled=0: filled < 3)
    ref, r = _slow_oracle_generation(loaded_target, True, tokens=tokens)
    s = r.stats
    assert r.token_ids == ref and s.fill_steps > 0, s
    assert s.profile.seconds["fill"] > 0 and s.profile.counts["fill"] > 0, s.profile
    # a round with fill steps waited for a request, the last one too (given up when its steps
    # finished the generation)
    assert s.profile.counts["draft_wait"] >= s.profile.counts["fill"], s.profile
