"""The wire section: one round trip of the same bytes through raw pyzmq, through StarSD, and (for
reference only) as a torch.save blob."""

from __future__ import annotations

import io
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator

import torch
import zmq

from common import protocol as P
from common.protocol import Message, MsgType
from common.sockets import SocketOptions, free_tcp_endpoint, make_socket
from common.tensors import to_wire
from common.verify import SamplingParams
from starsd_draftd.bench.procs import ProcessSet
from starsd_draftd.bench.emulation import EMU_FINGERPRINT, EMU_VOCAB
from starsd_draftd.bench.config import BenchConfig, TORCH_SAVE_LABEL
from starsd_draftd.bench.pool import Pool, _draftd_emulation_args
from starsd_draftd.bench.stats import summarize

log = logging.getLogger("starsd.bench")


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


def _wait_echo(endpoint: str, frames: list[bytes], timeout_s: float, ctx: zmq.Context, procs: ProcessSet) -> None:
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


