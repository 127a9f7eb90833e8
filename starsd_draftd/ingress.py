"""The draft daemon's front door: its ROUTER socket and everything that arrives on it.

``Ingress`` runs on a thread of its own (``start``), the only one that touches the socket: it
reads what arrived, decodes and bounds-checks each message, answers the handshake (HELLO), PING,
STATS, OPEN and CLOSE itself, checks a DRAFT request for what can be checked on arrival and queues
it within the queue's budgets (``enqueue``; count and bytes, in all and per peer), or refuses it
with a typed error, all while the batcher computes. The batcher (``starsd_draftd.server.DraftServer``)
takes queued requests from ``q_in`` (returning their budget with ``dequeued``), waits on
``arrived`` when it has nothing to do, and queues its replies with ``send`` and ``flush``, which
this thread sends. What a session's state needs when a request is served (its sequence, cache
memory) is checked there, at admission.

The two threads share the session table and the queue under ``lock``. The backend is the
batcher's alone: a session opened here gets its backend state when it is first served, and a
session closed, re-opened or dropped here is handed to the batcher to free (``take_released``,
and the table's ``dropped``), never freed under a forward that may be using it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import recv_monitor_message

from common import protocol as P
from common.features import check_feature_layers
from common.protocol import ErrorCode, Message, MsgType, ProtocolError
from common.security import AllowList
from common.sockets import SocketOptions, bind_server, is_local_address
from common.tensors import WIRE_DTYPES, all_finite, dtype_name
from common.verify import SamplingParams
from starsd_draftd.backends.base import DraftBackend
from starsd_draftd.eta import ServiceEstimate
from starsd_draftd.records import PeerBacklog, QueuedRequest, ask_of, drafted
from starsd_draftd.sessions import Session, SessionTable
from starsd_draftd.stats import Stats

if TYPE_CHECKING:
    from starsd_draftd.server import ServerConfig

log = logging.getLogger("starsd.draftd")

FEATURE_DTYPES = frozenset(WIRE_DTYPES[name] for name in ("float16", "bfloat16", "float32"))

# A msgpack byte can become up to about 12 bytes of Python objects (a uint16 token id is 3 bytes
# on the wire, a 28-byte int plus an 8-byte list slot once decoded); tensor frames are held as
# they arrived (decoded arrays are views of them). Measured: 2**18 uint32 ids (1.3 MiB) decode to
# about 11 MB, 8.4 bytes per wire byte.
HEADER_EXPANSION = 12
MESSAGE_OVERHEAD = 1024  # the Message, its dicts and the queue's record

# pyzmq's constants are enum members, and an operation on one builds another: the socket thread
# handles every message, so it uses plain ints
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_SRCFD = int(zmq.SRCFD)
_DRAFT = MsgType.DRAFT.value


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
    return frame.get(_SRCFD), address


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


class Ingress:
    """The socket side of the draft daemon (see the module's docstring). ``snapshot``: the STATS
    reply's content; ``on_draft(session)``: a DRAFT of ``session`` was queued (the batch window's
    bookkeeping); both are called with ``lock`` held."""

    POLL_S = 0.1  # the longest the thread sleeps in one poll (it also wakes on any reply queued)

    def __init__(self, backend: DraftBackend, config: ServerConfig, sessions: SessionTable, stats: Stats,
                 ctx: zmq.Context, instance: str, snapshot: Callable[[], dict],
                 on_draft: Callable[[Session], None], estimate: ServiceEstimate | None = None):
        self.backend = backend
        self.config = config
        self.sessions = sessions
        self.stats = stats
        self.ctx = ctx
        self.instance = instance
        self._snapshot = snapshot
        self._on_draft = on_draft
        self.estimate = estimate or ServiceEstimate(config.batch_max)  # the batcher's measured costs (ACK's eta)
        self.lock = threading.RLock()  # the session table, the queue and its budgets
        self.arrived = threading.Event()  # set when the batcher has something new: a request, a session to free
        self._released: list[Session] = []  # sessions closed or re-opened here, for the batcher to free
        self.limits = message_limits(backend)
        self.q_in: collections.deque[QueuedRequest] = collections.deque()
        self.queue_bytes = 0
        self.queued_fed = 0  # prompt tokens the queued requests feed (their ``fed``)
        self._peer_queue: dict[bytes, PeerBacklog] = {}  # principal -> what it has queued
        self._queued_keys: collections.Counter = collections.Counter()  # session key -> its requests queued
        self.q_out: collections.deque[list] = collections.deque()
        self.draining = False  # HELLO and OPEN refused: the daemon is leaving
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.allow: AllowList | None = None
        self.endpoint = config.bind
        self._read_at = 0.0  # when the message being handled was read off the socket
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_tx: zmq.Socket | None = None  # the batcher's end: a byte here wakes the thread to send
        self._wake_rx: zmq.Socket | None = None
        self.failure: BaseException | None = None  # what ended the thread, if anything did
        self._sent = threading.Event()  # set by the thread once what was queued before a flush has left
        self._wake_batcher = False  # requests were queued in this pass of the thread

    # ------------------------------------------------------------ the socket
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
        wake = f"inproc://starsd-ingress-{id(self):x}-{time.monotonic_ns()}"
        self._wake_rx = self.ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = self.ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is as good as many
        self._wake_tx.connect(wake)
        return self.endpoint

    def start(self) -> None:
        """Serve the socket on a thread of its own, from now until ``stop``."""
        self._thread = threading.Thread(target=self._run, name="starsd-ingress", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, close the socket and end the thread: with a short linger when
        draining, so the GOODBYEs and last replies leave (LINGER 0 would drop them)."""
        if self._thread is not None:
            self._stopping.set()
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the socket thread did not stop within %.0f s", timeout_s)
            self._thread = None
        elif self.sock is not None:
            self._close_sockets()
        if self._wake_tx is not None:
            self._wake_tx.close(linger=0)
            self._wake_tx = None
        if self.allow is not None:
            self.allow.stop()

    def _close_sockets(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=500 if self.draining else 0)
        self.sock = None
        self._wake_rx.close(linger=0)

    def _run(self) -> None:
        """The thread: wait for a message or a wake-up, handle what arrived, send what is queued."""
        poller = zmq.Poller()
        for s in (self.sock, self.monitor, self._wake_rx):
            poller.register(s, zmq.POLLIN)
        wake, sock, monitor = self._wake_rx, self.sock, self.monitor
        timeout_ms = int(1000 * self.POLL_S)
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(timeout_ms))
                woken = wake in ready
                if woken:
                    while wake.getsockopt(_EVENTS) & _POLLIN:
                        wake.recv(_NOBLOCK)
                if sock in ready or monitor in ready:
                    self.read(disconnects=monitor in ready)
                if self.q_out:
                    self._send_out()
                if woken:  # a flush waits for this (it wakes the thread once it has queued)
                    self._sent.set()
                if self._wake_batcher:  # after the sends: the batcher then has the GIL to itself
                    self._wake_batcher = False
                    self.arrived.set()
            self._send_out()
        except BaseException as exc:  # the batcher sees it and the daemon exits non-zero
            log.exception("the socket thread failed")
            self.failure = exc
            self.arrived.set()
        finally:
            self._close_sockets()

    def reload_keys(self) -> None:
        if self.allow is not None:
            self.allow.reload()
            self.stats.key_reloads += 1

    def say_goodbye(self, final: bool = False) -> None:
        """Refuse new handshakes and sessions from now on and tell every peer this daemon is
        leaving: draining (its sessions are served until their targets move them), or, ``final``,
        gone now."""
        self.draining = True
        with self.lock:
            n = len(self.sessions.conns)
            if final:
                log.info("telling %d target(s) this daemon is gone", n)
            else:
                log.info("draining: telling %d target(s) to move their %d session(s) elsewhere", n,
                         len(self.sessions.sessions))
            for identity in self.sessions.conns:
                self.send(identity, Message(MsgType.GOODBYE, {"instance": self.instance, "draining": not final}))
        self.flush()

    def load(self) -> dict:
        """What WELCOME and PONG report of this daemon's load, for targets to place sessions by:
        requests queued, when a request sent now would begin to be drafted (the batch computing
        and those queued before it, by the estimate), and the sessions it holds."""
        d = self.config.max_depth
        wait = self.estimate.eta_s(len(self.q_in), self.queued_fed, d, 0) - self.estimate.cost_s(d, 0)
        return {"queue": len(self.q_in), "wait_us": min(P.MAX_REPORTED_US, round(1e6 * max(0.0, wait))),
                "sessions": len(self.sessions.sessions)}

    def _drain_monitor(self) -> list:
        """The connections the socket monitor says have closed since the last look."""
        gone = []
        while self.monitor.getsockopt(_EVENTS) & _POLLIN:
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                gone.extend(self.sessions.conns_on(event["value"]))
        return gone

    # ------------------------------------------------------------ I/O
    def read(self, *, disconnects: bool = True, budget: int = 1024) -> None:
        """Read and handle what has arrived (the socket's thread); ``disconnects``: the socket
        monitor has events (the poll said so), read them first. Disconnects the socket monitor
        reported before the reading take effect after it: the messages those connections sent
        before closing were queued before the event, so this drain reads them; and a connection
        registered during it (on a reused socket) is not among those dropped."""
        gone = []
        if disconnects and self.monitor.getsockopt(_EVENTS) & _POLLIN:
            with self.lock:
                gone = self._drain_monitor()
        # ZMQ_EVENTS says whether a message is waiting; cheaper than a receive that raises Again
        sock = self.sock
        recv = sock.recv
        for _ in range(budget):
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                break
            frame = recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:  # the rest of a multipart message has arrived with its first frame
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame)
            with self.lock:
                self._on_frames(frames)
        if gone:
            with self.lock:
                self.sessions.disconnected(gone)
            self.arrived.set()  # the batcher frees what the table dropped

    def send(self, identity: bytes, msg: Message) -> None:
        """Queue a message for ``identity``; it leaves at the socket thread's next pass (``flush``
        wakes it)."""
        self.q_out.append([identity, *P.encode(msg)])

    FLUSH_WAIT_S = 0.002  # the most the batcher waits for its replies to leave

    def flush(self) -> None:
        """Have the socket's thread send what is queued now (from the batcher's thread), and wait
        (briefly) until it has: the wait hands the thread the GIL, which the batcher's Python
        would otherwise hold for up to a switch interval before the replies leave."""
        if not self.q_out:
            return
        self._sent.clear()
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending
        if self._thread is not None:
            self._sent.wait(self.FLUSH_WAIT_S)

    def take_released(self) -> list[Session]:
        """The sessions closed or re-opened since the last call, whose backend state the batcher
        frees (call with ``lock`` held)."""
        out, self._released = self._released, []
        return out

    def _release(self, session: Session) -> None:
        self._released.append(session)
        self.arrived.set()

    def _send_out(self) -> None:
        """Send queued messages (the socket's thread). A peer that stopped reading (its pipe is
        full) loses that reply rather than stalling everyone behind it; it resynchronises on its own."""
        send, q_out = self.sock.send, self.q_out
        while q_out:
            frames = q_out.popleft()
            copy = P.needs_copy(frames)
            try:
                # the frames one by one, as send_multipart sends them: ZeroMQ delivers a multipart
                # message whole or not at all, and only its first frame can fail to route
                last = len(frames) - 1
                for i, f in enumerate(frames):
                    send(f, _NOBLOCK if i == last else _MORE_NOBLOCK, copy=copy)
            except zmq.Again:
                self.stats.dropped_replies += 1
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self.stats.unroutable += 1  # the peer disconnected; its reply has nowhere to go

    def error(self, identity: bytes | None, exc: ProtocolError) -> None:
        with self.lock:
            self.stats.errors[exc.code.name] += 1
        log.debug("protocol error from %r: %s", identity, exc)
        if identity is not None:
            self.send(identity, P.error_from(exc))

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
            if len(frames) > 2 and frames[1].bytes == _DRAFT:
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
            self.error(identity, exc)
        except Exception:  # a bug must cost one request, never the daemon
            log.exception("internal error while handling a message from %r", identity)
            self.error(identity, ProtocolError(ErrorCode.INTERNAL, "internal error in the draft daemon"))
        finally:
            if self.sessions.dropped:
                self.arrived.set()  # the batcher frees what the table dropped

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
            if self._repeat(identity, session, msg):
                return
            # what the draft model feeds beyond a token: the newly verified, and what it has not taken in
            # (a new session's prompt; the rounds suffix drafts answered)
            fed = len(h["new"]) + max(0, len(session.verified) - session.backend_held)
            # without CURVE a host can open many connections: fair service is counted per address
            self.enqueue(identity, principal, msg, cost, principal if self.allow is not None else conn.address,
                         fed=fed)
            self._on_draft(session)
            return
        if mtype is MsgType.STATS and (conn is not None or self.allow is not None or is_local_address(address)):
            # operators' status: for targets, authenticated peers and this machine
            self.send(identity, Message(MsgType.STATS_REPLY, {"stats": self._snapshot()}))
            return
        if self.draining and mtype in (MsgType.HELLO, MsgType.OPEN):
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the draft daemon is shutting down", h.get("session"))
        if mtype is MsgType.HELLO:
            self._hello(identity, principal, h, origin)
            return
        if conn is None:
            raise ProtocolError(ErrorCode.NO_HANDSHAKE, "send HELLO first", h.get("session"), h.get("seq"))
        if mtype is MsgType.PING:
            self.send(identity, Message(MsgType.PONG, {"instance": self.instance, "draining": self.draining,
                                                       **self.load()}))
        elif mtype is MsgType.OPEN:
            self._open(principal, h, conn.address)
        elif mtype is MsgType.CLOSE:
            s = self.sessions.close(principal, h["session"])
            if s is not None:
                self._release(s)
        else:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{mtype.name} is not a request")

    def _repeat(self, identity: bytes, session: Session, msg: Message) -> bool:
        """Answer a DRAFT that brings nothing new (no verified tokens, nothing accepted) and asks
        what the session's last chain was drafted for, while nothing else of it is queued or being
        drafted, with that chain again: it costs no batch slot. Not for seeded sampled sessions,
        whose draws must follow their requests alone, not when each arrived. False: the request
        is queued as any other."""
        h = msg.header
        last = session.last_reply
        params = session.params
        if params.seeded:
            return False  # a seeded session's draws stay a function of its requests, not of their timing
        if (last is None or last.seq != session.last_seq or h["accepted"] or h["new"]
                or h["pos"] != len(session.verified) or self._queued_keys.get(session.key)
                or last.ask != ask_of(h)):
            return False
        f = msg.tensors.get("features")
        if f is not None and f.shape[0]:
            return False
        session.check(0, [], h["pos"], h["seq"])  # a stale sequence number is refused as ever
        session.last_seq = h["seq"]
        session.touched = time.monotonic()
        session.last_reply = dataclasses.replace(last, seq=h["seq"])
        self.stats.repeats += 1
        self.send(identity, drafted(h["session"], h["seq"], last.draft, 0.0, 0.0))
        return True

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
        self.send(identity, Message(MsgType.WELCOME, {
            "vocab_size": mine[0], "tokenizer": mine[1], "backend": self.backend.name,
            "max_depth": self.config.max_depth, "q_topk": getattr(self.backend, "q_topk", 0),
            "feature_size": need, "instance": self.instance, "server": self.config.name,
            "max_len": self.backend.max_len or 0, "tree_topk": self.backend.tree_topk,
            "max_tree_tokens": self.config.max_tree_tokens if self.backend.tree_topk > 1 else 0,
            "stops_drafts": self.backend.stops_drafts, **self.load(),
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
        # its backend state is made by the batcher, when it first drafts for it (``Session.state``)
        self.sessions.open(principal, sid, params, prompt, None, address, reserve=len(prompt) + self.config.max_depth)
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

    def enqueue(self, identity: bytes, principal: bytes, msg: Message, cost: int, share: bytes | str,
                fed: int = 0) -> None:
        """Queue a DRAFT request within the queue's budgets (count and bytes, in all and per peer)
        and acknowledge it: its place in the queue and when it should be answered (``eta``)."""
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
        now = time.perf_counter()
        eta = self.estimate.eta_s(len(self.q_in), self.queued_fed, h["depth"], fed, now)
        self.q_in.append(QueuedRequest(identity, principal, msg, cost, share, self._read_at, now, fed))
        self._queued_keys[(principal, h["session"])] += 1
        self.queued_fed += fed
        self._wake_batcher = True  # once this pass's acknowledgements are out (``_run``)
        self.send(identity, Message(MsgType.ACK, {"session": h["session"], "seq": h["seq"], "ahead": len(self.q_in) - 1,
                                                  "eta_us": min(P.MAX_REPORTED_US, round(1e6 * eta))}))
        self.stats.acks += 1

    def dequeued(self, item: QueuedRequest) -> None:
        self.queue_bytes -= item.cost
        self.queued_fed -= item.fed
        key = item.key
        self._queued_keys[key] -= 1
        if not self._queued_keys[key]:
            del self._queued_keys[key]
        mine = self._peer_queue[item.principal]
        mine.requests -= 1
        mine.nbytes -= item.cost
        if not mine.requests:
            del self._peer_queue[item.principal]
