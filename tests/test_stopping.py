"""Adaptive draft length on the draft daemon's side: a greedy chain stops once the chance that all
its drafts are kept falls below the request's ``min_survival``, each draft's chance calibrated on
the session's own outcomes; the target sets the threshold from its measured costs."""

import pytest

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import running_server, speculate
from starsd_draftd.backends.base import (CALIBRATION_DISCOUNT, NEXT_GUESSES, PRIOR_COPIED, Calibration, Draft,
                                         DraftRequest, Stopping, clip_draft)
from starsd_draftd.backends.model import ModelBackend
from starsd_target.client import DraftClient
from starsd_target.depth import MIN_SURVIVAL_RANGE, PRIOR_MIN_SURVIVAL, AdaptiveDepth
from starsd_target.engine import TargetEngine
from starsd_target.profile import split_round


def test_calibration_learns_from_the_kept_prefix_only():
    cal = Calibration()
    assert cal.chance(None) == pytest.approx(PRIOR_COPIED) and cal.chance(0.5) == pytest.approx(0.5)
    cal.learn([1, 2, 3])  # nothing sent yet: nothing learned
    assert cal.chance(0.5) == pytest.approx(0.5)
    # all kept: copies' share rises, and the model's pick kept where it promised 0.5 raises its scale
    cal.sent(3, Draft([7, 8, 9], top_probs=[None, None, 0.5]))
    cal.learn([1, 2, 3, 7, 8, 9, 4])
    assert cal.chance(None) > PRIOR_COPIED and cal.chance(0.5) > 0.5
    before = (cal.copied_kept, cal.copied_tried, cal.model_kept, cal.model_promised)
    cal.learn([1, 2, 3, 7, 8, 9, 4])  # an outcome is learned once
    assert (cal.copied_kept, cal.copied_tried, cal.model_kept, cal.model_promised) == before
    # the first draft rejected (4 came, not 5): it counts as not kept, the copy after it teaches nothing
    cal.sent(7, Draft([5, 6], top_probs=[0.9, None]))
    cal.learn([1, 2, 3, 7, 8, 9, 4, 4, 6])
    d = CALIBRATION_DISCOUNT
    assert (cal.copied_kept, cal.copied_tried) == before[:2]
    assert cal.model_kept == pytest.approx(d * before[2]) and cal.model_promised == pytest.approx(d * before[3] + 0.9)
    # nothing verified past the drafts' start yet: nothing learned
    cal.sent(20, Draft([1], top_probs=[0.3]))
    cal.learn([0] * 20)
    assert cal.model_promised == pytest.approx(d * before[3] + 0.9)
    # trees and chains measured without stopping are not recorded
    cal.sent(1, Draft([1, 2], parents=[-1, -1], top_probs=[0.5, 0.5]))
    cal.learn([0, 5, 5])
    assert cal.model_promised == pytest.approx(d * before[3] + 0.9)


def test_stopping_keeps_the_chain_while_its_chance_to_survive_whole_stays_above_the_threshold():
    cal = Calibration()  # priors: a model pick's chance is its probability
    stop = Stopping(cal, 0.3)
    assert stop.go_on(0, 0.9) and stop.go_on(1, 0.5)  # 0.9, then 0.45
    assert not stop.go_on(2, 0.6)  # 0.27 < 0.3
    assert stop.survival == pytest.approx(0.45)
    first = Stopping(cal, 0.3)
    assert not first.go_on(0, 0.01)  # a first draft that does not pay is not made either: an empty chain
    assert first.go_on(0, 0.99) and first.survival == pytest.approx(0.99)
    for off in (Stopping(cal, 0.0), Stopping(None, 0.5)):
        assert not off.active and all(off.go_on(j, 0.01) for j in range(10))
    copied = Stopping(cal, 0.5)  # a copied token's chance is the share of copies kept (0.85 at first)
    assert all(copied.go_on(j, None) for j in range(4))  # 0.85, 0.72, 0.61, 0.52
    assert not copied.go_on(4, None)  # 0.44 < 0.5


def test_clip_draft_cuts_by_depth_and_where_stopping_would_have_stopped():
    d = Draft([1, 2, 3, 4], alternatives=[5, 6, 7, 8], top_probs=[0.9, 0.5, 0.6, 0.9])
    assert clip_draft(d, 3).tokens == [1, 2, 3] and clip_draft(d, 3).alternatives == [5, 6, 7]
    cut = clip_draft(d, 4, Stopping(Calibration(), 0.3))
    assert cut.tokens == [1, 2] and cut.top_probs == [0.9, 0.5] and cut.alternatives == [5, 6]
    assert clip_draft(d, 4, Stopping(Calibration(), 0.0)).tokens == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def near(near_draft):
    return load_causal_lm(str(near_draft))


def test_model_backend_stops_a_greedy_chain_where_stopping_says_and_its_cache_stays_right(near):
    verified = [1, 5, 9, 30, 2, 77, 8]
    b = ModelBackend(near)
    # a threshold no chain falls below: the full chain, each pick's probability recorded
    full = b.draft(b.new_state(SamplingParams()), verified, 6, min_survival=1e-12)
    assert len(full.tokens) == 6 and all(p is not None and 0 < p <= 1 for p in full.top_probs)
    assert b.draft(b.new_state(SamplingParams()), verified, 6).tokens == full.tokens  # stopping off
    assert b.draft(b.new_state(SamplingParams()), verified, 6, min_survival=1.0).tokens == []  # nothing pays
    lengths = set()
    for tau in (0.9, 0.5, 0.2, 0.05, 0.01):
        st = b.new_state(SamplingParams())
        got = b.draft(st, verified, 6, min_survival=tau)
        # stopping changes how many drafts go, never which: the same rule over the recorded probabilities
        assert got.tokens == clip_draft(full, 6, Stopping(Calibration(), tau)).tokens
        lengths.add(len(got.tokens))
        # the session's cache holds what it fed: its next drafts are a fresh session's
        nxt = verified + got.tokens + [3]
        fresh = ModelBackend(near)
        assert b.draft(st, nxt, 4).tokens == fresh.draft(fresh.new_state(SamplingParams()), nxt, 4).tokens
    assert len(lengths) > 1  # the thresholds cut the chain at different places
    # a sampled session never stops early
    sampled = b.draft(b.new_state(SamplingParams(temperature=1.0, seed=3)), verified, 6, min_survival=0.99)
    assert len(sampled.tokens) == 6


def test_batched_drafting_stops_each_chain_as_drafting_it_alone_would(near):
    """Rows of one batch stop at their own places (a stopped row leaves the batch while the
    others go on); a sampled row is never stopped; every row's cache holds what it fed."""
    b, alone = ModelBackend(near), ModelBackend(near)
    seqs = [[1, 5, 9, 30, 2, 77, 8], [3, 4, 5, 6], [9, 9, 8, 7, 6, 5, 4, 3], [2, 4, 6, 8, 10]]
    taus = [0.5, 0.0, 0.05, 0.9]
    params = [SamplingParams(), SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=7)]
    states = [b.new_state(p) for p in params]
    got = b.draft_many([DraftRequest(st, s, 5, min_survival=t) for st, s, t in zip(states, seqs, taus)])
    lengths = [len(d.tokens) for d in got]
    assert min(lengths[:3]) < 5 and lengths[1] == 5 and lengths[3] == 5, lengths  # stopped beside full
    for st, s, t, p, d in zip(states, seqs, taus, params, got):
        ref = alone.draft(alone.new_state(p), s, 5, min_survival=t)
        assert d.tokens == ref.tokens
        nxt = s + d.tokens + [2]  # every row's cache holds what its chain fed
        if p.greedy:
            assert b.draft(st, nxt, 3).tokens == alone.draft(alone.new_state(p), nxt, 3).tokens


def test_the_target_sets_the_threshold_from_its_rate_and_what_a_draft_costs():
    ctl = AdaptiveDepth()
    assert ctl.min_survival() == PRIOR_MIN_SURVIVAL  # nothing measured yet
    assert ctl.verify_slope() is None
    assert ctl.min_chance() == 0.0  # none sent until the verification's cost is measured
    # verification at 20 ms plus 2 ms per token verified; 1 ms of drafting per draft; rounds of 40 ms
    for proposed, kept in [(1, 1), (4, 2), (2, 2), (6, 3), (3, 0), (5, 5), (1, 0), (4, 4)] * 3:
        verify = 0.020 + 0.002 * (proposed + 1)
        ctl.observe(6, proposed, kept, split_round(0.040, 0.001 * proposed, (0.0, 0.001 * proposed), verify, 0.001))
    assert ctl.verify_slope() == pytest.approx(0.002, rel=1e-6)
    rate = ctl.drafted_rate()
    assert rate is not None and rate > 0
    assert ctl.min_survival() == pytest.approx(rate * (0.001 + 0.002), rel=1e-6)
    assert ctl.min_chance() == pytest.approx(rate * 0.002, rel=1e-6)  # a copied draft: no drafting cost
    lo, hi = MIN_SURVIVAL_RANGE
    assert lo <= ctl.min_survival() <= hi


def test_thresholds_set_high_by_fast_copied_rounds_come_down_when_chains_stop_empty():
    """A generation's first rounds copy its prompt (16 drafts kept in 150 ms): the rate they
    measure prices a coin-toss copy out. Replies with no drafts then bring one token a round;
    they count in the rate, so the thresholds fall and copies are drafted again."""
    ctl = AdaptiveDepth()
    ctl.catching_up = False
    for proposed in (16, 2, 16, 1):  # copied runs, and short model chains: the slope is measured
        verify = 0.040 + 0.006 * (proposed + 1)
        ctl.observe(16, proposed, proposed, split_round(verify + 0.002, 0.002, (0.0, 0.0), verify, 0.0))
    assert ctl.min_chance() > 0.5 and ctl.min_survival() > 0.5  # a chance of 1/2 no longer pays
    for _ in range(30):  # the daemon stops every chain before its first draft
        ctl.observe(16, 0, 0, split_round(0.048, 0.002, (0.0, 0.0), 0.046, 0.0))
    assert ctl.verify_slope() == pytest.approx(0.006, rel=0.05)
    assert ctl.min_chance() < 0.25 and ctl.min_survival() < 0.5


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)],
                         ids=["greedy", "sampled"])
def test_the_star_stops_greedy_chains_and_stays_exact(params, near, loaded_target):
    """Through the scheduler and the draft daemon: a greedy generation sends a threshold, the
    daemon stops chains early, the tokens are the target's own and drafts were kept; a sampled
    one is never stopped."""
    engine = TargetEngine(loaded_target, depth=6)
    prompt = engine.encode("def parse(line):\n    ")
    with running_server(ModelBackend(near), max_depth=6) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        assert client.welcome.stops_drafts
        r = speculate(engine, client, prompt, 48, params, 30)
        client.close()
        stop = dict(server.stats.stopping)
    assert r.stats.fallback_rounds == 0 and r.stats.accepted > 0
    if params.greedy:
        assert r.token_ids == engine.generate(prompt, 48, params).token_ids
        assert 0 < stop["requests"] <= r.stats.rounds and stop["stopped"] > 0 and stop["drafts_saved"] > 0
        assert r.stats.drafted < 6 * stop["requests"]
    else:
        assert stop == {"requests": 0, "stopped": 0, "drafts_saved": 0}


def test_work_ahead_stops_each_guess_as_a_request_for_it_would(near):
    """Lookahead drafts each guess with the session's last threshold: every guess's drafts are
    what a request for it would get, some of them stopped short of the depth."""
    ahead, fresh = ModelBackend(near), ModelBackend(near)
    st = ahead.new_state(SamplingParams())
    verified = [1, 5, 9, 30, 2, 77, 8]
    tau = 0.3
    sent = ahead.draft(st, verified, 4, min_survival=tau)
    assert len(sent.tokens) == 4 and sent.next_top is None  # not stopped: the guesses of a full chain
    task = ahead.lookahead(st, verified, sent, 4)
    while not task.step():
        pass
    short = 0
    for b, (g, d) in enumerate(zip(task.guesses, task.result)):
        most = 4 if b == len(task.guesses) - 1 else 5  # the all-kept row's first pick is its guess
        assert d.tokens == fresh.draft(fresh.new_state(SamplingParams()), g, most, min_survival=tau).tokens
        short += len(d.tokens) < most
    assert short > 0
    # taking a guess leaves the session as drafting it on request would; the request first
    # teaches the calibration its outcome (the first draft kept, the second not), which can
    # only cut the drafts made ahead
    pick = 1
    got = ahead.finish_ahead(st, DraftRequest(st, task.guesses[pick], 5, min_survival=tau), task.take(pick))
    assert got.tokens == clip_draft(task.result[pick], 5, Stopping(st.calibration, tau)).tokens
    assert 1 <= len(got.tokens) and got.tokens == task.result[pick].tokens[: len(got.tokens)]
    nxt = task.guesses[pick] + got.tokens + [3]
    assert ahead.draft(st, nxt, 4).tokens == fresh.draft(fresh.new_state(SamplingParams()), nxt, 4).tokens


def test_after_a_chain_stopped_unsure_work_ahead_guesses_the_likeliest_next_tokens(near):
    """A chain that stopped where the model was unsure says the model's likeliest next tokens;
    lookahead then guesses the chain all kept followed by each of them (and rejections), ranked
    by their chance, at most MAX_ROWS, each drafted as a request for it would be."""
    ahead, fresh = ModelBackend(near), ModelBackend(near)
    st = ahead.new_state(SamplingParams())
    verified = [1, 5, 9, 30, 2, 77, 8]
    tau = 0.5
    sent = ahead.draft(st, verified, 6, min_survival=tau)
    assert len(sent.tokens) < 6 and len(sent.next_top) == NEXT_GUESSES
    probs = [p for _, p in sent.next_top]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-6
    seq = verified + sent.tokens
    task = ahead.lookahead(st, verified, sent, 4)
    assert all(g is not None for g in task.guesses) and len(task.guesses) <= ahead.MAX_ROWS
    after_all_kept = [g[-1] for g in task.guesses if g[:-1] == seq]
    assert after_all_kept and set(after_all_kept) <= {t for t, _ in sent.next_top}
    assert after_all_kept[0] == sent.next_top[0][0]  # the likeliest outcome first
    while not task.step():
        pass
    for g, d in zip(task.guesses, task.result):
        assert d.tokens == fresh.draft(fresh.new_state(SamplingParams()), g, 5, min_survival=tau).tokens
    # taking the likeliest guess leaves the session's cache as drafting on request would
    got = ahead.finish_ahead(st, DraftRequest(st, task.guesses[0], 5, min_survival=tau), task.take(0))
    assert got.tokens and got.tokens == task.result[0].tokens[: len(got.tokens)]
    nxt = task.guesses[0] + got.tokens + [3]
    assert ahead.draft(st, nxt, 4).tokens == fresh.draft(fresh.new_state(SamplingParams()), nxt, 4).tokens
