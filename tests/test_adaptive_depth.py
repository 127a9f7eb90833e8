"""Adaptive draft length: each generation asks for the number of drafts that its measured
acceptance and costs make worth the most tokens per second, up to the target's --depth."""

import pytest

from common.verify import SamplingParams
from fakes import running_server, speculate
from starsd_draftd.backends.base import Draft, DraftBackend
from starsd_target.client import DraftClient
from starsd_target.depth import (MIN_JUDGED_ROUNDS, PAY_SHARE, PROBE_FIRST, PROBE_MAX, PROBE_ROUNDS, AdaptiveDepth,
                                 expected_tokens)
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
        def observe(self, asked, proposed, kept, times, **parts):
            if times.reported:  # a round without the daemon's report teaches nothing, modelled or not
                times = _times(wall=MODEL_FIXED_S + per_token_s * asked, drafting=per_token_s * asked)
            super().observe(asked, proposed, kept, times, **parts)

        def observe_plain(self, times):  # a round without drafts: the rest of a round alone
            super().observe_plain(split_round(MODEL_FIXED_S, 0.0, None, MODEL_FIXED_S, 0.0))

    return Modelled


def _oracle_generation(loaded_target, monkeypatch, depth: int, tokens: int, right: bool, per_token_s: float,
                       **scheduler_options):
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
        r = speculate(engine, client, prompt, tokens, SamplingParams(), 30, **scheduler_options)
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


def test_a_drafter_that_costs_more_than_it_brings_gives_way_to_plain_rounds(loaded_target, monkeypatch):
    """With --pause-unpaid-drafts, drafts never kept, each costing half the rest of a round in the
    cost model: the generation runs most of its rounds on the target alone (plain, not fallback),
    probing now and then, and its tokens are the target's own. Without it, every round drafts."""
    ref, r = _oracle_generation(loaded_target, monkeypatch, 6, 96, False, per_token_s=0.005)
    assert r.token_ids == ref and r.stats.plain_rounds == 0 and r.stats.rounds == r.stats.generated
    ref, r = _oracle_generation(loaded_target, monkeypatch, 6, 96, False, per_token_s=0.005, pause_unpaid_drafts=True)
    assert r.token_ids == ref and r.stats.fallback_rounds == 0 and r.stats.accepted == 0
    assert r.stats.plain_rounds > r.stats.rounds / 2, r.stats
    assert r.stats.rounds - r.stats.plain_rounds >= MIN_JUDGED_ROUNDS + 1  # the rounds it judged by, and probes


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


def _plain(wall):
    return split_round(wall, 0.0, None, wall, 0.0)


def _drafting_pattern(ctl: AdaptiveDepth, rounds: int, drafted, plain) -> str:
    """``rounds`` rounds planned by ``ctl``: "d" for a round with drafts (observed with the
    times ``drafted()`` gives: asked, proposed, kept, RoundTimes), "p" for a plain one."""
    out = []
    for _ in range(rounds):
        if ctl.drafts_pay():
            ctl.observe(*drafted())
            out.append("d")
        else:
            ctl.observe_plain(plain())
            out.append("p")
    return "".join(out)


def test_drafting_that_does_not_pay_gives_way_to_plain_rounds_in_doubling_runs_with_probes():
    """A draft that is never kept, a round with it 30 ms, a plain round 20 ms: once
    MIN_JUDGED_ROUNDS rounds with drafts are measured (the first is a catch-up), the rounds run
    plain in runs of PROBE_FIRST, doubling up to PROBE_MAX, each followed by PROBE_ROUNDS probes."""
    ctl = AdaptiveDepth(pause_unpaid=True)
    seen = _drafting_pattern(ctl, 300, lambda: (4, 4, 0, _times(wall=0.030, drafting=0.010)), lambda: _plain(0.020))
    judged = MIN_JUDGED_ROUNDS + 1  # the first round with drafts is the session's catch-up
    assert seen[:judged] == "d" * judged
    runs, probes, pos, run = [], "d" * PROBE_ROUNDS, judged, PROBE_FIRST
    while pos + run + PROBE_ROUNDS <= len(seen):
        assert seen[pos: pos + run] == "p" * run and seen[pos + run: pos + run + PROBE_ROUNDS] == probes, (pos, seen)
        runs.append(run)
        pos, run = pos + run + PROBE_ROUNDS, min(2 * run, PROBE_MAX)
    assert runs[:4] == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST, 8 * PROBE_FIRST] and runs[-1] == PROBE_MAX
    assert ctl.alone_rate() == pytest.approx(1 / 0.020) and ctl.drafted_rate() == pytest.approx(1 / 0.030)


def test_drafting_that_pays_never_stops_and_resumes_when_the_text_turns():
    """Drafts mostly kept (four tokens in 30 ms against one in 20 ms alone): every round drafts.
    A controller whose drafting stopped paying starts again once its probes keep drafts."""
    keeps = AdaptiveDepth(pause_unpaid=True)
    good = lambda: (4, 4, 3, _times(wall=0.030, drafting=0.010))  # noqa: E731
    assert _drafting_pattern(keeps, 200, good, lambda: _plain(0.020)) == "d" * 200
    ctl = AdaptiveDepth(pause_unpaid=True)
    bad = lambda: (4, 4, 0, _times(wall=0.030, drafting=0.010))  # noqa: E731
    assert "p" in _drafting_pattern(ctl, 40, bad, lambda: _plain(0.020))
    after = _drafting_pattern(ctl, 200, good, lambda: _plain(0.020))
    first = after.index("d")  # the first probe, once the run of plain rounds under way ends
    assert after[first: first + PROBE_ROUNDS] == "d" * PROBE_ROUNDS and "p" not in after[first:]  # the probe resumes


def test_before_any_plain_round_the_alone_rate_comes_from_a_one_row_forward():
    """The verification forward costs 20 ms plus 5 ms a row verified; the rest of a round 2 ms:
    the target alone's rate is one token per 27 ms until plain rounds measure it."""
    ctl = AdaptiveDepth(pause_unpaid=True)
    assert ctl.alone_rate() is None and ctl.drafts_pay()
    for n in (1, 3, 5, 2, 4) * 4:  # rounds of n - 1 drafts, all kept
        forward = 0.020 + 0.005 * n
        ctl.observe(n - 1, n - 1, n - 1, split_round(forward + 0.010 + 0.002, 0.010, (0.0, 0.010), forward, 0.0))
    assert ctl.verify_slope() == pytest.approx(0.005)
    assert ctl.alone_rate() == pytest.approx(1 / 0.027)
    ctl.observe_plain(_plain(0.040))
    assert ctl.alone_rate() == pytest.approx(1 / 0.040)


def test_a_daemon_that_never_answers_in_time_gives_way_to_plain_rounds():
    """Rounds whose drafts never come count one token for their wait: below PAY_SHARE of the
    target alone's rate, the generation stops asking (for runs of plain rounds)."""
    ctl = AdaptiveDepth(pause_unpaid=True)
    ctl.observe(4, 4, 4, _times(wall=0.030, drafting=0.010))  # the catch-up round
    ctl.observe(4, 4, 4, _times(wall=0.030, drafting=0.010))
    for _ in range(MIN_JUDGED_ROUNDS):
        ctl.observe_fallback(split_round(0.100, 0.090, None, 0.010, 0.0, waited=True))
    ctl.observe_plain(_plain(0.012))
    assert ctl.drafted_rate() < PAY_SHARE * ctl.alone_rate() and not ctl.drafts_pay()


def test_a_controller_that_does_not_pause_always_drafts():
    """The default (no --pause-unpaid-drafts): the same unpaid rounds, every one drafts."""
    ctl = AdaptiveDepth()
    bad = lambda: (4, 4, 0, _times(wall=0.030, drafting=0.010))  # noqa: E731
    assert _drafting_pattern(ctl, 100, bad, lambda: _plain(0.005)) == "d" * 100


def test_serve_takes_pause_unpaid_drafts_to_the_scheduler(tiny_target, loaded_target, monkeypatch,
                                                                          tmp_path):
    """`starsd-target serve --pause-unpaid-drafts`, through its command line, reaches the daemon's
    scheduler; without the option (the default) the scheduler does not pause. (That the scheduler
    hands the setting to each generation's controller, the cost-model test above shows.)"""
    from click.testing import CliRunner

    from starsd_target import app
    from starsd_target.cli import main
    from starsd_target.daemon import TargetDaemon

    seen = {}

    def run(cfg):  # app.run, up to the daemon's scheduler
        sched = TargetDaemon(cfg, loaded=loaded_target).scheduler()
        seen[cfg.pause_unpaid_drafts] = sched.pause_unpaid_drafts

    monkeypatch.setattr(app, "run", run)
    base = ["serve", "--model", str(tiny_target), "--no-draft", "--listen", f"ipc://{tmp_path}/t.sock"]
    for extra in ([], ["--pause-unpaid-drafts"]):
        res = CliRunner().invoke(main, base + extra)
        assert res.exit_code == 0, res.output
    assert seen == {False: False, True: True}


def test_a_noisy_regression_never_makes_the_target_alone_look_infinitely_fast():
    """Forwards of 2 rows taking 10 ms and of 3 rows 30 ms (batched with others, say) fit a line
    whose value at one row is below zero: the mean forward stands in for the one-row estimate."""
    ctl = AdaptiveDepth(pause_unpaid=True)
    for i in range(10):
        n, forward = (2, 0.010) if i % 2 else (3, 0.030)
        ctl.observe(n - 1, n - 1, n - 1, split_round(forward + 0.012, 0.010, (0.0, 0.010), forward, 0.0))
    w, n, t = ctl._verify[:3]
    assert t / w - ctl.verify_slope() * (n / w - 1.0) < 0  # the line's value at one row
    assert ctl.alone_rate() == pytest.approx(1 / (t / w + 0.002))  # the mean forward and the rest of a round


def test_pausing_without_adaptive_depth_or_on_trees_is_said_to_do_nothing(tiny_target, loaded_target, tmp_path,
                                                                            caplog):
    from starsd_target.config import TargetConfig
    from starsd_target.daemon import TargetDaemon

    for extra, said in (({"adaptive_depth": False}, "--no-adaptive-depth"), ({"draft_tokens": 8}, "tree rounds"),
                        ({}, None)):
        caplog.clear()
        TargetDaemon(TargetConfig(model=str(tiny_target), draft=None, listen=f"ipc://{tmp_path}/t.sock", depth=4,
                                  pause_unpaid_drafts=True, **extra), loaded=loaded_target)
        warned = [r.getMessage() for r in caplog.records if "--pause-unpaid-drafts" in r.getMessage()]
        assert (said is None and not warned) or (said is not None and said in warned[0]), (extra, warned)
        caplog.clear()  # fill steps likewise
        TargetDaemon(TargetConfig(model=str(tiny_target), draft=None, listen=f"ipc://{tmp_path}/t.sock", depth=4,
                                  fill_steps=True, **extra), loaded=loaded_target)
        warned = [r.getMessage() for r in caplog.records if "--fill-steps" in r.getMessage()]
        assert (said is None and not warned) or (said is not None and said in warned[0]), (extra, warned)


def test_chains_the_daemon_stops_before_their_first_draft_are_judged_too():
    """A draft daemon that ends every chain empty (nothing likely enough), each round 30 ms of
    which the draft forward is 10 and the verification 20: the alone rate comes from those
    rounds, one token per 20 ms, and the rounds with drafts (one token per 30 ms) give way."""
    ctl = AdaptiveDepth(pause_unpaid=True)
    empty = lambda: (4, 0, 0, _times(wall=0.030, drafting=0.010))  # noqa: E731
    seen = _drafting_pattern(ctl, 20, empty, lambda: _plain(0.020))
    assert seen.startswith("d" * (MIN_JUDGED_ROUNDS + 1) + "p" * PROBE_FIRST), seen
