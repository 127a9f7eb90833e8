"""Adaptive draft length: each generation asks for the number of drafts that its measured
acceptance and costs make worth the most tokens per second, up to the target's --depth."""

import pytest

from common.verify import SamplingParams
from fakes import running_server, speculate
from starsd_draftd.backends.base import Draft, DraftBackend
from starsd_target.client import DraftClient
from starsd_target.depth import AdaptiveDepth, expected_tokens
from starsd_target.engine import TargetEngine
from starsd_target.profile import split_round


class OracleBackend(DraftBackend):
    """Drafts the target's own greedy continuation (always right), or a token next to it (always
    wrong)."""

    name = "oracle"

    def __init__(self, vocab: int, fingerprint: str, full: list[int], right: bool):
        self.vocab_size, self.fingerprint = vocab, fingerprint
        self.full, self.right = full, right

    def new_state(self, params):
        return None

    def draft(self, state, verified, depth, new_features=None):
        n = len(verified)
        truth = [self.full[i] if i < len(self.full) else 0 for i in range(n, n + depth)]
        return Draft(truth if self.right else [(t + 1) % self.vocab_size for t in truth])


MODEL_FIXED_S = 0.010  # the cost model's rest of a round: verification forward, wire, scheduler


def _cost_model(per_token_s: float) -> type[AdaptiveDepth]:
    """The scheduler's draft-length controller, reading its rounds' times from a cost model
    instead of the machine's clock: a round that asked for d drafts lasts MODEL_FIXED_S +
    ``per_token_s`` * d, the drafts' part of it drafting.
    What it decides then follows from the acceptance it sees and the model alone, whatever the
    machine's load (the split of measured times is tested in test_profile)."""

    class Modelled(AdaptiveDepth):
        def observe(self, asked, proposed, kept, times):
            if times.reported:  # a round without the daemon's report teaches nothing, modelled or not
                times = _times(wall=MODEL_FIXED_S + per_token_s * asked, drafting=per_token_s * asked)
            super().observe(asked, proposed, kept, times)

    return Modelled


def _oracle_generation(loaded_target, monkeypatch, depth: int, tokens: int, right: bool, per_token_s: float):
    """The target's greedy tokens for a code prompt, and the same generation through a draft
    daemon serving an oracle drafter whose drafts cost ``per_token_s`` each in the cost model."""
    import starsd_target.scheduler

    monkeypatch.setattr(starsd_target.scheduler, "AdaptiveDepth", _cost_model(per_token_s))
    engine = TargetEngine(loaded_target, depth=depth)
    prompt = engine.encode("def parse(line):\n    ")
    ref = engine.generate(prompt, tokens, SamplingParams()).token_ids
    backend = OracleBackend(loaded_target.vocab_size, loaded_target.fingerprint, prompt + ref, right)
    with running_server(backend, max_depth=depth) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        r = speculate(engine, client, prompt, tokens, SamplingParams(), 30)
        client.close()
    return ref, r


@pytest.mark.parametrize("right", [True, False], ids=["always-right", "always-wrong"])
def test_drafts_get_longer_for_a_drafter_that_is_right_and_shorter_for_one_that_is_wrong(right, loaded_target,
                                                                                         monkeypatch):
    # a draft costs a fiftieth of the rest of a round in the cost model: all kept, the cap pays;
    # none kept, one draft a round is the cheapest probe
    ref, r = _oracle_generation(loaded_target, monkeypatch, 6, 96, right, per_token_s=0.0002)
    assert r.token_ids == ref and r.stats.fallback_rounds == 0
    requests = r.stats.rounds
    mean_asked = r.stats.asked_tokens / requests
    if right:
        assert r.stats.accepted == r.stats.drafted > 0
        assert mean_asked > 5.0, (mean_asked, r.stats)  # near the cap of 6
        assert r.stats.plain_rounds == 0  # every round asked for drafts
    else:
        assert r.stats.accepted == 0 and r.stats.drafted > 0
        assert mean_asked < 2.0, (mean_asked, r.stats)  # one draft most rounds


def _times(wall, drafting, queued=0.0):
    return split_round(wall, drafting + queued, (queued, drafting), forward=wall - drafting - queued, math=0.0)


def test_the_choice_weighs_acceptance_against_the_cost_per_draft():
    fresh = AdaptiveDepth()
    assert fresh.choose(5) == 5 and fresh.choose(0) == 0  # nothing measured yet: the cap
    sure = AdaptiveDepth()
    for _ in range(20):  # every draft kept, drafts cheap beside the rest of the round
        sure.observe(4, 4, 4, _times(wall=0.060, drafting=0.004))
    assert sure.acceptance > 0.95 and sure.choose(8) == 8
    unsure = AdaptiveDepth()
    for _ in range(20):  # every first draft rejected
        unsure.observe(4, 4, 0, _times(wall=0.060, drafting=0.020))
    assert unsure.acceptance < 0.1 and unsure.choose(8) == 1
    # the same acceptance behind a saturated daemon: queueing for others' drafts makes each token dearer
    idle, busy = AdaptiveDepth(), AdaptiveDepth()
    for _ in range(20):
        idle.observe(4, 4, 2, _times(wall=0.080, drafting=0.020))
        busy.observe(4, 4, 2, _times(wall=0.140, drafting=0.020, queued=0.060))
    assert busy.choose(8) < idle.choose(8)
    a, c, f = idle.acceptance, idle.per_token_s, idle.fixed_s
    best = idle.choose(8)
    assert all(expected_tokens(a, best) / (f + c * best) >= expected_tokens(a, d) / (f + c * d) for d in range(1, 9))


def test_rounds_without_a_report_teach_nothing():
    ctl = AdaptiveDepth()
    ctl.observe(4, 4, 1, split_round(0.05, 0.01, None, 0.03, 0.0))  # a request given up, or an older daemon
    assert ctl.per_token_s is None and ctl.choose(4) == 4
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 3) == 4


def test_rounds_whose_drafts_never_came_count_against_drafting():
    ctl = AdaptiveDepth()
    for _ in range(5):  # 3 tokens in 60 ms
        ctl.observe(2, 2, 2, _times(wall=0.060, drafting=0.020))
    before = ctl.drafted_rate()
    for _ in range(5):  # a saturated daemon: the drafts do not come in time, 1 token in 100 ms
        ctl.observe_fallback(split_round(0.100, 0.090, None, 0.010, 0.0, waited=True))
    assert ctl.drafted_rate() < 0.6 * before
