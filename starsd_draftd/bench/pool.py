"""The bench's daemons, each started once and shared by the sections that use it, and the draft
service capacity probe."""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch
import zmq

from common.control import ControlClient
from common.sockets import free_tcp_endpoint
from common.tensors import to_wire
from common.verify import SamplingParams
from starsd_draftd.bench.procs import ProcessSet
from starsd_draftd.bench.emulation import EMU_FINGERPRINT, EMU_VOCAB
from starsd_draftd.bench.trace import Trace

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- shared plumbing
def emulation_max_depth(depth: int) -> int:
    """The emulated draft daemon's --depth for a bench at ``depth``."""
    return max(depth, 8)


def _draftd_emulation_args(endpoint: str, *, base_ms: float, per_token_ms: float, depth: int, batch_max: int = 1,
                           feature_size: int = 0, q_topk: int = 32, lookahead: bool = False) -> list[str]:
    return ["starsd_draftd.bench.emulation_serve", "serve", "--bind", endpoint, "--draft-base-ms", str(base_ms),
            "--draft-per-token-ms", str(per_token_ms), "--depth", str(emulation_max_depth(depth)),
            "--batch-max", str(batch_max),
            "--feature-size", str(feature_size), "--q-topk", str(q_topk), "--log-level", "warning",
            "--lookahead" if lookahead else "--no-lookahead"]


def _stats(endpoint: str, ctx: zmq.Context) -> dict:
    with ControlClient(endpoint, ctx) as cc:
        return cc.stats(timeout_s=10.0)


def _busy_fraction(s0: dict, s1: dict) -> float:
    return (s1["busy_s"] - s0["busy_s"]) / max(1e-9, s1["uptime_s"] - s0["uptime_s"])


class Pool:
    """The bench's daemons as child processes (a ProcessSet), each started once and shared by
    the sections that use it; a traced daemon's trace is read when it stops."""

    def __init__(self, workdir: Path, ctx: zmq.Context, startup_timeout_s: float):
        self.workdir = workdir
        self.ctx = ctx
        self.timeout_s = startup_timeout_s
        self.procs = ProcessSet(workdir, ctx)
        self.endpoints: dict[str, str] = {}
        self._traces: dict[str, Path] = {}
        self._starting: set[str] = set()
        self.state: dict = {}  # what a section's start-up decided (endpoints of helper processes)

    def start(self, name: str, args_for, traced: bool = False, stats: bool = True, cpus=None,
              jobs: bool = False) -> str:
        """Start ``python -m *args_for(endpoint)`` unless running; returns its endpoint: a free
        loopback one, or, for a target daemon's job socket (``jobs``), a private ipc one."""
        if name in self.endpoints:
            return self.endpoints[name]
        ep = self.procs.job_endpoint(name) if jobs else free_tcp_endpoint()
        args = list(args_for(ep))
        if traced:
            self._traces[name] = self.workdir / f"{name}-trace.json"
            args += ["--trace", str(self._traces[name])]
        self.procs.start(name, *args, cpus=cpus)
        self.endpoints[name] = ep
        if stats:
            self._starting.add(name)
        return ep

    def ready(self, *names: str) -> None:
        """Wait until the named daemons answer STATS."""
        for name in names:
            if name in self._starting:
                self.procs.wait_ready(name, self.endpoints[name], self.timeout_s)
                self._starting.discard(name)

    def running(self, name: str) -> bool:
        return name in self.endpoints

    def stop(self, name: str) -> Trace | None:
        """Stop one daemon (SIGTERM: it drains and exits); its trace, if it was traced."""
        if name in self.procs.procs:
            self.procs.stop(name)
        self.endpoints.pop(name, None)
        self._starting.discard(name)
        path = self._traces.pop(name, None)
        return Trace.load(path) if path is not None else None

    def stop_all(self) -> None:
        self.procs.close()
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


