"""`starsd-draftd bench-peers`: the same greedy workload through vLLM's CPU build and through StarSD's
real daemons in one run, one case after another (never at once), with the cores matched.

* vLLM: ``vllm_peer.py`` run by a separate venv's python (``.venv-peers``, built by
  ``make bench-peers``), one process per engine configuration: the target alone on one core, and
  target + draft (``speculative_config`` method ``draft_model``) in one process on one core and on
  two. The whole process tree is pinned to those cores and ``VLLM_CPU_OMP_THREADS_BIND`` binds
  its compute threads to them.
* StarSD: the real ``starsd_draftd serve`` and ``starsd_target serve`` daemons as child processes
  (``ProcessSet``, as the demo and the bench start them), the draft daemon on the first core and
  the target on the second, one torch thread each; the target-alone baseline is the same target
  daemon with ``no_draft``.

Both get the same prompt token ids (the demo's prompts as the demo sends them: raw text, no chat
template, tokenized as the target daemon does) and stop at the model's end of sequence; tokens
are counted as generated. The StarSD block runs between vLLM's engines to spread drift.

One pass per engine cannot tell two systems apart within 20% on a shared host whose speed drifts
by that much within minutes. So the closest comparison, the target alone per core, is also run
*alternated* (``--alternate N``): StarSD's target daemon and a vLLM engine (``vllm_peer.py
--serve``) both stay up on the target's core, idle but for their turn, and run the prompts one
at a time (or ``--alternate-streams`` at once) in turns, N rounds, each system first in every
other round and each pass after the same pause. Each round gives a ratio of two passes minutes apart at most; the report gives their
median and spread and the CPU time each system's idle processes took during the other's passes.
"""

from __future__ import annotations

import datetime
import glob
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import zmq

from starsd_draftd.bench.peers import report as rep

log = logging.getLogger("starsd.bench.peers")

VLLM_PEER = Path(__file__).with_name("vllm_peer.py")
PROGRESS_PREFIX = "[vllm-peer] "
RESULT_PREFIX = "[vllm-peer-result] "
TCMALLOC_GLOBS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so*",
                  "/usr/lib64/libtcmalloc_minimal.so*", "/usr/lib/libtcmalloc_minimal.so*")


# --models: (target, draft); a name of bench.rows.SHAPES is a random-init checkpoint of that real
# configuration, built once in the cache (a forward costs what the real model's costs; its drafts
# keep nothing, so its speculative rows measure a round's cost, not a speed-up)
MODEL_SETS = {"demo": ("demo", "demo-draft"), "qwen2.5-1.5b": ("qwen2.5-1.5b", "qwen2.5-0.5b")}
SHAPE_PROMPT_TOKENS = 24  # a random-init checkpoint has no tokenizer: its prompts are this many seeded random ids


@dataclass
class PeersConfig:
    out: Path = Path("results")
    prompts: int = 4  # the first N demo prompts
    max_tokens: int = 64
    depth: int = 4  # the demo's depth; vLLM's num_speculative_tokens
    streams: tuple[int, ...] = (1, 4)
    vllm_python: Path | None = Path(".venv-peers/bin/python")  # None: StarSD only
    # "auto": vLLM's faster dtype on this CPU (``vllm_dtype_list``); compiled, as vLLM runs on CPUs by default
    vllm_dtypes: tuple[str, ...] = ("auto",)
    vllm_eager: bool = False
    vllm_kvcache_gib: int = 1
    vllm_max_model_len: int = 512
    preload: tuple[str, ...] | None = None  # LD_PRELOAD for vLLM; None: tcmalloc and the venv's libiomp5 if found
    starsd: bool = True
    starsd_dtypes: tuple[str, ...] = ()  # StarSD's daemons run each case in each; () the demo's choice
    starsd_args: tuple[str, ...] = ()  # extra arguments for both daemons' `serve`
    draftd_args: tuple[str, ...] = ()
    target_args: tuple[str, ...] = ()
    target_model: str = "demo"  # a model name, a checkpoint directory or a bench.rows.SHAPES name
    draft_model: str = "demo-draft"
    cpus: tuple[int, ...] | None = None  # the two cores used; None: the first two this process may use
    warmup_tokens: int = 8
    startup_timeout_s: float = 1800.0  # daemons started with --compile compile first (minutes here)
    job_timeout_s: float = 900.0
    vllm_timeout_s: float = 1800.0
    workdir: Path | None = None
    alternate: int = 6  # rounds of the alternated target-alone comparison; 0: none
    alternate_pause_s: float = 1.0  # before each alternated pass
    alternate_streams: int = 1  # prompts sent at once in each alternated pass (1: one at a time)
    table: bool = True  # False: the alternated comparison only

    def check(self) -> None:
        if self.prompts < 1 or self.max_tokens < 1 or self.depth < 1:
            raise ValueError("prompts, max tokens and depth must be at least 1")
        if self.alternate < 0 or self.alternate_pause_s < 0:
            raise ValueError("alternated rounds and their pause cannot be negative")
        if not 1 <= self.alternate_streams <= self.prompts:
            raise ValueError(f"alternated streams must lie in 1..{self.prompts} (the prompts), "
                             f"got {self.alternate_streams}")
        if not self.table and not self.alternates():
            raise ValueError("nothing to run: the alternated comparison only was asked for, and it needs vLLM, "
                             "StarSD and --alternate of at least 1")
        if not self.streams or min(self.streams) < 1:
            raise ValueError("streams must be positive counts")
        if self.vllm_python is None and not self.starsd:
            raise ValueError("nothing to run: neither vLLM nor StarSD selected")
        if self.vllm_python is not None and not Path(self.vllm_python).is_file():
            raise ValueError(f"no vLLM python at {self.vllm_python}: run `make bench-peers` (it builds .venv-peers), "
                             "or pass --vllm-python")
        if len(self.two_cores()) < 2:
            raise ValueError("bench-peers needs two cores (draft and target on separate cores)")
        from common.models import DTYPE_CHOICES

        bad = [d for d in self.starsd_dtypes if d not in DTYPE_CHOICES]
        if bad:
            raise ValueError(f"unknown StarSD dtype(s) {', '.join(bad)}; choose from {', '.join(DTYPE_CHOICES)}")

    def alternates(self) -> bool:
        """Whether the alternated target-alone comparison runs."""
        return self.alternate > 0 and self.starsd and self.vllm_python is not None and bool(self.vllm_dtypes)

    def vllm_dtype_list(self) -> tuple[str, ...]:
        """The dtypes vLLM runs in, ``auto`` resolved: bfloat16 where the CPU computes it natively
        (AMX or AVX512-BF16), else float32, vLLM's faster of the two on each machine measured
        (docs/bench.md), so that StarSD meets vLLM at its best."""
        from starsd_draftd.demo.run import cpu_has_native_bf16

        out: list[str] = []
        for d in self.vllm_dtypes:
            d = ("bfloat16" if cpu_has_native_bf16() else "float32") if d == "auto" else d
            if d not in out:
                out.append(d)
        return tuple(out)

    def dtypes(self) -> tuple[str, ...]:
        """The dtypes StarSD's daemons run in: the configured ones, else the demo's choice here."""
        if self.starsd_dtypes:
            return self.starsd_dtypes
        from starsd_draftd.demo.run import DemoConfig, demo_dtype

        return (demo_dtype(DemoConfig()),)

    def two_cores(self) -> tuple[int, ...]:
        cpus = sorted(self.cpus) if self.cpus is not None else sorted(os.sched_getaffinity(0))
        return tuple(cpus[:2])


# ---------------------------------------------------------------- the plan
def vllm_blocks(cfg: PeersConfig) -> list[dict]:
    """vLLM's engine configurations: per dtype the target alone on the target's core, target +
    draft on that core, and target + draft on both cores."""
    if cfg.vllm_python is None:
        return []
    draft_core, target_core = cfg.two_cores()
    out = []
    for dtype in cfg.vllm_dtype_list():
        for mode, cores in (("alone", [target_core]), ("spec", [target_core]), ("spec", [draft_core, target_core])):
            label = f"{'target + draft' if mode == 'spec' else 'target alone'}, {len(cores)} core(s), {dtype}"
            out.append({"system": "vllm", "mode": mode, "cores": cores, "dtype": dtype, "label": label})
    return out


def starsd_blocks(cfg: PeersConfig, dtype: str) -> list[dict]:
    draft_core, target_core = cfg.two_cores()
    return [{"system": "starsd", "mode": "alone", "cores": [target_core], "dtype": dtype,
             "label": f"target daemon alone, core {target_core}, {dtype}"},
            {"system": "starsd", "mode": "spec", "cores": [draft_core, target_core], "dtype": dtype,
             "label": f"draft daemon core {draft_core} + target daemon core {target_core}, {dtype}"}]


def run_order(vllm: list[dict]) -> list[str | dict]:
    """vLLM's engines with StarSD's block (the string "starsd") in the middle of them."""
    mid = (len(vllm) + 1) // 2 if len(vllm) > 3 else min(1, len(vllm))
    return [*vllm[:mid], "starsd", *vllm[mid:]]


def daemon_args(cfg: PeersConfig, dtype: str, draft_ep: str, target_ep: str) -> tuple[list[str], list[str]]:
    """``python -m`` arguments of the draft daemon and the target daemon, as the demo runs them,
    with the extra arguments appended."""
    draftd = ["starsd_draftd", "serve", "--model", cfg.draft_model, "--bind", draft_ep, "--depth", str(cfg.depth),
              "--threads", "1", "--dtype", dtype, *cfg.starsd_args, *cfg.draftd_args]
    target = ["starsd_target", "serve", "--model", cfg.target_model, "--draft", draft_ep, "--listen", target_ep,
              "--depth", str(cfg.depth), "--threads", "1", "--dtype", dtype, "--name", "peers-target",
              "--connect-timeout", str(cfg.startup_timeout_s), "--heartbeat", "0.5", *cfg.starsd_args,
              *cfg.target_args]
    return draftd, target


def default_preload(vllm_python: Path) -> list[str]:
    """tcmalloc (Debian's libtcmalloc-minimal4) and the vLLM venv's Intel OpenMP, as vLLM's CPU
    installation guide preloads them; only those that exist."""
    found = []
    for pattern in TCMALLOC_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            found.append(hits[0])
            break
    iomp = Path(os.path.abspath(vllm_python)).parent.parent / "lib" / "libiomp5.so"  # abspath: keep the venv link
    if iomp.is_file():
        found.append(str(iomp))
    return found


def vllm_command(cfg: PeersConfig, block: dict, target_dir: Path, draft_dir: Path, prompts_file: Path,
                 out_file: Path) -> tuple[list[str], dict]:
    """The command line and the environment of one vLLM engine process."""
    cmd = [os.path.abspath(cfg.vllm_python), str(VLLM_PEER), "--target", str(target_dir), "--dtype", block["dtype"],
           "--depth", str(cfg.depth), "--prompts", str(prompts_file), "--max-tokens", str(cfg.max_tokens),
           "--streams", ",".join(map(str, cfg.streams)), "--max-model-len", str(cfg.vllm_max_model_len),
           "--warmup-tokens", str(cfg.warmup_tokens), "--out", str(out_file),
           "--enforce-eager" if cfg.vllm_eager else "--no-enforce-eager"]
    if block["mode"] == "spec":
        cmd += ["--draft", str(draft_dir)]
    preload = list(cfg.preload) if cfg.preload is not None else default_preload(Path(cfg.vllm_python))
    cores = block["cores"]
    bind = str(cores[0]) if len(cores) == 1 else (f"{cores[0]}-{cores[-1]}" if cores == list(
        range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores)))
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kvcache_gib),
           "LD_PRELOAD": ":".join(preload), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
    return cmd, env


def plan(cfg: PeersConfig) -> list[dict]:
    """What a run would do, in order (``--plan`` prints it): each vLLM process's command and
    environment, StarSD's daemons (once per dtype), then the alternated comparison's two engines."""
    if len(cfg.two_cores()) < 2:
        raise ValueError("bench-peers needs two cores (draft and target on separate cores)")
    cfg = replace(cfg, target_model=_model_place(cfg.target_model), draft_model=_model_place(cfg.draft_model))
    steps = []
    for item in run_order(vllm_blocks(cfg)) if cfg.table else ():
        if item == "starsd":
            for dtype in cfg.dtypes() if cfg.starsd else ():
                d, t = daemon_args(cfg, dtype, "tcp://127.0.0.1:PORT1", "tcp://127.0.0.1:PORT2")
                draft_core, target_core = cfg.two_cores()
                steps.append({"system": "starsd", "draftd": d, "draftd_cores": [draft_core], "target": t,
                              "target_cores": [target_core], "cases": [f"{m}, {s} stream(s)" for s in cfg.streams
                                                                        for m in ("target alone", "speculative")]})
            continue
        cmd, env = vllm_command(cfg, item, Path("<target>"), Path("<draft>"), Path("<prompts.json>"),
                                Path("<out.json>"))
        steps.append({"system": "vllm", "label": item["label"], "cores": item["cores"], "command": cmd, "env": env})
    if cfg.alternates():
        block = alternated_block(cfg)
        cmd, env = serve_command(cfg, block, Path("<target>"), Path("<prompts.json>"), Path("<out.json>"))
        target = alternated_target_args(cfg, cfg.dtypes()[0], "tcp://127.0.0.1:PORT")
        steps.append({"system": "alternated", "rounds": cfg.alternate, "streams": cfg.alternate_streams,
                      "pause_s": cfg.alternate_pause_s,
                      "cores": block["cores"], "starsd_target": target, "vllm_command": cmd, "vllm_env": env})
    return steps


# ---------------------------------------------------------------- running vLLM
def run_vllm_block(cfg: PeersConfig, block: dict, target_dir: Path, draft_dir: Path, prompts_file: Path,
                   workdir: Path, progress) -> dict:
    """One vLLM engine process, pinned to the block's cores; its JSON with the process wall time."""
    name = f"vllm-{block['mode']}-{len(block['cores'])}core-{block['dtype']}"
    out_file = workdir / f"{name}.json"
    cmd, env = vllm_command(cfg, block, target_dir, draft_dir, prompts_file, out_file)
    log_path = workdir / f"{name}.log"
    progress(f"vLLM {block['label']}: starting (log {log_path})")
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.PIPE, env={**os.environ, **env}, text=True,
                                start_new_session=True)
        os.sched_setaffinity(proc.pid, set(block["cores"]))  # before it imports anything; its children inherit
        timer = threading.Timer(cfg.vllm_timeout_s, _kill_group, (proc.pid,))
        timer.start()
        try:
            for line in proc.stderr:
                logf.write(line)
                if line.startswith(PROGRESS_PREFIX):
                    progress("  " + line[len(PROGRESS_PREFIX):].rstrip())
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            _kill_group(proc.pid)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out_file.is_file():
        raise RuntimeError(f"vLLM ({block['label']}) exited with status {proc.returncode}; its log ends:\n"
                           f"{log_path.read_text(errors='replace')[-3000:]}")
    res = json.loads(out_file.read_text())
    res["start"]["process_s"] = wall
    return res


def _kill_group(pid: int) -> None:
    """vLLM's engine-core and worker processes, should any outlive the peer (its own session)."""
    try:
        os.killpg(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- the alternated comparison
def alternated_block(cfg: PeersConfig) -> dict:
    """vLLM's engine in the alternated comparison: the target alone on the target's core, in the
    first vLLM dtype."""
    _, target_core = cfg.two_cores()
    dtype = cfg.vllm_dtype_list()[0]
    return {"system": "vllm", "mode": "alone", "cores": [target_core], "dtype": dtype,
            "label": f"target alone, 1 core(s), {dtype}, kept up"}


def serve_command(cfg: PeersConfig, block: dict, target_dir: Path, prompts_file: Path,
                  out_file: Path) -> tuple[list[str], dict]:
    """``vllm_command`` for an engine kept up: ``--serve``, the prompts ``alternate_streams`` at a time."""
    cmd, env = vllm_command(cfg, block, target_dir, target_dir, prompts_file, out_file)
    cmd[cmd.index("--streams") + 1] = str(cfg.alternate_streams)
    return cmd + ["--serve"], env


def alternated_target_args(cfg: PeersConfig, dtype: str, endpoint: str) -> list[str]:
    """The target daemon of the alternated comparison: as in the table, with no draft daemon (and no
    link to one: no retries in the background on the measured core)."""
    wide = cfg.alternate_streams > 4  # beyond the daemon's default --max-active/--max-batch: as wide as vLLM's batch
    width = ["--max-active", str(cfg.alternate_streams), "--max-batch", str(cfg.alternate_streams)] if wide else []
    return ["starsd_target", "serve", "--model", cfg.target_model, "--no-draft", "--listen", endpoint, "--threads",
            "1", "--dtype", dtype, "--name", "peers-alternated", *width, *cfg.starsd_args, *cfg.target_args]


def process_cpu_s(pid: int, group: bool = False) -> float:
    """CPU seconds (user + system) a process has used, all its threads; with ``group``, summed
    over every process in its process group (vLLM's engine and worker processes). 0 when gone."""
    tick = os.sysconf("SC_CLK_TCK")
    paths = glob.glob("/proc/[0-9]*/stat") if group else [f"/proc/{pid}/stat"]
    total = 0
    for path in paths:
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if group and int(fields[2]) != pid:  # fields after the name: state, ppid, pgrp, ...
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


class VllmServer:
    """A vLLM engine kept up (``vllm_peer.py --serve``) on its block's cores, in its own process
    group; ``run()`` runs the prompts once and returns the case. Its stdout and stderr go to
    ``log_path``; its results come on a pipe of their own (``--result-fd``), so nothing vLLM's
    processes print can split them. A process that ends is noticed within a second, whatever
    still holds its pipes."""

    POLL_S = 0.5

    def __init__(self, cmd: list[str], env: dict, cores: list[int], log_path: Path, ready_timeout_s: float,
                 run_timeout_s: float):
        import queue

        self.log_path, self.run_timeout_s = log_path, run_timeout_s
        self._results: queue.Queue = queue.Queue()
        self._log = open(log_path, "w")
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen([*cmd, "--result-fd", str(write_fd)], stdin=subprocess.PIPE,
                                         stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         text=True, start_new_session=True, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            self._log.close()
            raise
        finally:
            os.close(write_fd)  # the child holds its copy; EOF comes when every holder has closed it
        self._pipe = os.fdopen(read_fd, "r", encoding="utf-8", errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            os.sched_setaffinity(self.proc.pid, set(cores))  # before it imports anything; children inherit
            self.ready = self._next(ready_timeout_s, "to start")
        except BaseException:
            self.close(quit_first=False)
            raise

    def _read(self) -> None:
        try:
            for line in self._pipe:
                if not line.startswith(RESULT_PREFIX):
                    continue
                try:
                    self._results.put(json.loads(line[len(RESULT_PREFIX):]))
                except ValueError:
                    self._results.put({"error": f"unreadable result line: {line[:200]!r}"})
        except (OSError, ValueError):  # the pipe closed under it (close())
            pass
        finally:
            self._results.put(None)

    def _next(self, timeout_s: float, what: str) -> dict:
        import queue

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                res = self._results.get(timeout=self.POLL_S)
                break
            except queue.Empty:
                if self.proc.poll() is not None:  # ended, while something may still hold the pipe open
                    res = None
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM took longer than {timeout_s:.0f}s {what}; log: {self.log_path}") from None
        if res is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            self._log.flush()
            raise RuntimeError(f"vLLM (kept up) exited with status {self.proc.returncode}; its log ends:\n"
                               f"{self.log_path.read_text(errors='replace')[-3000:]}")
        if "error" in res:
            raise RuntimeError(f"vLLM (kept up) refused: {res['error']}")
        return res

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._next(self.run_timeout_s, "to run the prompts")

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid, group=True)

    def close(self, quit_first: bool = True) -> None:
        try:
            if quit_first and self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=60 if quit_first else 0.1)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _kill_group(self.proc.pid)  # engine processes that outlived it, and with them the pipe
        self._reader.join(timeout=5)
        self._pipe.close()
        self._log.close()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def alternate(rounds: int, pause_s: float, passes: dict, cpu: dict | None = None, sleep=time.sleep) -> list[dict]:
    """``rounds`` rounds of one pass of each system in ``passes`` (name -> callable returning a
    case), the first system first in even rounds and last in odd ones (so each leads equally
    often), ``pause_s`` before every pass. With ``cpu`` (name -> callable returning CPU seconds),
    each pass records the CPU time the other systems' processes used meanwhile."""
    names = list(passes)
    out = []
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        row = {"round": r + 1, "order": list(order), "passes": {}}
        for name in order:
            sleep(pause_s)
            before = {n: f() for n, f in (cpu or {}).items() if n != name}
            case = passes[name]()
            # a process of the group that exits mid-pass takes its CPU time with it: never below 0
            others = max(0.0, sum(f() - before[n] for n, f in cpu.items() if n != name)) if cpu else None
            row["passes"][name] = {"case": case, "others_cpu_s": others}
        out.append(row)
    return out


def run_alternated(cfg: PeersConfig, prompts: list[list[int]], dtype: str, target_dir: Path, prompts_file: Path,
                   workdir: Path, progress) -> dict:
    """The alternated target-alone comparison (see the module docstring): both engines up on the
    target's core, ``cfg.alternate`` rounds of passes in turns; the rounds and both starts."""
    from starsd_draftd.bench.procs import ProcessSet

    block = alternated_block(cfg)
    cmd, env = serve_command(cfg, block, target_dir, prompts_file, workdir / "vllm-alternated.json")
    log_path = workdir / "vllm-alternated.log"
    ctx = zmq.Context()
    procs = ProcessSet(workdir, ctx)
    progress(f"Alternated: vLLM {block['label']} and StarSD's target daemon ({dtype}), both on core "
             f"{block['cores'][0]}, {cfg.alternate} rounds, {cfg.alternate_streams} prompt(s) at once "
             f"(logs in {workdir})")
    mine = os.sched_getaffinity(0)
    elsewhere = mine - set(block["cores"])
    if elsewhere:  # this process's client threads off the measured core
        os.sched_setaffinity(0, elsewhere)
    try:
        t0 = time.perf_counter()
        with VllmServer(cmd, env, block["cores"], log_path, cfg.vllm_timeout_s, cfg.job_timeout_s) as vllm:
            vllm_up = time.perf_counter() - t0
            engine_s = vllm.ready.get("start", {}).get("engine_init_s", 0)
            progress(f"  vLLM up in {vllm_up:.1f}s (engine start {engine_s:.1f}s, log {log_path}); "
                     "starting StarSD's target daemon")
            endpoint = procs.job_endpoint("alternated-target")
            t1 = time.perf_counter()
            proc = procs.start("alternated-target", *alternated_target_args(cfg, dtype, endpoint), cpus=block["cores"])
            procs.wait_ready("alternated-target", endpoint, cfg.startup_timeout_s)
            generate_at_once(endpoint, [prompts[0]], cfg.warmup_tokens, True, ctx, cfg.job_timeout_s)
            starsd_up = time.perf_counter() - t1

            def starsd_pass() -> dict:
                return rep.starsd_case(cfg.alternate_streams,
                                       [generate_at_once(endpoint, g, cfg.max_tokens, True, ctx, cfg.job_timeout_s)
                                        for g in _groups(prompts, cfg.alternate_streams)])

            def report_pass(name: str, fn):
                def run() -> dict:
                    case = fn()
                    progress(f"  {name}: {case['tokens']} tokens in {case['wall_s']:.2f}s: "
                             f"{case['tokens'] / case['wall_s']:.1f} tok/s")
                    return case
                return run

            rounds = alternate(cfg.alternate, cfg.alternate_pause_s,
                               {"starsd": report_pass("StarSD", starsd_pass), "vllm": report_pass("vLLM", vllm.run)},
                               cpu={"starsd": lambda: process_cpu_s(proc.pid), "vllm": vllm.cpu_s})
            ready = vllm.ready
    finally:
        os.sched_setaffinity(0, mine)
        procs.close()
        ctx.destroy(linger=0)
    return {"streams": cfg.alternate_streams,
            "vllm": dict(block, start=dict(ready.get("start", {}), process_up_s=vllm_up),
                         vllm_version=ready.get("vllm_version"), torch_version=ready.get("torch_version"),
                         omp_threads_bind=ready.get("omp_threads_bind"),
                         affinity=ready.get("affinity"), enforce_eager=ready.get("enforce_eager")),
            "starsd": {"dtype": dtype, "cores": block["cores"], "up_s": starsd_up},
            "pause_s": cfg.alternate_pause_s, "rounds": rounds}


# ---------------------------------------------------------------- running StarSD
def _groups(prompts: list, size: int) -> list[list]:
    return [prompts[i: i + size] for i in range(0, len(prompts), size)]


def generate_at_once(endpoint: str, prompts: list[list[int]], max_tokens: int, no_draft: bool, ctx: zmq.Context,
                     timeout_s: float) -> dict:
    """``prompts`` (token ids) sent to the target daemon at once through GENERATE, one client
    each, greedy; its results in the shape of ``real._run_jobs`` (which sends text)."""
    from common.control import ControlClient
    from common.protocol import Message, MsgType

    results: list[list[dict]] = [[] for _ in prompts]
    failures: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with ControlClient(endpoint, ctx) as cc:
                msg = Message(MsgType.GENERATE, {"id": i + 1, "prompt_ids": list(prompts[i]), "max_tokens": max_tokens,
                                                 "temperature": 0.0, "no_draft": no_draft})
                h = cc.call(msg, timeout_s).header
                results[i].append({"stats": h["stats"], "token_ids": h["token_ids"]})
        except Exception as exc:  # re-raised below, in the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failures:
        raise RuntimeError(f"a StarSD job failed: {failures[0]}") from failures[0]
    return {"wall_s": wall, "results": results}


def run_starsd(cfg: PeersConfig, prompts: list[list[int]], dtype: str, workdir: Path, progress) -> dict:
    """Both StarSD daemons up once; for each streams count the target alone, then with drafts.
    Returns {"alone": {streams: case}, "spec": {...}, "start": {...}}."""
    from common.sockets import free_tcp_endpoint
    from starsd_draftd.bench.procs import ProcessSet

    ctx = zmq.Context()
    procs = ProcessSet(workdir, ctx)
    draft_core, target_core = cfg.two_cores()
    out: dict = {"alone": {}, "spec": {}, "start": {"warmup_tokens": cfg.warmup_tokens}}
    try:
        draft_ep, target_ep = free_tcp_endpoint(), procs.job_endpoint("target")
        d_args, t_args = daemon_args(cfg, dtype, draft_ep, target_ep)
        progress(f"StarSD: starting the draft daemon (core {draft_core}) and the target daemon (core {target_core}), "
                 f"logs in {workdir}")
        t0 = time.perf_counter()
        procs.start("draftd", *d_args, cpus=[draft_core])
        procs.start("target", *t_args, cpus=[target_core])
        procs.wait_ready("draftd", draft_ep, cfg.startup_timeout_s)
        procs.wait_ready("target", target_ep, cfg.startup_timeout_s)
        out["start"]["ready_s"] = time.perf_counter() - t0
        procs.wait_draft_link([target_ep], cfg.startup_timeout_s)
        out["start"]["link_s"] = time.perf_counter() - t0
        progress(f"  daemons ready in {out['start']['ready_s']:.1f}s; warm-up generations")
        t1 = time.perf_counter()
        for no_draft in (False, True):
            generate_at_once(target_ep, [prompts[0]], cfg.warmup_tokens, no_draft, ctx, cfg.job_timeout_s)
        out["start"]["first_generation_s"] = time.perf_counter() - t1
        for s in cfg.streams:
            for mode, no_draft in (("alone", True), ("spec", False)):
                phases = [generate_at_once(target_ep, g, cfg.max_tokens, no_draft, ctx, cfg.job_timeout_s)
                          for g in _groups(prompts, s)]
                case = rep.starsd_case(s, phases)
                out[mode][s] = case
                progress(f"  {'target alone' if no_draft else 'speculative'}, {s} at once: {case['tokens']} tokens "
                         f"in {case['wall_s']:.1f}s: {case['tokens'] / case['wall_s']:.1f} tok/s")
    finally:
        procs.close()
        ctx.destroy(linger=0)
    return out


# ---------------------------------------------------------------- the whole run
def _machine() -> dict:
    from starsd_draftd.bench.config import describe_machine

    return describe_machine()


def _prompt_ids(cfg: PeersConfig, target_dir: Path) -> tuple[list[str], list[list[int]]]:
    """The demo's prompts as the demo sends them (raw text), tokenized as the target daemon does
    (``TargetEngine.encode``: no special tokens); for a checkpoint without a tokenizer (a
    random-init one), ``SHAPE_PROMPT_TOKENS`` seeded random ids each."""
    import random

    from common.models import load_tokenizer
    from starsd_draftd.demo.prompts import DEMO_PROMPTS

    tok = load_tokenizer(target_dir)
    if tok is None:
        vocab = int(json.loads((target_dir / "config.json").read_text())["vocab_size"])
        rng = random.Random(0)
        ids = [[rng.randrange(vocab // 2) for _ in range(SHAPE_PROMPT_TOKENS)] for _ in range(cfg.prompts)]
        return [f"(random ids {i})" for i in range(cfg.prompts)], ids
    texts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(cfg.prompts)]
    return texts, [list(tok.encode(t, add_special_tokens=False)) for t in texts]


def _model_place(name: str) -> str:
    """Where a run finds the model ``name``: a shape's checkpoint directory in the cache (built
    by the run, not by ``--plan``), else the name as the daemons take it."""
    from common.models import cache_root
    from starsd_draftd.bench.rows import SHAPES, shape_dir

    return str(shape_dir(name, cache_root() / "bench")) if name in SHAPES else name


def resolve_models(cfg: PeersConfig) -> tuple[Path, Path]:
    """The target's and the draft's checkpoint directories; a shape's built once under the cache
    (``cfg.target_model`` and ``draft_model`` then name them, for the daemons' command lines)."""
    from common.models import cache_root, resolve_model_path
    from starsd_draftd.bench.rows import SHAPES, shape_checkpoint

    names = (cfg.target_model, cfg.draft_model)
    dirs = [shape_checkpoint(n, cache_root() / "bench") if n in SHAPES else resolve_model_path(n) for n in names]
    cfg.target_model, cfg.draft_model = str(dirs[0]), str(dirs[1])
    return dirs[0], dirs[1]


def run_peers(cfg: PeersConfig, progress=log.info) -> dict:
    """Run every case, write peers.json and peers.md into ``cfg.out``; the report."""
    cfg.check()
    t_start = time.perf_counter()
    target_dir, draft_dir = resolve_models(cfg)
    dtypes = cfg.dtypes()
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="starsd-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    texts, prompts = _prompt_ids(cfg, target_dir)
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    blocks, order, vllm_meta = [], [], {}
    for item in run_order(vllm_blocks(cfg)) if cfg.table else ():
        if item == "starsd":
            if not cfg.starsd:
                continue
            for dtype in dtypes:
                res = run_starsd(cfg, prompts, dtype, workdir, progress)
                for b in starsd_blocks(cfg, dtype):
                    blocks.append(dict(b, start=res["start"], cases=[res[b["mode"]][s] for s in cfg.streams]))
                order.append(f"StarSD {dtype} (target alone and speculative, alternated per streams count)")
            continue
        res = run_vllm_block(cfg, item, target_dir, draft_dir, prompts_file, workdir, progress)
        vllm_meta = {"vllm_version": res["vllm_version"], "vllm_torch": res.get("torch_version"),
                     "ld_preload": res["ld_preload"], "kvcache_space_gib": res["kvcache_space_gib"]}
        blocks.append(dict(item, start=res["start"], cases=res["cases"], omp_threads_bind=res["omp_threads_bind"],
                           affinity=res["affinity"]))
        order.append(f"vLLM {item['label']}")
    rows = rep.build_rows(blocks, cfg.max_tokens)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(alternated: dict | None) -> dict:
        report = {"schema": rep.SCHEMA,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "machine": _machine(), **vllm_meta,
                  "config": dict({k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                                 starsd_dtypes=list(dtypes), target_dir=str(target_dir), draft_dir=str(draft_dir)),
                  "prompt_texts": texts, "prompt_ids": prompts, "order": order, "blocks": blocks, "rows": rows,
                  "alternated": alternated,
                  "summary": rep.summary(rows), "notes": _notes(cfg, dtypes), "logs": str(workdir),
                  "wall_s": time.perf_counter() - t_start}
        (out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "peers.md").write_text(rep.format_markdown(report))
        return report

    if not cfg.alternates():
        return write(None)
    if blocks:
        write(None)  # the table is kept should the alternated comparison fail
    alternated = run_alternated(cfg, prompts, dtypes[0], target_dir, prompts_file, workdir, progress)
    alternated["summary"] = rep.alternated_summary(alternated["rounds"])
    vllm_meta = vllm_meta or {"vllm_version": alternated["vllm"]["vllm_version"],
                              "vllm_torch": alternated["vllm"]["torch_version"]}
    order.append(f"alternated: StarSD {dtypes[0]} and vLLM {alternated['vllm']['label']}, {cfg.alternate} rounds")
    return write(alternated)


def _notes(cfg: PeersConfig, dtypes: tuple[str, ...]) -> list[str]:
    draft_core, target_core = cfg.two_cores()
    if not cfg.table:
        return [f"Alternated only (--alternated-only): StarSD's target daemon (--no-draft, --dtype {dtypes[0]}, one "
                f"torch thread) and vLLM's engine (enforce_eager={cfg.vllm_eager}) both on core {target_core}; this "
                f"process's client threads on the other cores. Tokens are counted as generated."]
    notes = [f"StarSD: real daemons, draft on core {draft_core}, target on core {target_core}, one torch thread each, "
             f"--dtype {' and '.join(dtypes)} (fresh daemons per dtype); its target alone is the same target "
             "daemon with no_draft, and each dtype's outputs are compared with its own target alone.",
             f"vLLM: one process tree per engine, pinned to its cores (front end included), VLLM_CPU_OMP_THREADS_BIND "
             f"to the same cores, enforce_eager={cfg.vllm_eager}, VLLM_CPU_KVCACHE_SPACE={cfg.vllm_kvcache_gib} GiB, "
             f"max_model_len {cfg.vllm_max_model_len}; speculative: method draft_model, num_speculative_tokens "
             f"{cfg.depth}, draft and target in the same process.",
             "tokens kept per round: generated tokens / target forward rounds. StarSD: its STATS (generated / rounds). "
             "vLLM: rounds = spec_decode_num_drafts + one prefill step per request (its first token comes without "
             "drafts); vLLM's own mean acceptance length (1 + accepted / drafts) is shown beside it.",
             "Both systems stop at the model's end of sequence; tokens are counted as generated."]
    if cfg.starsd_args or cfg.draftd_args or cfg.target_args:
        notes.append(f"extra daemon arguments: both {list(cfg.starsd_args)}, draft daemon {list(cfg.draftd_args)}, "
                     f"target {list(cfg.target_args)}")
    return notes

