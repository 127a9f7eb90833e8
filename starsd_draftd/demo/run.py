"""`starsd-draftd demo`: one draft daemon and N target daemons as separate processes on loopback,
a short workload run with speculation and again by the targets alone, and a table of both."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from common.control import ControlClient
from common.protocol import Message, MsgType
from common.sockets import free_tcp_endpoint
from starsd_draftd.bench.procs import ProcessSet
from starsd_draftd.demo.prompts import DEMO_PROMPTS

log = logging.getLogger("starsd.demo")


@dataclass
class DemoConfig:
    targets: int = 2
    prompts_per_target: int = 2
    max_tokens: int = 64
    depth: int = 4
    draft_model: str = "demo-draft"
    target_model: str = "demo"
    device: str = "cpu"
    temperature: float = 0.0
    backend: str = "model"  # "eagle" runs the EAGLE head, then the standalone draft, then the targets alone;
    # "eagle3" the EAGLE-3 head, then the EAGLE-1 head, then the standalone draft
    dtype: str = "auto"  # auto: see demo_dtype
    pin: bool = True  # with 2+ cores: the draft daemon and the targets on disjoint cores, as separate machines
    suffix: bool = True  # drafts may come from text already seen (starsd-draftd serve --suffix)
    draft_vocab: bool = True  # the draft's output layer cut to the demo's vocabulary file (serve --draft-vocab)
    startup_timeout_s: float = 300.0
    job_timeout_s: float = 300.0
    workdir: Path | None = None


@dataclass
class Phase:
    wall_s: float = 0.0
    per_target: list[dict] = field(default_factory=list)  # summed stats per target
    draft_busy: float | None = None
    from_context: float | None = None  # share of the draft tokens sent as suffix drafts (None: suffix off)


def _run_phase(endpoints: list[str], cfg: DemoConfig, no_draft: bool, ctx: zmq.Context,
               draft_ep: str | None) -> Phase:
    phase = Phase(per_target=[{} for _ in endpoints])
    failures: list[BaseException] = []

    def worker(i: int, ep: str) -> None:
        acc = {"tokens": 0, "wall_s": 0.0, "rounds": 0, "drafted": 0, "accepted": 0, "fallback_rounds": 0,
               "plain_rounds": 0, "texts": []}
        try:
            with ControlClient(ep, ctx) as cc:
                for j in range(cfg.prompts_per_target):
                    prompt = DEMO_PROMPTS[(i * cfg.prompts_per_target + j) % len(DEMO_PROMPTS)]
                    rid = j + 1
                    msg = Message(MsgType.GENERATE, {"id": rid, "prompt": prompt, "max_tokens": cfg.max_tokens,
                                                     "temperature": cfg.temperature, "seed": 1000 * i + j,
                                                     "no_draft": no_draft})
                    stats = cc.call(msg, cfg.job_timeout_s).header
                    s = stats["stats"]
                    acc["tokens"] += s["generated"]
                    acc["wall_s"] += s["wall_s"]
                    for k in ("rounds", "drafted", "accepted", "fallback_rounds", "plain_rounds"):
                        acc[k] += s.get(k, 0)
                    acc["texts"].append(stats["text"])
        except BaseException as exc:  # reported to the caller below
            failures.append(exc)
        phase.per_target[i] = acc

    busy0 = None
    if draft_ep is not None:
        with ControlClient(draft_ep, ctx) as cc:
            busy0 = cc.stats()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i, ep)) for i, ep in enumerate(endpoints)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    phase.wall_s = time.perf_counter() - t0
    if failures:
        raise RuntimeError(f"a demo job failed: {failures[0]}") from failures[0]
    if busy0 is not None:
        with ControlClient(draft_ep, ctx) as cc:
            busy1 = cc.stats()
        phase.draft_busy = (busy1["busy_s"] - busy0["busy_s"]) / max(1e-9, busy1["uptime_s"] - busy0["uptime_s"])
        if "bytes" in busy1.get("suffix", {}):  # the share of draft tokens sent as whole suffix drafts
            copied = busy1["suffix"]["tokens"] - busy0["suffix"]["tokens"]
            drafted = busy1["drafted_tokens"] - busy0["drafted_tokens"]
            phase.from_context = copied / drafted if drafted else None
    return phase


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AMX or AVX512-BF16): then a forward over a few
    tokens costs about what one token does, and bf16 is the faster dtype for the demo's models."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def demo_dtype(cfg: DemoConfig) -> str:
    """What ``auto`` means for the demo's daemons on a CPU: float16 weights through fbgemm (x86, PyPI's aarch64 builds),
    else bfloat16 where the CPU computes it natively, else float32. In each, a forward over a few
    tokens costs about what one does, so verifying drafts is nearly free. fp16-weights comes first
    because it computes in float32: a 5-token verification and a 1-token step round alike, so
    greedy speculation gives the target alone's tokens, where bfloat16's coarse logits put top-2
    ties one rounding step apart and the two forwards break them differently. It was also the
    faster of the two on a 2-vCPU Xeon with AMX (demo target at 200 cached positions, one core,
    interleaved medians: one token 58 ms against 75 ms in bfloat16, five tokens 79 against 84)."""
    from common.fp16_weights import FP16_WEIGHTS, fp16_weights_available

    if cfg.dtype != "auto" or cfg.device != "cpu":
        return cfg.dtype
    if fp16_weights_available():
        return FP16_WEIGHTS
    return "bfloat16" if cpu_has_native_bf16() else "auto"


@dataclass(frozen=True)
class Topology:
    """Which cores each daemon runs on (None: unpinned, shared)."""

    draft: tuple[int, ...] | None
    targets: list[tuple[int, ...] | None]

    def describe(self) -> str:
        if self.draft is None:
            return "all daemons share every core (unpinned)"
        tcores = sorted({c for t in self.targets for c in t})
        return (f"draft daemon pinned to core {','.join(map(str, self.draft))}; "
                f"targets to core{'s' if len(tcores) > 1 else ''} {','.join(map(str, tcores))} "
                "(the target-alone baseline runs on the same cores)")


def topology(cfg: DemoConfig, cpus: list[int] | None = None) -> Topology:
    """With 2 or more cores and pinning on: the first core for the draft daemon, the others dealt to
    the targets in turn, so draft and targets never compete for a core, as on separate machines."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if not cfg.pin or len(cpus) < 2:
        return Topology(None, [None] * cfg.targets)
    rest = cpus[1:]
    return Topology((cpus[0],), [(rest[i % len(rest)],) for i in range(cfg.targets)])


def _draftd_args(cfg: DemoConfig, backend: str, endpoint: str) -> list[str]:
    args = ["starsd_draftd", "serve", "--bind", endpoint, "--depth", str(cfg.depth), "--device", cfg.device,
            "--threads", "1", "--dtype", demo_dtype(cfg)]
    if backend in ("eagle", "eagle3"):
        head = "demo-eagle" if backend == "eagle" else "demo-eagle3"
        return args + ["--backend", backend, "--eagle-head", head, "--base-model", cfg.target_model]
    return (args + ["--model", cfg.draft_model] + ([] if cfg.suffix else ["--no-suffix"])
            + ["--draft-vocab", "auto" if cfg.draft_vocab else "off"])  # explicit: not the environment's


def prepare(cfg: DemoConfig) -> dict[str, Path]:
    """Build (once, cached) the demo checkpoints the run uses, here rather than in every child."""
    from starsd_draftd.demo.checkpoints import ensure_demo_checkpoints

    built = {}
    if {"demo", "demo-draft"} & {cfg.target_model, cfg.draft_model}:
        built["demo"], built["demo-draft"] = ensure_demo_checkpoints(progress=True)
    if cfg.backend in ("eagle", "eagle3") and cfg.target_model == "demo":  # the demo's heads are for the demo target
        from starsd_draftd.demo.eagle_train import ensure_demo_eagle_head

        built["demo-eagle"] = ensure_demo_eagle_head(progress=True)
    if cfg.backend == "eagle3" and cfg.target_model == "demo":
        from starsd_draftd.demo.eagle3_train import ensure_demo_eagle3_head

        built["demo-eagle3"] = ensure_demo_eagle3_head(progress=True)
    return built


def run_demo(cfg: DemoConfig) -> dict:
    """Start the daemons, run the workload with each draft backend and then by the targets alone."""
    prepare(cfg)
    backends = {"eagle": ["eagle", "model"], "eagle3": ["eagle3", "eagle", "model"]}.get(cfg.backend, ["model"])
    ctx = zmq.Context()
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="starsd-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    procs = ProcessSet(workdir, ctx)
    phases: dict[str, Phase] = {}
    topo = topology(cfg)
    try:
        draft_ep = free_tcp_endpoint()
        target_eps = [procs.job_endpoint(f"target{i + 1}") for i in range(cfg.targets)]
        for n, backend in enumerate(backends):
            name = f"draftd-{backend}"
            if n:  # replace the previous draft daemon on the same endpoint; targets reconnect by themselves
                procs.stop(f"draftd-{backends[n - 1]}")
            procs.start(name, *_draftd_args(cfg, backend, draft_ep), cpus=topo.draft)
            procs.wait_ready(name, draft_ep, cfg.startup_timeout_s)
            if n == 0:
                for i, ep in enumerate(target_eps):
                    procs.start(
                        f"target{i + 1}", "starsd_target", "serve", "--model", cfg.target_model, "--draft", draft_ep,
                        "--listen", ep, "--depth", str(cfg.depth), "--device", cfg.device, "--threads", "1",
                        "--dtype", demo_dtype(cfg), "--name", f"target{i + 1}",
                        "--connect-timeout", str(cfg.startup_timeout_s), "--heartbeat", "0.5", cpus=topo.targets[i])
                for i, ep in enumerate(target_eps):
                    procs.wait_ready(f"target{i + 1}", ep, cfg.startup_timeout_s)
            procs.wait_draft_link(target_eps, cfg.startup_timeout_s)
            phases[backend] = _run_phase(target_eps, cfg, False, ctx, draft_ep)
        phases["alone"] = _run_phase(target_eps, cfg, True, ctx, None)
    finally:
        procs.close()
        ctx.destroy(linger=0)
    return _report(cfg, phases, workdir, topo)


def _tps(acc: dict) -> float:
    return acc["tokens"] / acc["wall_s"] if acc["wall_s"] else 0.0


def _report(cfg: DemoConfig, phases: dict[str, Phase], workdir: Path, topo: Topology) -> dict:
    alone = phases["alone"]
    spec_names = [k for k in phases if k != "alone"]
    rows = []
    for i in range(cfg.targets):
        a = alone.per_target[i]
        row = {"target": f"target{i + 1}", "alone_tokens_per_s": _tps(a), "backends": {}}
        for name in spec_names:
            s = phases[name].per_target[i]
            row["backends"][name] = {
                "tokens_per_s": _tps(s),
                "speedup": _tps(s) / _tps(a) if _tps(a) else 0.0,
                "mean_accepted_length": s["tokens"] / s["rounds"] if s["rounds"] else 0.0,
                "acceptance_rate": s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
                "fallback_rounds": s["fallback_rounds"],
                "plain_rounds": s["plain_rounds"],
                "same_text_as_alone": s["texts"] == a["texts"] if cfg.temperature == 0.0 else None,
                "texts": s["texts"],
            }
        rows.append(row)
    alone_tps = sum(a["tokens"] for a in alone.per_target) / alone.wall_s
    system = {"alone_tokens_per_s": alone_tps, "backends": {}}
    for name in spec_names:
        ph = phases[name]
        tokens = sum(s["tokens"] for s in ph.per_target)
        rounds = sum(s["rounds"] for s in ph.per_target)
        tps = tokens / ph.wall_s
        system["backends"][name] = {"tokens_per_s": tps, "speedup": tps / alone_tps if alone_tps else 0.0,
                                    "mean_accepted_length": tokens / rounds if rounds else 0.0,
                                    "draft_busy_fraction": ph.draft_busy, "drafts_from_context": ph.from_context}
    return {"config": {"targets": cfg.targets, "prompts_per_target": cfg.prompts_per_target,
                       "max_tokens": cfg.max_tokens, "depth": cfg.depth, "device": cfg.device,
                       "temperature": cfg.temperature, "backends": spec_names, "dtype": demo_dtype(cfg),
                       "suffix": cfg.suffix, "draft_vocab": cfg.draft_vocab,
                       "topology": topo.describe(), "pinned": topo.draft is not None},
            "prompts": [DEMO_PROMPTS[(i * cfg.prompts_per_target + j) % len(DEMO_PROMPTS)]
                        for i in range(cfg.targets) for j in range(cfg.prompts_per_target)],
            "targets": rows, "system": system, "logs": str(workdir)}


def format_table(report: dict) -> str:
    names = report["config"]["backends"]
    head = f"{'':10} {'draft':>6} {'tok/s':>8} {'alone tok/s':>12} {'speedup':>8} {'mean acc len':>13} " \
           f"{'accept %':>9} {'fallback rounds':>16} {'alone by choice':>16}"
    lines = [head, "-" * len(head)]
    for r in report["targets"]:
        for name in names:
            b = r["backends"][name]
            lines.append(f"{r['target']:10} {name:>6} {b['tokens_per_s']:8.1f} {r['alone_tokens_per_s']:12.1f} "
                         f"{b['speedup']:7.2f}x {b['mean_accepted_length']:13.2f} {100 * b['acceptance_rate']:8.1f}% "
                         f"{b['fallback_rounds']:16d} {b['plain_rounds']:16d}")
    lines.append("-" * len(head))
    s = report["system"]
    for name in names:
        b = s["backends"][name]
        busy, ctx_share = b["draft_busy_fraction"], b.get("drafts_from_context")
        lines.append(f"{'system':10} {name:>6} {b['tokens_per_s']:8.1f} {s['alone_tokens_per_s']:12.1f} "
                     f"{b['speedup']:7.2f}x {b['mean_accepted_length']:13.2f}"
                     + "".join(f"{', ' if i else '   '}{part}" for i, part in enumerate(
                         ([f"draft busy {100 * busy:.0f}%"] if busy is not None else [])
                         + ([f"{100 * ctx_share:.0f}% of draft tokens from suffix drafts"]
                            if ctx_share is not None else []))))
    same = [b["same_text_as_alone"] for r in report["targets"] for b in r["backends"].values()
            if b["same_text_as_alone"] is not None]
    if same:
        lines.append("greedy outputs identical to the target alone: " + ("yes" if all(same) else "NO"))
    return "\n".join(lines)


def format_texts(report: dict, lines_per_text: int = 3, width: int = 96) -> str:
    """The first lines of each target's first completion (with the first backend's drafts)."""
    name = report["config"]["backends"][0]
    per_target = report["config"]["prompts_per_target"]
    out = []
    for i, r in enumerate(report["targets"]):
        prompt = report["prompts"][i * per_target]
        text = (prompt + r["backends"][name]["texts"][0]).strip("\n")
        shown = [ln[:width] for ln in text.splitlines()[:lines_per_text]]
        out.append(f"--- {r['target']}: " + shown[0] if shown else f"--- {r['target']}: (empty)")
        out.extend("    " + ln for ln in shown[1:])
    return "\n".join(out)
