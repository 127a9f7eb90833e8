"""The emulation section: N emulated targets against one emulated draft daemon, beside the analytic model."""

from __future__ import annotations

import logging
import statistics

import zmq

from starsd_draftd.bench import plan as plan_mod
from starsd_draftd.bench.emulation import EMULATION_LABEL, ServiceModel
from starsd_draftd.bench.emulated_target import EmulatedTarget, TargetModel, run_window
from starsd_draftd.bench.trace import BusyIndex, Trace, idle_gaps, services_between
from starsd_draftd.bench.config import BenchConfig, GAP_EDGES_MS
from starsd_draftd.bench.pool import Pool, _busy_fraction, _draftd_emulation_args, _stats, emulation_max_depth
from starsd_draftd.bench.stats import framework_overheads, histogram, per_token_latencies, relative_error_pct, summarize
from starsd_draftd.lookahead import ahead_depth

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- emulation
def _run_emulated_targets(endpoint: str, n: int, model: TargetModel, warmup_s: float, window_s: float,
                          ctx: zmq.Context, seed: int) -> dict:
    targets = [EmulatedTarget(endpoint, model, seed=seed + i, name=f"emu-n{n}-t{i}", ctx=ctx) for i in range(n)]
    stats = {}
    w0, w1 = run_window(targets, warmup_s, window_s, "emulated",
                        at_open=lambda: stats.__setitem__("s0", _stats(endpoint, ctx)),
                        at_close=lambda: stats.__setitem__("s1", _stats(endpoint, ctx)))
    return {"n": n, "targets": targets, "w0": w0, "w1": w1, **stats}


def emulation_row(run: dict, trace: Trace, busy_idx: BusyIndex, model: plan_mod.Plan, nominal: plan_mod.Plan) -> dict:
    """Measurement for one N from the targets' rounds, the daemon's STATS and its trace, beside
    the analytic model (``model``: S and R with the measured framework costs; ``nominal``: as
    configured). The model's busy fraction counts only the nominal S(d) as busy: the daemon's
    own per-request work is not drafting."""
    n, w0, w1 = run["n"], run["w0"], run["w1"]
    window = w1 - w0
    services = services_between(trace.services, w0, w1)
    per_target, all_rounds, overheads = [], [], []
    for t in run["targets"]:
        rounds = [r for r in t.rounds if w0 <= r.t_done <= w1]
        all_rounds.extend(rounds)
        per_target.append(sum(r.tokens for r in rounds) / window)
        serial = trace.serial_for_seed(t.seed)
        by_pos = {nv: (a, b) for s, a, b, nv in trace.requests if s == serial}
        overheads.extend(framework_overheads(rounds, by_pos, busy_idx))
    tokens = sum(r.tokens for r in all_rounds)
    gaps = idle_gaps(services)
    measured = {
        "window_s": window,
        "rounds": len(all_rounds),
        "system_tps": tokens / window,
        "per_target_tps": statistics.fmean(per_target),
        "per_target_tps_min": min(per_target),
        "per_target_tps_max": max(per_target),
        "rounds_per_s": len(all_rounds) / window,
        "mean_accepted_length": tokens / len(all_rounds) if all_rounds else 0.0,
        "busy_fraction": _busy_fraction(run["s0"], run["s1"]),
        "busy_fraction_trace": sum(b - a for a, b, _ in services) / window,
        "idle_gaps_ms": dict(summarize(gaps, 1e3), total_fraction=sum(gaps) / window,
                             histogram=histogram([g * 1e3 for g in gaps], GAP_EDGES_MS)),
        "per_token_latency_ms": summarize(per_token_latencies([(r.duration, r.tokens) for r in all_rounds]), 1e3),
        "framework_overhead_ms": summarize(overheads, 1e3),
        "fallback_rounds": sum(r.fallback for r in all_rounds),
    }
    pred = dict(model.row(n), busy_fraction=n * nominal.service_ms / model.round_ms(n))
    nom = nominal.row(n)
    return {
        "n": n,
        "label": "emulation",
        "measured": measured,
        "predicted": pred,
        "predicted_nominal": nom,
        "error_pct": {
            "system_tps": relative_error_pct(measured["system_tps"], pred["system_tps"]),
            "rounds_per_s": relative_error_pct(measured["rounds_per_s"], pred["rounds_per_s"]),
            "busy_fraction_points": 100.0 * (measured["busy_fraction"] - pred["busy_fraction"]),
            "system_tps_vs_nominal": relative_error_pct(measured["system_tps"], nom["system_tps"]),
        },
        "alternatives_predicted": {
            "target_alone_system_tps": n * nominal.standalone_tps,
            "colocated_system_tps": n * nominal.colocated_tps,
        },
    }


def emulation_calibration(one: dict, sat: dict, trace: Trace, busy_idx: BusyIndex) -> dict:
    """The framework costs the model adds to R and S, from the two calibration runs: the median
    round-trip overhead of one target (its wait minus all drafting inside it) and the median idle
    gap between services of the saturated daemon (its own per-request loop work)."""
    target = one["targets"][0]
    rounds = [r for r in target.rounds if one["w0"] <= r.t_done <= one["w1"]]
    serial = trace.serial_for_seed(target.seed)
    by_pos = {nv: (a, b) for s, a, b, nv in trace.requests if s == serial}
    overheads = framework_overheads(rounds, by_pos, busy_idx)
    gaps = idle_gaps(services_between(trace.services, sat["w0"], sat["w1"]))
    if not overheads or not gaps:
        raise RuntimeError("the emulation's calibration runs recorded no rounds; is the host overloaded?")
    return {
        "one_target": {"rounds": len(rounds), "overhead_ms": summarize(overheads, 1e3)},
        "saturated": {"targets": len(sat["targets"]), "busy_fraction": _busy_fraction(sat["s0"], sat["s1"]),
                      "idle_gap_ms": summarize(gaps, 1e3)},
        "framework_rtt_ms": 1e3 * statistics.median(overheads),
        "server_ms_per_request": 1e3 * statistics.median(gaps),
        "statistic": "median",
    }


def _sweep_times(cfg: BenchConfig, nominal: plan_mod.Plan, n: int) -> tuple[float, float]:
    """(warm-up, window) in seconds for N targets: the window holds about ``cfg.min_rounds`` rounds."""
    window = min(cfg.max_window_s, max(cfg.min_window_s, cfg.min_rounds * nominal.round_ms(n) / n / 1000.0))
    return max(cfg.warmup_s, 2 * nominal.round_ms(n) / 1000.0), window


def start_emulation(cfg: BenchConfig, pool: Pool) -> str:
    """The emulated draft daemon (traced, one session at a time: the paper's loop)."""
    return pool.start("emu-draftd", lambda e: _draftd_emulation_args(e, base_ms=cfg.draft_base_ms,
                                                                     per_token_ms=cfg.draft_per_token_ms,
                                                                     depth=cfg.depth, q_topk=cfg.q_topk), traced=True)


def emulation_section(cfg: BenchConfig, pool: Pool, step) -> dict:
    ctx = pool.ctx
    nominal = cfg.emulation_plan()
    tm = TargetModel(verify_ms=cfg.verify_ms, rtt_ms=cfg.rtt_ms, depth=cfg.depth, acceptance=cfg.acceptance,
                     single_ms=cfg.single_ms)
    ep = start_emulation(cfg, pool)
    pool.ready("emu-draftd")
    # Calibration on the sweep's daemon, before the sweep: the framework's costs that the model's
    # S and R must include, as medians (a host that others share has stalls the model is not about).
    # (1) R: what a round trip costs beyond drafting when a target idles V + R between requests,
    #     as under-loaded targets do: one emulated target.
    # (2) S: the daemon's own loop work between two services when requests always wait (a fully
    #     loaded daemon adds it to every service): 2 N_full emulated targets.
    # Both are read off the daemon's trace once the sweep is over, in the calibration windows only.
    t1 = nominal.round_ms(1) / 1000.0
    one = _run_emulated_targets(ep, 1, tm, 2 * t1, max(0.3, cfg.calib_rounds * t1), ctx, seed=cfg.seed + 990_000)
    n_sat = 2 * nominal.n_full
    sat = _run_emulated_targets(ep, n_sat, tm, 2 * nominal.round_ms(n_sat) / 1000.0,
                                max(0.3, cfg.calib_rounds * nominal.service_ms / 1000.0), ctx, seed=cfg.seed + 995_000)
    step("emulation calibration")
    runs = []
    for n in range(1, cfg.n_max + 1):
        runs.append(_run_emulated_targets(ep, n, tm, *_sweep_times(cfg, nominal, n), ctx, seed=cfg.seed + 1000 * n))
        step(f"emulation N={n}")
    trace = pool.stop("emu-draftd")
    busy_idx = BusyIndex(trace.services)
    calibration = emulation_calibration(one, sat, trace, busy_idx)
    model = plan_mod.Plan(verify_ms=cfg.verify_ms, rtt_ms=cfg.rtt_ms + calibration["framework_rtt_ms"],
                          depth=cfg.depth, acceptance=cfg.acceptance,
                          draft_ms=nominal.service_ms + calibration["server_ms_per_request"], single_ms=cfg.single_ms)
    rows = [emulation_row(run, trace, busy_idx, model, nominal) for run in runs]
    ahead = emulation_lookahead(cfg, pool, step, model, rows)
    nf = model.n_full
    full_rows = [r for r in rows if r["n"] >= nf]
    within = [r for r in rows if r["n"] <= 16]
    return {
        "label": EMULATION_LABEL,
        "params": {"draft_base_ms": cfg.draft_base_ms, "draft_per_token_ms": cfg.draft_per_token_ms,
                   "service_ms": nominal.service_ms, "verify_ms": cfg.verify_ms, "rtt_ms": cfg.rtt_ms,
                   "single_ms": nominal.v1_ms, "depth": cfg.depth, "acceptance": cfg.acceptance,
                   "batch_max": 1, "min_rounds": cfg.min_rounds},
        "calibration": calibration,
        "lookahead": ahead,
        "model": dict(model.summary(), note="S and R include the framework costs measured in calibration"),
        "model_nominal": nominal.summary(),
        "rows": rows,
        "targets": {
            "n_full": nf,
            "busy_fraction_min_from_n_full": min((r["measured"]["busy_fraction"] for r in full_rows), default=None),
            "busy_ge_95_from_n_full": (all(r["measured"]["busy_fraction"] >= 0.95 for r in full_rows)
                                       if full_rows else None),
            "max_abs_error_pct": max(abs(r["error_pct"]["system_tps"]) for r in within),
            "throughput_within_10pct": all(abs(r["error_pct"]["system_tps"]) <= 10.0 for r in within),
            "max_abs_error_pct_nominal": max(abs(r["error_pct"]["system_tps_vs_nominal"]) for r in within),
            "max_abs_timing_error_pct": max(abs(r["error_pct"]["rounds_per_s"]) for r in within),
        },
    }


# ---------------------------------------------------------------- emulation with lookahead
LOOKAHEAD_N_MAX = 8  # the lookahead sweep's largest N (it covers the under-loaded range N < N_full)


def lookahead_n_max(cfg: BenchConfig) -> int:
    return min(cfg.n_max, LOOKAHEAD_N_MAX)


def emulated_ahead_depth(depth: int) -> int:
    """The drafts the emulated daemon makes ahead after a request for ``depth`` (the server's rule)."""
    return ahead_depth(emulation_max_depth(depth), depth)


def emulation_lookahead(cfg: BenchConfig, pool: Pool, step, model: plan_mod.Plan, plain_rows: list[dict]) -> dict:
    """N = 1..min(8, N_max) emulated targets against an emulated daemon that drafts ahead (its
    guess of each target's next token is right with probability ``cfg.guess_rate`` after an
    all-kept round), beside the extended model (``plan.lookahead_round``) at the hit rate
    measured: the share of the window's requests answered from work ahead. The model's S and R
    are the calibrated ones of the sweep without lookahead; its S_a is the emulated work ahead,
    S(d + 2): the daemon drafts d + 1 tokens ahead (room for a longer next round) after the
    guess's forward."""
    nominal = cfg.emulation_plan()
    tm = TargetModel(verify_ms=cfg.verify_ms, rtt_ms=cfg.rtt_ms, depth=cfg.depth, acceptance=cfg.acceptance,
                     single_ms=cfg.single_ms, guess_rate=cfg.guess_rate)
    ep = pool.start("emu-draftd-ahead", lambda e: _draftd_emulation_args(
        e, base_ms=cfg.draft_base_ms, per_token_ms=cfg.draft_per_token_ms, depth=cfg.depth, q_topk=cfg.q_topk,
        lookahead=True))
    pool.ready("emu-draftd-ahead")
    ahead_ms = 1000.0 * ServiceModel(cfg.draft_base_ms, cfg.draft_per_token_ms).ahead_s(emulated_ahead_depth(cfg.depth))
    tokens_per_round = plan_mod.expected_tokens_per_round(cfg.acceptance, cfg.depth)
    plain = {r["n"]: r for r in plain_rows}
    rows = []
    for n in range(1, lookahead_n_max(cfg) + 1):
        run = _run_emulated_targets(ep, n, tm, *_sweep_times(cfg, nominal, n), pool.ctx,
                                    seed=cfg.seed + 500_000 + 1000 * n)
        rows.append(lookahead_row(run, model, ahead_ms, tokens_per_round, plain.get(n)))
        step(f"emulation with lookahead N={n}")
    pool.stop("emu-draftd-ahead")
    return {"guess_rate": cfg.guess_rate, "ahead_ms": ahead_ms,
            "hit_rate_iid": plan_mod.lookahead_hit_rate(cfg.acceptance, cfg.depth, cfg.guess_rate), "rows": rows}


def lookahead_row(run: dict, model: plan_mod.Plan, ahead_ms: float, tokens_per_round: float,
                  plain: dict | None) -> dict:
    """One N of the lookahead sweep: measured throughput and hit rate beside the model's. The hit
    rate given to the model counts every request (a round the daemon's gate or a lack of idle time
    left undrafted ahead is a miss). At N = 1 that is the model's h exactly (its coverage is 1);
    from N = 2 the model applies its own idle-time coverage on top, so there it understates what
    lookahead gains."""
    n, w0, w1 = run["n"], run["w0"], run["w1"]
    window = w1 - w0
    rounds = [r for t in run["targets"] for r in t.rounds if w0 <= r.t_done <= w1]
    tokens = sum(r.tokens for r in rounds)
    la0, la1 = run["s0"]["lookahead"], run["s1"]["lookahead"]
    hits = sum(la1[k] - la0[k] for k in ("hits", "late_hits"))
    misses = la1["misses"] - la0["misses"]
    requests = max(1, len(rounds))
    hit_rate = hits / requests  # over every request: rounds not drafted ahead count as misses
    # the counters and the rounds are cut at the window's edges a moment apart: a hit counted just
    # inside can belong to a round that ends just outside, so a tiny window could pass 1
    pred = plan_mod.lookahead_round(n, model.service_ms, max(ahead_ms, model.service_ms), model.verify_ms,
                                    model.rtt_ms, min(1.0, hit_rate))
    predicted_tps = n * tokens_per_round / pred.round_ms * 1000.0
    measured_tps = tokens / window
    row = {"n": n, "label": "emulation", "rounds": len(rounds), "system_tps": measured_tps,
           "fallback_rounds": sum(r.fallback for r in rounds),
           "hits": hits, "misses": misses, "hit_rate": hit_rate,
           "checked_hit_rate": hits / (hits + misses) if hits + misses else None,
           "idle_s_used": la1["idle_s"] - la0["idle_s"],
           "predicted_system_tps": predicted_tps, "predicted_coverage": pred.coverage,
           "error_pct": relative_error_pct(measured_tps, predicted_tps)}
    if plain is not None:
        row["without_lookahead_tps"] = plain["measured"]["system_tps"]
        row["gain"] = measured_tps / plain["measured"]["system_tps"]
        row["predicted_gain"] = predicted_tps / plain["predicted"]["system_tps"]
    return row

