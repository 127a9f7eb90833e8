"""The bench's own logic: statistics, the emulation's timing accounting (fake clocks and sleeps, or
real sockets with no timing assertions), the CLI wiring, and one quick bench run whose JSON is
checked for every field the issue asks for. No test here asserts on how long anything took."""

import json
import math
import random
import threading

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from common.protocol import MsgType
from common.verify import SamplingParams
from fakes import running_server
from starsd_draftd.bench import config, pool, run, star, stats, wire
from starsd_draftd.bench import cli as bench_cli
from starsd_draftd.backends.base import DraftRequest
from starsd_draftd.bench.emulated_target import EmulatedTarget, Round, TargetModel, acceptance_chain
from starsd_draftd.bench.emulation import EMULATION_LABEL, EmulatedBackend, PacedSleep, ServiceModel
from starsd_draftd.bench.trace import BusyIndex, Trace, TracingBackend, idle_gaps, services_between
from starsd_draftd.bench.plan import Plan
from starsd_draftd.bench.real import bench_dtype
from starsd_draftd.bench.report import format_report


class FakeClock:
    """A clock that only moves when someone sleeps on it."""

    def __init__(self, overshoot: float = 0.0):
        self.t = 100.0
        self.overshoot = overshoot
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds + self.overshoot


# ---------------------------------------------------------------- statistics
def test_percentile_matches_linear_interpolation():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([4, 1, 3, 2], 0) == 1
    assert stats.percentile([1, 2, 3, 4], 100) == 4
    assert stats.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert stats.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        stats.percentile([], 50)


def test_summarize_and_histogram():
    s = stats.summarize([0.001, 0.002, 0.003, 0.006], scale=1e3)
    assert s["n"] == 4 and s["mean"] == pytest.approx(3.0) and s["p50"] == pytest.approx(2.5)
    assert s["std"] == pytest.approx(math.sqrt(((2 ** 2) + 1 + 0 + 9) / 4))
    assert s["min"] == pytest.approx(1.0) and s["max"] == pytest.approx(6.0)
    assert stats.summarize([])["p50"] is None
    h = stats.histogram([0.05, 0.1, 0.3, 7.0, 99.0], (0.0, 0.1, 0.25, 5.0))
    assert [b["count"] for b in h] == [1, 1, 1, 2]
    assert h[-1]["hi"] is None and h[0]["lo"] == 0.0


def test_per_token_latency_spreads_a_round_over_its_tokens():
    lat = stats.per_token_latencies([(0.030, 3), (0.010, 1), (0.5, 0)])
    assert lat == pytest.approx([0.01, 0.01, 0.01, 0.01])
    assert stats.relative_error_pct(90.0, 100.0) == pytest.approx(-10.0)


def test_session_rounds_from_a_draft_trace():
    # session 1: requests at 0, 10, 25 ms with verified lengths 16, 19, 20; session 2 re-opened (length drops)
    reqs = [(1, 0.000, 0.001, 16), (2, 0.002, 0.003, 30), (1, 0.010, 0.011, 19), (1, 0.025, 0.026, 20),
            (2, 0.020, 0.021, 12), (2, 0.030, 0.031, 14)]
    rounds = sorted((round(d, 9), k) for d, k in stats.session_rounds(reqs))
    assert rounds == [(0.01, 2), (0.01, 3), (0.015, 1)]


def test_busy_index_overlaps_and_idle_gaps():
    services = [(1.0, 2.0, 1), (2.5, 3.0, 1), (2.8, 3.5, 2), (5.0, 6.0, 1)]
    idx = BusyIndex(services)
    assert idx.busy(0.0, 10.0) == pytest.approx(1.0 + 1.0 + 1.0)  # 2.5..3.5 merged
    assert idx.busy(1.5, 2.7) == pytest.approx(0.5 + 0.2)
    assert idx.busy(3.5, 5.0) == 0.0
    assert idx.busy(5.5, 5.0) == 0.0
    assert idle_gaps([(1.0, 2.0, 1), (2.5, 3.0, 1), (5.0, 6.0, 1)]) == pytest.approx([0.5, 2.0])
    assert services_between(services, 2.4, 3.6) == [(2.5, 3.0, 1), (2.8, 3.5, 2)]


def test_framework_overhead_subtracts_all_drafting_inside_the_wait():
    # a request sent at 1.0 waited behind another session's service (1.0-1.4), was served 1.5-1.9 and
    # its reply arrived at 2.0: 1.0 s of wait, 0.4 + 0.4 of it drafting -> 0.2 of framework
    services = [(1.0, 1.4, 1), (1.5, 1.9, 1)]
    r = Round(t_send=1.0, t_reply=2.0, t_done=2.5, pos=20, drafted=4, accepted=2, fallback=False)
    out = stats.framework_overheads([r], {20: (1.5, 1.9)}, BusyIndex(services))
    assert out == pytest.approx([0.2])
    assert stats.framework_overheads([r], {}, BusyIndex(services)) == []


# ---------------------------------------------------------------- emulation accounting
def test_paced_sleep_pays_back_overshoot():
    clock = FakeClock(overshoot=0.0003)
    sleep = PacedSleep(clock.sleep, clock)
    t0 = clock()
    for _ in range(200):
        sleep(0.005)
    # the total tracks the nominal 1.0 s within one overshoot; no single sleep is cut below half
    assert clock() - t0 == pytest.approx(1.0, abs=0.0004)
    assert min(clock.slept) >= 0.0025
    sleep(0)  # no-op
    assert len(clock.slept) == 200


def test_emulated_backend_sleeps_service_time_and_drafts():
    clock = FakeClock()
    be = EmulatedBackend(ServiceModel(1.0, 0.5), vocab_size=100, q_topk=8, sleep=clock.sleep)
    st = be.new_state(SamplingParams())
    d = be.draft(st, [5, 98], 4)
    assert clock.slept == pytest.approx([0.003])  # 1 + 0.5 * 4 ms
    assert d.tokens == [99, 0, 1, 2] and d.q_ids is None
    st = be.new_state(SamplingParams(temperature=1.0, seed=3))
    d = be.draft(st, [7], 3)
    assert d.q_ids.shape == (3, 8) and d.q_ids.dtype == np.int32 and d.q_probs.dtype == np.float32
    assert d.q_ids[:, 0].tolist() == d.tokens
    assert np.allclose(d.q_probs.sum(-1), 1.0)
    assert (d.q_ids[:, 1:] == (d.q_ids[:, :1] + np.arange(1, 8)) % 100).all()
    untabled = EmulatedBackend(ServiceModel(0, 0), vocab_size=100, q_topk=8, sleep=clock.sleep)
    untabled._q_table = None  # what a vocabulary too large for the table gets: rows computed per draft
    for start in ([7], [97]):
        a, b = be.draft(be.new_state(SamplingParams(temperature=1.0)), start, 3), \
            untabled.draft(untabled.new_state(SamplingParams(temperature=1.0)), start, 3)
        assert a.tokens == b.tokens and np.array_equal(a.q_ids, b.q_ids) and b.q_ids.dtype == np.int32
    with pytest.raises(ValueError):
        be.draft(st, [], 2)


def test_emulated_backend_drafts_ahead_for_the_all_kept_guess():
    """The work ahead guesses the token after the last draft, sleeps S(d + 1) in d + 1 steps (the
    model's S_a), and drafts what a request for the guessed sequence would get; off by default."""
    clock = FakeClock()
    off = EmulatedBackend(ServiceModel(1.0, 0.5), vocab_size=100, sleep=clock.sleep)
    st = off.new_state(SamplingParams())
    assert not off.drafts_ahead and off.lookahead(st, [5, 96], off.draft(st, [5, 96], 3), 4) is None
    be = EmulatedBackend(ServiceModel(1.0, 0.5), vocab_size=100, sleep=clock.sleep, lookahead=True)
    st = be.new_state(SamplingParams())
    sent = be.draft(st, [5, 96], 3)  # 97, 98, 99
    clock.slept.clear()
    task = be.lookahead(st, [5, 96], sent, 4)
    assert be.drafts_ahead and task.guesses == [[5, 96, 97, 98, 99, 0]] and task.total_steps == 5
    steps = 0
    while not task.step():
        steps += 1
    assert steps + 1 == 5 and clock.slept == pytest.approx([0.0015] + [0.0005] * 4)
    assert sum(clock.slept) == pytest.approx(be.service.ahead_s(4))
    assert task.take(0).tokens == be.draft(be.new_state(SamplingParams()), task.guesses[0], 4).tokens == [1, 2, 3, 4]
    sampled = be.new_state(SamplingParams(temperature=1.0))
    assert be.lookahead(sampled, [5, 96], be.draft(sampled, [5, 96], 3), 4) is None  # greedy sessions only


@pytest.mark.parametrize("guess_rate,hits", [(1.0, True), (0.0, False)])
def test_an_emulated_target_that_takes_the_guess_gets_answers_from_work_ahead(guess_rate, hits):
    """Every draft kept: with guess rate 1 the target's own token is the drafter's guess, so after
    the first round every request brings the sequence drafted ahead (a hit); with guess rate 0
    none does. The bookkeeping stays exact either way (no round without drafts)."""
    with running_server(EmulatedBackend(ServiceModel(0.0, 0.0), lookahead=True)) as (server, ctx):
        tm = TargetModel(verify_ms=30.0, rtt_ms=0.0, depth=3, acceptance=1.0, guess_rate=guess_rate)
        t = EmulatedTarget(server.endpoint, tm, seed=2, ctx=ctx)
        rounds = t.run(threading.Event(), max_rounds=12)
        la = dict(server.stats.lookahead)
    assert len(rounds) == 12 and not any(r.fallback for r in rounds)
    assert all(r.accepted == r.drafted == 3 for r in rounds)
    answered = la["hits"] + la["late_hits"]
    if hits:
        assert answered == 11 and la["misses"] == 0
    else:
        assert answered == 0 and la["misses"] >= 1


def test_lookahead_row_takes_the_hit_rate_over_all_requests():
    class T:
        def __init__(self, rounds):
            self.rounds = rounds

    rounds = [Round(10.0 + 0.1 * i, 10.01 + 0.1 * i, 10.1 + 0.1 * i, 16 + 3 * i, 2, 2, False) for i in range(10)]
    run = {"n": 1, "targets": [T(rounds)], "w0": 10.0, "w1": 11.0,
           "s0": {"lookahead": {"hits": 5, "late_hits": 0, "misses": 1, "idle_s": 1.0}},
           "s1": {"lookahead": {"hits": 8, "late_hits": 1, "misses": 3, "idle_s": 1.25}}}
    model = Plan(verify_ms=60, rtt_ms=4, depth=2, acceptance=0.5, draft_ms=20)
    plain = {"measured": {"system_tps": 25.0}, "predicted": {"system_tps": model.system_tps(1)}}
    row = star.lookahead_row(run, model, 30.0, model.tokens_per_round, plain)
    assert row["rounds"] == 10 and row["system_tps"] == pytest.approx(30.0)  # 3 tokens a round
    assert row["hits"] == 4 and row["misses"] == 2 and row["hit_rate"] == pytest.approx(0.4)
    assert row["checked_hit_rate"] == pytest.approx(4 / 6) and row["idle_s_used"] == pytest.approx(0.25)
    t1 = 64 + 0.4 * 0 + 0.6 * 20  # W + h max(0, S_a - W) + (1 - h) S, N = 1
    assert row["predicted_system_tps"] == pytest.approx(model.tokens_per_round / t1 * 1000)
    assert row["gain"] == pytest.approx(30.0 / 25.0)
    assert row["predicted_gain"] == pytest.approx(model.round_ms(1) / t1)


def test_tracing_backend_records_services_sessions_and_batches():
    clock = FakeClock()
    inner = EmulatedBackend(ServiceModel(2.0, 0.0), sleep=clock.sleep)
    tb = TracingBackend(inner, clock=clock)
    assert (tb.name, tb.vocab_size, tb.fingerprint, tb.q_topk) == ("emulated", inner.vocab_size, inner.fingerprint, 32)
    a, b = tb.new_state(SamplingParams(seed=11)), tb.new_state(SamplingParams(seed=12))
    tb.draft(a, [3, 4, 5], 2)
    tb.draft_many([DraftRequest(a, [3, 4, 5, 6], 2), DraftRequest(b, [9], 3)])
    tr = tb.trace
    assert tr.sessions == {1: 11, 2: 12} and tr.serial_for_seed(12) == 2
    assert [round(x, 9) for svc in tr.services for x in svc] == [100.0, 100.002, 1, 100.002, 100.006, 2]
    assert [(r[0], r[3]) for r in tr.requests] == [(1, 3), (1, 4), (2, 1)]
    tb.release(a)
    again = Trace.from_json(json.loads(json.dumps(tr.to_json())))
    assert again.services == tr.services and again.sessions == tr.sessions


def test_acceptance_chain():
    rng = random.Random(0)
    assert acceptance_chain(rng, 0.0, 5) == 0
    assert acceptance_chain(rng, 1.0, 5) == 5
    xs = [acceptance_chain(rng, 0.8, 4) + 1 for _ in range(20000)]  # seeded: deterministic
    assert sum(xs) / len(xs) == pytest.approx(Plan(verify_ms=1, rtt_ms=0, depth=4, acceptance=0.8,
                                                   draft_ms=1).tokens_per_round, rel=0.02)


@pytest.mark.parametrize("temperature,feature_size", [(0.0, 0), (1.0, 0), (0.0, 16)])
def test_emulated_target_bookkeeping_over_the_real_protocol(temperature, feature_size):
    """An emulated target against an in-process draft server: every round gets its drafts (the
    server accepts the accepted/new/pos and feature bookkeeping), the verification sleeps are
    accounted exactly, and the draft trace lines up with the target's rounds."""
    traced = TracingBackend(EmulatedBackend(ServiceModel(0.0, 0.0), feature_size=feature_size))
    clock = FakeClock()
    with running_server(traced) as (server, ctx):
        tm = TargetModel(verify_ms=7.0, rtt_ms=2.0, depth=4, acceptance=0.6)
        t = EmulatedTarget(server.endpoint, tm, seed=5, ctx=ctx, temperature=temperature, feature_size=feature_size,
                           sleep=clock.sleep)
        rounds = t.run(threading.Event(), max_rounds=25)
    assert len(rounds) == 25 and not any(r.fallback for r in rounds)
    assert clock.slept == pytest.approx([0.009] * 25)  # V + R per round, nothing else
    assert all(r.drafted == 4 and 0 <= r.accepted <= 4 for r in rounds)
    for a, b in zip(rounds, rounds[1:]):
        assert b.pos == a.pos + a.tokens
    by_pos = {nv: (s0, s1) for _, s0, s1, nv in traced.trace.requests}
    assert [r.pos for r in rounds] == sorted(by_pos)
    assert traced.trace.serial_for_seed(5) == 1
    assert len(stats.framework_overheads(rounds, by_pos, BusyIndex(traced.trace.services))) == 25


def test_emulation_row_accounting_on_a_synthetic_run():
    """Two targets, a 1 s window: tokens, rounds, busy fraction, gaps and latencies by hand."""
    class T:
        def __init__(self, seed, rounds):
            self.seed, self.rounds = seed, rounds

    # target A: 3 rounds of 0.2 s with 2, 3, 5 tokens inside the window, one outside; target B: 2 rounds of 0.4 s
    ra = [Round(10.0 + 0.2 * i, 10.05 + 0.2 * i, 10.2 + 0.2 * i, 16 + 10 * i, 4, k - 1, False)
          for i, k in enumerate([2, 3, 5, 1])]
    ra[3].t_done = 11.5  # after the window
    rb = [Round(10.0 + 0.4 * i, 10.1 + 0.4 * i, 10.4 + 0.4 * i, 40 + 10 * i, 4, 0, False) for i in range(2)]
    trace = Trace(services=[(10.0, 10.04, 1), (10.05, 10.09, 1), (10.5, 10.54, 1)],
                  requests=[(1, 10.0, 10.04, 16), (2, 10.05, 10.09, 40)], sessions={1: 1, 2: 2})
    run = {"n": 2, "targets": [T(1, ra), T(2, rb)], "w0": 10.0, "w1": 11.0,
           "s0": {"busy_s": 5.0, "uptime_s": 100.0}, "s1": {"busy_s": 5.12, "uptime_s": 101.0}}
    model = Plan(verify_ms=100, rtt_ms=0, depth=4, acceptance=0.5, draft_ms=40)
    row = star.emulation_row(run, trace, BusyIndex(trace.services), model, model)
    m = row["measured"]
    assert row["label"] == "emulation"
    assert m["rounds"] == 5 and m["system_tps"] == pytest.approx(12.0)  # 2+3+5 + 1+1 tokens in 1 s
    assert m["per_target_tps_min"] == pytest.approx(2.0) and m["per_target_tps_max"] == pytest.approx(10.0)
    assert m["mean_accepted_length"] == pytest.approx(12 / 5)
    assert m["busy_fraction"] == pytest.approx(0.12)
    assert m["busy_fraction_trace"] == pytest.approx(0.12)
    assert m["idle_gaps_ms"]["n"] == 2 and m["idle_gaps_ms"]["p50"] == pytest.approx((10 + 410) / 2)
    assert m["per_token_latency_ms"]["n"] == 12
    assert m["framework_overhead_ms"]["n"] == 2
    assert row["predicted"]["system_tps"] == pytest.approx(model.system_tps(2))
    assert row["error_pct"]["system_tps"] == pytest.approx(100 * (12 - model.system_tps(2)) / model.system_tps(2))


def test_emulation_calibration_takes_medians_of_the_calibration_windows():
    class T:
        seed = 7
        rounds = [Round(1.0, 1.1, 1.2, 16, 4, 1, False), Round(1.2, 1.35, 1.4, 18, 4, 0, False),
                  Round(1.4, 1.5, 1.6, 19, 4, 0, False), Round(3.0, 3.9, 4.0, 20, 4, 0, False)]  # last: outside

    # the target's three services, then a saturated stretch with gaps of 20, 10 and 50 ms
    services = [(1.02, 1.08, 1), (1.22, 1.30, 1), (1.42, 1.48, 1),
                (5.0, 5.1, 1), (5.12, 5.2, 1), (5.21, 5.3, 1), (5.35, 5.4, 1)]
    trace = Trace(services=services, requests=[(1, 1.02, 1.08, 16), (1, 1.22, 1.30, 18), (1, 1.42, 1.48, 19)],
                  sessions={1: 7})
    one = {"targets": [T()], "w0": 1.0, "w1": 2.0}
    sat = {"targets": [None] * 8, "w0": 5.0, "w1": 5.5, "s0": {"busy_s": 0.0, "uptime_s": 0.0},
           "s1": {"busy_s": 0.4, "uptime_s": 0.5}}
    cal = star.emulation_calibration(one, sat, trace, BusyIndex(services))
    # waits 0.1, 0.15, 0.1 minus own services 0.06, 0.08, 0.06 -> 0.04, 0.07, 0.04
    assert cal["framework_rtt_ms"] == pytest.approx(40.0)
    assert cal["server_ms_per_request"] == pytest.approx(20.0)
    assert cal["one_target"]["rounds"] == 3 and cal["saturated"]["targets"] == 8
    assert cal["saturated"]["busy_fraction"] == pytest.approx(0.8)


# ---------------------------------------------------------------- sockets, no timing assertions
def test_capacity_and_framework_round_trips_against_an_in_process_server():
    with running_server(EmulatedBackend(ServiceModel(0.0, 0.0), feature_size=32)) as (server, ctx):
        loop = wire.framework_loop(server.endpoint, "features_q", 0.0, ctx, feature_size=32, feature_rows=3)
        try:
            rtts = wire.interleaved({"framework": loop}, n=6, warmup=2, blocks=1)["framework"]
        finally:
            loop.close()
        assert len(rtts) == 6 and all(x > 0 for x in rtts)
    with running_server(EmulatedBackend(ServiceModel(0.0, 0.0))) as (server, ctx):
        cap = pool.measure_capacity(server.endpoint, 3, 4, 0.2, ctx, max_len=40)
        assert cap["k"] == 3 and cap["requests"] > 0 and cap["requests_per_s"] > 0
        assert set(cap) >= {"busy_fraction", "mean_batch", "drafted_tokens_per_s", "busy_ms_per_request"}
        assert server.snapshot()["errors"] == {}


def test_wire_payloads_and_torch_reference_round_trip():
    req, rep = wire.wire_messages("features_q", q_topk=16, feature_size=64, feature_rows=3)
    assert req.type is MsgType.DRAFT and req.tensors["features"].shape == (3, 64)
    assert req.tensors["features"].dtype == torch.float16
    assert rep.tensors["q_ids"].shape == (5, 16) and rep.tensors["q_probs"].dtype == torch.float32
    assert "features" not in wire.wire_messages("greedy")[0].tensors and not wire.wire_messages("greedy")[1].tensors
    back = wire._torch_unblob(wire._torch_blob(rep))
    assert back["type"] == "DRAFTED" and torch.equal(back["tensors"]["q_ids"], rep.tensors["q_ids"])


def test_batch_max_detection_matches_server_config():
    import dataclasses

    from starsd_draftd.server import ServerConfig

    assert config.batch_max_supported() == ("batch_max" in {f.name for f in dataclasses.fields(ServerConfig)})


# ---------------------------------------------------------------- CLI
@pytest.fixture
def cli():
    """The user's command line, ``starsd-draftd``, whose bench and plan commands these are (a bare
    group would leave click's cached --help option without the -h the real group gives it)."""
    from starsd_draftd.cli import main

    return main


def test_plan_cli_prints_the_model(cli):
    res = CliRunner().invoke(cli, ["plan", "--draft-ms", "5", "--verify-ms", "10", "--rtt-ms", "3",
                                   "--acceptance", "0.8", "--n-max", "6"])
    assert res.exit_code == 0, res.output
    assert "N_full = ceil((V + R) / S) + 1 = 4" in res.output and "<- N_full" in res.output
    res = CliRunner().invoke(cli, ["plan", "--draft-base-ms", "1", "--draft-per-token-ms", "1", "--verify-ms", "10",
                                   "--rtt-ms", "3", "--acceptance", "0.8", "--json"])
    out = json.loads(res.output)
    assert out["n_full"] == 4 and out["service_ms"] == 5.0 and len(out["table"]) == 16
    res = CliRunner().invoke(cli, ["plan", "--verify-ms", "10", "--acceptance", "0.8"])  # S(d) = 0
    assert res.exit_code == 1 and "S(d)" in res.output
    res = CliRunner().invoke(cli, ["plan", "--verify-ms", "10", "--acceptance", "0.8", "--draft-ms", "2"],
                             env={"STARSD_DRAFTD_RTT_MS": "8"})
    assert "R = 8.000 ms" in res.output


def test_bench_cli_builds_the_config(cli, monkeypatch, tmp_path):
    seen = {}

    def fake_run(cfg):
        seen["cfg"] = cfg
        return {"logs": "x"}

    monkeypatch.setattr(bench_cli, "run_bench", fake_run)
    monkeypatch.setattr(bench_cli, "setup_logging", lambda *a: None)
    monkeypatch.delenv("STARSD_DRAFTD_DTYPE", raising=False)  # the tests' daemons' dtype (conftest)
    monkeypatch.setattr(bench_cli, "format_report", lambda r: "table")
    res = CliRunner().invoke(cli, ["bench", "--quick", "--out", str(tmp_path), "--n-max", "2", "--sections",
                                   "wire,emulation", "--no-progress"])
    assert res.exit_code == 0, res.output
    cfg = seen["cfg"]
    assert cfg.quick and cfg.n_max == 2 and cfg.models == "tiny" and cfg.sections == ("wire", "emulation")
    assert not cfg.progress and cfg.out == tmp_path
    res = CliRunner().invoke(cli, ["bench", "--verify-ms", "30", "--models", "tiny"])
    cfg = seen["cfg"]
    assert not cfg.quick and cfg.n_max == 16 and cfg.verify_ms == 30 and cfg.models == "tiny"
    assert cfg.dtype == "auto" and bench_dtype(cfg) == "float32"  # the tiny pair's default
    res = CliRunner().invoke(cli, ["bench", "--models", "demo", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    assert bench_dtype(seen["cfg"]) == "bfloat16"  # the daemons', and the target alone's beside them
    assert "--quick" in CliRunner().invoke(cli, ["bench", "--help"]).output


def test_bench_config_refuses_unknown_sections():
    with pytest.raises(ValueError):
        config.BenchConfig(sections=("wire", "gpu")).check()


# ---------------------------------------------------------------- one quick run, every field
@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # --quick, with fewer measurements still: these tests check what the report holds, not its figures
    report = run.run_bench(config.BenchConfig.quick_config(
        out=out, progress=False, workdir=tmp_path_factory.mktemp("bench-work"), wire_rounds=60, wire_paced_rounds=6,
        min_rounds=15, calib_rounds=5, capacity_s=0.2, max_tokens=16))
    return out, report


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
def test_quick_bench_writes_json_png_and_markdown(quick_report):
    out, report = quick_report
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["schema"] == config.SCHEMA and on_disk["mode"] == "quick"
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "EMULATION" in md and "Wire cost" in md and "Real models" in md and "Batched" in md
    assert "Where a StarSD round's time goes" in md and "| 1 target, 4 stream(s) |" in md
    assert _num(on_disk["wall_s"])


@pytest.mark.slow
def test_quick_bench_pool_fields(quick_report):
    """The pool section: each daemon count's targets spread over every daemon and drafting, and
    the failover run's targets all drafting again after one daemon is killed."""
    from starsd_draftd.bench.draft_pool import QUICK_DAEMONS

    _, r = quick_report
    p = r["pool"]
    assert p["n_full"] >= 1 and [row["daemons"] for row in p["sweep"]] == list(QUICK_DAEMONS)
    for row in p["sweep"]:
        assert row["targets"] == 2 * p["n_full"] * row["daemons"] and row["daemons_used"] == row["daemons"], row
        assert row["rounds"] > 0 and _num(row["tok_s"]) and _num(row["x_one"]) and _num(row["per_target_tok_s"])
    f = p["failover"]
    assert f["daemons"] == 2 and len(f["fallback_rounds_per_target"]) == f["targets"] == 2 * p["n_full"]
    assert _num(f["recovered_s"]) and f["recovered_s"] > 0  # every target drafted again after the kill
    assert "A pool of draft daemons" in format_report(r)


@pytest.mark.slow
def test_quick_bench_machine_and_labels(quick_report):
    _, r = quick_report
    m = r["machine"]
    for k in ("cpu", "logical_cores", "usable_cores", "torch", "transformers", "pyzmq", "python", "accelerator",
              "load_average_at_start"):
        assert m[k] not in (None, ""), k
    assert "emulation" in r["labels"]["emulation"] and "reference" in r["labels"]["torch_save"]
    assert r["emulation"]["label"] == EMULATION_LABEL
    assert all(row["label"] == "emulation" for row in r["emulation"]["rows"])


@pytest.mark.slow
def test_quick_bench_wire_fields(quick_report):
    _, r = quick_report
    w = r["wire"]
    assert [c["case"] for c in w["cases"]] == ["greedy", "sampling_q", "features_q"]
    for c in w["cases"]:
        for path in ("raw_zmq_us", "framework_us", "torch_save_us"):
            assert all(_num(c[path][k]) for k in ("p50", "p99", "mean", "std")), (c["case"], path)
        assert c["torch_save_us"]["label"].startswith("reference only")
        assert _num(c["overhead_ratio_p50"]) and c["request_bytes"] > 0 and c["reply_bytes"] > 0
    assert w["cases"][2]["request_bytes"] > 3 * 4096 * 2  # carries the features
    assert _num(w["paced"]["overhead_ratio_p50"])
    assert isinstance(w["target"]["met"], bool)


@pytest.mark.slow
def test_quick_bench_emulation_fields(quick_report):
    _, r = quick_report
    e = r["emulation"]
    assert [row["n"] for row in e["rows"]] == [1, 2, 3]
    assert e["model"]["n_full"] >= 1 and _num(e["calibration"]["server_ms_per_request"])
    for row in e["rows"]:
        me, pd = row["measured"], row["predicted"]
        for k in ("system_tps", "per_target_tps", "mean_accepted_length", "busy_fraction", "busy_fraction_trace",
                  "rounds_per_s"):
            assert _num(me[k]), k
        assert me["rounds"] > 0 and me["fallback_rounds"] == 0
        assert 0 < me["busy_fraction"] <= 1.0
        for k in ("p50", "p99", "std"):
            assert _num(me["per_token_latency_ms"][k]), k
        assert _num(me["framework_overhead_ms"]["p50"])
        gaps = me["idle_gaps_ms"]
        assert gaps["n"] > 0 and _num(gaps["p50"]) and sum(b["count"] for b in gaps["histogram"]) == gaps["n"]
        for k in ("system_tps", "per_target_tps", "busy_fraction", "round_ms", "idle_ms"):
            assert _num(pd[k]) and _num(row["predicted_nominal"][k]), k
        assert _num(row["error_pct"]["system_tps"])
        assert _num(row["alternatives_predicted"]["target_alone_system_tps"])
    t = e["targets"]
    assert isinstance(t["throughput_within_10pct"], bool) and _num(t["max_abs_error_pct"])
    la = e["lookahead"]
    assert [row["n"] for row in la["rows"]] == [1, 2, 3] and _num(la["hit_rate_iid"])
    for row in la["rows"]:
        assert row["rounds"] > 0 and row["fallback_rounds"] == 0 and 0.0 <= row["hit_rate"] <= 1.0
        for k in ("system_tps", "predicted_system_tps", "predicted_coverage", "error_pct", "gain", "predicted_gain"):
            assert _num(row[k]), k


@pytest.mark.slow
def test_quick_bench_real_model_fields(quick_report):
    _, r = quick_report
    real = r["real"]
    assert [row["n"] for row in real["rows"]] == [1, 2]
    for row in real["rows"]:
        s, a = row["starsd"], row["alone"]
        for k in ("system_tps", "per_target_tps", "mean_accepted_length", "draft_busy_fraction"):
            assert _num(s[k]), k
        for k in ("system_tps", "per_target_tps"):
            assert _num(a[k]), k
        assert _num(s["per_token_latency_ms"]["p50"]) and _num(s["per_token_latency_ms"]["p99"])
        assert _num(s["per_token_latency_ms"]["std"]) and "histogram" in s["idle_gaps_ms"]
        assert s["fallback_rounds"] == 0 and _num(row["speedup_system"])
    assert real["greedy_outputs_identical"] is True  # speculation never changes greedy output
    c = real["colocated"]
    assert _num(c["assisted"]["tokens_per_s"]) and _num(c["target_generate"]["tokens_per_s"])
    assert _num(c["target_batched"]["tokens_per_s"]) and c["target_batched"]["batch"] >= 1
    assert c["target_batched"]["tokens"] > 0
    # one target, 1, 2 and 4 generations at once: exact, and no generation loses its drafts
    assert [it["streams"] for it in real["interleaving"]] == [1, 2, 4]
    for it in real["interleaving"]:
        assert it["greedy_same_tokens_as_alone"] is True and it["rounds"] > 0 and it["fallback_rounds"] == 0
        assert _num(it["speedup_system"]) and it["mean_accepted_length"] > 1.0
    assert _num(real["target_forward_ms"]["verify_ms"]) and _num(real["target_forward_ms"]["single_ms"])
    assert real["plan"]["n_full"] >= 1
    # where the rounds went: one profile per run, its parts adding up to the round
    runs = [p["run"] for p in real["round_profile"]]
    assert runs == ["1 target(s), 1 stream each", "2 target(s), 1 stream each", "1 target, 1 stream(s)",
                    "1 target, 2 stream(s)", "1 target, 4 stream(s)"]
    for p in real["round_profile"]:
        ms = p["ms_per_round"]
        assert p["rounds"] > 0 and ms["verify_forward"] > 0 and ms["draft_forward"] > 0
        assert ms["draft_wait"] + ms["verify_forward"] + ms["verify_math"] + ms["rest"] == pytest.approx(ms["round"])
        assert ms["draft_queue"] + ms["draft_forward"] + ms["wire"] == pytest.approx(ms["draft_wait"])
        assert set(p["draftd_ms_per_request"]) == {"queue", "draft_forward", "rest"}


@pytest.mark.slow
def test_quick_bench_batched_verification_fields(quick_report):
    _, r = quick_report
    v = r["verify"]
    assert [row["generations"] for row in v["rows"]] == [1, 2] and v["modes"] == {"batched": 8, "one_at_a_time": 1}
    for row in v["rows"]:
        assert row["same_tokens"] is True  # batched or not, with drafts or not: the same greedy tokens
        for key in ("spec_batched", "spec_one_at_a_time", "alone_batched", "alone_one_at_a_time"):
            assert _num(row[key]["system_tps"]) and row[key]["rounds"] > 0, key
            assert row[key]["verify_forwards"] > 0, key
        assert row["spec_batched"]["fallback_rounds"] == 0 and row["spec_batched"]["mean_accepted_length"] > 1.0
        assert row["spec_one_at_a_time"]["batched_rounds"] == 0 and row["alone_one_at_a_time"]["batched_rounds"] == 0
        assert _num(row["spec_gain"]) and _num(row["alone_gain"])
    two = v["rows"][1]
    # two generations with no drafts to wait for are ready together every pass: they share forwards
    assert two["alone_batched"]["batched_rounds"] > 0 and two["alone_batched"]["rounds_per_forward"] > 1.0
    assert "Batched verification" in format_report(r)


@pytest.mark.slow
def test_quick_bench_lookahead_fields(quick_report):
    _, r = quick_report
    v = r["lookahead"]
    assert [row["streams"] for row in v["rows"]] == [1]
    row = v["rows"][0]
    assert _num(row["alone_tps"]) and row["alone_same"] is True
    assert set(row["configs"]) == {"fixed", "adaptive", "lookahead", "lookahead+adaptive", "lookahead+adaptive+fill"}
    for name, c in row["configs"].items():
        assert _num(c["tps"]) and _num(c["speedup"]) and _num(c["speedup_vs_fixed"]), name
        assert c["fallback_rounds"] == 0 and c["rounds"] > 0, name
        assert c["same_as_alone"] == c["of"] > 0, name  # exact with every combination
        assert 0 < c["asked_per_round"] <= r["config"]["depth"], name
        ms = c["round_ms"]  # the target's round profile, per round
        assert ms["round"] >= ms["verify_forward"] + ms["fill"] > 0 and ms["draft_forward"] > 0, name
        assert _num(c["round_over_larger"]) and c["round_over_larger"] > 0 and c["drafting_ms"] > 0, name
        if c["fill_steps"]:  # whether a step pays follows the host's timing (tests/test_fill_steps.py pins it)
            assert c["fills"] >= 0 and (c["fills"] > 0) == (ms["fill"] > 0), name
            continue
        assert c["fills"] == 0 and ms["fill"] == 0 and c["kept_per_round"] > 1.0, name
        assert 0 < c["drafted_per_round"] <= c["asked_per_round"], name
        if c["lookahead"]:  # drafted ahead, and requests were checked against it
            assert c["hit_rate"] is not None and 0.0 <= c["hit_rate"] <= 1.0 and c["idle_s"] > 0, name
        else:
            assert c["hit_rate"] is None, name
    assert row["configs"]["fixed"]["speedup_vs_fixed"] == 1.0
    assert "Lookahead and adaptive depth" in format_report(r)


@pytest.mark.slow
def test_quick_bench_trees_fields(quick_report):
    _, r = quick_report
    v = r["trees"]
    assert [row["backend"] for row in v["rows"]] == ["model"]  # the tiny pair has no EAGLE head
    row = v["rows"][0]
    assert _num(row["alone_tps"]) and row["alone_same"] is True
    assert set(row["configs"]) == {"chain", "tree 8"}
    for name, c in row["configs"].items():
        assert _num(c["tps"]) and _num(c["speedup"]) and _num(c["kept_vs_chain"]), name
        assert c["fallback_rounds"] == 0 and c["rounds"] > 0 and c["kept_per_round"] > 1.0, name
        assert c["same_as_alone"] == c["of"] > 0, name  # exact, chain and tree
        assert _num(c["draft_ms"]) and c["draft_ms"] > 0 and _num(c["verify_ms"]) and c["verify_ms"] > 0, name
    chain, tree = row["configs"]["chain"], row["configs"]["tree 8"]
    assert chain["tree_rounds"] == 0 and tree["tree_rounds"] > 0  # the budget really asked for trees
    assert chain["drafted_per_round"] <= r["config"]["depth"] < tree["drafted_per_round"] <= 8
    assert "Draft trees against chains" in format_report(r)


@pytest.mark.slow
def test_quick_bench_batched_fields(quick_report):
    _, r = quick_report
    b = r["batched"]
    if not config.batch_max_supported():
        assert b == {"available": False, "reason": b["reason"]}
        return
    assert b["available"] and b["batch_max"] == 8
    assert [x["k"] for x in b["one_at_a_time"]] == [8] and [x["k"] for x in b["batched"]] == [1, 8]
    assert [x["k"] for x in b["windowed"]] == [1, 8] and b["batch_window_ms"] > 0
    assert _num(b["capacity_gain"]) and b["n_full"]["batched"] >= 1 and b["n_full"]["one_at_a_time"] >= 1
    assert _num(b["capacity_gain_work_conserving"])
    assert b["batched"][-1]["mean_batch"] >= 1.0 and b["windowed"][-1]["mean_batch"] >= 1.0
    assert "batch window" in b["target"]["measured_with"]
    e = b["eagle"]  # eagle-llm is part of the install, so the EAGLE backend is measured too
    assert e["available"] and e["hidden_size"] > 0 and "random weights" in e["label"]
    assert e["one_at_a_time"]["k"] == e["windowed"]["k"] == 8
    assert e["one_at_a_time"]["mean_batch"] == 1.0 and e["windowed"]["mean_batch"] >= 1.0
    assert _num(e["capacity_gain"]) and e["n_full"]["one_at_a_time"] >= 1 and e["n_full"]["batched"] >= 1
    assert set(r["targets"]) == {"overhead_ratio_p50_le_1_5", "emulation_busy_ge_95_from_n_full",
                                 "emulation_throughput_within_10pct", "batched_capacity_ge_3x"}


def test_interleaved_takes_n_after_warmup_in_alternating_blocks():
    order = []

    def loop(name):
        i = 0
        while True:
            i += 1
            order.append(name)
            yield float(i)

    out = wire.interleaved({"a": loop("a"), "b": loop("b")}, n=7, warmup=2, blocks=3)
    assert out["a"] == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0] and out["b"] == out["a"]  # warm-up rounds dropped
    assert "".join(order) == "aabb" + "aaabbb" + "aabb" + "aabb"  # blocks of 3, 2, 2, alternating


@pytest.mark.slow
def test_quick_bench_rows_fields(quick_report):
    from starsd_draftd.bench.rows import ROW_COUNTS, row_formats

    _, r = quick_report
    v = r["rows"]
    assert v["rows"] == list(ROW_COUNTS) and v["model"].endswith("target")  # the bench's own target
    assert [f["dtype"] for f in v["formats"]] == list(row_formats())
    for f in v["formats"]:
        assert len(f["ms"]) == len(ROW_COUNTS) and all(_num(x) and x > 0 for x in f["ms"]), f
        assert f["relative"][0] == 1.0 and all(_num(x) for x in f["relative"])
        assert f["forward"] in ("lean", "eager", "compiled")
        # a bfloat16 target verifies its rows as one-row steps compute them, where they are checked exact
        assert f["row_exact"] >= 0 and (f["dtype"] == "bfloat16" or f["row_exact"] == 0)
        assert f["memory"]["rss_bytes"] > 0 and f["memory"]["weights_bytes"] > 0
    assert "One forward against its rows" in format_report(r)


def test_rows_model_resolves_target_shapes_and_directories(tmp_path, tiny_target, monkeypatch):
    from starsd_draftd.bench import rows

    assert rows.resolve_rows_model("target", tiny_target, tmp_path) == tiny_target
    assert rows.resolve_rows_model(str(tiny_target), None, tmp_path) == tiny_target
    built = []
    monkeypatch.setattr(rows, "shape_checkpoint", lambda name, root: built.append((name, root)) or root / name)
    assert rows.resolve_rows_model("qwen2.5-1.5b", None, tmp_path) == tmp_path / "qwen2.5-1.5b"
    assert built == [("qwen2.5-1.5b", tmp_path)]
    with pytest.raises(ValueError, match="neither 'target', a shape"):
        rows.resolve_rows_model(str(tmp_path / "nothing"), None, tmp_path)
    with pytest.raises(ValueError, match="needs the bench's models"):
        rows.resolve_rows_model("target", None, tmp_path)


def test_a_shape_checkpoint_has_the_real_configuration(tmp_path, monkeypatch):
    """Built from the real configuration (a smaller copy here: the layer count and widths are
    what the table names), saved once in bfloat16, reused after."""
    import json as json_mod

    from starsd_draftd.bench import rows

    monkeypatch.setitem(rows.SHAPES, "small", dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                                   num_attention_heads=4, num_key_value_heads=2))
    out = rows.shape_checkpoint("small", tmp_path)
    cfg = json_mod.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 151936
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    stamp = (out / "config.json").stat().st_mtime_ns
    assert rows.shape_checkpoint("small", tmp_path) == out and (out / "config.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="unknown shape"):
        rows.shape_checkpoint("llama-70b", tmp_path)
    assert rows.SHAPES["qwen2.5-1.5b"]["hidden_size"] == 1536 and rows.SHAPES["qwen2.5-1.5b"]["num_hidden_layers"] == 28


def test_a_round_is_set_against_the_larger_of_drafting_and_verification():
    from starsd_draftd.bench.lookahead import overlap
    from starsd_target.profile import merge, ms_per_round

    def prof(rounds, wall, drafting, verifying):
        return {"rounds": rounds, "wall_s": wall, "seconds": {"draft_wait": drafting, "draft_forward": drafting,
                                                              "verify_forward": verifying}}

    fixed = merge([prof(2, 0.2, 0.08, 0.1), prof(2, 0.2, 0.08, 0.1)])
    assert fixed["rounds"] == 4 and fixed["seconds"]["draft_forward"] == pytest.approx(0.16)
    # fixed depth: 40 ms drafting, then 50 ms verifying, one after the other (100 ms rounds);
    # ahead: drafting hidden, rounds of 55 ms against the larger of the two, 50 ms
    # adaptive: 10 ms drafting, 50 ms verifying, 70 ms rounds; with lookahead, against its partner's 10
    configs = {"fixed": {"round_ms": ms_per_round(fixed), "lookahead": False, "adaptive_depth": False},
               "lookahead": {"round_ms": ms_per_round(prof(4, 0.22, 0.004, 0.2)), "lookahead": True,
                             "adaptive_depth": False},
               "adaptive": {"round_ms": ms_per_round(prof(2, 0.14, 0.02, 0.1)), "lookahead": False,
                            "adaptive_depth": True},
               "both": {"round_ms": ms_per_round(prof(2, 0.12, 0.002, 0.1)), "lookahead": True, "adaptive_depth": True}}
    overlap(configs)
    assert configs["fixed"]["drafting_ms"] == configs["lookahead"]["drafting_ms"] == pytest.approx(40.0)
    assert configs["fixed"]["round_over_larger"] == pytest.approx(2.0)
    assert configs["lookahead"]["round_over_larger"] == pytest.approx(1.1)
    assert configs["both"]["drafting_ms"] == pytest.approx(10.0)
    assert configs["adaptive"]["round_over_larger"] == pytest.approx(1.4)
    assert configs["both"]["round_over_larger"] == pytest.approx(1.2)
