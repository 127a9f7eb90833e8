"""The batched section: draft service capacity with k sessions waiting, one at a time versus batched."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from starsd_draftd.bench.config import BenchConfig, batch_max_supported
from starsd_draftd.bench.pool import Pool, measure_capacity
from starsd_draftd.bench.real import quiet_transformers

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- batched drafting
def start_batched(cfg: BenchConfig, pool: Pool, draft_dir: Path) -> tuple[str, dict[str, str]]:
    """Draft daemons with the real draft model, all through the same traced launcher and
    DraftServer: one session at a time (the real section's when it runs), batch_max at a time
    strictly work-conserving, and batch_max at a time with a batch window. All three draft with the
    model alone (--no-suffix), so that they do the same work per request: a request whose drafts
    come from the context costs the one-at-a-time loop fewer forwards, the batched one no fewer."""
    def args(b: int, window_ms: float = 0.0):
        return lambda ep: ["starsd_draftd.bench.emulation_serve", "serve", "--backend", "model", "--model", str(draft_dir),
                           "--bind", ep, "--depth", str(cfg.depth), "--batch-max", str(b), "--batch-window-ms",
                           str(window_ms), "--q-topk", str(cfg.q_topk), "--threads", "1", "--no-suffix",
                           "--log-level", "warning"]

    one_name = "batch1-draftd"
    b = cfg.batch_max
    return one_name, {"one": pool.start(one_name, args(1)),
                      "batched": pool.start(f"batch{b}-draftd", args(b)),
                      "windowed": pool.start(f"batch{b}-window-draftd", args(b, cfg.batch_window_ms))}


def random_eagle_head(target_dir: Path, out: Path, seed: int = 0) -> Path:
    """An EAGLE head with random weights, shaped for ``target_dir`` and written in EAGLE's layout:
    enough to time the EAGLE backend (not to draft well)."""
    from transformers import AutoConfig

    from starsd_draftd.backends.eagle_compat import build_head
    from starsd_draftd.demo.eagle_train import head_config_for, save_eagle_head

    if (out / "config.json").is_file():
        return out
    target = AutoConfig.from_pretrained(str(target_dir))
    config = head_config_for(target, int(target.hidden_size), int(target.vocab_size))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = build_head(config, bias=True)
    return save_eagle_head(head, config, out)


def eagle_capacity(cfg: BenchConfig, pool: Pool, step, target_dir: Path) -> dict:
    """The EAGLE backend's capacity with batch_max sessions waiting, one session at a time and
    batched (with the batch window), each request carrying the target features it needs."""
    if importlib.util.find_spec("eagle") is None:
        step("batched eagle (not installed)")
        step("batched eagle (not installed)")
        return {"available": False, "reason": "eagle-llm is not installed (pip install --no-deps eagle-llm==1.2.1)"}
    from starsd_draftd.backends.eagle import EagleBackend

    with quiet_transformers():
        head_dir = random_eagle_head(target_dir, pool.workdir / "eagle-head", cfg.seed)
        probe = EagleBackend.from_dirs(head_dir, target_dir, dtype="float32")
    vocab, fingerprint, hidden = probe.vocab_size, probe.fingerprint, probe.feature_size
    del probe
    b = cfg.batch_max

    def args(batch: int, window_ms: float):
        return lambda ep: ["starsd_draftd.bench.emulation_serve", "serve", "--backend", "eagle", "--eagle-head", str(head_dir),
                           "--model", str(target_dir), "--bind", ep, "--depth", str(cfg.depth), "--batch-max",
                           str(batch), "--batch-window-ms", str(window_ms), "--q-topk", str(cfg.q_topk),
                           "--threads", "1", "--log-level", "warning"]

    runs = {}
    for label, batch, window in (("one", 1, 0.0), ("windowed", b, cfg.batch_window_ms)):
        name = f"eagle-batch{batch}-draftd"
        ep = pool.start(name, args(batch, window))
        pool.ready(name)
        runs[label] = measure_capacity(ep, b, cfg.depth, cfg.capacity_s, pool.ctx, vocab_size=vocab,
                                       fingerprint=fingerprint, seed=cfg.seed + b, feature_size=hidden)
        pool.stop(name)
        step(f"batched eagle {label} k={b}")
    one, win = runs["one"], runs["windowed"]
    return {
        "available": True,
        "label": ("EAGLE head with random weights shaped for the target (timing only), k sessions always waiting, "
                  "each request carrying its float16 target features"),
        "hidden_size": hidden,
        "one_at_a_time": one,
        "windowed": win,
        "capacity_gain": win["requests_per_s"] / one["requests_per_s"],
        "service_ms_per_request_one_at_a_time": 1000.0 / one["requests_per_s"],
        "service_ms_per_request_batched": 1000.0 / win["requests_per_s"],
    }


def batched_section(cfg: BenchConfig, pool: Pool, step, draft_dir: Path, target_dir: Path) -> dict:
    """Capacity of the real draft model one session at a time and with batch_max (without and
    with a batch window), and of the EAGLE backend for the target."""
    if not batch_max_supported():
        step("batched (not available)")
        return {"available": False,
                "reason": "this draft daemon has no batched drafting (ServerConfig has no batch_max)"}
    from common.models import load_causal_lm

    with quiet_transformers():
        loaded = load_causal_lm(str(draft_dir))
    vocab, fingerprint = loaded.vocab_size, loaded.fingerprint
    del loaded

    b = cfg.batch_max
    one_name, eps = start_batched(cfg, pool, draft_dir)
    pool.ready(one_name, f"batch{b}-draftd", f"batch{b}-window-draftd")
    ks = sorted(set(cfg.batch_ks) | {b})
    runs: dict[str, list[dict]] = {}
    for label, ep in eps.items():
        runs[label] = []
        for k in ([b] if label == "one" else ks):
            runs[label].append(measure_capacity(ep, k, cfg.depth, cfg.capacity_s, pool.ctx, vocab_size=vocab,
                                                fingerprint=fingerprint, seed=cfg.seed + k))
            step(f"batched {label} k={k}")
    pool.stop(f"batch{b}-draftd")
    pool.stop(f"batch{b}-window-draftd")
    pool.stop(one_name)
    one = runs["one"][0]

    def at_k(label: str) -> dict:
        return next(r for r in runs[label] if r["k"] == b)

    def gain(label: str) -> float:
        return at_k(label)["requests_per_s"] / one["requests_per_s"]

    best = max(runs["windowed"] + runs["batched"], key=lambda r: r["requests_per_s"])
    eagle = eagle_capacity(cfg, pool, step, target_dir)
    return {
        "available": True,
        "label": "real draft model on this CPU, k sessions always waiting (closed loop, real client and protocol)",
        "batch_max": b,
        "batch_window_ms": cfg.batch_window_ms,
        "one_at_a_time": runs["one"],
        "batched": runs["batched"],
        "windowed": runs["windowed"],
        "capacity_gain": gain("windowed"),
        "capacity_gain_work_conserving": gain("batched"),
        "capacity_gain_best": {"k": best["k"], "gain": best["requests_per_s"] / one["requests_per_s"],
                               "mean_batch": best["mean_batch"]},
        "service_ms_per_request_one_at_a_time": 1000.0 / one["requests_per_s"],
        "service_ms_per_request_batched": 1000.0 / at_k("windowed")["requests_per_s"],
        "target": {"capacity_gain_min": 3.0, "met": gain("windowed") >= 3.0,
                   "measured_with": f"batch_max {b}, batch window {cfg.batch_window_ms:g} ms"},
        "eagle": eagle,
    }


