"""The bench report: derived figures, the Markdown table and the plot."""

from __future__ import annotations

from pathlib import Path


from starsd_draftd.bench import plan as plan_mod
from starsd_draftd.bench.config import BenchConfig, TORCH_SAVE_LABEL
from starsd_draftd.bench.real import _real_plan


def _derive(report: dict, cfg: BenchConfig) -> None:
    """Cross-section results: the real models' sizing plan, batched N_full, the targets' summary."""
    wire_rtt = None
    if "emulation" in report:
        wire_rtt = max(0.0, report["emulation"]["calibration"]["framework_rtt_ms"])
    elif "wire" in report:
        wire_rtt = report["wire"]["paced"]["framework_us"]["mean"] / 1000.0
    batched = report.get("batched")
    real = report.get("real")
    if real is not None and wire_rtt is not None:
        s1 = real["rows"][0]["starsd"]["draft_service_ms_per_request"]
        if batched and batched.get("available"):
            s1 = batched["service_ms_per_request_one_at_a_time"]
        if s1:
            real["plan"] = _real_plan(real, wire_rtt, cfg.depth, cfg.n_max, s1)
    if batched and batched.get("available"):
        v_r = (cfg.verify_ms + cfg.rtt_ms, "emulation parameters")
        if real is not None and wire_rtt is not None:
            v_r = (real["target_forward_ms"]["verify_ms"] + wire_rtt, "real target forward + loopback round trip")

        def n_full(section: dict) -> dict:
            return {"one_at_a_time": plan_mod.n_full(section["service_ms_per_request_one_at_a_time"], v_r[0], 0.0),
                    "batched": plan_mod.n_full(section["service_ms_per_request_batched"], v_r[0], 0.0),
                    "verify_plus_rtt_ms": v_r[0], "from": v_r[1]}

        batched["n_full"] = dict(n_full(batched),
                                 note="capacity-equivalent: S = 1 / requests per second with k = batch_max waiting")
        eagle = batched.get("eagle", {})
        if eagle.get("available"):
            eagle["n_full"] = n_full(eagle)
    summary = {}
    if "wire" in report:
        summary["overhead_ratio_p50_le_1_5"] = report["wire"]["target"]
    if "emulation" in report:
        t = report["emulation"]["targets"]
        summary["emulation_busy_ge_95_from_n_full"] = {"met": t["busy_ge_95_from_n_full"], "n_full": t["n_full"],
                                                       "min": t["busy_fraction_min_from_n_full"]}
        summary["emulation_throughput_within_10pct"] = {"met": t["throughput_within_10pct"],
                                                        "max_abs_error_pct": t["max_abs_error_pct"]}
    if batched is not None:
        summary["batched_capacity_ge_3x"] = batched.get("target", {"met": None, "reason": batched.get("reason")})
    report["targets"] = summary


def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


PROFILE_COLUMNS = (("draft_wait", "draft wait"), ("draft_queue", "daemon queue"), ("draft_forward", "draft forwards"),
                   ("wire", "wire"), ("verify_forward", "verify forward"), ("verify_math", "verify math"),
                   ("rest", "rest"), ("round", "round"))


def format_round_profile(profiles: list[dict]) -> str:
    """The per-round profile table (ms per round; see starsd_target.profile for the parts)."""
    lines = ["Where a StarSD round's time goes, ms per round (draft wait = daemon queue + draft forwards + wire; "
             "round = draft wait + verify forward + verify math + rest):", "",
             "| run | rounds | " + " | ".join(name for _, name in PROFILE_COLUMNS) + " | draftd ms per request: "
             "queue / forwards / rest |", "|---|---|" + "---|" * (len(PROFILE_COLUMNS) + 1)]
    for p in profiles:
        ms = p["ms_per_round"]
        d = p.get("draftd_ms_per_request")
        daemon = "-" if d is None else f"{d['queue']:.2f} / {d['draft_forward']:.1f} / {d['rest']:.2f}"
        lines.append(f"| {p['run']} | {p['rounds']} | "
                     + " | ".join(_fmt(ms.get(key)) for key, _ in PROFILE_COLUMNS) + f" | {daemon} |")
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """The report as Markdown tables (printed by the CLI, written to bench.md, the source of docs/bench.md)."""
    m = report["machine"]
    lines = [f"# StarSD bench ({report['mode']}, {report['created']})", "",
             f"Machine: {m['cpu']}, {m['usable_cores']} usable cores"
             f"{' (virtual machine)' if m['virtualized'] else ''}, "
             f"{m['memory_gib']} GiB, accelerator: {m['accelerator']}; Python {m['python']}, torch {m['torch']}, "
             f"transformers {m['transformers']}, pyzmq {m['pyzmq']} (libzmq {m['libzmq']}).", ""]
    if "wire" in report:
        w = report["wire"]
        lines += ["## Wire cost per round trip (loopback, back to back)", "",
                  "| payload | request B | reply B | raw pyzmq p50 / p99 us | StarSD path p50 / p99 us | ratio p50 | "
                  "torch.save p50 / p99 us (reference) |", "|---|---|---|---|---|---|---|"]
        for c in w["cases"]:
            lines.append(f"| {c['case']} | {c['request_bytes']} | {c['reply_bytes']} | "
                         f"{c['raw_zmq_us']['p50']:.0f} / {c['raw_zmq_us']['p99']:.0f} | "
                         f"{c['framework_us']['p50']:.0f} / {c['framework_us']['p99']:.0f} | "
                         f"{c['overhead_ratio_p50']:.2f}x | {c['torch_save_us']['p50']:.0f} / "
                         f"{c['torch_save_us']['p99']:.0f} |")
        p = w["paced"]
        lines += ["", f"With the host idle {p['gap_ms']:.0f} ms between round trips ({p['case']}): raw "
                      f"{p['raw_zmq_us']['p50']:.0f} us, StarSD {p['framework_us']['p50']:.0f} us p50 "
                      f"({p['overhead_ratio_p50']:.2f}x). torch.save rows: {TORCH_SAVE_LABEL}.", ""]
    if "emulation" in report:
        e = report["emulation"]
        pr = e["params"]
        mo = e["model"]
        lines += ["## EMULATION: one draft daemon, N emulated targets", "",
                  f"*{e['label']}.* S(d) = {pr['draft_base_ms']:g} + {pr['draft_per_token_ms']:g} d = "
                  f"{pr['service_ms']:g} ms, V = {pr['verify_ms']:g} ms, R = {pr['rtt_ms']:g} ms (emulated), "
                  f"d = {pr['depth']}, acceptance {pr['acceptance']:g}. Model with the measured framework costs: "
                  f"S = {mo['service_ms']:.2f} ms, R = {mo['params']['rtt_ms']:.2f} ms, N_full = {mo['n_full']} "
                  f"(nominal {e['model_nominal']['n_full']}).", "",
                  "| N | system tok/s | predicted | error | per-target tok/s | mean acc. len | busy | predicted busy | "
                  "idle gap p50 / p99 ms | per-token ms p50 / p99 / std | overhead ms p50 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in e["rows"]:
            me, pd = r["measured"], r["predicted"]
            g, lat, ov = me["idle_gaps_ms"], me["per_token_latency_ms"], me["framework_overhead_ms"]
            lines.append(f"| {r['n']} | {me['system_tps']:.1f} | {pd['system_tps']:.1f} | "
                         f"{r['error_pct']['system_tps']:+.1f}% | {me['per_target_tps']:.1f} | "
                         f"{me['mean_accepted_length']:.2f} | {100 * me['busy_fraction']:.1f}% | "
                         f"{100 * pd['busy_fraction']:.1f}% | {_fmt(g['p50'], '.2f')} / {_fmt(g['p99'], '.2f')} | "
                         f"{lat['p50']:.2f} / {lat['p99']:.2f} / {lat['std']:.2f} | {_fmt(ov['p50'], '.2f')} |")
        lines.append("")
        la = e.get("lookahead")
        if la and la["rows"]:
            lines += ["### With lookahead", "",
                      f"The daemon drafts each session's next round ahead while idle (S_a = {la['ahead_ms']:g} ms of "
                      f"work ahead); the emulated drafter's guess of a target's next token after an all-kept round "
                      f"is right with probability {la['guess_rate']:g} (i.i.d. hit rate "
                      f"{100 * la['hit_rate_iid']:.0f}%). The model (`plan.lookahead_round`) takes the measured hit "
                      f"rate, over all requests: exact at N = 1; from N = 2 it also applies its own idle-time "
                      f"coverage, so there it understates the gain.", "",
                      "| N | system tok/s | predicted | error | without lookahead | gain (x) | predicted gain (x) | "
                      "hit rate | predicted coverage | rounds without drafts |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for r in la["rows"]:
                lines.append(f"| {r['n']} | {r['system_tps']:.1f} | {r['predicted_system_tps']:.1f} | "
                             f"{r['error_pct']:+.1f}% | {_fmt(r.get('without_lookahead_tps'), '.1f')} | "
                             f"{_fmt(r.get('gain'), '.3f')} | {_fmt(r.get('predicted_gain'), '.3f')} | "
                             f"{100 * r['hit_rate']:.0f}% | {100 * r['predicted_coverage']:.0f}% | "
                             f"{r['fallback_rounds']} of {r['rounds']} |")
            lines.append("")
    if "real" in report:
        r = report["real"]
        tr = r["models"].get("training") or {}
        agree = tr.get("heldout_top1_agreement")
        about = (f" Demo pair: target {tr.get('target_params')} parameters, draft {tr.get('draft_params')} "
                 f"({tr.get('draft_layers')} layer), held-out top-1 agreement "
                 f"{'?' if agree is None else f'{100 * agree:.0f}%'}." if tr else "")
        lines += [f"## Real models on this CPU ({r['models']['kind']} pair)", "", f"*{r['label']}.*{about}", "",
                  "| N | StarSD system tok/s | per-target | target alone system tok/s | per-target | speedup | "
                  "mean acc. len | draft busy | idle gap p50 ms | per-token ms p50 / p99 / std |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            s, a = row["starsd"], row["alone"]
            lat = s["per_token_latency_ms"]
            lines.append(f"| {row['n']} | {s['system_tps']:.1f} | {s['per_target_tps']:.1f} | {a['system_tps']:.1f} | "
                         f"{a['per_target_tps']:.1f} | {row['speedup_system']:.2f}x | "
                         f"{s['mean_accepted_length']:.2f} | "
                         f"{100 * s['draft_busy_fraction']:.0f}% | {_fmt(s['idle_gaps_ms']['p50'], '.2f')} | "
                         f"{_fmt(lat['p50'], '.2f')} / {_fmt(lat['p99'], '.2f')} / {_fmt(lat['std'], '.2f')} |")
        c = r["colocated"]
        lines += ["", f"Co-located, one stream (transformers `generate(assistant_model=...)`, {c.get('dtype', 'auto')}): "
                      f"{c['assisted']['tokens_per_s']:.1f} tok/s; transformers target alone "
                      f"{c['target_generate']['tokens_per_s']:.1f} tok/s"
                      + (f"; the target alone over the {c['target_batched']['batch']} prompts as one batch "
                         f"{c['target_batched']['tokens_per_s']:.1f} tok/s" if "target_batched" in c else "")
                      + f". Greedy outputs identical to the target alone: "
                        f"{'yes' if r['greedy_outputs_identical'] else 'NO'}."]
        if r.get("interleaving"):
            lines += ["", "One target, several generations at once (its scheduler interleaves them):", "",
                      "| generations | StarSD tok/s | target alone tok/s | speedup | mean acc. len | "
                      "rounds without drafts: fallback, by choice | same text |", "|---|---|---|---|---|---|---|"]
            for it in r["interleaving"]:
                lines.append(f"| {it['streams']} | {it['starsd_system_tps']:.1f} | {it['alone_system_tps']:.1f} | "
                             f"{it['speedup_system']:.2f}x | {it['mean_accepted_length']:.2f} | "
                             f"{it['fallback_rounds']}, {it.get('plain_rounds', 0)} of {it['rounds']} | "
                             f"{'yes' if it['greedy_same_tokens_as_alone'] else 'NO'} |")
        if r.get("round_profile"):
            lines += ["", format_round_profile(r["round_profile"])]
        if "plan" in r:
            pl = r["plan"]
            lines.append(f"Sizing estimate with one device per target (S = {pl['service_ms']:.2f} ms, V = "
                         f"{pl['params']['verify_ms']:.2f} ms, R = {pl['params']['rtt_ms']:.2f} ms, E = "
                         f"{pl['tokens_per_round']:.2f}): N_full = {pl['n_full']}, saturated "
                         f"{pl['saturated_system_tps']:.0f} tok/s.")
        lines.append("")
    if "lookahead" in report:
        from starsd_draftd.bench.lookahead import format_lookahead

        lines += format_lookahead(report["lookahead"])
    if "trees" in report:
        from starsd_draftd.bench.trees import format_trees

        lines += format_trees(report["trees"])
    if "rows" in report:
        from starsd_draftd.bench.rows import format_rows

        lines += format_rows(report["rows"])
    if "verify" in report:
        from starsd_draftd.bench.verify_batch import format_verify

        lines += format_verify(report["verify"])
    if "pool" in report:
        from starsd_draftd.bench.draft_pool import format_pool

        lines += format_pool(report["pool"])
    if "suffix" in report:
        from starsd_draftd.bench.suffix import format_suffix

        lines += format_suffix(report["suffix"]) + [""]
    if "batched" in report:
        b = report["batched"]
        lines += ["## Batched drafting (draft service capacity)", ""]
        if not b["available"]:
            lines.append(f"not available: {b['reason']}")
        else:
            lines += ["| batch_max | batch window ms | k waiting | requests/s | mean batch | busy |",
                      "|---|---|---|---|---|---|"]
            window = b.get("batch_window_ms", 0.0)
            for bm, w, runs in ((1, 0.0, b["one_at_a_time"]), (b["batch_max"], 0.0, b["batched"]),
                                (b["batch_max"], window, b.get("windowed", []))):
                for x in runs:
                    lines.append(f"| {bm} | {w:g} | {x['k']} | {x['requests_per_s']:.0f} | "
                                 f"{_fmt(x['mean_batch'], '.2f')} | {100 * x['busy_fraction']:.0f}% |")
            nf = b.get("n_full", {})
            best = b["capacity_gain_best"]
            lines += ["", f"Capacity gain with {b['batch_max']} sessions in the loop: {b['capacity_gain']:.2f}x with a "
                          f"{window:g} ms batch window, {_fmt(b.get('capacity_gain_work_conserving'), '.2f')}x "
                          f"strictly work-conserving (best: {best['gain']:.2f}x with {best['k']}, mean batch "
                          f"{_fmt(best['mean_batch'], '.1f')}); N_full "
                          f"{nf.get('one_at_a_time', '-')} -> {nf.get('batched', '-')} (V + R = "
                          f"{_fmt(nf.get('verify_plus_rtt_ms'), '.2f')} ms, {nf.get('from', '-')})."]
            e = b.get("eagle", {})
            if e.get("available"):
                enf = e.get("n_full", {})
                lines += ["", f"EAGLE backend ({e['label']}; hidden size {e['hidden_size']}): "
                              f"{e['one_at_a_time']['requests_per_s']:.0f} requests/s one at a time, "
                              f"{e['windowed']['requests_per_s']:.0f} with batch_max {b['batch_max']} and the "
                              f"{window:g} ms window (mean batch {_fmt(e['windowed']['mean_batch'], '.2f')}): "
                              f"{e['capacity_gain']:.2f}x; N_full {enf.get('one_at_a_time', '-')} -> "
                              f"{enf.get('batched', '-')}."]
            elif e:
                lines += ["", f"EAGLE backend: not measured ({e.get('reason')})."]
        lines.append("")
    if report.get("targets"):
        lines += ["## Targets", ""]
        for k, v in report["targets"].items():
            met = v.get("met")
            detail = ", ".join(f"{a}={_fmt(b, '.3g') if isinstance(b, float) else b}"
                               for a, b in v.items() if a != "met")
            lines.append(f"- {k}: {'met' if met else ('n/a' if met is None else 'NOT met')} ({detail})")
        lines.append("")
    prep = report.get("section_wall_s", {}).get("models", 0.0)
    lines.append(f"Bench wall time: {report['wall_s']:.0f} s" + (f" (of which {prep:.0f} s preparing the models)"
                                                                 if prep >= 1 else "") + ".")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    """Throughput and busy fraction versus N, measured beside predicted (Agg backend, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_t, ax_b), (ax_r, ax_c) = axes
    e = report.get("emulation")
    if e:
        ns = [r["n"] for r in e["rows"]]
        ax_t.plot(ns, [r["measured"]["system_tps"] for r in e["rows"]], "o", label="measured")
        ax_t.plot(ns, [r["predicted"]["system_tps"] for r in e["rows"]], "-", label="model (measured framework costs)")
        ax_t.plot(ns, [r["predicted_nominal"]["system_tps"] for r in e["rows"]], ":", label="model (nominal)")
        ax_t.plot(ns, [r["alternatives_predicted"]["target_alone_system_tps"] for r in e["rows"]], "--",
                  color="gray", label="N targets alone, one device each (model)")
        ax_t.axvline(e["model"]["n_full"], color="k", lw=0.8, ls="--")
        ax_t.set_ylim(0, 1.15 * max(max(r["predicted"]["system_tps"], r["measured"]["system_tps"]) for r in e["rows"]))
        ax_t.set_title("EMULATION: system throughput vs N", fontsize=10)
        ax_t.set_xlabel("targets N")
        ax_t.set_ylabel("tokens/s")
        ax_t.legend(fontsize=8)
        ax_b.plot(ns, [100 * r["measured"]["busy_fraction"] for r in e["rows"]], "o", label="measured (STATS busy_s)")
        ax_b.plot(ns, [100 * r["predicted"]["busy_fraction"] for r in e["rows"]], "-", label="model")
        ax_b.axhline(95, color="gray", lw=0.8, ls=":")
        ax_b.axvline(e["model"]["n_full"], color="k", lw=0.8, ls="--", label=f"N_full = {e['model']['n_full']}")
        ax_b.set_ylim(0, 105)
        ax_b.set_title("EMULATION: draft busy fraction vs N", fontsize=10)
        ax_b.set_xlabel("targets N")
        ax_b.set_ylabel("% of wall time drafting")
        ax_b.legend(fontsize=8)
    else:
        for ax in (ax_t, ax_b):
            ax.text(0.5, 0.5, "emulation not run", ha="center", va="center")
    r = report.get("real")
    if r:
        ns = [row["n"] for row in r["rows"]]
        ax_r.plot(ns, [row["starsd"]["system_tps"] for row in r["rows"]], "o-", label="StarSD")
        ax_r.plot(ns, [row["alone"]["system_tps"] for row in r["rows"]], "s--", label="target alone")
        ax_r.plot([1], [r["colocated"]["assisted"]["tokens_per_s"]], "^", label="co-located (transformers), 1 stream")
        ax_r.set_title(f"real {r['models']['kind']} models on this CPU ({report['machine']['usable_cores']} cores "
                       "shared)", fontsize=10)
        ax_r.set_xlabel("targets N")
        ax_r.set_ylabel("system tokens/s")
        ax_r.set_ylim(bottom=0)
        ax_r.legend(fontsize=8)
    else:
        ax_r.text(0.5, 0.5, "real models not run", ha="center", va="center")
    b = report.get("batched")
    if b and b.get("available"):
        ax_c.plot([x["k"] for x in b["batched"]], [x["requests_per_s"] for x in b["batched"]], "o-",
                  label=f"batch_max {b['batch_max']}")
        if b.get("windowed"):
            ax_c.plot([x["k"] for x in b["windowed"]], [x["requests_per_s"] for x in b["windowed"]], "^-",
                      label=f"batch_max {b['batch_max']}, {b['batch_window_ms']:g} ms window")
        ax_c.plot([x["k"] for x in b["one_at_a_time"]], [x["requests_per_s"] for x in b["one_at_a_time"]], "s",
                  label="one at a time")
        ax_c.set_title(f"draft capacity, real draft model (gain {b['capacity_gain']:.1f}x at k = {b['batch_max']})",
                       fontsize=10)
        ax_c.set_xlabel("sessions waiting k")
        ax_c.set_ylabel("draft requests/s")
        ax_c.set_ylim(bottom=0)
        ax_c.legend(fontsize=8)
    else:
        ax_c.text(0.5, 0.5, "batched drafting not available" if b else "batched not run", ha="center", va="center")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_t, ax_b, ax_r, ax_c):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    m = report["machine"]
    fig.suptitle(f"StarSD bench ({report['mode']}): {m['cpu']}, {m['usable_cores']} cores, {m['accelerator']}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


