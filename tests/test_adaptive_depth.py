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
    ``per_token_s`` * d, the drafts' part of it drafting; a round without drafts, MODEL_FIXED_S.
    What it decides then follows from the acceptance it sees and the model alone, whatever the
    machine's load (the split of measured times is tested in test_profile)."""

    class Modelled(AdaptiveDepth):
        def observe(self, asked, proposed, kept, times):
            if times.reported:  # a round without the daemon's report teaches nothing, modelled or not
                times = _times(wall=MODEL_FIXED_S + per_token_s * asked, drafting=per_token_s * asked)
            super().observe(asked, proposed, kept, times)

        def observe_plain(self, times):
            super().observe_plain(_plain_times(MODEL_FIXED_S))

    return Modelled


def _oracle_generation(loaded_target, monkeypatch, depth: int, tokens: int, right: bool, per_token_s: float,
                       plain: bool = True):
    """The target's greedy tokens for a code prompt, and the same generation through a draft
    daemon serving an oracle drafter whose drafts cost ``per_token_s`` each in the cost model,
    adaptive speculation on where ``plain``."""
    import starsd_target.scheduler

    monkeypatch.setattr(starsd_target.scheduler, "AdaptiveDepth", _cost_model(per_token_s))
    engine = TargetEngine(loaded_target, depth=depth)
    prompt = engine.encode("def parse(line):\n    ")
    ref = engine.generate(prompt, tokens, SamplingParams()).token_ids
    backend = OracleBackend(loaded_target.vocab_size, loaded_target.fingerprint, prompt + ref, right)
    with running_server(backend, max_depth=depth) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        r = speculate(engine, client, prompt, tokens, SamplingParams(), 30, adaptive_speculation=plain)
        client.close()
    return ref, r


@pytest.mark.parametrize("right", [True, False], ids=["always-right", "always-wrong"])
def test_drafts_get_longer_for_a_drafter_that_is_right_and_shorter_for_one_that_is_wrong(right, loaded_target,
                                                                                         monkeypatch):
    # a draft costs a fiftieth of the rest of a round in the cost model: all kept, the cap pays;
    # none kept, one draft a round is the cheapest probe
    ref, r = _oracle_generation(loaded_target, monkeypatch, 6, 96, right, per_token_s=0.0002, plain=False)
    assert r.token_ids == ref and r.stats.fallback_rounds == 0
    requests = r.stats.rounds
    mean_asked = r.stats.asked_tokens / requests
    if right:
        assert r.stats.accepted == r.stats.drafted > 0
        assert mean_asked > 5.0, (mean_asked, r.stats)  # near the cap of 6
        assert r.stats.plain_rounds == 0  # adaptive speculation off
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


def _plain_times(wall):
    return split_round(wall, 0.0, None, forward=wall, math=0.0, waited=False)


def _drive(policy, ctls, rounds, plain_s, drafted):
    """``rounds`` passes over the generations ``ctls`` (name -> controller), each asking
    ``policy`` before its round; plain rounds take ``plain_s``, drafted ones are observed by
    ``drafted(name, controller, d)``. The choices, per generation."""
    choices = {name: [] for name in ctls}
    for _ in range(rounds):
        for name, ctl in ctls.items():
            d = 0 if policy.plain_for(name, ctls) else ctl.choose(4)
            choices[name].append(d)
            if d == 0:
                ctl.observe_plain(_plain_times(plain_s))
            else:
                drafted(name, ctl, d)
    return choices


def _runs(choices, pred):
    """(start, length) of each run of consecutive choices for which ``pred`` holds."""
    runs = []
    for i, d in enumerate(choices):
        if pred(d):
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def test_no_drafts_where_the_target_alone_is_faster_with_probe_rounds_that_back_off():
    """Rounds with drafts that keep little and cost much: the generation runs rounds without
    drafts, asks again in probe rounds (after 8, then 16, 32 ... plain rounds), and goes back to
    drafts once a probe shows them ahead."""
    from starsd_target.depth import PROBE_FIRST, PROBE_MAX, PROBE_ROUNDS, PlainOrDrafts

    ctl, policy = AdaptiveDepth(), PlainOrDrafts()
    for _ in range(10):  # every first draft rejected, 20 ms of drafting in a 60 ms round
        ctl.observe(4, 4, 0, _times(wall=0.060, drafting=0.020))
    choices = _drive(policy, {"g": ctl}, 400, 0.030,
                     lambda n, c, d: c.observe(d, d, 0, _times(wall=0.050, drafting=0.010)))["g"]
    # the target alone is unmeasured: probed after 8 rounds, found faster (33 against 20 tok/s)
    assert choices[PROBE_FIRST] == 0 and all(choices[:PROBE_FIRST]) and policy.plain
    probes = _runs(choices[PROBE_FIRST:], lambda d: d > 0)
    assert len(probes) >= 4 and all(n == PROBE_ROUNDS for _, n in probes[:-1])
    gaps = [b[0] - a[0] - a[1] for a, b in zip(probes, probes[1:])]  # plain rounds between probes
    assert gaps[0] >= PROBE_FIRST and all(g2 >= g1 for g1, g2 in zip(gaps, gaps[1:]))
    assert max(gaps) <= PROBE_MAX + 1 and max(gaps) >= 4 * PROBE_FIRST
    # the drafts get good (the text turned to one the draft knows): the next probe switches back
    for _ in range(30):
        ctl.observe(4, 4, 4, _times(wall=0.060, drafting=0.010))
    assert [0 if policy.plain_for("g", {"g": ctl}) else ctl.choose(4) for _ in range(5)] == [4] * 5
    assert not policy.plain and policy.switches == 2


def test_the_choice_is_the_targets_for_all_its_generations_together():
    """Two generations: one whose drafts pay on their own, one whose drafts do not. Together the
    target alone wins (their plain rounds share a forward), so both run without drafts, and both
    take part in the probes; a generation not yet measured drafts its first round."""
    from starsd_target.depth import PlainOrDrafts

    good, bad, policy = AdaptiveDepth(), AdaptiveDepth(), PlainOrDrafts()
    for _ in range(10):
        good.observe(2, 2, 2, _times(wall=0.050, drafting=0.020))  # all kept: 3 tokens in 50 ms, 60 tok/s
        bad.observe(2, 2, 0, _times(wall=0.080, drafting=0.020))  # none kept: 1 token in 80 ms
    for ctl in (good, bad):  # each alone: 1 token in 20 ms (50 tok/s)
        ctl.observe_plain(_plain_times(0.020))
    # the good one's drafts win on their own, the sum does not
    assert good.drafted_rate() > good.plain_rate() and bad.drafted_rate() < bad.plain_rate()

    def drafted(name, ctl, d):
        ctl.observe(d, d, d if name == "good" else 0, _times(wall=0.080, drafting=0.010 * d))

    choices = _drive(policy, {"good": good, "bad": bad}, 60, 0.020, drafted)
    assert policy.plain and choices["good"][0] == 0 and choices["bad"][0] == 0
    assert sum(d == 0 for d in choices["good"]) > 40 and sum(d == 0 for d in choices["bad"]) > 40
    assert any(choices["good"]) and any(choices["bad"])  # the probes asked both
    fresh = AdaptiveDepth()
    assert not policy.plain_for("new", {"good": good, "bad": bad, "new": fresh})


def test_a_choice_holds_until_the_other_side_leads_by_the_margin():
    from starsd_target.depth import SWITCH_MARGIN, PlainOrDrafts

    ctl, policy = AdaptiveDepth(), PlainOrDrafts()
    for _ in range(30):  # one draft in two kept
        ctl.observe(1, 1, 1, _times(wall=0.060, drafting=0.010))
        ctl.observe(1, 1, 0, _times(wall=0.060, drafting=0.010))
    rate = ctl.drafted_rate()
    one = {"g": ctl}
    # a target alone that is slightly faster does not win the round...
    ctl.alone = (1.0, 1.0 / (rate * (1 + SWITCH_MARGIN / 2)), 10)
    assert not policy.plain_for("g", one)
    # ... one faster by more than the margin does, and keeps it while the lead stays within the margin
    ctl.alone = (1.0, 1.0 / (rate * (1 + 2 * SWITCH_MARGIN)), 10)
    assert policy.plain_for("g", one)
    ctl.alone = (1.0, 1.0 / (rate * (1 - SWITCH_MARGIN / 2)), 10)
    assert policy.plain_for("g", one)
    ctl.alone = (1.0, 1.0 / (rate * (1 - 2 * SWITCH_MARGIN)), 10)
    assert not policy.plain_for("g", one)


def test_costly_wrong_drafts_leave_rounds_to_the_target_alone_and_the_output_exact(loaded_target, monkeypatch):
    """End to end through a draft daemon: drafts that are always wrong and cost 15 ms a token in
    the cost model. Most rounds run without drafts (counted as plain_rounds, not as fallback
    rounds); probe rounds still ask; the tokens are the target's own."""
    ref, r = _oracle_generation(loaded_target, monkeypatch, 4, 64, right=False, per_token_s=0.015)
    assert r.token_ids == ref and r.stats.fallback_rounds == 0
    assert r.stats.plain_rounds > r.stats.rounds // 2, r.stats
    assert r.stats.drafted > 0 and r.stats.accepted == 0  # the first rounds and the probes asked


@pytest.mark.slow
def test_a_target_daemon_with_adaptive_speculation_keeps_its_output_and_counts_plain_rounds(star, tiny_target,
                                                                                            tiny_draft, loaded_target):
    """The daemons as a user runs them, with ``--adaptive-speculation`` (opt-in): an unrelated draft whose tokens are mostly rejected, beside tiny
    models whose target alone is faster. Two generations at once keep the target's own greedy
    tokens; their rounds run mostly without drafts, counted as plain rounds in each result and
    in the metrics, none as fallback rounds; the first rounds and the probes still drafted."""
    import urllib.request

    from common.control import ControlClient
    from common.protocol import Message, MsgType
    from common.sockets import free_tcp_port
    from fakes import run_concurrently
    from tiny_models import reference_greedy

    draft_ep, metrics = star.draftd(tiny_draft, ready=False), free_tcp_port()
    (target_ep,) = star.targets(tiny_target, draft_ep, 1, "--adaptive-speculation", "--metrics-port", str(metrics),
                                "--draft-max-active", "0",  # both generations may draft: adaptive speculation decides
                                "--connect-timeout", "120")
    engine = TargetEngine(loaded_target)
    prompts = [engine.encode("def parse(line):\n    "), engine.encode("class Point:\n")]
    results = run_concurrently([target_ep, target_ep], [{"id": i + 1, "prompt_ids": p, "max_tokens": 64}
                                                        for i, p in enumerate(prompts)])
    plain = 0
    for p, res in zip(prompts, results):
        s = res["stats"]
        assert res["token_ids"] == reference_greedy(tiny_target, p, 64)
        assert s["fallback_rounds"] == 0 and s["drafted"] > 0
        assert s["plain_rounds"] > s["rounds"] // 2, s
        plain += s["plain_rounds"]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert f"starsd_target_plain_rounds_total {float(plain)}" in text
    with ControlClient(target_ep) as cc:
        stats = cc.call(Message(MsgType.STATS, {}), timeout_s=30).header["stats"]
    assert stats["adaptive_speculation"]["switches"] >= 1  # STATS says which way the target stands



def test_while_drafting_the_target_alone_is_probed_and_wins_where_its_rounds_measure_faster():
    """A target that batches its generations' plain rounds is found faster only by measuring
    them: while drafts lead, probe rounds on the target alone come after 8, 16, 32 ... rounds;
    a probe that measures plain rounds faster switches."""
    from starsd_target.depth import PROBE_FIRST, PROBE_ROUNDS, PlainOrDrafts

    ctl, policy = AdaptiveDepth(), PlainOrDrafts()
    for _ in range(10):  # 2 tokens in 200 ms: 10 tok/s
        ctl.observe(4, 4, 1, _times(wall=0.200, drafting=0.100))
    assert ctl.plain_rate() is None
    slow = _drive(policy, {"g": ctl}, 100, 0.150,  # plain rounds measured slower (6.7 tok/s): drafts stay
                  lambda n, c, d: c.observe(4, 4, 1, _times(wall=0.200, drafting=0.100)))["g"]
    probes = _runs(slow, lambda d: d == 0)
    assert probes and probes[0] == (PROBE_FIRST, PROBE_ROUNDS) and not policy.plain
    # a probe's first round starts the count: 2 more, then 16 + 1 rounds with drafts, then 32 + 1
    assert [b[0] - a[0] for a, b in zip(probes, probes[1:])][:2] == [PROBE_ROUNDS - 1 + 2 * PROBE_FIRST + 1,
                                                                   PROBE_ROUNDS - 1 + 4 * PROBE_FIRST + 1]
    ctl2, policy2 = AdaptiveDepth(), PlainOrDrafts()
    for _ in range(10):
        ctl2.observe(4, 4, 1, _times(wall=0.200, drafting=0.100))
    fast = _drive(policy2, {"g": ctl2}, 40, 0.060,  # plain rounds at 16.7 tok/s: the probe switches
                  lambda n, c, d: c.observe(4, 4, 1, _times(wall=0.200, drafting=0.100)))["g"]
    assert fast[PROBE_FIRST] == 0 and policy2.plain and sum(d == 0 for d in fast[PROBE_FIRST:]) > 25


def test_rounds_whose_drafts_never_came_count_against_drafting():
    ctl = AdaptiveDepth()
    for _ in range(5):  # 3 tokens in 60 ms
        ctl.observe(2, 2, 2, _times(wall=0.060, drafting=0.020))
    before = ctl.drafted_rate()
    for _ in range(5):  # a saturated daemon: the drafts do not come in time, 1 token in 100 ms
        ctl.observe_fallback(split_round(0.100, 0.090, None, 0.010, 0.0, waited=True))
    assert ctl.drafted_rate() < 0.6 * before


def test_the_link_keeps_its_heartbeat_while_rounds_run_without_drafts():
    """With every generation on the target alone nothing goes to the draft daemon, which drops
    a silent peer: the scheduler sends the heartbeat it sends when idle."""
    from starsd_target.scheduler import Scheduler

    class Link:
        beats = 0

        def heartbeat(self):
            self.beats += 1

    link = Link()
    sched = Scheduler(None, lambda: link, draft_timeout_s=1, heartbeat_s=0.0, adaptive_speculation=True)
    sched._keep_link()
    assert link.beats == 0  # drafting: requests keep the link alive
    sched.speculation.plain = True
    sched._keep_link()
    sched._keep_link()
    assert link.beats == 2
    off = Scheduler(None, lambda: link, draft_timeout_s=1, heartbeat_s=0.0)
    off._keep_link()
    assert link.beats == 2
