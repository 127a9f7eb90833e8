"""The bench's configuration, its sections, and a description of the machine it ran on."""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from starsd_draftd.bench import plan as plan_mod


SCHEMA = "starsd-bench/1"
SECTIONS = ("wire", "emulation", "pool", "real", "batched", "verify", "lookahead", "trees", "rows", "suffix")
# sections a quick (CI) run leaves out: the suffix section needs a chat model (the demo's) and its peer a C++ build
NOT_QUICK = ("suffix",)
GAP_EDGES_MS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
TORCH_SAVE_LABEL = ("reference only: the same payload as a torch.save/torch.load (pickle) blob, as the paper's "
                    "research code sends it; StarSD never unpickles network input")


# ---------------------------------------------------------------- configuration
@dataclass
class BenchConfig:
    out: Path = Path("results")
    quick: bool = False
    sections: tuple[str, ...] = SECTIONS
    seed: int = 0
    depth: int = 4
    # emulation: S(d) = draft_base_ms + draft_per_token_ms * d, V, R, acceptance, V1
    n_max: int = 16
    draft_base_ms: float = 4.0
    draft_per_token_ms: float = 4.0
    verify_ms: float = 40.0
    rtt_ms: float = 4.0
    single_ms: float | None = None
    acceptance: float = 0.8
    guess_rate: float = 0.8  # emulation with lookahead: the drafter's guess of the token after an all-kept round
    min_rounds: int = 500  # rounds per N (all targets together): sampling error of tokens per round ~2% (1 sd)
    min_window_s: float = 2.0
    max_window_s: float = 40.0
    warmup_s: float = 0.3
    calib_rounds: int = 100
    capacity_s: float = 3.0
    # wire
    wire_rounds: int = 2000
    wire_paced_rounds: int = 200
    wire_gap_ms: float = 10.0
    wire_blocks: int = 10  # the paths compared alternate in this many blocks
    feature_size: int = 4096  # EAGLE drafting for a 7B-class target
    feature_rows: int = 3
    q_topk: int = 32
    tree_topk: int = 8  # the trees section's branching (the draft daemons' --tree-topk)
    # real models
    # "demo": the demo checkpoints (SmolLM2 + its draft); "demo-third": the demo target and its real-cost
    # draft (a third of its layers); "tiny": random tiny checkpoints (CI)
    models: str = "demo"
    dtype: str = "auto"  # the daemons' --dtype in the sections with real models (auto: ``bench_dtype``)
    real_n_max: int = 2  # SmolLM2 on a CPU: each extra target shares the targets' cores
    jobs_per_target: int = 2
    max_tokens: int = 64
    repeats: int = 2  # lookahead section: runs of each configuration, in alternating order
    real_pin: bool = True  # with 2+ cores: the draft daemon and the targets on disjoint cores (as separate machines)
    real_batch_max: int = 1  # the draft daemon of the real section serves one session at a time, as the model assumes
    # batched drafting
    batch_max: int = 8
    batch_ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_window_ms: float = 2.0  # the windowed batched daemon's --batch-window-ms
    # one forward against its rows (starsd_draftd.bench.rows)
    rows_model: str = "target"  # "target": the bench's target; a shape name (qwen2.5-1.5b); a checkpoint directory
    rows_reps: int = 5
    # run
    progress: bool = True
    plot: bool = True
    prestart: bool = False  # start every daemon at once (quick runs: faster, but start-up disturbs measurements)
    workdir: Path | None = None
    startup_timeout_s: float = 300.0

    @classmethod
    def quick_config(cls, **overrides) -> "BenchConfig":
        """A few seconds of measurement, N up to 3, tiny random models: for CI."""
        base = dict(quick=True, n_max=3, min_rounds=30, min_window_s=0.4, max_window_s=1.0, warmup_s=0.15,
                    calib_rounds=10, capacity_s=0.4, wire_rounds=200, wire_paced_rounds=15, wire_gap_ms=5.0,
                    models="tiny", real_n_max=2, jobs_per_target=1, max_tokens=24, batch_ks=(1, 8), prestart=True,
                    repeats=1, rows_reps=1, sections=tuple(s for s in SECTIONS if s not in NOT_QUICK))
        base.update(overrides)
        return cls(**base)

    def emulation_plan(self) -> plan_mod.Plan:
        return plan_mod.Plan(verify_ms=self.verify_ms, rtt_ms=self.rtt_ms, depth=self.depth, acceptance=self.acceptance,
                             draft_base_ms=self.draft_base_ms, draft_per_token_ms=self.draft_per_token_ms,
                             single_ms=self.single_ms)

    def check(self) -> None:
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown bench sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
        if self.models not in ("demo", "demo-third", "tiny"):
            raise ValueError("models must be 'demo', 'demo-third' or 'tiny'")
        if "suffix" in self.sections and self.models == "tiny":
            raise ValueError("the suffix section sends chat requests: it needs the demo models (--models demo)")
        if self.n_max < 1 or self.real_n_max < 1:
            raise ValueError("N must be >= 1")
        self.emulation_plan()  # validates the timing parameters


# ---------------------------------------------------------------- the machine
def describe_machine() -> dict:
    cpu = platform.processor() or "unknown"
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown", "", "x86_64"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    import transformers

    accel = "none (CPU only)"
    if torch.cuda.is_available():
        accel = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "virtualized": " hypervisor" in flags,
        "memory_gib": mem_gib,
        "accelerator": accel,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "torch_threads_per_process": 1,
    }


def batch_max_supported() -> bool:
    """Whether this draft daemon has batched drafting (ServerConfig.batch_max)."""
    from starsd_draftd.server import ServerConfig

    return "batch_max" in {f.name for f in dataclasses.fields(ServerConfig)}


