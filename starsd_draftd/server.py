"""The draft daemon's work-conserving loop: one ROUTER socket, one request queue, one backend.

I/O is drained into Q_in without blocking; each pass serves a batch of the waiting DRAFT
requests (oldest first, one per address in turn before any address gets a second) and queues
the replies on Q_out. The loop blocks only when no work is waiting, so the draft model is busy
whenever any target is waiting for drafts.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from common import protocol as P
from common.features import check_feature_layers
from common.protocol import ErrorCode, Message, MsgType, ProtocolError
from common.memory import memory_report
from common.metrics import serve_metrics
from common.sdnotify import Watchdog, notify
from common.security import AllowList
from common.sockets import SocketOptions, bind_server, check_server_endpoint, is_local_address
from common.tensors import WIRE_DTYPES, all_finite, dtype_name
from common.verify import SamplingParams
from starsd_draftd.backends.base import Draft, DraftBackend, DraftRequest
from starsd_draftd.lookahead import LookaheadServing, ahead_depth
from starsd_draftd.metrics import DraftMetrics
from starsd_draftd.records import AdmittedRequest, PeerBacklog, QueuedRequest
from starsd_draftd.sessions import Session, SessionTable, TableLimits
from starsd_draftd.stats import REQUEST_PARTS, Stats  # noqa: F401 (REQUEST_PARTS: part of this module's face)

log = logging.getLogger("starsd.draftd")

FEATURE_DTYPES = frozenset(WIRE_DTYPES[name] for name in ("float16", "bfloat16", "float32"))


_TABLE = TableLimits()  # the session table's defaults, which the daemon's are


@dataclass
class ServerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    max_depth: int = 5
    batch_max: int = 8  # requests of different sessions drafted together; 1 serves one at a time
    # Longest wait, with requests queued, for sessions predicted to send their next request within
    # it (each session's reply-to-request turnaround is tracked). 0 keeps the loop strictly
    # work-conserving; a few ms fills batches when targets answer fast (many targets, short V).
    batch_window_s: float = 0.0
    # With nothing queued, draft each served session's next round ahead for the outcomes the
    # draft can guess (its drafts all kept then its next token; kept up to a position then its
    # second choice there), one batched forward per loop pass; a request that brings one of
    # those sequences is answered from it at once.
    lookahead: bool = True
    # The most tokens a target may ask a draft tree to hold (DRAFT.tree_tokens); trees are
    # drafted by backends with a tree_topk above 1, and with requests still queued after a batch
    # is taken, at half the size asked (at least the depth).
    max_tree_tokens: int = 64
    # The session table's bounds (TableLimits, fields of the same names)
    max_sessions: int = _TABLE.max_sessions
    max_sessions_per_peer: int = _TABLE.max_sessions_per_peer
    max_peers: int = _TABLE.max_peers  # connections that completed the handshake
    # Without CURVE every connection is its own principal: bound what one remote address may hold.
    max_peers_per_address: int = _TABLE.max_peers_per_address
    max_sessions_per_address: int = _TABLE.max_sessions_per_address
    # Cache memory, estimated per position from the drafter's config: in all, per target, per session
    max_kv_bytes: int = _TABLE.max_kv_bytes
    max_peer_kv_bytes: int = _TABLE.max_peer_kv_bytes
    max_session_kv_bytes: int = _TABLE.max_session_kv_bytes
    session_ttl_s: float = _TABLE.session_ttl_s
    peer_ttl_s: float = _TABLE.peer_ttl_s
    evict_idle_s: float = _TABLE.evict_idle_s  # a full table gives way to its least recently used entry idle this long
    max_queue: int = 4096
    # Queued draft requests are charged what they hold in memory, estimated from their frame sizes
    # (queue_cost); beyond a budget a request gets BUSY. Per peer too, so no one target's backlog
    # crowds out the others.
    max_queue_bytes: int = 256 << 20
    max_peer_queue: int = 64  # requests of one peer waiting at once (one per session is the norm)
    max_peer_queue_bytes: int = 64 << 20
    drain_s: float = 5.0
    curve_secret: Path | None = None  # this daemon's .key_secret file
    curve_allow: Path | None = None  # directory of allowed target public keys (.key files)
    insecure: bool = False
    metrics_port: int | None = None
    name: str = "starsd-draftd"


# A msgpack byte can become up to about 12 bytes of Python objects (a uint16 token id is 3 bytes
# on the wire, a 28-byte int plus an 8-byte list slot once decoded); tensor frames are held as
# they arrived (decoded arrays are views of them). Measured: 2**18 uint32 ids (1.3 MiB) decode to
# about 11 MB, 8.4 bytes per wire byte.
HEADER_EXPANSION = 12
MESSAGE_OVERHEAD = 1024  # the Message, its dicts and the queue's record


def queue_cost(frames: list) -> int:
    """What a queued request costs in memory, from its frame sizes (frames[0]: the type,
    frames[1]: the msgpack header, the rest tensors), before anything is decoded."""
    return MESSAGE_OVERHEAD + HEADER_EXPANSION * len(frames[1]) + sum(len(f) for f in frames[2:])


def _origin(frame: zmq.Frame) -> tuple[int, str]:
    """The socket a message arrived on and the remote address ZeroMQ reports ("" for ipc)."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        address = ""
    return frame.get(zmq.SRCFD), address


def message_limits(backend: DraftBackend) -> P.Limits:
    """Bounds for what this daemon accepts: no token list longer than the drafter's context, no
    message larger than the largest a target can need (a prompt of that length, or features for
    every position of it)."""
    base = P.DEFAULT_LIMITS
    n = min(base.max_array_len, backend.max_len or base.max_array_len)
    largest = (64 << 10) + 5 * n + 4 * n * backend.feature_size  # headers, ids (5 bytes each), float32 features
    if not backend.feature_size:  # a feature backend takes what its targets need, beyond the default cap
        largest = min(base.max_message_bytes, largest)
    return dataclasses.replace(base, max_array_len=n, max_message_bytes=largest)


class LoopFailed(RuntimeError):
    """The serving loop kept failing outside any one request: the daemon exits non-zero (and
    systemd restarts it) rather than look alive and serve nothing."""


class DraftServer:
    def __init__(self, backend: DraftBackend, config: ServerConfig, ctx: zmq.Context | None = None):
        check_server_endpoint(config.bind, config.curve_secret, config.curve_allow, config.insecure)
        self.backend = backend
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        bounds = {f.name: getattr(config, f.name) for f in dataclasses.fields(TableLimits)
                  if f.name != "kv_bytes_per_token"}  # the one bound that comes from the model
        self.sessions = SessionTable(TableLimits(**bounds, kv_bytes_per_token=backend.kv_bytes_per_token),
                                     durable=config.curve_secret is not None)
        self.q_in: collections.deque[QueuedRequest] = collections.deque()
        self._served_turn: dict[bytes | str, int] = {}  # share -> the batch that last served it
        self._turn = 0
        self.queue_bytes = 0
        self._peer_queue: dict[bytes, PeerBacklog] = {}  # principal -> what it has queued
        self.limits = message_limits(backend)
        self.q_out: collections.deque[list] = collections.deque()
        self._awaited: dict[tuple[bytes, int], Session] = {}  # replied to, not back yet (batch window)
        self.stats = Stats()
        self.lookahead = LookaheadServing(backend, self.sessions, self.stats)
        self.metrics = DraftMetrics(self.snapshot)
        self._busy_mark = (time.monotonic(), 0.0)
        self.instance = secrets.token_hex(8)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self.draining = False
        self.sock: zmq.Socket | None = None
        self.allow: AllowList | None = None
        self.endpoint = config.bind
        self._read_at = 0.0  # when the message being handled was read off the socket

    # ------------------------------------------------------------ life cycle
    def stop(self) -> None:
        """Safe from signal handlers and other threads: only sets a flag."""
        self._stop.set()

    def reload_keys(self) -> None:
        """Safe from signal handlers: the loop re-reads the allowed keys on its next pass."""
        self._reload.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        signal.signal(signal.SIGHUP, lambda *_: self.reload_keys())

    def bind(self) -> str:
        # ZeroMQ drops a connection that sends more than this before buffering it; up to it, an
        # oversized message is read and answered TOO_LARGE (the decode limits), so a careless
        # peer learns why
        hard = max(16 << 20, 2 * self.limits.max_message_bytes)
        self.sock, self.allow = bind_server(self.ctx, self.config.bind, self.config.curve_secret,
                                            self.config.curve_allow, SocketOptions(max_msg_bytes=hard))
        # disconnects, so a connection's entry and sessions go when it does, not a TTL later
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.config.metrics_port is not None:
            serve_metrics(self.metrics.registry, self.config.metrics_port)
        log.info("draft daemon listening on %s (backend %s, max depth %d, %s)", self.endpoint, self.backend.name,
                 self.config.max_depth, "CURVE" if self.allow else "plaintext")
        return self.endpoint

    def serve_forever(self, ready: threading.Event | None = None) -> None:
        if self.sock is None:
            self.bind()
        if ready is not None:
            ready.set()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        self._next_sweep = time.monotonic() + 1.0
        drain_deadline = None
        failures = 0
        watchdog = Watchdog()
        notify("READY=1", f"STATUS=serving drafts on {self.endpoint}")
        try:
            while True:
                if watchdog.due():
                    watchdog.tick()
                if self._stop.is_set() and not self.draining:
                    drain_deadline = time.monotonic() + self.config.drain_s
                    self._start_draining()
                if self.draining and (not self.q_in or time.monotonic() >= drain_deadline):
                    self._flush_out()
                    break
                try:
                    self._pass(poller)
                    failures = 0
                except Exception as exc:  # outside any one request: count it, and give up only if it persists
                    failures += 1
                    self.stats.loop_errors += 1
                    log.exception("the serving loop failed (%d pass(es) in a row)", failures)
                    if failures >= self.MAX_FAILED_PASSES:
                        raise LoopFailed(f"the serving loop failed {failures} passes in a row") from exc
                    time.sleep(0.01)
        finally:
            if self.q_in:
                log.warning("stopping with %d draft requests unanswered", len(self.q_in))
            # a short linger lets the GOODBYEs and last replies leave; LINGER 0 would drop them
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.sock.close(linger=500 if self.draining else 0)
            self.sock = None
            if self.allow is not None:
                self.allow.stop()
            log.info("draft daemon stopped")

    MAX_FAILED_PASSES = 50  # passes in a row that fail outside any request: then the daemon exits non-zero

    def _pass(self, poller: zmq.Poller) -> None:
        """One pass: read what arrived, serve the oldest waiting batch, send replies, and once a
        second expire silent peers and sample the metrics."""
        if self._reload.is_set():
            self._reload.clear()
            if self.allow is not None:
                self.allow.reload()
                self.stats.key_reloads += 1
        timeout = 0 if (self.q_in or self.q_out or self.lookahead.pending) else 100
        if poller.poll(timeout):
            self._drain_socket()
        if self.q_in:
            self._fill_batch()
            self._serve_batch()
        elif self.lookahead.pending and not self.draining:
            self.lookahead.step()  # one forward, then the socket is looked at again
        self._flush_out()
        now = time.monotonic()
        if now >= self._next_sweep:
            self.sessions.expire(now)
            self._free_dropped()
            self._sample_metrics(now)
            self._next_sweep = now + 1.0

    def _drain_monitor(self) -> list:
        """The connections the socket monitor says have closed since the last look."""
        gone = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                gone.extend(self.sessions.conns_on(event["value"]))
        return gone

    def _free_dropped(self) -> None:
        """Free the backend state of sessions the table dropped on its own, counted by why."""
        for s, why in self.sessions.take_dropped():
            self._release(s)
            if why == "expired":
                self.stats.sessions_expired += 1
                log.info("expired silent session %d of peer %s", s.key[1], s.key[0].hex())
            elif why == "evicted":
                self.stats.sessions_evicted += 1
            else:
                self.stats.sessions_disconnected += 1

    def _start_draining(self) -> None:
        """Stop taking sessions, tell every peer we are leaving, answer what is already queued."""
        self.draining = True
        notify("STOPPING=1", "STATUS=draining")
        log.info("draining: telling %d target(s) this daemon is leaving", len(self.sessions.conns))
        for identity in self.sessions.conns:
            self._send(identity, Message(MsgType.GOODBYE, {"instance": self.instance}))

    # ------------------------------------------------------------ I/O
    def _drain_socket(self, budget: int = 1024) -> None:
        """Read and handle what has arrived. Disconnects the socket monitor reported before the
        reading take effect after it: the messages those connections sent before closing were
        queued before the event, so this drain reads them; and a connection registered during
        it (on a reused socket) is not among those dropped."""
        gone = self._drain_monitor()
        # ZMQ_EVENTS says whether a message is waiting; cheaper than a receive that raises Again
        sock = self.sock
        for _ in range(budget):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            self._on_frames(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        if gone:
            self.sessions.disconnected(gone)
            self._free_dropped()

    def _send(self, identity: bytes, msg: Message) -> None:
        self.q_out.append([identity, *P.encode(msg)])

    def _flush_out(self) -> None:
        """Send queued replies. A peer that stopped reading (its pipe is full) loses that reply
        rather than stalling everyone behind it; it resynchronises on its own."""
        while self.q_out:
            frames = self.q_out.popleft()
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=P.needs_copy(frames))
            except zmq.Again:
                self.stats.dropped_replies += 1
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self.stats.unroutable += 1  # the peer disconnected; its reply has nowhere to go

    def _error(self, identity: bytes | None, exc: ProtocolError) -> None:
        self.stats.errors[exc.code.name] += 1
        log.debug("protocol error from %r: %s", identity, exc)
        if identity is not None:
            self._send(identity, P.error_from(exc))

    # ------------------------------------------------------------ message handling
    def _on_frames(self, frames: list) -> None:
        self._read_at = time.perf_counter()  # when this message was read off the socket (request_s)
        identity = frames[0].bytes if frames else None
        try:
            if len(frames) < 2:
                raise ProtocolError(ErrorCode.MALFORMED, "empty message")
            # With CURVE the authenticator stamps each message with the peer's public key: sessions
            # follow the key, so nobody can reach another key's sessions, even after reconnecting.
            principal = identity
            if self.allow is not None:
                principal = frames[1].get("User-Id").encode()
            cost = 0
            if len(frames) > 2 and frames[1].bytes == MsgType.DRAFT.value:
                cost = queue_cost(frames[1:])
                if cost > min(self.config.max_peer_queue_bytes, self.config.max_queue_bytes):
                    raise ProtocolError(ErrorCode.TOO_LARGE, f"a draft request of {cost} bytes (estimated in "
                                        f"memory) exceeds the queue's budget per target",
                                        *P.peek_ids(frames[2].buffer, self.limits), re=MsgType.DRAFT)
            msg = P.decode(frames[1:], self.limits)
            try:
                self._on_message(identity, principal, msg, _origin(frames[1]), cost)
            except ProtocolError as exc:
                exc.re = exc.re or msg.type  # the refusal names the request it answers
                raise
        except ProtocolError as exc:
            self._error(identity, exc)
        except Exception:  # a bug must cost one request, never the daemon
            log.exception("internal error while handling a message from %r", identity)
            self._error(identity, ProtocolError(ErrorCode.INTERNAL, "internal error in the draft daemon"))
        finally:
            if self.sessions.dropped:
                self._free_dropped()

    def _on_message(self, identity: bytes, principal: bytes, msg: Message, origin: tuple[int, str],
                    cost: int = 0) -> None:
        """Handle one decoded message; ``origin`` is (socket fd, remote address) of its connection."""
        h = msg.header
        mtype = msg.type
        fd, address = origin
        conn = self.sessions.touch(principal, identity, fd)
        if mtype is MsgType.DRAFT:  # the hot path first
            if conn is None:
                raise ProtocolError(ErrorCode.NO_HANDSHAKE, "send HELLO first", h["session"], h["seq"])
            session = self.sessions.get(principal, h["session"], h["seq"])  # fail fast on unknown sessions
            self._check_draft(session, msg)
            # without CURVE a host can open many connections: fair service is counted per address
            self._enqueue(identity, principal, msg, cost, principal if self.allow is not None else conn.address)
            if self.config.batch_window_s > 0:
                session.returned(time.monotonic())
                self._awaited.pop(session.key, None)
            return
        if mtype is MsgType.STATS and (conn is not None or self.allow is not None or is_local_address(address)):
            # operators' status: for targets, authenticated peers and this machine
            self._send(identity, Message(MsgType.STATS_REPLY, {"stats": self.snapshot()}))
            return
        if self.draining and mtype in (MsgType.HELLO, MsgType.OPEN):
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the draft daemon is shutting down", h.get("session"))
        if mtype is MsgType.HELLO:
            self._hello(identity, principal, h, origin)
            return
        if conn is None:
            raise ProtocolError(ErrorCode.NO_HANDSHAKE, "send HELLO first", h.get("session"), h.get("seq"))
        if mtype is MsgType.PING:
            self._send(identity, Message(MsgType.PONG, {"instance": self.instance, "draining": self.draining}))
        elif mtype is MsgType.OPEN:
            self._open(principal, h, conn.address)
        elif mtype is MsgType.CLOSE:
            s = self.sessions.close(principal, h["session"])
            if s is not None:
                self._release(s)
        else:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{mtype.name} is not a request")

    def _enqueue(self, identity: bytes, principal: bytes, msg: Message, cost: int, share: bytes | str) -> None:
        """Queue a DRAFT request within the queue's budgets (count and bytes, in all and per peer)."""
        h, cfg = msg.header, self.config
        mine = self._peer_queue.get(principal) or PeerBacklog()
        why = None
        if len(self.q_in) >= cfg.max_queue:
            why = f"the request queue is full ({cfg.max_queue} requests)"
        elif self.queue_bytes + cost > cfg.max_queue_bytes:
            why = f"the request queue holds {self.queue_bytes} of its {cfg.max_queue_bytes} bytes"
        elif mine.requests >= cfg.max_peer_queue:
            why = f"this target already has {mine.requests} requests queued (limit {cfg.max_peer_queue})"
        elif mine.nbytes + cost > cfg.max_peer_queue_bytes:
            why = f"this target's queued requests hold {mine.nbytes} of its {cfg.max_peer_queue_bytes} bytes"
        if why is not None:
            raise ProtocolError(ErrorCode.BUSY, why, h["session"], h["seq"])
        mine.requests += 1
        mine.nbytes += cost
        self._peer_queue[principal] = mine
        self.queue_bytes += cost
        self.stats.queue_bytes_peak = max(self.stats.queue_bytes_peak, self.queue_bytes)
        self.q_in.append(QueuedRequest(identity, principal, msg, cost, share, self._read_at, time.perf_counter()))

    def _dequeued(self, item: QueuedRequest) -> None:
        self.queue_bytes -= item.cost
        mine = self._peer_queue[item.principal]
        mine.requests -= 1
        mine.nbytes -= item.cost
        if not mine.requests:
            del self._peer_queue[item.principal]

    def _check_draft(self, session: Session, msg: Message) -> None:
        """What a DRAFT request can be checked for on arrival, before it is queued: depth, token
        ids, the length it claims, and its features' type and size (at most one per position).
        What depends on the session's state when it is served (seq, accepted, pos) is checked then."""
        h = msg.header
        sid, seq, pos = h["session"], h["seq"], h["pos"]
        if not 1 <= h["depth"] <= self.config.max_depth:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"depth {h['depth']} is outside 1..{self.config.max_depth}",
                                sid, seq)
        if len(h["new"]) > pos:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(h['new'])} new tokens cannot make a sequence of {pos}",
                                sid, seq)
        self._check_ids(h["new"], sid, seq)
        self._check_len(pos + h["depth"], sid, seq)
        if h.get("tree_tokens", 0) > self.config.max_tree_tokens:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"tree_tokens {h['tree_tokens']} exceeds this daemon's "
                                f"{self.config.max_tree_tokens}", sid, seq)
        f = msg.tensors.get("features")
        need = self.backend.feature_size
        if not need:
            if f is not None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "this draft daemon takes no features", sid, seq)
            return
        if f is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the {self.backend.name} backend needs target features",
                                sid, seq)
        dtype, shape = f.dtype, f.shape
        if dtype not in FEATURE_DTYPES or len(shape) != 2 or shape[1] != need or shape[0] > pos:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"features must be float [m, {need}] with m <= pos ({pos}), "
                                f"got {dtype_name(dtype)} {list(shape)}", sid, seq)
        if not all_finite(f):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "features must be finite", sid, seq)

    def _hello(self, identity: bytes, principal: bytes, h: dict, origin: tuple[int, str]) -> None:
        mine = (self.backend.vocab_size, self.backend.fingerprint)
        theirs = (h["vocab_size"], h["tokenizer"])
        need = self.backend.feature_size
        why = self._feature_refusal(h)
        if why is not None:
            log.warning("refusing target %r: %s", h.get("name", ""), why)
            raise ProtocolError(ErrorCode.INCOMPATIBLE_MODEL, why)
        if mine != theirs:
            log.warning("refusing target %r: its vocabulary %d (tokenizer %s) differs from the draft's %d "
                        "(tokenizer %s)", h.get("name", ""), theirs[0], theirs[1], mine[0], mine[1])
            raise ProtocolError(
                ErrorCode.INCOMPATIBLE_MODEL,
                f"draft model vocabulary {mine[0]} (tokenizer {mine[1]}) does not match the target's "
                f"vocabulary {theirs[0]} (tokenizer {theirs[1]})")
        fd, address = origin
        conn = self.sessions.welcome(principal, identity, h.get("name", ""), address, fd)
        log.info("target %s connected from %s", conn.name or identity.hex(), address or "ipc")
        self._send(identity, Message(MsgType.WELCOME, {
            "vocab_size": mine[0], "tokenizer": mine[1], "backend": self.backend.name,
            "max_depth": self.config.max_depth, "q_topk": getattr(self.backend, "q_topk", 0),
            "feature_size": need, "instance": self.instance, "server": self.config.name,
            "max_len": self.backend.max_len or 0, "tree_topk": self.backend.tree_topk,
            "max_tree_tokens": self.config.max_tree_tokens if self.backend.tree_topk > 1 else 0,
            "stops_drafts": self.backend.stops_drafts,
            **({"feature_layers": list(self.backend.feature_layers)} if self.backend.feature_layers else {})}))

    def _feature_refusal(self, h: dict) -> str | None:
        """Why the HELLO's target cannot give the features this daemon's head reads (None: it can,
        or the head reads none): its hidden size, and for fused features its layer count."""
        b = self.backend
        if not b.feature_size:
            return None
        width = getattr(b, "target_hidden_size", b.feature_size)
        theirs = h.get("feature_size", 0)
        if theirs != width:
            return (f"the {b.name} draft head works on a target hidden size of {width}, but the target's hidden "
                    f"size is {theirs or 'unknown'}")
        layers = b.feature_layers
        if layers:
            n = h.get("num_layers", 0)
            why = check_feature_layers(layers, n) if n else "the target did not say how many layers it has"
            if why is not None:
                return f"the {b.name} draft head fuses the target's hidden states entering layers {list(layers)}: {why}"
        return None

    def _open(self, principal: bytes, h: dict, address: str) -> None:
        sid = h["session"]
        P.validate_fields(P.SAMPLING_SCHEMA, h["sampling"], "OPEN.sampling", sid)
        try:
            params = SamplingParams.from_wire(h["sampling"])
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc), sid) from None
        prompt = h["prompt"]
        if not prompt:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the prompt must hold at least one token", sid)
        self._check_len(len(prompt), sid, None)
        self._check_ids(prompt, sid, None)
        old = self.sessions.close(principal, sid)
        if old is not None:
            self._release(old)
        state = self.backend.new_state(params)
        try:
            self.sessions.open(principal, sid, params, prompt, state, address,
                               reserve=len(prompt) + self.config.max_depth)
        except ProtocolError:
            self.backend.release(state)
            raise
        self.stats.sessions_opened += 1

    def _check_len(self, length: int, sid, seq) -> None:
        limit = self.backend.max_len
        if limit is not None and length > limit:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{length} positions exceed the draft model's context of {limit}",
                                sid, seq)

    def _check_ids(self, ids: list[int], sid, seq) -> None:
        vocab = self.backend.vocab_size
        if ids and max(ids) >= vocab:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"token id {max(ids)} is outside the vocabulary ({vocab})",
                                sid, seq)

    def _fill_batch(self) -> None:
        """With a batch window, wait (at most the window) while the batch has room and some
        session is predicted to send its next request within the window; otherwise return at
        once. Replies to a batch go out together, so targets that answer fast come back
        together: a short wait turns their trickle of arrivals into one full batch."""
        window = self.config.batch_window_s
        if window <= 0 or self.config.batch_max <= 1:
            return
        start = time.monotonic()
        deadline = start + window
        waited = False
        while True:
            waiting = {item.key for item in self.q_in}
            if len(waiting) >= self.config.batch_max:
                break
            now = time.monotonic()
            # sessions replied to and not back yet, due (by their usual turnaround) within the window
            due = False
            for key, s in list(self._awaited.items()):
                t = None if s.replied_at is None or s.turnaround_s is None else s.replied_at + s.turnaround_s
                if t is None or t < now - window or self.sessions.sessions.get(key) is not s:
                    del self._awaited[key]  # unpredictable, long overdue, or gone: never waited for again
                elif t <= deadline and key not in waiting:
                    due = True
            if not due or now >= deadline:
                break
            waited = True
            if self.sock.poll(max(1, int(1000 * (deadline - now))), zmq.POLLIN):
                self._drain_socket()
            else:
                break
        if waited:
            self.stats.batch_waits += 1
            self.stats.batch_wait_s += time.monotonic() - start

    def _take_batch(self) -> list[QueuedRequest]:
        """At most batch_max waiting requests, one per session (a session's later request waits
        for the next pass, so each session's requests stay in order), shared fairly: each share
        (an address, or a CURVE key) gets one request in turn, the share served longest ago
        first, before any gets a second. Within a share, and in the batch, oldest first. So one
        host's backlog delays another's request by one batch at most, not by the backlog."""
        items = self.q_in
        by_share: dict = {}
        seen = set()
        for i, item in enumerate(items):
            if item.key not in seen:
                seen.add(item.key)
                by_share.setdefault(item.share, []).append(i)
        shares = sorted(by_share, key=lambda sh: (self._served_turn.get(sh, 0), by_share[sh][0]))
        taken: list[int] = []
        limit, depth = self.config.batch_max, 0
        while len(taken) < limit:
            row = [by_share[sh][depth] for sh in shares if depth < len(by_share[sh])]
            if not row:
                break
            taken.extend(row[: limit - len(taken)])
            depth += 1
        self._turn += 1
        for i in taken:
            self._served_turn[items[i].share] = self._turn
        self._served_turn = {sh: t for sh, t in self._served_turn.items() if sh in by_share}
        chosen = set(taken)
        batch = [items[i] for i in sorted(chosen)]
        self.q_in = collections.deque(item for i, item in enumerate(items) if i not in chosen)
        for item in batch:
            self._dequeued(item)
        return batch

    def _admit(self, principal: bytes, msg: Message, keep: set) -> DraftRequest:
        """Validate a DRAFT request against its session, reserve its cache memory and apply what
        it reports; refused (BUSY, TOO_LARGE), the session is as it was. ``keep``: the sessions
        admitted to this batch so far (never evicted to make room)."""
        h = msg.header
        sid, seq = h["session"], h["seq"]
        session = self.sessions.get(principal, sid, seq)
        features = msg.tensors.get("features") if self.backend.feature_size else None
        if features is not None and session.features + features.shape[0] != h["pos"] - 1:
            raise ProtocolError(
                ErrorCode.DESYNC,
                f"the session holds {session.features} features; {features.shape[0]} more make "
                f"{session.features + features.shape[0]}, but {h['pos'] - 1} are needed; re-open the session",
                sid, seq)
        session.check(h["accepted"], h["new"], h["pos"], seq)
        tree = self._tree_budget(session, h)
        try:
            room = self.backend.tree_room(h["depth"], tree, session.params.greedy)
            self.sessions.reserve(session, h["pos"] + room, seq, keep)
        except ProtocolError:
            if not tree:
                raise
            tree = 0  # no memory for the tree's drafting: a chain, if that fits
            self.sessions.reserve(session, h["pos"] + h["depth"], seq, keep)
        session.advance(h["accepted"], h["new"], h["pos"], seq)
        if features is not None:
            session.features += features.shape[0]
        return DraftRequest(session.state, session.verified, h["depth"], features, tree, h.get("min_survival", 0.0))

    def _tree_budget(self, session: Session, h: dict) -> int:
        """The tree tokens a DRAFT is drafted with (0: a chain): what it asks, where the backend
        drafts trees; halved while requests wait behind this batch (smaller trees, sooner),
        except for seeded sampled sessions, whose tokens follow the tree's shape."""
        tree = h.get("tree_tokens", 0)
        if self.backend.tree_topk <= 1 or tree <= h["depth"]:
            return 0
        if self.q_in and (session.params.greedy or session.params.seed is None):
            tree = max(h["depth"], tree // 2)
            self.stats.trees["shrunk"] += 1
        return tree if tree > h["depth"] else 0

    def _serve_batch(self) -> None:
        admitted: list[AdmittedRequest] = []
        keys: set = set()
        start = time.perf_counter()  # the batch begins: its requests' wait in the queue ends
        for item in self._take_batch():
            try:
                request = self._admit(item.principal, item.msg, keys)
            except ProtocolError as exc:
                exc.re = MsgType.DRAFT
                self._error(item.identity, exc)
                continue
            admitted.append(AdmittedRequest(item.identity, item.msg.header, item.key, request, item.read_at,
                                            item.queued_at))
            keys.add(item.key)
        if self.sessions.dropped:  # sessions evicted to make room for these (none of them)
            self._free_dropped()
        if not admitted:
            return
        stats = self.stats
        drafts: list[Draft | None] = [None] * len(admitted)
        spent = [0.0] * len(admitted)  # each request's drafting time (what its reply reports)
        # requests answered from work done ahead go out at once, before the others are drafted
        ahead = self.lookahead.answered(admitted)
        if ahead:  # counted before their replies leave, as the others below
            stats.requests += len(ahead)
            stats.drafted_tokens += sum(len(d.tokens) for d, _ in ahead.values())
            for i, (draft, seconds) in ahead.items():
                drafts[i], spent[i] = draft, seconds
                self._reply(admitted[i], draft, start, seconds)
            self._flush_out()
        todo = [i for i in range(len(admitted)) if i not in ahead]
        t0 = time.perf_counter()
        try:
            if todo:
                for i, d in zip(todo, self.backend.draft_many([admitted[i].request for i in todo])):
                    drafts[i] = d
        except Exception:  # a failing draft costs these rounds (targets verify alone), not the daemon
            log.exception("drafting failed for %d session(s)", len(todo))
            for i in todo:
                h = admitted[i].header
                self._error(admitted[i].identity, ProtocolError(ErrorCode.INTERNAL, "drafting failed", h["session"], h["seq"],
                                                    MsgType.DRAFT))
            todo = []  # answered (with an error); the hits above still need their bookkeeping
        finally:
            elapsed = time.perf_counter() - t0
            stats.busy_s += elapsed + sum(spent)
        served = [i for i in range(len(admitted)) if drafts[i] is not None]
        # counted before the replies leave, so a target that saw its reply sees it counted
        stats.requests += len(todo)
        stats.drafted_tokens += sum(len(drafts[i].tokens) for i in todo)
        if served:
            stats.batches += 1
            stats.batched_requests += len(served)
        if len(todo) == 1 and drafts[todo[0]].parents is None:  # a chain alone: what a fresh forward costs
            self.lookahead.note_fresh(elapsed, admitted[todo[0]].request.depth)
        for i in todo:
            spent[i] = elapsed
            self._reply(admitted[i], drafts[i], start, elapsed)
        self._flush_out()
        # the rest of the bookkeeping is off the targets' critical path
        done = time.perf_counter()
        parts = stats.request_s
        for i in served:
            queued = start - admitted[i].queued_at
            parts["queue"] += queued
            parts["draft_forward"] += spent[i]
            parts["rest"] += (done - admitted[i].read_at) - queued - spent[i]
        stats.profiled += len(served)
        window = self.config.batch_window_s > 0
        sent = time.monotonic()
        for i in served:
            key, req = admitted[i].key, admitted[i].request
            draft = drafts[i]
            session = self.sessions.sessions.get(key)
            if draft.parents is not None:
                self.stats.trees["requests"] += 1
                self.stats.trees["tokens"] += len(draft.tokens)
            elif req.min_survival > 0.0 and self.backend.stops_drafts:
                stop = self.stats.stopping
                stop["requests"] += 1
                stop["stopped"] += len(draft.tokens) < req.depth
                stop["drafts_saved"] += max(req.depth - len(draft.tokens), 0)
            if session is not None:
                # a tree's kept path is no prefix of its tokens: the target reports it as new tokens
                session.last_draft = list(draft.tokens) if draft.parents is None else []
                if window:
                    session.replied_at = sent
                    self._awaited[key] = session
                if self.config.lookahead and not self.draining and draft.parents is None:
                    self.lookahead.start(session, draft, ahead_depth(self.config.max_depth, req.depth),
                                         admitted[i].header["seq"])
        if served:
            self.metrics.on_batch(len(served), elapsed + sum(spent[i] for i in ahead))

    def _reply(self, item: AdmittedRequest, draft: Draft, start: float, seconds: float) -> None:
        """Queue one DRAFTED reply: its drafts, its wait in the queue (to ``start``, when its
        batch began) and the drafting time it reports."""
        h = item.header
        reply = {"session": h["session"], "seq": h["seq"], "tokens": draft.tokens,
                 "queued_us": min(P.MAX_REPORTED_US, round(1e6 * max(0.0, start - item.queued_at))),
                 "draft_us": min(P.MAX_REPORTED_US, round(1e6 * seconds))}
        tensors = {} if draft.q_ids is None else {"q_ids": draft.q_ids, "q_probs": draft.q_probs}
        if draft.parents is not None:
            tensors["parents"] = np.asarray(draft.parents, dtype=np.int16)
        self._send(item.identity, Message(MsgType.DRAFTED, reply, tensors))

    def _release(self, session: Session) -> None:
        """Free a session's backend state, dropping any work done ahead for it first."""
        self.lookahead.drop(session)
        self.backend.release(session.state)

    def _sample_metrics(self, now: float) -> None:
        t0, busy0 = self._busy_mark
        busy = (self.stats.busy_s - busy0) / max(1e-9, now - t0)
        self._busy_mark = (now, self.stats.busy_s)
        self.metrics.busy_fraction = min(1.0, busy)

    def snapshot(self) -> dict:
        snap = self.stats.snapshot(len(self.sessions.sessions), len(self.q_in), len(self.sessions.conns))
        snap["addresses"] = len(self.sessions.address_conns)
        snap["kv_bytes"] = self.sessions.kv_bytes
        snap["backend"] = self.backend.counters()
        snap["queue_bytes"] = self.queue_bytes
        snap["limits"] = self.budgets()
        snap["memory"] = memory_report(self.backend.weights_bytes)
        return snap

    def budgets(self) -> dict:
        """The configured bounds a snapshot's usage figures are measured against: the session
        table's (TableLimits, kv_bytes_per_token included) and the queue's."""
        c = self.config
        return {**dataclasses.asdict(self.sessions.limits), "max_queue": c.max_queue,
                "max_queue_bytes": c.max_queue_bytes, "max_peer_queue": c.max_peer_queue,
                "max_peer_queue_bytes": c.max_peer_queue_bytes}
