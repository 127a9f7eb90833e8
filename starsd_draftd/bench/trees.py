"""The trees section: chains against draft trees of 8, 16, 32 and 60 tokens, for the demo
target's EAGLE-1 and EAGLE-3 heads (trained with the same budget on the same text) and for the
draft model, on one target, one stream, beside the same target alone.

Per backend one draft daemon (``--tree-topk``; ``--no-lookahead --no-suffix``: the drafter's own
chains and trees, every round) on the draft core and one target daemon
(``--draft-tokens`` the largest budget) on the target core; each budget is a per-request cap
(``max_draft_tokens``: at the depth, a chain; above it, a tree of at most that many tokens).
The budgets run in turns, twice in opposite orders, the target alone after each run. A row
reports tokens kept per round, the daemon's drafting time per round as it reported it, the
target's verification forward per round, tok/s, the speedup over the target alone measured in
the same turn, rounds without drafts and whether the tokens equal the target alone's."""

from __future__ import annotations

from pathlib import Path

from starsd_draftd.bench.config import BenchConfig
from starsd_draftd.bench.real import _run_jobs, bench_dtype
from starsd_draftd.demo.prompts import DEMO_PROMPTS

BUDGETS = (8, 16, 32, 60)
QUICK_BUDGETS = (8,)


def tree_budgets(cfg: BenchConfig) -> tuple[int, ...]:
    return QUICK_BUDGETS if cfg.quick else BUDGETS


def tree_backends(cfg: BenchConfig) -> tuple[str, ...]:
    """The EAGLE heads are the demo target's trained ones; the tiny random pair has none."""
    return ("model",) if cfg.models == "tiny" else ("eagle", "eagle3", "model")


def start_trees(cfg: BenchConfig, pool, models: tuple[Path, Path]) -> dict[str, str]:
    from starsd_draftd.demo.run import DemoConfig, topology

    target_dir, draft_dir = models
    topo = topology(DemoConfig(targets=1, pin=cfg.real_pin))
    dtype = bench_dtype(cfg)
    pool.state["trees_topology"], pool.state["trees_dtype"] = topo.describe(), dtype
    most = max(tree_budgets(cfg))
    eps = {}
    for backend in tree_backends(cfg):
        if backend == "eagle":
            from starsd_draftd.demo.eagle_train import ensure_demo_eagle_head

            drafter = ["--backend", "eagle", "--eagle-head", str(ensure_demo_eagle_head(progress=cfg.progress)),
                       "--base-model", str(target_dir)]
        elif backend == "eagle3":
            from starsd_draftd.demo.eagle3_train import ensure_demo_eagle3_head

            drafter = ["--backend", "eagle3", "--eagle-head", str(ensure_demo_eagle3_head(progress=cfg.progress)),
                       "--base-model", str(target_dir)]
        else:
            drafter = ["--backend", "model", "--model", str(draft_dir)]
        draft = pool.start(f"tree-draftd-{backend}", lambda ep, d=drafter: [
            "starsd_draftd", "serve", *d, "--bind", ep, "--depth", str(cfg.depth), "--q-topk", str(cfg.q_topk),
            "--threads", "1", "--dtype", dtype, "--tree-topk", str(cfg.tree_topk), "--no-lookahead", "--no-suffix",
            "--max-tree-tokens", str(most), "--log-level", "warning"], cpus=topo.draft)
        eps[backend] = pool.start(f"tree-target-{backend}", lambda ep, d=draft, b=backend: [
            "starsd_target", "serve", "--model", str(target_dir), "--draft", d, "--listen", ep,
            "--depth", str(cfg.depth), "--draft-tokens", str(most), "--threads", "1", "--dtype", dtype,
            "--name", f"tree-{b}", "--no-adaptive-depth", "--max-active", "1",
            "--connect-timeout", str(cfg.startup_timeout_s), "--draft-timeout", "30", "--heartbeat", "0.5",
            "--log-level", "warning"], cpus=topo.targets[0], jobs=True)
    return eps


def _run(ep: str, prompts: list[str], budget: int | None, pool, cfg: BenchConfig) -> dict:
    extra = {"max_draft_tokens": budget} if budget is not None else {"no_draft": True}
    run = _run_jobs([ep], [prompts], cfg.max_tokens, budget is None, pool.ctx, cfg.startup_timeout_s, extra=extra)
    jobs = run["results"][0]
    tokens = sum(j["stats"]["generated"] for j in jobs)
    rounds = sum(j["stats"]["rounds"] for j in jobs)
    prof = [j["stats"].get("profile", {}) for j in jobs]
    drafted = sum(p.get("counts", {}).get("draft_forward", 0) for p in prof)
    return {"tokens": tokens, "rounds": rounds, "wall_s": run["wall_s"], "tps": tokens / run["wall_s"],
            "draft_s": sum(p.get("seconds", {}).get("draft_forward", 0.0) for p in prof), "draft_rounds": drafted,
            "verify_s": sum(p.get("seconds", {}).get("verify_forward", 0.0) for p in prof),
            "fallback_rounds": sum(j["stats"]["fallback_rounds"] for j in jobs),
            "tree_rounds": sum(j["stats"].get("tree_rounds", 0) for j in jobs),
            "drafted": sum(j["stats"]["drafted"] for j in jobs),
            "token_ids": [j["token_ids"] for j in jobs]}


def trees_section(cfg: BenchConfig, pool, step, models: tuple[Path, Path]) -> dict:
    eps = start_trees(cfg, pool, models)
    backends = tree_backends(cfg)
    names = [n for b in backends for n in (f"tree-draftd-{b}", f"tree-target-{b}")]
    pool.ready(*names)
    pool.procs.wait_draft_link([eps[b] for b in backends], cfg.startup_timeout_s)
    prompts = list(DEMO_PROMPTS[: 2 if cfg.quick else 4])
    configs = [("chain", cfg.depth)] + [(f"tree {b}", b) for b in tree_budgets(cfg)]
    repeats = 1 if cfg.quick else 2
    rows = []
    for backend in backends:
        ep = eps[backend]
        for budget in (cfg.depth, max(tree_budgets(cfg)), None):  # warm-up: first forwards, the link
            _run(ep, prompts[:1], budget, pool, cfg)
        runs: dict[str, list[dict]] = {n: [] for n, _ in configs}
        alone: list[dict] = []
        for rep in range(repeats):
            for name, budget in (configs if rep % 2 == 0 else configs[::-1]):
                runs[name].append(_run(ep, prompts, budget, pool, cfg))
                alone.append(_run(ep, prompts, None, pool, cfg))
        ref = alone[0]["token_ids"]
        alone_tps = sum(a["tps"] for a in alone) / len(alone)
        row = {"backend": backend, "alone_tps": alone_tps, "alone_same": all(a["token_ids"] == ref for a in alone),
               "configs": {}}
        for name, budget in configs:
            rs = runs[name]
            rounds = sum(r["rounds"] for r in rs)
            tps = sum(r["tps"] for r in rs) / len(rs)
            row["configs"][name] = {
                "budget": budget, "tps": tps, "speedup": tps / alone_tps, "tps_runs": [r["tps"] for r in rs],
                "kept_per_round": sum(r["tokens"] for r in rs) / max(1, rounds), "rounds": rounds,
                "drafted_per_round": sum(r["drafted"] for r in rs) / max(1, rounds),
                "draft_ms": 1000 * sum(r["draft_s"] for r in rs) / max(1, sum(r["draft_rounds"] for r in rs)),
                "verify_ms": 1000 * sum(r["verify_s"] for r in rs) / max(1, rounds),
                "fallback_rounds": sum(r["fallback_rounds"] for r in rs),
                "tree_rounds": sum(r["tree_rounds"] for r in rs),
                "same_as_alone": sum(a == b for r in rs for a, b in zip(r["token_ids"], ref)),
                "of": sum(len(r["token_ids"]) for r in rs)}
        chain = row["configs"]["chain"]["kept_per_round"]
        for c in row["configs"].values():
            c["kept_vs_chain"] = c["kept_per_round"] / chain if chain else None
        rows.append(row)
        step(f"trees {backend}")
    for name in names:
        pool.stop(name)
    return {"label": f"{cfg.models} target ({pool.state['trees_topology']}, {pool.state['trees_dtype']}), "
                     f"{len(prompts)} greedy prompts of {cfg.max_tokens} tokens per run, depth {cfg.depth}, "
                     f"tree branching {cfg.tree_topk}, each budget {repeats} run(s) in alternating order, the "
                     f"target alone after each",
            "rows": rows}


def format_trees(v: dict) -> list[str]:
    lines = ["## Draft trees against chains (one target, one stream)", "", f"*{v['label']}.*", "",
             "| drafter | drafts | tokens kept per round | over the chain | draft tokens per round | "
             "drafting per round (ms) | verify forward per round (ms) | tok/s | speedup over the target alone | "
             "rounds without drafts | same tokens as the target alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        lines.append(f"| {r['backend']} | target alone | 1.00 | - | - | - | - | {r['alone_tps']:.1f} | 1.00x | - | "
                     f"(reference) |")
        for name, c in r["configs"].items():
            lines.append(f"| {r['backend']} | {name} | {c['kept_per_round']:.2f} | {c['kept_vs_chain']:.2f}x | "
                         f"{c['drafted_per_round']:.1f} | {c['draft_ms']:.1f} | {c['verify_ms']:.1f} | "
                         f"{c['tps']:.1f} | {c['speedup']:.2f}x | {c['fallback_rounds']} of {c['rounds']} | "
                         f"{c['same_as_alone']} of {c['of']} |")
    lines += ["", "Drafting per round: the draft daemon's backend call as it reported it to the target; "
                  "verify forward: the target's forward over the round's drafts.", ""]
    return lines
