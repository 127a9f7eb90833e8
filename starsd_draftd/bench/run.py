"""`starsd-draftd bench`: StarSD's quantitative claims measured on this machine, beside the analytic
model and beside what a user would otherwise run.

Sections (each with real daemons as separate processes, real sockets on loopback):

* ``wire``: one round trip of the same bytes three ways: a raw pyzmq DEALER/ROUTER exchange, the
  full StarSD path (target-side client encode -> ROUTER -> draft daemon decode, session, encode ->
  client decode, with a zero-time emulated backend), and, as a reference only, the same payload
  serialized with torch.save / torch.load (what the paper's research code sends; pickle-based, so
  StarSD never does this -- it lives here and nowhere else).
* ``emulation``: accelerator emulation (see ``starsd_draftd.bench.emulation``): N = 1..N_max emulated
  targets against one emulated draft daemon; throughput, busy fraction, idle gaps, per-token
  latency and framework overhead, each beside the analytic model (``starsd_draftd.bench.plan``).
* ``real``: the real draft and target models on this CPU, N = 1..N_real target daemons through
  their GENERATE endpoint, beside the target alone and beside transformers' co-located
  ``generate(assistant_model=...)``.
* ``batched``: draft service capacity (requests/s with k sessions waiting) of the real draft
  model, one session at a time versus batched drafting.
* ``verify``: one target daemon with 1, 2, 4 and 8 generations at once, verified together in one
  forward versus one per forward, with drafts and alone (``starsd_draftd.bench.verify_batch``).
* ``lookahead``: lookahead off/on x adaptive depth off/on with 1 and 2 streams on one target,
  beside the target alone (``starsd_draftd.bench.lookahead``).
* ``rows``: one forward's cost against the rows it carries (1 to 32), in each weight format, in
  process on one core (``starsd_draftd.bench.rows``); ``--rows-model`` measures a real size.

Output: ``bench.json``, ``bench.png`` and ``bench.md`` in the results folder.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from starsd_draftd.bench.emulation import EMULATION_LABEL
from starsd_draftd.bench.batched import batched_section, start_batched
from starsd_draftd.bench.draft_pool import pool_daemons, pool_section
from starsd_draftd.bench.config import BenchConfig, SCHEMA, TORCH_SAVE_LABEL, batch_max_supported, describe_machine
from starsd_draftd.bench.pool import Pool
from starsd_draftd.bench.real import (INTERLEAVE_STREAMS, make_tiny_pair, quiet_transformers, real_finish,
                                      real_measure, start_real)
from starsd_draftd.bench.report import _derive, format_report, plot_report
from starsd_draftd.bench.star import emulation_section, lookahead_n_max, start_emulation
from starsd_draftd.bench.lookahead import lookahead_section, lookahead_streams, start_lookahead
from starsd_draftd.bench.rows import resolve_rows_model, row_formats, rows_section
from starsd_draftd.bench.trees import start_trees, tree_backends, trees_section
from starsd_draftd.bench.verify_batch import start_verify, verify_section, verify_streams
from starsd_draftd.bench.wire import WIRE_CASES, start_wire, wire_section

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- report
def run_bench(cfg: BenchConfig) -> dict:
    """Run the selected sections and write bench.json, bench.png and bench.md into ``cfg.out``."""
    from tqdm import tqdm

    cfg.check()
    if cfg.plot and importlib.util.find_spec("matplotlib") is None:  # fail before minutes of measurement
        raise ImportError("the bench's plot needs matplotlib: pip install matplotlib (or pass --no-plot)")
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="starsd-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    n_steps = {"wire": len(WIRE_CASES) + 1, "emulation": cfg.n_max + 1 + lookahead_n_max(cfg),
               "real": min(cfg.real_n_max, cfg.n_max) + 3 + len(INTERLEAVE_STREAMS),
               "batched": 2 * len(set(cfg.batch_ks) | {cfg.batch_max}) + 3,
               "verify": len(verify_streams(cfg)) + 1, "lookahead": len(lookahead_streams(cfg)) + 1,
               "trees": len(tree_backends(cfg)), "rows": len(row_formats()), "pool": len(pool_daemons(cfg)) + 1,
               "suffix": 4}
    bar = tqdm(total=sum(n_steps[s] for s in cfg.sections), desc="bench", unit="step", file=sys.stderr,
               disable=not cfg.progress, dynamic_ncols=True)

    def step(what: str) -> None:
        log.debug("bench step done: %s", what)
        bar.set_postfix_str(what)
        bar.update(1)

    report: dict = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if cfg.quick else "standard",
        "machine": describe_machine(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "labels": {"emulation": EMULATION_LABEL, "torch_save": TORCH_SAVE_LABEL},
        "logs": str(workdir),
    }
    report["machine"]["load_average_at_start"] = list(os.getloadavg())
    ctx = zmq.Context()
    pool = Pool(workdir, ctx, cfg.startup_timeout_s)
    walls: dict[str, float] = {}
    report["section_wall_s"] = walls

    def timed(name: str, fn):
        t0 = time.perf_counter()
        result = fn()
        walls[name] = walls.get(name, 0.0) + time.perf_counter() - t0
        log.info("bench section %s: %.1fs", name, walls[name])
        return result

    try:
        models = None
        needs_pair = cfg.rows_model == "target" and "rows" in cfg.sections
        if needs_pair or {"real", "batched", "verify", "lookahead", "trees", "suffix"} & set(cfg.sections):
            if cfg.models == "tiny":
                with quiet_transformers():
                    models = timed("models", lambda: make_tiny_pair(workdir, cfg.seed))
            else:
                from starsd_draftd.demo.checkpoints import ensure_demo_checkpoints, ensure_real_cost_draft

                # builds the demo checkpoints once (minutes) when not cached yet; reported apart from the measurement
                ensure = ensure_real_cost_draft if cfg.models == "demo-third" else ensure_demo_checkpoints
                models = timed("models", lambda: ensure(progress=cfg.progress))
        if cfg.prestart:  # every daemon starts now; their start-up overlaps earlier sections' measurements
            sel = set(cfg.sections)
            if "wire" in sel:
                start_wire(cfg, pool)
            if "emulation" in sel:
                start_emulation(cfg, pool)
            if "real" in sel:
                start_real(cfg, pool, models)
            if "batched" in sel and batch_max_supported():
                start_batched(cfg, pool, models[1])
            if "verify" in sel:
                start_verify(cfg, pool, models)
            if "lookahead" in sel:
                start_lookahead(cfg, pool, models)
            if "trees" in sel:
                start_trees(cfg, pool, models)
        if "wire" in cfg.sections:
            report["wire"] = timed("wire", lambda: wire_section(cfg, pool, step))
        if "emulation" in cfg.sections:
            report["emulation"] = timed("emulation", lambda: emulation_section(cfg, pool, step))
        if "pool" in cfg.sections:
            report["pool"] = timed("pool", lambda: pool_section(cfg, pool, step))
        real_raw = None
        if "real" in cfg.sections:
            real_raw = timed("real", lambda: real_measure(cfg, pool, step, models))
        if "batched" in cfg.sections:
            report["batched"] = timed("batched", lambda: batched_section(cfg, pool, step, models[1], models[0]))
        if real_raw is not None:
            report["real"] = timed("real", lambda: real_finish(cfg, pool, real_raw, step))
        if "verify" in cfg.sections:  # after the real section (unless prestarted, as quick runs are): cores free
            report["verify"] = timed("verify", lambda: verify_section(cfg, pool, step, models))
        if "lookahead" in cfg.sections:
            report["lookahead"] = timed("lookahead", lambda: lookahead_section(cfg, pool, step, models))
        if "trees" in cfg.sections:
            report["trees"] = timed("trees", lambda: trees_section(cfg, pool, step, models))
        if "suffix" in cfg.sections:
            from starsd_draftd.bench.suffix import suffix_section

            report["suffix"] = timed("suffix", lambda: suffix_section(cfg, pool, step, models))
        if "rows" in cfg.sections:  # last: in process, with every daemon stopped
            pool.stop_all()
            from common.models import cache_root

            rows_dir = resolve_rows_model(cfg.rows_model, models[0] if models else None, cache_root() / "bench")
            report["rows"] = timed("rows", lambda: rows_section(rows_dir, row_formats(), step, reps=cfg.rows_reps))
    finally:
        bar.close()
        pool.stop_all()
        ctx.destroy(linger=0)
    _derive(report, cfg)
    report["machine"]["load_average_at_end"] = list(os.getloadavg())
    report["wall_s"] = time.perf_counter() - t_start
    report["files"] = {"json": str(out / "bench.json"), "markdown": str(out / "bench.md")}
    if cfg.plot:
        plot_report(report, out / "bench.png")
        report["files"]["png"] = str(out / "bench.png")
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(format_report(report) + "\n")
    return report


