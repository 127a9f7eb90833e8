"""The lookahead section: lookahead off/on x adaptive depth off/on, and both with fill steps, side
by side, with 1 and 2 streams on one target, beside the same target alone.

Two draft daemons (``--lookahead`` and ``--no-lookahead``) share the draft core and five target
daemons (each draft daemon x ``--adaptive-depth`` / ``--no-adaptive-depth`` without fill steps,
and lookahead, adaptive depth and ``--fill-steps``) the target core; one
runs at a time, in turns, each configuration twice in opposite orders, so drift on a shared
machine hits them alike. Each run reports its tok/s, the speedup over the target alone measured
in the same turn, tokens kept per round, the drafts asked for per round, rounds without drafts,
the lookahead's hit rate (from the draft daemon's counters) and whether the tokens equal the
target alone's. The targets run with ``--draft-max-active 0``: with the CPU default (1), two
streams on one target would run without drafts, and there would be nothing to compare."""

from __future__ import annotations

from pathlib import Path

from starsd_draftd.bench.config import BenchConfig
from starsd_draftd.bench.pool import Pool, _stats
from starsd_draftd.bench.real import _run_jobs, bench_dtype
from starsd_draftd.demo.prompts import DEMO_PROMPTS
from starsd_target.profile import merge, ms_per_round

CONFIGS = (("fixed", False, False, False), ("adaptive", False, True, False), ("lookahead", True, False, False),
           ("lookahead+adaptive", True, True, False),
           ("lookahead+adaptive+fill", True, True, True))  # (name, lookahead, adaptive depth, fill steps)
STREAMS = (1, 2)
QUICK_STREAMS = (1,)


def lookahead_streams(cfg: BenchConfig) -> tuple[int, ...]:
    return QUICK_STREAMS if cfg.quick else STREAMS


def _prompts(cfg: BenchConfig) -> list[str]:
    return list(DEMO_PROMPTS[: 2 if cfg.quick else 4])


def start_lookahead(cfg: BenchConfig, pool: Pool, models: tuple[Path, Path]) -> dict[str, str]:
    from starsd_draftd.demo.run import DemoConfig, topology

    target_dir, draft_dir = models
    topo = topology(DemoConfig(targets=1, pin=cfg.real_pin))
    dtype = bench_dtype(cfg)
    pool.state["lookahead_topology"], pool.state["lookahead_dtype"] = topo.describe(), dtype
    drafts = {}
    for on in (True, False):
        drafts[on] = pool.start(f"la-draftd-{'on' if on else 'off'}", lambda ep, on=on: [
            "starsd_draftd", "serve", "--backend", "model", "--model", str(draft_dir), "--bind", ep,
            "--depth", str(cfg.depth), "--q-topk", str(cfg.q_topk), "--threads", "1", "--dtype", dtype,
            "--lookahead" if on else "--no-lookahead", "--no-suffix",  # the draft model's rounds, ahead or not
            "--log-level", "warning"], cpus=topo.draft)
    eps = {}
    for name, la, adaptive, fill in CONFIGS:
        eps[name] = pool.start(_proc(name), lambda ep, la=la, ad=adaptive, fill=fill, n=name: [
            "starsd_target", "serve", "--model", str(target_dir), "--draft", drafts[la], "--listen", ep,
            "--depth", str(cfg.depth), "--threads", "1", "--dtype", dtype, "--name", _proc(n),
            "--adaptive-depth" if ad else "--no-adaptive-depth", "--fill-steps" if fill else "--no-fill-steps",
            "--max-active", str(max(STREAMS)),
            "--draft-max-active", "0",  # two streams draft too: this section compares ways of drafting
            "--connect-timeout", str(cfg.startup_timeout_s), "--draft-timeout", "30", "--heartbeat", "0.5",
            "--log-level", "warning"], cpus=topo.targets[0], jobs=True)
    eps["draftd-on"], eps["draftd-off"] = drafts[True], drafts[False]
    return eps


def _proc(name: str) -> str:
    """The target daemon's process name for a configuration."""
    return "la-target-" + name.replace("+", "-")


def _run(ep: str, prompts: list[str], streams: int, max_tokens: int, no_draft: bool, pool: Pool,
         cfg: BenchConfig) -> dict:
    groups = [prompts[i::streams] for i in range(streams)]
    run = _run_jobs([ep] * streams, groups, max_tokens, no_draft, pool.ctx, cfg.startup_timeout_s)
    jobs = [j for g in run["results"] for j in g]
    tokens = sum(j["stats"]["generated"] for j in jobs)
    rounds = sum(j["stats"]["rounds"] for j in jobs)
    profile = merge([j["stats"]["profile"] for j in jobs])
    return {"profile": profile, "tokens": tokens, "wall_s": run["wall_s"], "tps": tokens / run["wall_s"],
            "rounds": rounds,
            "kept_per_round": tokens / rounds if rounds else 0.0,
            "asked_per_round": sum(j["stats"].get("asked_tokens", 0) for j in jobs) / rounds if rounds else 0.0,
            "drafted_per_round": sum(j["stats"]["drafted"] for j in jobs) / rounds if rounds else 0.0,
            "fallback_rounds": sum(j["stats"]["fallback_rounds"] for j in jobs),
            "plain_rounds": sum(j["stats"].get("plain_rounds", 0) for j in jobs),
            "fill_steps": sum(j["stats"].get("fill_steps", 0) for j in jobs),
            "token_ids": [j["token_ids"] for j in jobs]}


def overlap(configs: dict) -> None:
    """Each configuration's round against the larger of drafting and verifying it: drafting is what
    drafting its rounds on request costs (the draft forward per round of the configuration without
    lookahead and with the same depth rule: lookahead's own hides what it drafted ahead), verifying
    its own target forwards per round (verification, and fill steps where it takes them). 1.0: a
    round as long as the larger of the two (drafting hidden behind the target's work, or the
    reverse); about their sum: one after the other."""
    for c in configs.values():
        partner = next((o for o in configs.values() if not o["lookahead"] and not o.get("fill_steps")
                        and o["adaptive_depth"] == c["adaptive_depth"]), None)
        drafting = None if partner is None else partner["round_ms"].get("draft_forward")
        ms = c["round_ms"]
        larger = max(drafting or 0.0, ms.get("verify_forward", 0.0) + ms.get("fill", 0.0))
        c["drafting_ms"] = drafting
        c["round_over_larger"] = ms["round"] / larger if ms and larger else None


def lookahead_section(cfg: BenchConfig, pool: Pool, step, models: tuple[Path, Path]) -> dict:
    eps = start_lookahead(cfg, pool, models)
    names = [_proc(n) for n, *_ in CONFIGS]
    pool.ready("la-draftd-on", "la-draftd-off", *names)
    pool.procs.wait_draft_link([eps[n] for n, *_ in CONFIGS], cfg.startup_timeout_s)
    prompts = _prompts(cfg)
    for name, *_ in CONFIGS:  # warm-up: first forwards and the draft link
        for no_draft in (False, True):
            _run(eps[name], prompts[:1], 1, 8, no_draft, pool, cfg)
    step("lookahead warm-up")
    repeats = cfg.repeats
    rows = []
    for s in lookahead_streams(cfg):
        runs: dict[str, list[dict]] = {n: [] for n, *_ in CONFIGS}
        alone_runs: list[dict] = []
        for rep in range(repeats):
            order = list(CONFIGS) if rep % 2 == 0 else list(reversed(CONFIGS))
            for name, la, *_ in order:
                d0 = _stats(eps["draftd-on" if la else "draftd-off"], pool.ctx)
                r = _run(eps[name], prompts, s, cfg.max_tokens, False, pool, cfg)
                d1 = _stats(eps["draftd-on" if la else "draftd-off"], pool.ctx)
                r["lookahead"] = {k: d1["lookahead"][k] - d0["lookahead"][k] for k in d1["lookahead"]}
                runs[name].append(r)
                # the target alone in the same turn, on the same target daemon's core
                alone_runs.append(_run(eps[name], prompts, s, cfg.max_tokens, True, pool, cfg))
        ref = alone_runs[0]["token_ids"]
        alone_tps = sum(a["tps"] for a in alone_runs) / len(alone_runs)
        row: dict = {"streams": s, "alone_tps": alone_tps,
                     "alone_same": all(a["token_ids"] == ref for a in alone_runs), "configs": {}}
        for name, la, adaptive, fill in CONFIGS:
            rs = runs[name]
            tps = sum(r["tps"] for r in rs) / len(rs)
            hits = sum((r["lookahead"]["hits"] + r["lookahead"]["late_hits"]) for r in rs)
            tried = sum((r["lookahead"]["hits"] + r["lookahead"]["late_hits"] + r["lookahead"]["misses"]) for r in rs)
            row["configs"][name] = {
                "lookahead": la, "adaptive_depth": adaptive, "fill_steps": fill, "tps": tps, "speedup": tps / alone_tps,
                "fills": sum(r["fill_steps"] for r in rs),
                "tps_runs": [r["tps"] for r in rs],
                "round_ms": ms_per_round(merge([r["profile"] for r in rs])),
                "kept_per_round": sum(r["tokens"] for r in rs) / max(1, sum(r["rounds"] for r in rs)),
                "asked_per_round": sum(r["asked_per_round"] for r in rs) / len(rs),
                "drafted_per_round": sum(r["drafted_per_round"] for r in rs) / len(rs),
                "fallback_rounds": sum(r["fallback_rounds"] for r in rs), "rounds": sum(r["rounds"] for r in rs),
                "plain_rounds": sum(r["plain_rounds"] for r in rs),
                "hit_rate": hits / tried if tried else None,
                "late_hits": sum(r["lookahead"]["late_hits"] for r in rs),
                "idle_s": sum(r["lookahead"]["idle_s"] for r in rs),
                "same_as_alone": sum(a == b for r in rs for a, b in zip(r["token_ids"], ref)),
                "of": sum(len(r["token_ids"]) for r in rs)}
        overlap(row["configs"])
        fixed = row["configs"]["fixed"]["speedup"]
        for c in row["configs"].values():
            c["speedup_vs_fixed"] = c["speedup"] / fixed if fixed else None
        rows.append(row)
        step(f"lookahead {s} stream(s)")
    for name in ("la-draftd-on", "la-draftd-off", *names):
        pool.stop(name)
    return {"label": f"{cfg.models} target and draft ({pool.state['lookahead_topology']}, {pool.state['lookahead_dtype']}), "
                     f"{len(prompts)} greedy prompts of {cfg.max_tokens} tokens per run, depth at most {cfg.depth}, "
                     f"each configuration {repeats} run(s) in alternating order, the target alone after each",
            "rows": rows}


def format_lookahead(v: dict) -> list[str]:
    lines = ["## Lookahead and adaptive depth (one target, 1 and 2 streams)", "", f"*{v['label']}.*", "",
             "| streams | configuration | tok/s | speedup over the target alone | over fixed depth | "
             "tokens kept per round | drafts asked per round | drafts sent per round | lookahead hit rate | "
             "fallback rounds | rounds on the target alone by choice | fill steps | same tokens as the target alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        lines.append(f"| {r['streams']} | target alone | {r['alone_tps']:.1f} | 1.00x | - | 1.00 | - | - | - | - | - | "
                     f"- | (reference) |")
        for name, c in r["configs"].items():
            hit = "-" if c["hit_rate"] is None else f"{100 * c['hit_rate']:.0f}%"
            lines.append(f"| {r['streams']} | {name} | {c['tps']:.1f} | {c['speedup']:.2f}x | "
                         f"{c['speedup_vs_fixed']:.2f}x | {c['kept_per_round']:.2f} | {c['asked_per_round']:.2f} | "
                         f"{c['drafted_per_round']:.2f} | "
                         f"{hit} | {c['fallback_rounds']} of {c['rounds']} | {c['plain_rounds']} of {c['rounds']} | "
                         f"{c.get('fills', 0)} | {c['same_as_alone']} of {c['of']} |")
    lines += ["", "Where a round's time goes (milliseconds per round, from the target's round profile):", "",
              "| streams | configuration | round | draft wait | of which drafting | of which wire | verification | "
              "fill steps | round over the larger of drafting and the target's forwards |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        for name, c in r["configs"].items():
            ms = c.get("round_ms") or {}
            if not ms:
                continue
            ratio = "-" if c.get("round_over_larger") is None else f"{c['round_over_larger']:.2f}"
            lines.append(f"| {r['streams']} | {name} | {ms['round']:.1f} | {ms['draft_wait']:.1f} | "
                         f"{ms['draft_forward']:.1f} | {ms['wire']:.1f} | {ms['verify_forward']:.1f} | "
                         f"{ms.get('fill', 0.0):.1f} | {ratio} |")
    lines += ["", "Drafting, in the last column: a round's drafts made on request (the draft forward per round "
                  "of the same depth rule without lookahead); the target's forwards: its verification and fill "
                  "steps; 1.00 is a round as long as the larger of the two, about their sum is one after the other. "
                  "A round here is a draft request's: its fill steps are within it.",
              "", "Drafts asked: the length a round asked for (with adaptive depth on a daemon that stops "
                  "chains itself, the cap); sent: the drafts that came.",
              "", "Rounds count the fill steps (a target step taken while drafts were on their way), so tokens "
                  "kept per round are per target forward.",
              "", "Hit rate: requests answered from work drafted ahead (late hits, finished on arrival, "
                  "included) over the requests checked against it.", ""]
    return lines
