"""Adaptive draft length: each generation asks for the number of drafts that its measured
acceptance and costs make worth the most tokens per second, up to the target's --depth."""

import time

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
    wrong), taking ``per_token_s`` per drafted token so that drafting has a cost to weigh."""

    name = "oracle"

    def __init__(self, vocab: int, fingerprint: str, full: list[int], right: bool, per_token_s: float = 0.001):
        self.vocab_size, self.fingerprint = vocab, fingerprint
        self.full, self.right, self.per_token_s = full, right, per_token_s

    def new_state(self, params):
        return None

    def draft(self, state, verified, depth, new_features=None):
        time.sleep(self.per_token_s * depth)
        n = len(verified)
        truth = [self.full[i] if i < len(self.full) else 0 for i in range(n, n + depth)]
        return Draft(truth if self.right else [(t + 1) % self.vocab_size for t in truth])


@pytest.mark.parametrize("right", [True, False], ids=["always-right", "always-wrong"])
def test_drafts_get_longer_for_a_drafter_that_is_right_and_shorter_for_one_that_is_wrong(right, loaded_target):
    engine = TargetEngine(loaded_target, depth=6)
    prompt = engine.encode("def parse(line):\n    ")
    # 96 tokens: the controller weighs measured costs, so one round slowed by the machine may
    # choose a shorter draft; over 14 rounds that one round does not decide the mean
    ref = engine.generate(prompt, 96, SamplingParams()).token_ids
    backend = OracleBackend(loaded_target.vocab_size, loaded_target.fingerprint, prompt + ref, right)
    with running_server(backend, max_depth=6) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        r = speculate(engine, client, prompt, 96, SamplingParams(), 30)
        client.close()
    assert r.token_ids == ref and r.stats.fallback_rounds == 0
    requests = r.stats.rounds
    mean_asked = r.stats.asked_tokens / requests
    if right:
        assert r.stats.accepted == r.stats.drafted > 0
        assert mean_asked > 5.0, (mean_asked, r.stats)  # near the cap of 6
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
