"""``rows``: what one forward costs against how many rows (tokens) it carries, in each weight format.

Speculation pays on a device where verifying k drafts costs about what one decoding step does. A
GPU has that for free; a CPU core has it only while the forward is bound by moving the weights
rather than by arithmetic. This section feeds 1 to 32 new tokens after a fixed context through the
model runner the daemons use (one core, the lean forward where the model allows it) in every
format this machine offers, interleaved so that a noisy neighbour slows every row count alike,
and reports each count's median time beside one row's. ``--rows-model`` picks the checkpoint: the
bench's target (the demo's 135M, or the tiny CI model), a checkpoint directory, or a random-init
checkpoint built once from a real configuration (``qwen2.5-1.5b``, ``qwen2.5-0.5b``): a forward's
cost does not depend on the weights' values.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger("starsd.bench.rows")

ROW_COUNTS = (1, 2, 4, 5, 8, 12, 16, 24, 32)
CONTEXT = 200  # cached positions before the measured forward: a round in the middle of a short reply
# Real configurations, random-initialised: the shapes a user's 1.5B target and 0.5B draft have
SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2),
}


def row_formats() -> tuple[str, ...]:
    """The weight formats this machine runs on a CPU: fp16-weights where fbgemm exists, then the
    plain ones."""
    from common.fp16_weights import FP16_WEIGHTS, fp16_weights_available

    return ((FP16_WEIGHTS,) if fp16_weights_available() else ()) + ("bfloat16", "float32")


def shape_dir(name: str, root: Path) -> Path:
    """Where ``shape_checkpoint`` keeps the named shape under ``root`` (built or not)."""
    return root / f"shape-{name}"


def shape_checkpoint(name: str, root: Path) -> Path:
    """A bfloat16 checkpoint of the named real configuration with random weights, built once
    under ``root`` (the 1.5B one is 3.1 GB on disk and takes about a minute)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}, or give a checkpoint directory")
    out = shape_dir(name, root)
    if (out / "config.json").is_file():
        return out
    cfg = Qwen2Config(vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, **SHAPES[name])
    log.info("building a random-init %s-shaped checkpoint in %s", name, out)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def resolve_rows_model(spec: str, target: Path | None, root: Path) -> Path:
    """``target``: the bench's own target checkpoint; a SHAPES name: built once under ``root``;
    else a checkpoint directory."""
    if spec == "target":
        if target is None:
            raise ValueError("--rows-model target needs the bench's models")
        return Path(target)
    if spec in SHAPES:
        return shape_checkpoint(spec, root)
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ValueError(f"--rows-model {spec!r} is neither 'target', a shape ({', '.join(SHAPES)}) nor a "
                         "checkpoint directory")
    return path


def measure_rows(model_dir: Path, dtype: str, rows: tuple[int, ...] = ROW_COUNTS, reps: int = 5,
                 context: int = CONTEXT, clock=time.perf_counter) -> dict:
    """Median time of a forward feeding each row count after ``context`` cached positions, all
    logits asked for (as a verification does), each count measured ``reps`` times in interleaved
    order after one warm-up pass. One torch thread."""
    from common.memory import describe, memory_report
    from common.models import crop_cache, load_causal_lm
    from common.runner import ModelRunner

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = load_causal_lm(str(model_dir), dtype=dtype)
        runner = ModelRunner(loaded)
        exact = runner.enable_row_exact()  # as a target verifies
        cache = runner.new_cache(context + max(rows))
        vocab = loaded.vocab_size
        ids = torch.randint(0, vocab, (context + max(rows),), generator=torch.Generator().manual_seed(0)).tolist()
        runner.forward(cache, ids[:context], logits="none")
        times: dict[int, list[float]] = {r: [] for r in rows}
        for rep in range(reps + 1):
            for r in rows:
                t0 = clock()
                runner.forward(cache, ids[context:context + r], logits="all")
                elapsed = clock() - t0
                crop_cache(cache, context)
                if rep:  # the first pass warms every shape up
                    times[r].append(elapsed)
        memory = memory_report(loaded.weights_bytes)  # after the forwards: a mapped checkpoint is paged in lazily
        log.info("rows %s: %s", dtype, describe(memory))
        ms = [statistics.median(times[r]) * 1e3 for r in rows]
        return {"dtype": loaded.dtype_name, "forward": runner.forward_kind, "row_exact": exact, "rows": list(rows), "ms": ms,
                "relative": [m / ms[0] for m in ms], "memory": memory}
    finally:
        torch.set_num_threads(previous)
        gc.collect()


def rows_section(model_dir: Path, formats: tuple[str, ...], step, reps: int = 5,
                 rows: tuple[int, ...] = ROW_COUNTS) -> dict:
    """Every format's row costs on one checkpoint (one format loaded at a time)."""
    results = []
    for dtype in formats:
        results.append(measure_rows(model_dir, dtype, rows=rows, reps=reps))
        step(f"rows {dtype}")
    return {"model": str(model_dir), "context": CONTEXT, "rows": list(rows), "formats": results}


def format_rows(section: dict) -> list[str]:
    """The section as a Markdown table: ms per forward, and its ratio to one row's."""
    rows = section["rows"]  # every format's own list is the same
    lines = [f"## One forward against its rows ({Path(section['model']).name}, one core, "
             f"{section['context']} cached positions)", "",
             "| format | forward | " + " | ".join(f"{r} rows" for r in rows) + " | resident / weights |",
             "|---|---|" + "---|" * len(rows) + "---|"]
    for f in section["formats"]:
        cells = " | ".join(f"{m:.1f} ms ({r:.2f}x)" for m, r in zip(f["ms"], f["relative"]))
        mem = f["memory"]
        ratio = f"{mem['rss_over_weights']:.2f}x" if mem["rss_over_weights"] else "n/a"
        forward = f["forward"] + (f", rows exact to {f['row_exact']}" if f.get("row_exact") else "")
        lines.append(f"| {f['dtype']} | {forward} | {cells} | {ratio} |")
    return lines + [""]
