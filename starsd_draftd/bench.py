"""`starsd-draftd bench`: StarSD's quantitative claims measured on this machine, beside the analytic
model and beside what a user would otherwise run.

Sections (each with real daemons as separate processes, real sockets on loopback):

* ``wire``: one round trip of the same bytes three ways: a raw pyzmq DEALER/ROUTER exchange, the
  full StarSD path (target-side client encode -> ROUTER -> draft daemon decode, session, encode ->
  client decode, with a zero-time emulated backend), and, as a reference only, the same payload
  serialized with torch.save / torch.load (what the paper's research code sends; pickle-based, so
  StarSD never does this -- it lives here and nowhere else).
* ``emulation``: accelerator emulation (see ``starsd_draftd.emulation``): N = 1..N_max emulated
  targets against one emulated draft daemon; throughput, busy fraction, idle gaps, per-token
  latency and framework overhead, each beside the analytic model (``starsd_draftd.plan``).
* ``real``: the real draft and target models on this CPU, N = 1..N_real target daemons through
  their GENERATE endpoint, beside the target alone and beside transformers' co-located
  ``generate(assistant_model=...)``.
* ``batched``: draft service capacity (requests/s with k sessions waiting) of the real draft
  model, one session at a time versus batched drafting.

Output: ``bench.json``, ``bench.png`` and ``bench.md`` in the results folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import io
import json
import logging
import math
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import torch
import zmq

from common import protocol as P
from common.control import ControlClient
from common.protocol import Message, MsgType
from common.sockets import SocketOptions, free_tcp_endpoint, make_socket
from common.tensors import to_wire
from common.verify import SamplingParams
from starsd_draftd import plan as plan_mod
from starsd_draftd.demo import DEMO_PROMPTS, Processes, _wait_draft_link, _wait_ready
from starsd_draftd.emulation import (EMU_FINGERPRINT, EMU_VOCAB, EMULATION_LABEL, BusyIndex, EmulatedTarget,
                                     TargetModel, Trace, idle_gaps, services_between)

log = logging.getLogger("starsd.bench")

SCHEMA = "starsd-bench/1"
SECTIONS = ("wire", "emulation", "real", "batched")
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
    # real models
    models: str = "demo"  # "demo": the trained demo pair; "tiny": random tiny checkpoints (CI)
    real_n_max: int = 4
    jobs_per_target: int = 3
    max_tokens: int = 128
    real_batch_max: int = 1  # the draft daemon of the real section serves one session at a time, as the model assumes
    # batched drafting
    batch_max: int = 8
    batch_ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_window_ms: float = 2.0  # the windowed batched daemon's --batch-window-ms
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
                    models="tiny", real_n_max=2, jobs_per_target=1, max_tokens=24, batch_ks=(1, 8), prestart=True)
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
        if self.models not in ("demo", "tiny"):
            raise ValueError("models must be 'demo' or 'tiny'")
        if self.n_max < 1 or self.real_n_max < 1:
            raise ValueError("N must be >= 1")
        self.emulation_plan()  # validates the timing parameters


# ---------------------------------------------------------------- statistics
def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default method)."""
    if not xs:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError("q must lie in [0, 100]")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(xs: list[float], scale: float = 1.0) -> dict:
    """n, mean, population std, p50, p99, min, max of ``xs`` times ``scale`` (e.g. 1e3 for s -> ms)."""
    if not xs:
        return {"n": 0, "mean": None, "std": None, "p50": None, "p99": None, "min": None, "max": None}
    v = [x * scale for x in xs]
    return {"n": len(v), "mean": statistics.fmean(v), "std": statistics.pstdev(v), "p50": percentile(v, 50),
            "p99": percentile(v, 99), "min": min(v), "max": max(v)}


def histogram(xs: list[float], edges: tuple[float, ...]) -> list[dict]:
    """Counts in [edges[i], edges[i+1]) and a last open bin [edges[-1], inf)."""
    counts = [0] * len(edges)
    for x in xs:
        i = 0
        while i + 1 < len(edges) and x >= edges[i + 1]:
            i += 1
        counts[i] += 1
    return [{"lo": lo, "hi": (edges[i + 1] if i + 1 < len(edges) else None), "count": c}
            for i, (lo, c) in enumerate(zip(edges, counts))]


def per_token_latencies(rounds: list[tuple[float, int]]) -> list[float]:
    """Time per output token: a round of duration t that produced k tokens gives each of its k
    tokens the latency t / k (so the mean over tokens is total time / total tokens)."""
    out: list[float] = []
    for duration, tokens in rounds:
        if tokens > 0:
            out.extend([duration / tokens] * tokens)
    return out


def relative_error_pct(measured: float, predicted: float) -> float:
    return 100.0 * (measured - predicted) / predicted if predicted else math.inf


def session_rounds(requests: list[tuple[int, float, float, int]]) -> list[tuple[float, int]]:
    """(duration, tokens) of each round, from a draft trace's requests: consecutive requests of one
    session are one target round apart, and the verified length grew by that round's tokens."""
    by_session: dict[int, list[tuple[float, int]]] = {}
    for serial, t0, _t1, n_verified in requests:
        by_session.setdefault(serial, []).append((t0, n_verified))
    out = []
    for reqs in by_session.values():
        reqs.sort()
        for (ta, na), (tb, nb) in zip(reqs, reqs[1:]):
            if nb > na:  # a re-opened session starts over; that step is not a round
                out.append((tb - ta, nb - na))
    return out


def framework_overheads(rounds, requests_by_pos: dict[int, tuple[float, float]], busy: BusyIndex) -> list[float]:
    """Per round trip: the client-observed wait for drafts minus the draft server's busy time
    inside it (this request's own service and other sessions' services before it): the time spent
    in the framework, the network and wake-ups rather than drafting."""
    out = []
    for r in rounds:
        svc = requests_by_pos.get(r.pos)
        if svc is None or r.fallback:
            continue
        s0, s1 = svc
        out.append((r.t_reply - r.t_send) - (s1 - s0) - busy.busy(r.t_send, s0))
    return out


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


# ---------------------------------------------------------------- shared plumbing
def _draftd_emulation_args(endpoint: str, *, base_ms: float, per_token_ms: float, depth: int, batch_max: int = 1,
                           feature_size: int = 0, q_topk: int = 32) -> list[str]:
    return ["starsd_draftd.emulation", "serve", "--bind", endpoint, "--draft-base-ms", str(base_ms),
            "--draft-per-token-ms", str(per_token_ms), "--depth", str(max(depth, 8)), "--batch-max", str(batch_max),
            "--feature-size", str(feature_size), "--q-topk", str(q_topk), "--log-level", "warning"]


def _stats(endpoint: str, ctx: zmq.Context) -> dict:
    with ControlClient(endpoint, ctx) as cc:
        return cc.stats(timeout_s=10.0)


def _busy_fraction(s0: dict, s1: dict) -> float:
    return (s1["busy_s"] - s0["busy_s"]) / max(1e-9, s1["uptime_s"] - s0["uptime_s"])


class Pool:
    """The bench's daemons as child processes (demo.Processes), each started once and shared by
    the sections that use it; a traced daemon's trace is read when it stops."""

    def __init__(self, workdir: Path, ctx: zmq.Context, startup_timeout_s: float):
        self.workdir = workdir
        self.ctx = ctx
        self.timeout_s = startup_timeout_s
        self.procs = Processes(workdir)
        self.endpoints: dict[str, str] = {}
        self._traces: dict[str, Path] = {}
        self._starting: set[str] = set()
        self.state: dict = {}  # what a section's start-up decided (endpoints of helper processes)

    def start(self, name: str, args_for, traced: bool = False, stats: bool = True) -> str:
        """Start ``python -m *args_for(endpoint)`` unless running; returns its endpoint."""
        if name in self.endpoints:
            return self.endpoints[name]
        ep = free_tcp_endpoint()
        args = list(args_for(ep))
        if traced:
            self._traces[name] = self.workdir / f"{name}-trace.json"
            args += ["--trace", str(self._traces[name])]
        self.procs.start(name, args)
        self.endpoints[name] = ep
        if stats:
            self._starting.add(name)
        return ep

    def ready(self, *names: str) -> None:
        """Wait until the named daemons answer STATS."""
        for name in names:
            if name in self._starting:
                _wait_ready(self.procs, self.endpoints[name], self.timeout_s, self.ctx)
                self._starting.discard(name)

    def running(self, name: str) -> bool:
        return name in self.endpoints

    def stop(self, name: str) -> Trace | None:
        """Stop one daemon (SIGTERM: it drains and exits); its trace, if it was traced."""
        self.procs.stop(name)
        self.endpoints.pop(name, None)
        self._starting.discard(name)
        path = self._traces.pop(name, None)
        return Trace.load(path) if path is not None else None

    def stop_all(self) -> None:
        self.procs.stop_all()
        self.endpoints.clear()


def measure_capacity(endpoint: str, k: int, depth: int, duration_s: float, ctx: zmq.Context, *,
                     vocab_size: int = EMU_VOCAB, fingerprint: str = EMU_FINGERPRINT, acceptance: float = 0.7,
                     seed: int = 0, prompt_len: int = 16, max_len: int = 320, warmup_rounds: int = 2,
                     feature_size: int = 0) -> dict:
    """Requests per second a draft daemon serves with ``k`` sessions always waiting: k targets
    (one DraftClient each, the real target-side client) in a closed loop that re-sends as soon
    as its drafts arrive, keeping its prefix bookkeeping exact (a Bernoulli(acceptance) prefix
    of each draft kept, plus one token of its own). With ``feature_size`` (a feature backend)
    each request carries random float16 features for the positions verified since the last."""
    from starsd_target.client import DraftClient, DraftReply

    rng = random.Random(seed)
    clients, state = [], []
    poller = zmq.Poller()
    try:
        for i in range(k):
            c = DraftClient(endpoint, vocab_size, fingerprint, f"capacity{i}", ctx, feature_size=feature_size)
            c.handshake(30.0)
            clients.append(c)
            poller.register(c.sock, zmq.POLLIN)
        prompts = [[3 + (seed * 7 + 13 * i + j) % 200 for j in range(prompt_len)] for i in range(k)]
        g = torch.Generator().manual_seed(seed)
        features = None  # as a target's feature buffer hands them over: a float16 wire array
        if feature_size:
            features = to_wire(torch.randn(max_len + 2 * depth + 8, feature_size, generator=g).half())

        def send(i: int) -> None:
            st = state[i]
            if len(st["verified"]) > max_len:  # keep contexts bounded: start the session over
                clients[i].open(1, prompts[i], SamplingParams(seed=i))
                st.update(verified=list(prompts[i]), accepted=0, new=[], sent=0)
            st["seq"] += 1
            f = None
            if features is not None:
                f = features[: len(st["verified"]) - 1 - st["sent"]]
                st["sent"] = len(st["verified"]) - 1
            if not clients[i].request(1, st["seq"], st["accepted"], st["new"], len(st["verified"]), depth, f):
                raise RuntimeError(f"capacity client {i} cannot reach {endpoint}")

        for i, c in enumerate(clients):
            c.open(1, prompts[i], SamplingParams(seed=i))
            state.append({"verified": list(prompts[i]), "accepted": 0, "new": [], "seq": 0, "done": 0, "sent": 0})
        by_sock = {c.sock: i for i, c in enumerate(clients)}
        for i in range(k):
            send(i)
        served = 0
        t_start = s0 = None
        deadline = None
        drafted = 0
        while True:
            events = poller.poll(30000)
            if not events:
                raise RuntimeError(f"the draft daemon at {endpoint} stopped answering")
            for sock, _ in events:
                i = by_sock[sock]
                st = state[i]
                reply = clients[i].wait_draft(1, st["seq"], 5.0)
                if not isinstance(reply, DraftReply):
                    raise RuntimeError(f"capacity run: no draft ({reply})")
                n = 0
                while n < len(reply.tokens) and rng.random() < acceptance:
                    n += 1
                own = 3 + rng.randrange(vocab_size - 3)
                st["verified"] += list(reply.tokens[:n]) + [own]
                st["accepted"], st["new"] = n, [own]
                st["done"] += 1
                if t_start is not None:
                    served += 1
                    drafted += len(reply.tokens)
                send(i)
            if t_start is None and min(s["done"] for s in state) >= warmup_rounds:
                s0 = _stats(endpoint, ctx)
                t_start = time.perf_counter()
                deadline = t_start + duration_s
            elif t_start is not None and time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - t_start
        s1 = _stats(endpoint, ctx)
        for i in range(k):  # collect the replies still in flight so the daemon ends idle
            clients[i].wait_draft(1, state[i]["seq"], 5.0)
    finally:
        for c in clients:
            c.close()
    batches = s1.get("batches", 0) - s0.get("batches", 0)
    batched = s1.get("batched_requests", 0) - s0.get("batched_requests", 0)
    busy = s1["busy_s"] - s0["busy_s"]
    requests = s1["requests"] - s0["requests"]
    return {"k": k, "requests": served, "elapsed_s": elapsed, "requests_per_s": served / elapsed,
            "drafted_tokens_per_s": drafted / elapsed, "busy_fraction": _busy_fraction(s0, s1),
            "busy_ms_per_request": 1000.0 * busy / requests if requests else None,
            "mean_batch": batched / batches if batches else None}


# ---------------------------------------------------------------- wire cost
WIRE_CASES = {
    # name: (drafted tokens, sparse q with the reply, feature rows with the request)
    "greedy": (5, False, 0),
    "sampling_q": (5, True, 0),
    "features_q": (5, True, 3),
}


def wire_messages(case: str, q_topk: int = 32, feature_size: int = 4096,
                  feature_rows: int = 3) -> tuple[Message, Message]:
    """A representative DRAFT request and DRAFTED reply: depth 5, vocabulary ids of a 32k
    tokenizer, q as [5, q_topk] int32 ids + float32 probabilities, features as
    [rows, feature_size] float16 (the positions verified since the previous request)."""
    depth, with_q, rows = WIRE_CASES[case]
    g = torch.Generator().manual_seed(1)
    req_tensors = {}
    if rows:
        req_tensors["features"] = torch.randn(feature_rows, feature_size, generator=g).to(torch.float16)
    request = Message(MsgType.DRAFT, {"session": 7, "seq": 1234, "accepted": 2, "new": [31337 % EMU_VOCAB],
                                      "pos": 517, "depth": depth}, req_tensors)
    tokens = [int(t) for t in torch.randint(3, EMU_VOCAB, (depth,), generator=g)]
    rep_tensors = {}
    if with_q:
        rep_tensors = {"q_ids": torch.randint(0, EMU_VOCAB, (depth, q_topk), generator=g, dtype=torch.int32),
                       "q_probs": torch.softmax(torch.randn(depth, q_topk, generator=g), -1)}
    reply = Message(MsgType.DRAFTED, {"session": 7, "seq": 1234, "tokens": tokens}, rep_tensors)
    return request, reply


def _frames_bytes(msg: Message) -> list[bytes]:
    return [bytes(f) for f in P.encode(msg)]


def _torch_blob(msg: Message) -> bytes:
    buf = io.BytesIO()
    torch.save({"type": msg.type.value.decode(), "header": msg.header, "tensors": msg.tensors}, buf)
    return buf.getvalue()


def _torch_unblob(data) -> dict:
    return torch.load(io.BytesIO(memoryview(data)), weights_only=True)


def run_wire_server(spec: list[dict], q_topk: int, feature_size: int, feature_rows: int) -> None:
    """The raw and torch.save counterparts of the draft daemon, one ROUTER per (mode, case):
    ``raw`` answers every request with the DRAFTED reply's frames as they are (no decode, no
    encode); ``torch`` unpickles the request with torch.load and answers a torch.save blob."""
    ctx = zmq.Context()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    poller = zmq.Poller()
    socks = {}
    for s in spec:
        sock = make_socket(ctx, zmq.ROUTER, SocketOptions())
        sock.bind(s["endpoint"])
        poller.register(sock, zmq.POLLIN)
        _, reply = wire_messages(s["case"], q_topk, feature_size, feature_rows)
        socks[sock] = (s["mode"], _frames_bytes(reply), reply)
    try:
        while not stop.is_set():
            for sock, _ in poller.poll(100):
                frames = sock.recv_multipart(copy=False)
                mode, raw_reply, reply = socks[sock]
                if mode == "raw":
                    sock.send_multipart([frames[0], *raw_reply], copy=False)
                else:
                    request = _torch_unblob(frames[1].buffer)
                    header = dict(reply.header, seq=request["header"]["seq"])
                    blob = _torch_blob(Message(reply.type, header, reply.tensors))
                    sock.send_multipart([frames[0], blob], copy=False)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def _raw_loop(endpoint: str, frames: list[bytes], gap_s: float, ctx: zmq.Context) -> Iterator[float]:
    """Round trips (seconds) of ``frames`` against a raw echo, one per ``next()``."""
    sock = make_socket(ctx, zmq.DEALER, SocketOptions())
    sock.connect(endpoint)
    try:
        while True:
            t0 = time.perf_counter()
            sock.send_multipart(frames, copy=False)
            if not sock.poll(30000):
                raise RuntimeError(f"no echo from {endpoint}")
            sock.recv_multipart(copy=False)
            yield time.perf_counter() - t0
            if gap_s:
                time.sleep(gap_s)
    finally:
        sock.close(linger=0)


def _torch_loop(endpoint: str, request: Message, gap_s: float, ctx: zmq.Context) -> Iterator[float]:
    """Round trips of ``request`` as a torch.save blob, answered with one, one per ``next()``."""
    sock = make_socket(ctx, zmq.DEALER, SocketOptions())
    sock.connect(endpoint)
    try:
        while True:
            t0 = time.perf_counter()
            sock.send(_torch_blob(request), copy=False)
            if not sock.poll(30000):
                raise RuntimeError(f"no reply from {endpoint}")
            _torch_unblob(sock.recv(copy=False).buffer)
            yield time.perf_counter() - t0
            if gap_s:
                time.sleep(gap_s)
    finally:
        sock.close(linger=0)


def framework_loop(endpoint: str, case: str, gap_s: float, ctx: zmq.Context, feature_size: int = 0,
                   feature_rows: int = 3, depth: int = 5) -> Iterator[float]:
    """Round trips of the full path against a draft daemon with a zero-time backend, one per
    ``next()``: the real target-side client encodes a DRAFT, the daemon decodes, validates,
    advances the session, drafts, encodes the DRAFTED; the client decodes it. Each round keeps
    2 drafts plus one own token, so requests carry exactly the bookkeeping (and feature rows)
    of a real target. Arrays cross as in production: features leave as the engine's feature
    buffer hands them over (a numpy view), and the reply's q arrives as numpy views."""
    from starsd_target.client import DraftClient, DraftReply

    _, with_q, rows = WIRE_CASES[case]
    client = DraftClient(endpoint, EMU_VOCAB, EMU_FINGERPRINT, f"wire-{case}", ctx,
                         feature_size=feature_size if rows else 0)
    try:
        client.handshake(30.0)
        prompt = [3 + i for i in range(16)]
        params = SamplingParams(temperature=1.0 if with_q else 0.0, seed=1)
        # the features as the engine's feature buffer hands them over: a float16 wire array
        feats = to_wire(torch.randn(max(len(prompt), feature_rows), feature_size).half()) if rows else None
        verified = list(prompt)
        client.open(1, verified, params)
        accepted, new, sent, i = 0, [], 0, 0
        while True:
            i += 1
            pos = len(verified)
            f = None if feats is None else feats[: pos - 1 - sent]
            t0 = time.perf_counter()
            ok = client.request(1, i, accepted, new, pos, depth, f)
            reply = client.wait_draft(1, i, 30.0) if ok else None
            t1 = time.perf_counter()
            if not isinstance(reply, DraftReply):
                raise RuntimeError(f"wire run against {endpoint}: no draft ({reply})")
            keep = min(feature_rows - 1, len(reply.tokens))
            own = 3 + (i * 7919) % (EMU_VOCAB - 3)
            verified += list(reply.tokens[:keep]) + [own]
            accepted, new, sent = keep, [own], pos - 1
            yield t1 - t0
            if gap_s:
                time.sleep(gap_s)
    finally:
        client.close()


def _take(loop: Iterator[float], n: int) -> list[float]:
    return [next(loop) for _ in range(n)]


def interleaved(loops: dict[str, Iterator[float]], n: int, warmup: int, blocks: int) -> dict[str, list[float]]:
    """``n`` round trips of each loop, taken in ``blocks`` alternating blocks (after ``warmup``
    each), so that a change of load on the host during the run affects every path alike."""
    out: dict[str, list[float]] = {name: [] for name in loops}
    for loop in loops.values():
        _take(loop, warmup)
    blocks = max(1, min(blocks, n))
    for b in range(blocks):
        size = n // blocks + (1 if b < n % blocks else 0)
        for name, loop in loops.items():
            out[name] += _take(loop, size)
    return out


def _codec_us(msg: Message, n: int) -> dict:
    t0 = time.perf_counter()
    for _ in range(n):
        frames = P.encode(msg)
    t1 = time.perf_counter()
    raw = _frames_bytes(msg)
    for _ in range(n):
        P.decode(raw)
    t2 = time.perf_counter()
    del frames
    return {"encode_us": 1e6 * (t1 - t0) / n, "decode_us": 1e6 * (t2 - t1) / n}


def _wait_echo(endpoint: str, frames: list[bytes], timeout_s: float, ctx: zmq.Context, procs: Processes) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check_alive()
        sock = make_socket(ctx, zmq.DEALER, SocketOptions())
        sock.connect(endpoint)
        try:
            sock.send_multipart(frames)
            if sock.poll(1000):
                sock.recv_multipart()
                return
        finally:
            sock.close(linger=0)
    raise TimeoutError(f"wire server at {endpoint} did not come up within {timeout_s:.0f}s")


def start_wire(cfg: BenchConfig, pool: Pool) -> tuple[str, str, list[dict]]:
    """The wire section's daemons: zero-time emulated draft daemons (plain and with features) and
    the raw / torch.save counterparts."""
    plain_ep = pool.start("zero-draftd", lambda ep: _draftd_emulation_args(ep, base_ms=0, per_token_ms=0,
                                                                           depth=cfg.depth, q_topk=cfg.q_topk))
    feat_ep = pool.start("zero-draftd-features", lambda ep: _draftd_emulation_args(
        ep, base_ms=0, per_token_ms=0, depth=cfg.depth, q_topk=cfg.q_topk, feature_size=cfg.feature_size))
    spec = pool.state.setdefault("wire-spec", [{"mode": m, "case": c, "endpoint": free_tcp_endpoint()}
                                               for c in WIRE_CASES for m in ("raw", "torch")])
    pool.start("wire-server", lambda ep: ["starsd_draftd.bench", "wire-server", "--spec", json.dumps(spec),
                                          "--q-topk", str(cfg.q_topk), "--feature-size", str(cfg.feature_size),
                                          "--feature-rows", str(cfg.feature_rows)], stats=False)
    return plain_ep, feat_ep, spec


def wire_section(cfg: BenchConfig, pool: Pool, step) -> dict:
    ctx = pool.ctx
    plain_ep, feat_ep, spec = start_wire(cfg, pool)
    pool.ready("zero-draftd", "zero-draftd-features")
    eps = {(s["mode"], s["case"]): s["endpoint"] for s in spec}
    n, warm = cfg.wire_rounds, max(20, cfg.wire_rounds // 20)
    cases = []
    for case in WIRE_CASES:
        request, reply = wire_messages(case, cfg.q_topk, cfg.feature_size, cfg.feature_rows)
        req_frames, rep_frames = _frames_bytes(request), _frames_bytes(reply)
        _wait_echo(eps[("raw", case)], req_frames, cfg.startup_timeout_s, ctx, pool.procs)
        daemon = feat_ep if WIRE_CASES[case][2] else plain_ep
        loops = {"raw": _raw_loop(eps[("raw", case)], req_frames, 0.0, ctx),
                 "framework": framework_loop(daemon, case, 0.0, ctx, cfg.feature_size, cfg.feature_rows),
                 "torch": _torch_loop(eps[("torch", case)], request, 0.0, ctx)}
        try:
            rtts = interleaved(loops, n, warm, cfg.wire_blocks)
        finally:
            for loop in loops.values():
                loop.close()
        raw, fw, ts = rtts["raw"], rtts["framework"], rtts["torch"]
        raw_s, fw_s, ts_s = summarize(raw, 1e6), summarize(fw, 1e6), summarize(ts, 1e6)
        cases.append({
            "case": case,
            "request_bytes": sum(len(f) for f in req_frames),
            "reply_bytes": sum(len(f) for f in rep_frames),
            "request_torch_save_bytes": len(_torch_blob(request)),
            "reply_torch_save_bytes": len(_torch_blob(reply)),
            "raw_zmq_us": raw_s,
            "framework_us": fw_s,
            "torch_save_us": dict(ts_s, label=TORCH_SAVE_LABEL),
            "overhead_ratio_p50": fw_s["p50"] / raw_s["p50"],
            "overhead_us_p50": fw_s["p50"] - raw_s["p50"],
            "codec": {"request": _codec_us(request, 500), "reply": _codec_us(reply, 500)},
        })
        step(f"wire {case}")
    # The same exchange with the host idle between round trips, as in a real round (the target
    # verifies meanwhile): waking an idle process costs more than the bytes.
    gap = cfg.wire_gap_ms / 1000.0
    request, _ = wire_messages("sampling_q", cfg.q_topk, cfg.feature_size, cfg.feature_rows)
    pn = cfg.wire_paced_rounds
    paced = {"case": "sampling_q", "gap_ms": cfg.wire_gap_ms,
             "raw_zmq_us": None, "framework_us": None}
    loops = {"raw": _raw_loop(eps[("raw", "sampling_q")], _frames_bytes(request), gap, ctx),
             "framework": framework_loop(plain_ep, "sampling_q", gap, ctx)}
    try:
        rtts = interleaved(loops, pn, 3, cfg.wire_blocks)
    finally:
        for loop in loops.values():
            loop.close()
    paced["raw_zmq_us"] = summarize(rtts["raw"], 1e6)
    paced["framework_us"] = summarize(rtts["framework"], 1e6)
    paced["overhead_ratio_p50"] = paced["framework_us"]["p50"] / paced["raw_zmq_us"]["p50"]
    step("wire paced")
    pool.stop("wire-server")
    pool.stop("zero-draftd-features")
    pool.stop("zero-draftd")
    ratios = [c["overhead_ratio_p50"] for c in cases]
    return {
        "description": "round trip of the same bytes on loopback: raw pyzmq DEALER/ROUTER, the full StarSD path "
                       "(client encode, ROUTER, daemon decode + session + zero-time draft + encode, client decode), "
                       "and torch.save/torch.load as a reference",
        "rounds": n,
        "cases": cases,
        "paced": paced,
        "target": {"overhead_ratio_p50_max": 1.5, "worst_ratio_p50": max(ratios), "met": max(ratios) <= 1.5},
    }


# ---------------------------------------------------------------- emulation
def _run_emulated_targets(endpoint: str, n: int, model: TargetModel, warmup_s: float, window_s: float,
                          ctx: zmq.Context, seed: int) -> dict:
    stop = threading.Event()
    targets = [EmulatedTarget(endpoint, model, seed=seed + i, name=f"emu-n{n}-t{i}", ctx=ctx) for i in range(n)]

    def body(t: EmulatedTarget) -> None:
        try:
            t.run(stop)
        except Exception:  # recorded on the target, re-raised below in the caller's thread
            log.exception("emulated target %s failed", t.name)

    threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in targets]
    for th in threads:
        th.start()
    time.sleep(warmup_s)
    s0 = _stats(endpoint, ctx)
    w0 = time.monotonic()
    time.sleep(window_s)
    w1 = time.monotonic()
    s1 = _stats(endpoint, ctx)
    stop.set()
    for th in threads:
        th.join(60)
    failed = [t for t in targets if t.error is not None or not t.rounds]
    if failed:
        raise RuntimeError(f"emulated target {failed[0].name} failed: {failed[0].error}")
    return {"n": n, "targets": targets, "w0": w0, "w1": w1, "s0": s0, "s1": s1}


def emulation_row(run: dict, trace: Trace, busy_idx: BusyIndex, model: plan_mod.Plan, nominal: plan_mod.Plan) -> dict:
    """Measurement for one N from the targets' rounds, the daemon's STATS and its trace, beside
    the analytic model (``model``: S and R with the measured framework costs; ``nominal``: as
    configured). The model's busy fraction counts only the nominal S(d) as busy: the daemon's
    own per-request work is not drafting."""
    n, w0, w1 = run["n"], run["w0"], run["w1"]
    window = w1 - w0
    services = services_between(trace.services, w0, w1)
    per_target, all_rounds, overheads = [], [], []
    for t in run["targets"]:
        rounds = [r for r in t.rounds if w0 <= r.t_done <= w1]
        all_rounds.extend(rounds)
        per_target.append(sum(r.tokens for r in rounds) / window)
        serial = trace.serial_for_seed(t.seed)
        by_pos = {nv: (a, b) for s, a, b, nv in trace.requests if s == serial}
        overheads.extend(framework_overheads(rounds, by_pos, busy_idx))
    tokens = sum(r.tokens for r in all_rounds)
    gaps = idle_gaps(services)
    measured = {
        "window_s": window,
        "rounds": len(all_rounds),
        "system_tps": tokens / window,
        "per_target_tps": statistics.fmean(per_target),
        "per_target_tps_min": min(per_target),
        "per_target_tps_max": max(per_target),
        "rounds_per_s": len(all_rounds) / window,
        "mean_accepted_length": tokens / len(all_rounds) if all_rounds else 0.0,
        "busy_fraction": _busy_fraction(run["s0"], run["s1"]),
        "busy_fraction_trace": sum(b - a for a, b, _ in services) / window,
        "idle_gaps_ms": dict(summarize(gaps, 1e3), total_fraction=sum(gaps) / window,
                             histogram=histogram([g * 1e3 for g in gaps], GAP_EDGES_MS)),
        "per_token_latency_ms": summarize(per_token_latencies([(r.duration, r.tokens) for r in all_rounds]), 1e3),
        "framework_overhead_ms": summarize(overheads, 1e3),
        "fallback_rounds": sum(r.fallback for r in all_rounds),
    }
    pred = dict(model.row(n), busy_fraction=n * nominal.service_ms / model.round_ms(n))
    nom = nominal.row(n)
    return {
        "n": n,
        "label": "emulation",
        "measured": measured,
        "predicted": pred,
        "predicted_nominal": nom,
        "error_pct": {
            "system_tps": relative_error_pct(measured["system_tps"], pred["system_tps"]),
            "rounds_per_s": relative_error_pct(measured["rounds_per_s"], pred["rounds_per_s"]),
            "busy_fraction_points": 100.0 * (measured["busy_fraction"] - pred["busy_fraction"]),
            "system_tps_vs_nominal": relative_error_pct(measured["system_tps"], nom["system_tps"]),
        },
        "alternatives_predicted": {
            "target_alone_system_tps": n * nominal.standalone_tps,
            "colocated_system_tps": n * nominal.colocated_tps,
        },
    }


def emulation_calibration(one: dict, sat: dict, trace: Trace, busy_idx: BusyIndex) -> dict:
    """The framework costs the model adds to R and S, from the two calibration runs: the median
    round-trip overhead of one target (its wait minus all drafting inside it) and the median idle
    gap between services of the saturated daemon (its own per-request loop work)."""
    target = one["targets"][0]
    rounds = [r for r in target.rounds if one["w0"] <= r.t_done <= one["w1"]]
    serial = trace.serial_for_seed(target.seed)
    by_pos = {nv: (a, b) for s, a, b, nv in trace.requests if s == serial}
    overheads = framework_overheads(rounds, by_pos, busy_idx)
    gaps = idle_gaps(services_between(trace.services, sat["w0"], sat["w1"]))
    if not overheads or not gaps:
        raise RuntimeError("the emulation's calibration runs recorded no rounds; is the host overloaded?")
    return {
        "one_target": {"rounds": len(rounds), "overhead_ms": summarize(overheads, 1e3)},
        "saturated": {"targets": len(sat["targets"]), "busy_fraction": _busy_fraction(sat["s0"], sat["s1"]),
                      "idle_gap_ms": summarize(gaps, 1e3)},
        "framework_rtt_ms": 1e3 * statistics.median(overheads),
        "server_ms_per_request": 1e3 * statistics.median(gaps),
        "statistic": "median",
    }


def start_emulation(cfg: BenchConfig, pool: Pool) -> str:
    """The emulated draft daemon (traced, one session at a time: the paper's loop)."""
    return pool.start("emu-draftd", lambda e: _draftd_emulation_args(e, base_ms=cfg.draft_base_ms,
                                                                     per_token_ms=cfg.draft_per_token_ms,
                                                                     depth=cfg.depth, q_topk=cfg.q_topk), traced=True)


def emulation_section(cfg: BenchConfig, pool: Pool, step) -> dict:
    ctx = pool.ctx
    nominal = cfg.emulation_plan()
    tm = TargetModel(verify_ms=cfg.verify_ms, rtt_ms=cfg.rtt_ms, depth=cfg.depth, acceptance=cfg.acceptance,
                     single_ms=cfg.single_ms)
    ep = start_emulation(cfg, pool)
    pool.ready("emu-draftd")
    # Calibration on the sweep's daemon, before the sweep: the framework's costs that the model's
    # S and R must include, as medians (a host that others share has stalls the model is not about).
    # (1) R: what a round trip costs beyond drafting when a target idles V + R between requests,
    #     as under-loaded targets do: one emulated target.
    # (2) S: the daemon's own loop work between two services when requests always wait (a fully
    #     loaded daemon adds it to every service): 2 N_full emulated targets.
    # Both are read off the daemon's trace once the sweep is over, in the calibration windows only.
    t1 = nominal.round_ms(1) / 1000.0
    one = _run_emulated_targets(ep, 1, tm, 2 * t1, max(0.3, cfg.calib_rounds * t1), ctx, seed=cfg.seed + 990_000)
    n_sat = 2 * nominal.n_full
    sat = _run_emulated_targets(ep, n_sat, tm, 2 * nominal.round_ms(n_sat) / 1000.0,
                                max(0.3, cfg.calib_rounds * nominal.service_ms / 1000.0), ctx, seed=cfg.seed + 995_000)
    step("emulation calibration")
    runs = []
    for n in range(1, cfg.n_max + 1):
        window = min(cfg.max_window_s, max(cfg.min_window_s, cfg.min_rounds * nominal.round_ms(n) / n / 1000.0))
        warmup = max(cfg.warmup_s, 2 * nominal.round_ms(n) / 1000.0)
        runs.append(_run_emulated_targets(ep, n, tm, warmup, window, ctx, seed=cfg.seed + 1000 * n))
        step(f"emulation N={n}")
    trace = pool.stop("emu-draftd")
    busy_idx = BusyIndex(trace.services)
    calibration = emulation_calibration(one, sat, trace, busy_idx)
    model = plan_mod.Plan(verify_ms=cfg.verify_ms, rtt_ms=cfg.rtt_ms + calibration["framework_rtt_ms"],
                          depth=cfg.depth, acceptance=cfg.acceptance,
                          draft_ms=nominal.service_ms + calibration["server_ms_per_request"], single_ms=cfg.single_ms)
    rows = [emulation_row(run, trace, busy_idx, model, nominal) for run in runs]
    nf = model.n_full
    full_rows = [r for r in rows if r["n"] >= nf]
    within = [r for r in rows if r["n"] <= 16]
    return {
        "label": EMULATION_LABEL,
        "params": {"draft_base_ms": cfg.draft_base_ms, "draft_per_token_ms": cfg.draft_per_token_ms,
                   "service_ms": nominal.service_ms, "verify_ms": cfg.verify_ms, "rtt_ms": cfg.rtt_ms,
                   "single_ms": nominal.v1_ms, "depth": cfg.depth, "acceptance": cfg.acceptance,
                   "batch_max": 1, "min_rounds": cfg.min_rounds},
        "calibration": calibration,
        "model": dict(model.summary(), note="S and R include the framework costs measured in calibration"),
        "model_nominal": nominal.summary(),
        "rows": rows,
        "targets": {
            "n_full": nf,
            "busy_fraction_min_from_n_full": min((r["measured"]["busy_fraction"] for r in full_rows), default=None),
            "busy_ge_95_from_n_full": (all(r["measured"]["busy_fraction"] >= 0.95 for r in full_rows)
                                       if full_rows else None),
            "max_abs_error_pct": max(abs(r["error_pct"]["system_tps"]) for r in within),
            "throughput_within_10pct": all(abs(r["error_pct"]["system_tps"]) <= 10.0 for r in within),
            "max_abs_error_pct_nominal": max(abs(r["error_pct"]["system_tps_vs_nominal"]) for r in within),
            "max_abs_timing_error_pct": max(abs(r["error_pct"]["rounds_per_s"]) for r in within),
        },
    }


# ---------------------------------------------------------------- real models
@contextlib.contextmanager
def quiet_transformers():
    """No progress bars or deprecation chatter from transformers while the bench loads models in
    its own process (the bench draws its own progress bar)."""
    import transformers.utils.logging as tlog

    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


def make_tiny_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Tiny random checkpoints for quick runs: a 2-layer target and, as its draft, the same weights
    (so drafts are mostly accepted and rounds carry several tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, make_byte_tokenizer

    target = root / "tiny-target"
    if not (target / "config.json").is_file():
        config = LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=0.3,
                             tie_word_embeddings=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.mul_(4.0)  # sharp logits: no near-ties for chunked and step-by-step forwards to break apart
            head[EOS_ID].zero_()  # rare EOS: generations run their length
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target)
        make_byte_tokenizer().save_pretrained(target)
    return target, target


def measure_target_forward(target_dir: Path, depth: int, reps: int = 30) -> dict:
    """V: the target's forward over [last token, x_1..x_d] after a 64-token prefix, and V1: its
    single-token forward (one thread, median of ``reps``)."""
    from common.models import crop_cache, load_causal_lm, new_cache

    loaded = load_causal_lm(str(target_dir), progress=False)
    model = loaded.model
    prefix = torch.tensor([[3 + (7 * i) % 200 for i in range(64)]])
    out = {}
    with torch.inference_mode():
        cache = new_cache(model)
        model(input_ids=prefix, cache=cache, use_cache=True)
        for name, width in (("verify_ms", depth + 1), ("single_ms", 1)):
            ids = torch.tensor([[5] * width])
            times = []
            for _ in range(reps + 3):
                t0 = time.perf_counter()
                model(input_ids=ids, cache=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
                crop_cache(cache, 64)
            out[name] = 1000.0 * statistics.median(times[3:])
    return out


def _run_jobs(endpoints: list[str], prompts: list[list[str]], max_tokens: int, no_draft: bool, ctx: zmq.Context,
              timeout_s: float) -> dict:
    """Each target runs its prompts one after another, all targets at once, through GENERATE."""
    results: list[list[dict]] = [[] for _ in endpoints]
    failures: list[BaseException] = []

    def worker(i: int, ep: str) -> None:
        try:
            with ControlClient(ep, ctx) as cc:
                for j, prompt in enumerate(prompts[i]):
                    msg = Message(MsgType.GENERATE, {"id": j + 1, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0.0, "no_draft": no_draft})
                    h = cc.call(msg, timeout_s).header
                    results[i].append({"stats": h["stats"], "token_ids": h["token_ids"]})
        except Exception as exc:  # re-raised below, in the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i, ep)) for i, ep in enumerate(endpoints)]
    t0, w0 = time.perf_counter(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, w1 = time.perf_counter() - t0, time.monotonic()
    if failures:
        raise RuntimeError(f"a bench job failed: {failures[0]}") from failures[0]
    return {"wall_s": wall, "w0": w0, "w1": w1, "results": results}


def _phase_summary(phase: dict) -> dict:
    res = phase["results"]
    per_target = []
    tokens = rounds = fallback = 0
    for jobs in res:
        t = sum(j["stats"]["generated"] for j in jobs)
        w = sum(j["stats"]["wall_s"] for j in jobs)
        per_target.append(t / w if w else 0.0)
        tokens += t
        rounds += sum(j["stats"]["rounds"] for j in jobs)
        fallback += sum(j["stats"]["fallback_rounds"] for j in jobs)
    job_tpot = [(j["stats"]["wall_s"] - j["stats"]["prefill_s"]) / j["stats"]["generated"]
                for jobs in res for j in jobs if j["stats"]["generated"]]
    return {"system_tps": tokens / phase["wall_s"], "per_target_tps": statistics.fmean(per_target),
            "per_target_tps_min": min(per_target), "per_target_tps_max": max(per_target),
            "tokens": tokens, "rounds": rounds, "mean_accepted_length": tokens / rounds if rounds else 0.0,
            "fallback_rounds": fallback, "wall_s": phase["wall_s"],
            "per_job_time_per_token_ms": summarize(job_tpot, 1e3)}


def colocated_baseline(target_dir: Path, draft_dir: Path, prompts: list[str], max_tokens: int) -> dict:
    """transformers' co-located speculative decoding (``generate(assistant_model=...)``) and the
    target's own ``generate``, in this process, one thread, greedy, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True).eval()
        draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32, local_files_only=True).eval()
        gen_kw = dict(do_sample=False, max_new_tokens=max_tokens, pad_token_id=tok.pad_token_id,
                      eos_token_id=target.generation_config.eos_token_id)
        out: dict = {}
        for name, extra in (("assisted", {"assistant_model": draft}), ("target_generate", {})):
            jobs = []
            for i, prompt in enumerate([prompts[0], *prompts]):  # the first run warms up and is not counted
                ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
                t0 = time.perf_counter()
                with torch.inference_mode():
                    seq = target.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw, **extra)
                wall = time.perf_counter() - t0
                if i:
                    jobs.append({"tokens": seq.shape[1] - ids.shape[1], "wall_s": wall,
                                 "token_ids": seq[0, ids.shape[1]:].tolist()})
            tokens, wall = sum(j["tokens"] for j in jobs), sum(j["wall_s"] for j in jobs)
            out[name] = {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                         "per_job_time_per_token_ms": summarize(
                             [j["wall_s"] / j["tokens"] for j in jobs if j["tokens"]], 1e3),
                         "token_ids": [j["token_ids"] for j in jobs]}
        gc = draft.generation_config
        out["assistant_settings"] = {k: getattr(gc, k, None) or "transformers default"
                                     for k in ("num_assistant_tokens", "num_assistant_tokens_schedule")}
        return out
    finally:
        torch.set_num_threads(threads)


def start_real(cfg: BenchConfig, pool: Pool, models: tuple[Path, Path]) -> tuple[list[str], list[str]]:
    """The real section's draft daemon (real draft model, traced, one session at a time) and its
    target daemons; returns the targets' endpoints and names."""
    target_dir, draft_dir = models
    draft_ep = pool.start("real-draftd", lambda ep: [
        "starsd_draftd.emulation", "serve", "--backend", "model", "--model", str(draft_dir), "--bind", ep,
        "--depth", str(cfg.depth), "--batch-max", str(cfg.real_batch_max), "--q-topk", str(cfg.q_topk),
        "--threads", "1", "--log-level", "warning"], traced=True)
    names = [f"real-target{i + 1}" for i in range(min(cfg.real_n_max, cfg.n_max))]
    target_eps = [pool.start(name, lambda ep, i=i: [
        "starsd_target", "serve", "--model", str(target_dir), "--draft", draft_ep, "--listen", ep,
        "--depth", str(cfg.depth), "--threads", "1", "--name", f"target{i + 1}", "--connect-timeout",
        str(cfg.startup_timeout_s), "--draft-timeout", "30", "--heartbeat", "0.5", "--log-level", "warning"])
        for i, name in enumerate(names)]
    return target_eps, names


def real_measure(cfg: BenchConfig, pool: Pool, step, models: tuple[Path, Path]) -> dict:
    """Start the draft daemon (traced, one session at a time) and N_real target daemons, then for
    N = 1..N_real run the same jobs with speculation and by the targets alone. The draft daemon
    stays up (the batched section measures its one-at-a-time capacity); ``real_finish`` stops it."""
    ctx = pool.ctx
    n_real = min(cfg.real_n_max, cfg.n_max)
    target_eps, names = start_real(cfg, pool, models)
    draft_ep = pool.endpoints["real-draftd"]
    pool.ready("real-draftd", *names)
    _wait_draft_link(target_eps, cfg.startup_timeout_s, ctx)
    warm = [[DEMO_PROMPTS[i % len(DEMO_PROMPTS)]] for i in range(n_real)]
    _run_jobs(target_eps, warm, 8, False, ctx, cfg.startup_timeout_s)
    _run_jobs(target_eps, warm, 8, True, ctx, cfg.startup_timeout_s)
    step("real warm-up")
    phases = []
    for n in range(1, n_real + 1):
        prompts = [[DEMO_PROMPTS[(i * cfg.jobs_per_target + j) % len(DEMO_PROMPTS)]
                    for j in range(cfg.jobs_per_target)] for i in range(n)]
        s0 = _stats(draft_ep, ctx)
        spec = _run_jobs(target_eps[:n], prompts, cfg.max_tokens, False, ctx, cfg.startup_timeout_s)
        s1 = _stats(draft_ep, ctx)
        alone = _run_jobs(target_eps[:n], prompts, cfg.max_tokens, True, ctx, cfg.startup_timeout_s)
        phases.append({"n": n, "spec": spec, "alone": alone, "busy": _busy_fraction(s0, s1),
                       "requests": s1["requests"] - s0["requests"], "busy_s": s1["busy_s"] - s0["busy_s"]})
        step(f"real N={n}")
    return {"phases": phases, "targets": names, "models": models}


def _train_summary(path: Path) -> dict | None:
    """What the demo pair's training report says about it (None for other checkpoints)."""
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {"recipe_version": rep.get("recipe_version"),
            "target_params": rep.get("target", {}).get("params"),
            "draft_params": rep.get("draft", {}).get("params"),
            "agreement": rep.get("agreement")}


def real_finish(cfg: BenchConfig, pool: Pool, raw: dict, step) -> dict:
    """Stop the real daemons, read the draft daemon's trace, then run the co-located baseline and
    time the target's forwards on the now idle machine."""
    trace = pool.stop("real-draftd")
    for name in raw["targets"]:
        pool.stop(name)
    target_dir, draft_dir = raw["models"]
    rows = []
    same_all = True
    for ph in raw["phases"]:
        spec, alone = ph["spec"], ph["alone"]
        sp, al = _phase_summary(spec), _phase_summary(alone)
        same = all(a["token_ids"] == b["token_ids"] for ja, jb in zip(spec["results"], alone["results"])
                   for a, b in zip(ja, jb))
        same_all = same_all and same
        reqs = [r for r in trace.requests if spec["w0"] <= r[1] <= spec["w1"]]
        gaps = idle_gaps(services_between(trace.services, spec["w0"], spec["w1"]))
        rows.append({
            "n": ph["n"],
            "starsd": dict(sp, draft_busy_fraction=ph["busy"],
                           draft_service_ms_per_request=(1000.0 * ph["busy_s"] / ph["requests"]
                                                         if ph["requests"] else None),
                           idle_gaps_ms=dict(summarize(gaps, 1e3), histogram=histogram([g * 1e3 for g in gaps],
                                                                                       GAP_EDGES_MS)),
                           per_token_latency_ms=summarize(per_token_latencies(session_rounds(reqs)), 1e3)),
            "alone": al,
            "speedup_system": sp["system_tps"] / al["system_tps"] if al["system_tps"] else None,
            "greedy_same_tokens_as_alone": same,
        })
    flat_prompts = [DEMO_PROMPTS[j % len(DEMO_PROMPTS)] for j in range(cfg.jobs_per_target)]
    with quiet_transformers():
        colocated = colocated_baseline(target_dir, draft_dir, flat_prompts, cfg.max_tokens)
    alone1 = raw["phases"][0]["alone"]["results"][0]
    colocated["assisted_same_tokens_as_starsd_alone"] = colocated["assisted"]["token_ids"] == [
        j["token_ids"] for j in alone1]
    for k in ("assisted", "target_generate"):
        colocated[k].pop("token_ids")
    step("real co-located")
    with quiet_transformers():
        forward = measure_target_forward(target_dir, cfg.depth)
    step("real forward timing")
    return {
        "label": "real models on this machine's CPU: N target daemons and the draft daemon share its cores",
        "models": {"target": str(target_dir), "draft": str(draft_dir), "kind": cfg.models,
                   "training": _train_summary(Path(target_dir).parent / "train_report.json")},
        "config": {"jobs_per_target": cfg.jobs_per_target, "max_tokens": cfg.max_tokens, "depth": cfg.depth,
                   "temperature": 0.0, "draft_batch_max": cfg.real_batch_max, "threads_per_process": 1},
        "rows": rows,
        "greedy_outputs_identical": same_all,
        "colocated": colocated,
        "target_forward_ms": forward,
        "notes": ["per-token latency of StarSD rounds is measured on the draft side (successive requests of a "
                  "session are one round apart); the target alone and transformers report whole jobs only, so "
                  "their per-token figures are per-job means",
                  "co-located runs one stream on an otherwise idle machine"],
    }


def _real_plan(real: dict, wire_rtt_ms: float, depth: int, n_max: int, service_ms: float) -> dict:
    """The analytic model for these real models if each target had its own device: S from the
    draft daemon, V and V1 timed in-process, R the loopback framework round trip, and the
    acceptance whose i.i.d. E matches the mean accepted length measured at N = 1."""
    e = min(max(real["rows"][0]["starsd"]["mean_accepted_length"], 1.0), depth + 1.0)
    fwd = real["target_forward_ms"]
    p = plan_mod.Plan(verify_ms=fwd["verify_ms"], rtt_ms=wire_rtt_ms, depth=depth,
                      acceptance=plan_mod.acceptance_for_tokens_per_round(e, depth), draft_ms=service_ms,
                      single_ms=fwd["single_ms"])
    return dict(p.summary(), table=p.table(n_max),
                note="sizing estimate for one accelerator per target; on this CPU the processes share cores")


# ---------------------------------------------------------------- batched drafting
def start_batched(cfg: BenchConfig, pool: Pool, draft_dir: Path) -> tuple[str, dict[str, str]]:
    """Draft daemons with the real draft model, all through the same traced launcher and
    DraftServer: one session at a time (the real section's when it runs), batch_max at a time
    strictly work-conserving, and batch_max at a time with a batch window."""
    def args(b: int, window_ms: float = 0.0):
        return lambda ep: ["starsd_draftd.emulation", "serve", "--backend", "model", "--model", str(draft_dir),
                           "--bind", ep, "--depth", str(cfg.depth), "--batch-max", str(b), "--batch-window-ms",
                           str(window_ms), "--q-topk", str(cfg.q_topk), "--threads", "1", "--log-level", "warning"]

    one_name = "real-draftd" if "real" in cfg.sections and cfg.real_batch_max == 1 else "batch1-draftd"
    if one_name == "real-draftd" and not pool.running("real-draftd"):
        raise RuntimeError("the real section's draft daemon is needed for the one-at-a-time capacity")
    b = cfg.batch_max
    return one_name, {"one": pool.start(one_name, args(1)),
                      "batched": pool.start(f"batch{b}-draftd", args(b)),
                      "windowed": pool.start(f"batch{b}-window-draftd", args(b, cfg.batch_window_ms))}


def random_eagle_head(target_dir: Path, out: Path, seed: int = 0) -> Path:
    """An EAGLE head with random weights, shaped for ``target_dir`` and written in EAGLE's layout:
    enough to time the EAGLE backend (not to draft well)."""
    from transformers import AutoConfig

    from starsd_draftd.eagle_compat import build_head
    from starsd_draftd.eagle_train import head_config_for, save_eagle_head

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
        return lambda ep: ["starsd_draftd.emulation", "serve", "--backend", "eagle", "--eagle-head", str(head_dir),
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
        loaded = load_causal_lm(str(draft_dir), progress=False)
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
    if one_name != "real-draftd":
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
    n_steps = {"wire": len(WIRE_CASES) + 1, "emulation": cfg.n_max + 1,
               "real": min(cfg.real_n_max, cfg.n_max) + 3,
               "batched": 2 * len(set(cfg.batch_ks) | {cfg.batch_max}) + 3}
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
        if {"real", "batched"} & set(cfg.sections):
            if cfg.models == "tiny":
                with quiet_transformers():
                    models = timed("models", lambda: make_tiny_pair(workdir, cfg.seed))
            else:
                from common.demo_models import ensure_demo_pair

                # trains the pair once (minutes) when it is not cached yet; reported apart from the measurement
                models = timed("models", lambda: ensure_demo_pair(progress=cfg.progress))
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
        if "wire" in cfg.sections:
            report["wire"] = timed("wire", lambda: wire_section(cfg, pool, step))
        if "emulation" in cfg.sections:
            report["emulation"] = timed("emulation", lambda: emulation_section(cfg, pool, step))
        real_raw = None
        if "real" in cfg.sections:
            real_raw = timed("real", lambda: real_measure(cfg, pool, step, models))
        if "batched" in cfg.sections:
            report["batched"] = timed("batched", lambda: batched_section(cfg, pool, step, models[1], models[0]))
        if real_raw is not None:
            report["real"] = timed("real", lambda: real_finish(cfg, pool, real_raw, step))
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


def _derive(report: dict, cfg: BenchConfig) -> None:
    """Cross-section results: the real models' sizing plan, batched N_full, the targets' summary."""
    wire_rtt = None
    if "emulation" in report:
        wire_rtt = max(0.0, report["emulation"]["calibration"]["framework_rtt_ms"])
    elif "wire" in report:
        wire_rtt = report["wire"]["paced"]["framework_us"]["mean"] / 1000.0
    batched = report.get("batched")
    real = report.get("real")
    if real is not None and wire_rtt is not None:
        s1 = real["rows"][0]["starsd"]["draft_service_ms_per_request"]
        if batched and batched.get("available"):
            s1 = batched["service_ms_per_request_one_at_a_time"]
        if s1:
            real["plan"] = _real_plan(real, wire_rtt, cfg.depth, cfg.n_max, s1)
    if batched and batched.get("available"):
        v_r = (cfg.verify_ms + cfg.rtt_ms, "emulation parameters")
        if real is not None and wire_rtt is not None:
            v_r = (real["target_forward_ms"]["verify_ms"] + wire_rtt, "real target forward + loopback round trip")

        def n_full(section: dict) -> dict:
            return {"one_at_a_time": plan_mod.n_full(section["service_ms_per_request_one_at_a_time"], v_r[0], 0.0),
                    "batched": plan_mod.n_full(section["service_ms_per_request_batched"], v_r[0], 0.0),
                    "verify_plus_rtt_ms": v_r[0], "from": v_r[1]}

        batched["n_full"] = dict(n_full(batched),
                                 note="capacity-equivalent: S = 1 / requests per second with k = batch_max waiting")
        eagle = batched.get("eagle", {})
        if eagle.get("available"):
            eagle["n_full"] = n_full(eagle)
    summary = {}
    if "wire" in report:
        summary["overhead_ratio_p50_le_1_5"] = report["wire"]["target"]
    if "emulation" in report:
        t = report["emulation"]["targets"]
        summary["emulation_busy_ge_95_from_n_full"] = {"met": t["busy_ge_95_from_n_full"], "n_full": t["n_full"],
                                                       "min": t["busy_fraction_min_from_n_full"]}
        summary["emulation_throughput_within_10pct"] = {"met": t["throughput_within_10pct"],
                                                        "max_abs_error_pct": t["max_abs_error_pct"]}
    if batched is not None:
        summary["batched_capacity_ge_3x"] = batched.get("target", {"met": None, "reason": batched.get("reason")})
    report["targets"] = summary


def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_report(report: dict) -> str:
    """The report as Markdown tables (printed by the CLI, written to bench.md, pasted in the README)."""
    m = report["machine"]
    lines = [f"# StarSD bench ({report['mode']}, {report['created']})", "",
             f"Machine: {m['cpu']}, {m['usable_cores']} usable cores"
             f"{' (virtual machine)' if m['virtualized'] else ''}, "
             f"{m['memory_gib']} GiB, accelerator: {m['accelerator']}; Python {m['python']}, torch {m['torch']}, "
             f"transformers {m['transformers']}, pyzmq {m['pyzmq']} (libzmq {m['libzmq']}).", ""]
    if "wire" in report:
        w = report["wire"]
        lines += ["## Wire cost per round trip (loopback, back to back)", "",
                  "| payload | request B | reply B | raw pyzmq p50 / p99 us | StarSD path p50 / p99 us | ratio p50 | "
                  "torch.save p50 / p99 us (reference) |", "|---|---|---|---|---|---|---|"]
        for c in w["cases"]:
            lines.append(f"| {c['case']} | {c['request_bytes']} | {c['reply_bytes']} | "
                         f"{c['raw_zmq_us']['p50']:.0f} / {c['raw_zmq_us']['p99']:.0f} | "
                         f"{c['framework_us']['p50']:.0f} / {c['framework_us']['p99']:.0f} | "
                         f"{c['overhead_ratio_p50']:.2f}x | {c['torch_save_us']['p50']:.0f} / "
                         f"{c['torch_save_us']['p99']:.0f} |")
        p = w["paced"]
        lines += ["", f"With the host idle {p['gap_ms']:.0f} ms between round trips ({p['case']}): raw "
                      f"{p['raw_zmq_us']['p50']:.0f} us, StarSD {p['framework_us']['p50']:.0f} us p50 "
                      f"({p['overhead_ratio_p50']:.2f}x). torch.save rows: {TORCH_SAVE_LABEL}.", ""]
    if "emulation" in report:
        e = report["emulation"]
        pr = e["params"]
        mo = e["model"]
        lines += ["## EMULATION: one draft daemon, N emulated targets", "",
                  f"*{e['label']}.* S(d) = {pr['draft_base_ms']:g} + {pr['draft_per_token_ms']:g} d = "
                  f"{pr['service_ms']:g} ms, V = {pr['verify_ms']:g} ms, R = {pr['rtt_ms']:g} ms (emulated), "
                  f"d = {pr['depth']}, acceptance {pr['acceptance']:g}. Model with the measured framework costs: "
                  f"S = {mo['service_ms']:.2f} ms, R = {mo['params']['rtt_ms']:.2f} ms, N_full = {mo['n_full']} "
                  f"(nominal {e['model_nominal']['n_full']}).", "",
                  "| N | system tok/s | predicted | error | per-target tok/s | mean acc. len | busy | predicted busy | "
                  "idle gap p50 / p99 ms | per-token ms p50 / p99 / std | overhead ms p50 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in e["rows"]:
            me, pd = r["measured"], r["predicted"]
            g, lat, ov = me["idle_gaps_ms"], me["per_token_latency_ms"], me["framework_overhead_ms"]
            lines.append(f"| {r['n']} | {me['system_tps']:.1f} | {pd['system_tps']:.1f} | "
                         f"{r['error_pct']['system_tps']:+.1f}% | {me['per_target_tps']:.1f} | "
                         f"{me['mean_accepted_length']:.2f} | {100 * me['busy_fraction']:.1f}% | "
                         f"{100 * pd['busy_fraction']:.1f}% | {_fmt(g['p50'], '.2f')} / {_fmt(g['p99'], '.2f')} | "
                         f"{lat['p50']:.2f} / {lat['p99']:.2f} / {lat['std']:.2f} | {_fmt(ov['p50'], '.2f')} |")
        lines.append("")
    if "real" in report:
        r = report["real"]
        tr = r["models"].get("training") or {}
        agree = (tr.get("agreement") or {}).get("heldout_top1")
        about = (f" Demo pair {tr.get('recipe_version')}: target {tr.get('target_params')} parameters, draft "
                 f"{tr.get('draft_params')}, held-out top-1 agreement {agree}." if tr else "")
        lines += [f"## Real models on this CPU ({r['models']['kind']} pair)", "", f"*{r['label']}.*{about}", "",
                  "| N | StarSD system tok/s | per-target | target alone system tok/s | per-target | speedup | "
                  "mean acc. len | draft busy | idle gap p50 ms | per-token ms p50 / p99 / std |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            s, a = row["starsd"], row["alone"]
            lat = s["per_token_latency_ms"]
            lines.append(f"| {row['n']} | {s['system_tps']:.1f} | {s['per_target_tps']:.1f} | {a['system_tps']:.1f} | "
                         f"{a['per_target_tps']:.1f} | {row['speedup_system']:.2f}x | "
                         f"{s['mean_accepted_length']:.2f} | "
                         f"{100 * s['draft_busy_fraction']:.0f}% | {_fmt(s['idle_gaps_ms']['p50'], '.2f')} | "
                         f"{_fmt(lat['p50'], '.2f')} / {_fmt(lat['p99'], '.2f')} / {_fmt(lat['std'], '.2f')} |")
        c = r["colocated"]
        lines += ["", f"Co-located, one stream (transformers `generate(assistant_model=...)`): "
                      f"{c['assisted']['tokens_per_s']:.1f} tok/s; transformers target alone "
                      f"{c['target_generate']['tokens_per_s']:.1f} tok/s. Greedy outputs identical to the target "
                      f"alone: {'yes' if r['greedy_outputs_identical'] else 'NO'}."]
        if "plan" in r:
            pl = r["plan"]
            lines.append(f"Sizing estimate with one device per target (S = {pl['service_ms']:.2f} ms, V = "
                         f"{pl['params']['verify_ms']:.2f} ms, R = {pl['params']['rtt_ms']:.2f} ms, E = "
                         f"{pl['tokens_per_round']:.2f}): N_full = {pl['n_full']}, saturated "
                         f"{pl['saturated_system_tps']:.0f} tok/s.")
        lines.append("")
    if "batched" in report:
        b = report["batched"]
        lines += ["## Batched drafting (draft service capacity)", ""]
        if not b["available"]:
            lines.append(f"not available: {b['reason']}")
        else:
            lines += ["| batch_max | batch window ms | k waiting | requests/s | mean batch | busy |",
                      "|---|---|---|---|---|---|"]
            window = b.get("batch_window_ms", 0.0)
            for bm, w, runs in ((1, 0.0, b["one_at_a_time"]), (b["batch_max"], 0.0, b["batched"]),
                                (b["batch_max"], window, b.get("windowed", []))):
                for x in runs:
                    lines.append(f"| {bm} | {w:g} | {x['k']} | {x['requests_per_s']:.0f} | "
                                 f"{_fmt(x['mean_batch'], '.2f')} | {100 * x['busy_fraction']:.0f}% |")
            nf = b.get("n_full", {})
            best = b["capacity_gain_best"]
            lines += ["", f"Capacity gain with {b['batch_max']} sessions in the loop: {b['capacity_gain']:.2f}x with a "
                          f"{window:g} ms batch window, {_fmt(b.get('capacity_gain_work_conserving'), '.2f')}x "
                          f"strictly work-conserving (best: {best['gain']:.2f}x with {best['k']}, mean batch "
                          f"{_fmt(best['mean_batch'], '.1f')}); N_full "
                          f"{nf.get('one_at_a_time', '-')} -> {nf.get('batched', '-')} (V + R = "
                          f"{_fmt(nf.get('verify_plus_rtt_ms'), '.2f')} ms, {nf.get('from', '-')})."]
            e = b.get("eagle", {})
            if e.get("available"):
                enf = e.get("n_full", {})
                lines += ["", f"EAGLE backend ({e['label']}; hidden size {e['hidden_size']}): "
                              f"{e['one_at_a_time']['requests_per_s']:.0f} requests/s one at a time, "
                              f"{e['windowed']['requests_per_s']:.0f} with batch_max {b['batch_max']} and the "
                              f"{window:g} ms window (mean batch {_fmt(e['windowed']['mean_batch'], '.2f')}): "
                              f"{e['capacity_gain']:.2f}x; N_full {enf.get('one_at_a_time', '-')} -> "
                              f"{enf.get('batched', '-')}."]
            elif e:
                lines += ["", f"EAGLE backend: not measured ({e.get('reason')})."]
        lines.append("")
    if report.get("targets"):
        lines += ["## Targets", ""]
        for k, v in report["targets"].items():
            met = v.get("met")
            detail = ", ".join(f"{a}={_fmt(b, '.3g') if isinstance(b, float) else b}"
                               for a, b in v.items() if a != "met")
            lines.append(f"- {k}: {'met' if met else ('n/a' if met is None else 'NOT met')} ({detail})")
        lines.append("")
    prep = report.get("section_wall_s", {}).get("models", 0.0)
    lines.append(f"Bench wall time: {report['wall_s']:.0f} s" + (f" (of which {prep:.0f} s preparing the models)"
                                                                 if prep >= 1 else "") + ".")
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    """Throughput and busy fraction versus N, measured beside predicted (Agg backend, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_t, ax_b), (ax_r, ax_c) = axes
    e = report.get("emulation")
    if e:
        ns = [r["n"] for r in e["rows"]]
        ax_t.plot(ns, [r["measured"]["system_tps"] for r in e["rows"]], "o", label="measured")
        ax_t.plot(ns, [r["predicted"]["system_tps"] for r in e["rows"]], "-", label="model (measured framework costs)")
        ax_t.plot(ns, [r["predicted_nominal"]["system_tps"] for r in e["rows"]], ":", label="model (nominal)")
        ax_t.plot(ns, [r["alternatives_predicted"]["target_alone_system_tps"] for r in e["rows"]], "--",
                  color="gray", label="N targets alone, one device each (model)")
        ax_t.axvline(e["model"]["n_full"], color="k", lw=0.8, ls="--")
        ax_t.set_ylim(0, 1.15 * max(max(r["predicted"]["system_tps"], r["measured"]["system_tps"]) for r in e["rows"]))
        ax_t.set_title("EMULATION: system throughput vs N", fontsize=10)
        ax_t.set_xlabel("targets N")
        ax_t.set_ylabel("tokens/s")
        ax_t.legend(fontsize=8)
        ax_b.plot(ns, [100 * r["measured"]["busy_fraction"] for r in e["rows"]], "o", label="measured (STATS busy_s)")
        ax_b.plot(ns, [100 * r["predicted"]["busy_fraction"] for r in e["rows"]], "-", label="model")
        ax_b.axhline(95, color="gray", lw=0.8, ls=":")
        ax_b.axvline(e["model"]["n_full"], color="k", lw=0.8, ls="--", label=f"N_full = {e['model']['n_full']}")
        ax_b.set_ylim(0, 105)
        ax_b.set_title("EMULATION: draft busy fraction vs N", fontsize=10)
        ax_b.set_xlabel("targets N")
        ax_b.set_ylabel("% of wall time drafting")
        ax_b.legend(fontsize=8)
    else:
        for ax in (ax_t, ax_b):
            ax.text(0.5, 0.5, "emulation not run", ha="center", va="center")
    r = report.get("real")
    if r:
        ns = [row["n"] for row in r["rows"]]
        ax_r.plot(ns, [row["starsd"]["system_tps"] for row in r["rows"]], "o-", label="StarSD")
        ax_r.plot(ns, [row["alone"]["system_tps"] for row in r["rows"]], "s--", label="target alone")
        ax_r.plot([1], [r["colocated"]["assisted"]["tokens_per_s"]], "^", label="co-located (transformers), 1 stream")
        ax_r.set_title(f"real {r['models']['kind']} models on this CPU ({report['machine']['usable_cores']} cores "
                       "shared)", fontsize=10)
        ax_r.set_xlabel("targets N")
        ax_r.set_ylabel("system tokens/s")
        ax_r.set_ylim(bottom=0)
        ax_r.legend(fontsize=8)
    else:
        ax_r.text(0.5, 0.5, "real models not run", ha="center", va="center")
    b = report.get("batched")
    if b and b.get("available"):
        ax_c.plot([x["k"] for x in b["batched"]], [x["requests_per_s"] for x in b["batched"]], "o-",
                  label=f"batch_max {b['batch_max']}")
        if b.get("windowed"):
            ax_c.plot([x["k"] for x in b["windowed"]], [x["requests_per_s"] for x in b["windowed"]], "^-",
                      label=f"batch_max {b['batch_max']}, {b['batch_window_ms']:g} ms window")
        ax_c.plot([x["k"] for x in b["one_at_a_time"]], [x["requests_per_s"] for x in b["one_at_a_time"]], "s",
                  label="one at a time")
        ax_c.set_title(f"draft capacity, real draft model (gain {b['capacity_gain']:.1f}x at k = {b['batch_max']})",
                       fontsize=10)
        ax_c.set_xlabel("sessions waiting k")
        ax_c.set_ylabel("draft requests/s")
        ax_c.set_ylim(bottom=0)
        ax_c.legend(fontsize=8)
    else:
        ax_c.text(0.5, 0.5, "batched drafting not available" if b else "batched not run", ha="center", va="center")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_t, ax_b, ax_r, ax_c):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    m = report["machine"]
    fig.suptitle(f"StarSD bench ({report['mode']}): {m['cpu']}, {m['usable_cores']} cores, {m['accelerator']}",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- helper process entry
@click.group()
def main() -> None:
    """Helper processes for `starsd-draftd bench`."""


@main.command("wire-server")
@click.option("--spec", required=True, help="JSON list of {mode: raw|torch, case, endpoint}.")
@click.option("--q-topk", type=int, default=32)
@click.option("--feature-size", type=int, default=4096)
@click.option("--feature-rows", type=int, default=3)
def wire_server(spec, q_topk, feature_size, feature_rows) -> None:
    """The raw pyzmq and torch.save counterparts of the draft daemon, for the wire-cost section."""
    run_wire_server(json.loads(spec), q_topk, feature_size, feature_rows)


if __name__ == "__main__":
    sys.exit(main())
