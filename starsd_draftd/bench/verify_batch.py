"""The verify section: one target daemon with 1, 2, 4 and 8 generations at once, their rounds
verified together in one forward (``--max-batch 8``) against one generation per forward
(``--max-batch 1``), with drafts from a draft daemon and by the target alone."""

from __future__ import annotations

from pathlib import Path

from starsd_draftd.bench.config import BenchConfig
from starsd_draftd.bench.pool import Pool, _stats
from starsd_draftd.bench.real import _phase_summary, _run_streams, bench_dtype
from starsd_draftd.demo.prompts import DEMO_PROMPTS

VERIFY_STREAMS = (1, 2, 4, 8)
QUICK_VERIFY_STREAMS = (1, 2)
MODES = (("batched", max(VERIFY_STREAMS)), ("one_at_a_time", 1))


def verify_streams(cfg: BenchConfig) -> tuple[int, ...]:
    return QUICK_VERIFY_STREAMS if cfg.quick else VERIFY_STREAMS


def start_verify(cfg: BenchConfig, pool: Pool, models: tuple[Path, Path]) -> dict[str, str]:
    """A draft daemon (batched drafting, so that it keeps up with 8 generations) and two target
    daemons of the same model that differ only in --max-batch, on the target's core; both draft
    whatever the number of generations (--draft-max-active 0), as this section measures verifying
    drafts in batches."""
    from starsd_draftd.demo.run import DemoConfig, topology

    target_dir, draft_dir = models
    topo = topology(DemoConfig(targets=1, pin=cfg.real_pin))
    dtype = bench_dtype(cfg)
    active = max(VERIFY_STREAMS)
    pool.state["verify_topology"], pool.state["verify_dtype"] = topo.describe(), dtype
    draft_ep = pool.start("verify-draftd", lambda ep: [
        "starsd_draftd.bench.emulation_serve", "serve", "--backend", "model", "--model", str(draft_dir), "--bind", ep,
        "--depth", str(cfg.depth), "--batch-max", str(active), "--q-topk", str(cfg.q_topk), "--threads", "1",
        "--dtype", dtype, "--log-level", "warning"], cpus=topo.draft)
    eps = {}
    for mode, batch in MODES:
        eps[mode] = pool.start(f"verify-target-{mode}", lambda ep, b=batch: [
            "starsd_target", "serve", "--model", str(target_dir), "--draft", draft_ep, "--listen", ep,
            "--depth", str(cfg.depth), "--threads", "1", "--dtype", dtype, "--name", f"verify-b{b}",
            "--max-active", str(active), "--max-batch", str(b), "--draft-max-active", "0",
            "--connect-timeout", str(cfg.startup_timeout_s),
            "--draft-timeout", "30", "--heartbeat", "0.5", "--log-level", "warning"], cpus=topo.targets[0],
            jobs=True)
    return eps


def verify_section(cfg: BenchConfig, pool: Pool, step, models: tuple[Path, Path]) -> dict:
    """For each number of generations g: the same g prompts sent at once to each target, with
    drafts and alone, the two targets taking turns (so drift on a shared machine hits both)."""
    eps = start_verify(cfg, pool, models)
    names = [f"verify-target-{mode}" for mode, _ in MODES]
    pool.ready("verify-draftd", *names)
    pool.procs.wait_draft_link(list(eps.values()), cfg.startup_timeout_s)
    ctx = pool.ctx
    for ep in eps.values():  # warm-up: first forwards, the pool's buffers, the draft link
        for no_draft in (False, True):
            _run_streams(ep, DEMO_PROMPTS[:2], 8, no_draft, ctx, cfg.startup_timeout_s)
    step("verify warm-up")
    rows = []
    for g in verify_streams(cfg):
        prompts = [DEMO_PROMPTS[j % len(DEMO_PROMPTS)] for j in range(g)]
        row: dict = {"generations": g}
        for no_draft, kind in ((False, "spec"), (True, "alone")):
            for mode, _ in MODES:
                s0 = _stats(eps[mode], ctx)
                run = _run_streams(eps[mode], prompts, cfg.max_tokens, no_draft, ctx, cfg.startup_timeout_s)
                s1 = _stats(eps[mode], ctx)
                summary = _phase_summary(run)
                forwards = s1.get("verify_forwards", 0) - s0.get("verify_forwards", 0)
                summary.update(verify_forwards=forwards,
                               batched_rounds=s1.get("batched_rounds", 0) - s0.get("batched_rounds", 0),
                               rounds_per_forward=summary["rounds"] / forwards if forwards else None,
                               token_ids=[j["token_ids"] for jobs in run["results"] for j in jobs])
                row[f"{kind}_{mode}"] = summary
        for kind in ("spec", "alone"):
            b, one = row[f"{kind}_batched"], row[f"{kind}_one_at_a_time"]
            row[f"{kind}_gain"] = b["system_tps"] / one["system_tps"] if one["system_tps"] else None
        # each run's outputs against the target alone, one per forward (the reference), per generation
        ref = row["alone_one_at_a_time"]["token_ids"]
        for k in ("spec", "alone"):
            for m, _ in MODES:
                got = row[f"{k}_{m}"]["token_ids"]
                row[f"{k}_{m}"]["same_as_alone_one_at_a_time"] = sum(a == b for a, b in zip(got, ref))
        row["same_tokens"] = all(row[f"{k}_{m}"]["same_as_alone_one_at_a_time"] == g
                                 for k in ("spec", "alone") for m, _ in MODES)
        for k in ("spec", "alone"):
            for m, _ in MODES:
                row[f"{k}_{m}"].pop("token_ids")
        rows.append(row)
        step(f"verify {g} generations")
    for name in ("verify-draftd", *names):
        pool.stop(name)
    return {"label": f"demo target, one target daemon ({pool.state['verify_topology']}, {pool.state['verify_dtype']}), "
                     f"{cfg.max_tokens} greedy tokens per generation, depth {cfg.depth}",
            "modes": {m: b for m, b in MODES}, "rows": rows}


def format_verify(v: dict) -> list[str]:
    lines = ["## Batched verification (one target, several generations at once)", "", f"*{v['label']}.*", "",
             "| generations | speculative, batched tok/s | one per forward | gain | rounds per forward | "
             "rounds without drafts | target alone, batched | one per forward | gain | "
             "same tokens as the target alone one per forward (spec batched / spec one / alone batched) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        sb, so, ab, ao = (r["spec_batched"], r["spec_one_at_a_time"], r["alone_batched"], r["alone_one_at_a_time"])
        rpf = sb["rounds_per_forward"]
        lines.append(f"| {r['generations']} | {sb['system_tps']:.1f} | {so['system_tps']:.1f} | "
                     f"{r['spec_gain']:.2f}x | {'-' if rpf is None else f'{rpf:.2f}'} | "
                     f"{sb['fallback_rounds']} of {sb['rounds']} / {so['fallback_rounds']} of {so['rounds']} | "
                     f"{ab['system_tps']:.1f} | {ao['system_tps']:.1f} | {r['alone_gain']:.2f}x | "
                     + " / ".join(f"{x['same_as_alone_one_at_a_time']} of {r['generations']}" for x in (sb, so, ab))
                     + " |")
    lines += ["", "Tokens are compared per generation with the target alone verifying one generation per forward. "
                  "In float32 batched forwards give the same tokens; in 16-bit dtypes a batched forward rounds "
                  "differently, and where the two best logits lie one rounding step apart the greedy token can "
                  "differ (docs/architecture.md, \"Batched verification\").", ""]
    return lines
