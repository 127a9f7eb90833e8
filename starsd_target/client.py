"""The target's link to the draft daemon: one DEALER socket read in one place, the link's state
(down, connecting, up), draft requests and the routing of their replies."""

from __future__ import annotations

import enum
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from common import protocol as P
from common.features import check_feature_layers
from common.protocol import ErrorCode, Message, MsgType, ProtocolError, RemoteError
from common.security import CurveKeys
from common.sockets import SocketOptions, make_socket
from common.verify import SamplingParams
from starsd_target.rtt import ACK_FLOOR_S, RTT_FLOOR_S, RttEstimator

log = logging.getLogger("starsd.target.client")


class HandshakeError(RuntimeError):
    """The draft daemon refused this target (version or model mismatch) or never answered."""


class HandshakeRefused(HandshakeError):
    """The draft daemon answered, and the two sides cannot work together: a configuration error."""


class HandshakeTimeout(HandshakeError):
    """No draft daemon answered in time; the target can still generate alone."""


@dataclass
class Welcome:
    vocab_size: int
    tokenizer: str
    backend: str
    max_depth: int
    q_topk: int
    feature_size: int
    instance: str
    server: str
    max_len: int = 0  # longest sequence the drafter takes (0: no bound)
    tree_topk: int = 1  # branching of its draft trees (1: chains only)
    max_tree_tokens: int = 0  # the most tree tokens a request may ask for (0: no trees)
    feature_layers: tuple[int, ...] | None = None  # the hidden states fused per feature (None: the final one)
    stops_drafts: bool = False  # its greedy chains stop early on a request's min_survival

    @property
    def trees(self) -> bool:
        return self.tree_topk > 1 and self.max_tree_tokens > 0


@dataclass
class DraftReply:
    """Drafts as they arrived: q as read-only numpy views of the reply's frames (the engine
    views them as tensors where it verifies)."""

    tokens: list[int]
    q_ids: np.ndarray | None
    q_probs: np.ndarray | None
    parents: list[int] | None = None  # a tree's parent indices (common.tree); None: a chain
    # Where the request's time went in the draft daemon, as it reported (seconds; None: it did not
    # say): waiting for its batch, and its batch's backend call.
    queued_s: float | None = None
    draft_s: float | None = None

    @property
    def reported(self) -> tuple[float, float] | None:
        """(queued, drafting) as the draft daemon reported them, or None (an older daemon)."""
        if self.queued_s is None or self.draft_s is None:
            return None
        return self.queued_s, self.draft_s


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.25
    cap_s: float = 10.0


class LinkState(enum.Enum):
    DOWN = "down"  # no handshake in force: HELLO is retried on the backoff schedule
    CONNECTING = "connecting"  # HELLO sent, awaiting WELCOME; rounds run without drafts meanwhile
    UP = "up"  # WELCOME taken: drafts can be asked for


Key = tuple[int, int]  # (session, seq) of a draft request


class DraftClient:
    """The target's link to the draft daemon, driven by one thread and never blocking it.

    ``poll()`` is the one reader of the DEALER socket: every message is routed, DRAFTED and
    ERROR replies by (session, seq) to the request that waits for them (``take()``), WELCOME,
    PONG and GOODBYE to the link's state. A reply whose session gave up on it (``abandon()``)
    is counted in ``stale_replies``; nothing else is.

    The link's state (``LinkState``) changes in ``_set_state`` only. HELLO goes out without
    waiting; the WELCOME is taken whenever ``poll()`` reads it. Down, a new HELLO is tried after
    a backoff that doubles up to ``Backoff.cap_s``. The daemon acknowledges each draft request on
    arrival (ACK) with its estimate of when the reply will leave: a request waits for its ACK as
    long as an acknowledgement's round trip takes (``ack_rtt``, measured), then for its reply the
    estimate plus a margin, never past the caller's cap. A request with no ACK in time marks the
    link ``suspect``: rounds then go on without waiting for drafts until the daemon is heard again
    (any message). After ``MISSES_TO_DOWN`` requests in a row got no reply in time, or on GOODBYE,
    the link is down."""

    MISSES_TO_DOWN = 3
    ETA_SLACK = 1.5  # a reply is waited for this times the daemon's estimate, plus an ACK's deadline
    ABANDONED_KEPT = 1024  # given-up requests remembered, so that a late reply is counted stale, not unexpected

    def __init__(self, endpoint: str, vocab_size: int, fingerprint: str, name: str = "",
                 ctx: zmq.Context | None = None, feature_size: int = 0, curve: CurveKeys | None = None,
                 num_layers: int = 0,
                 backoff: Backoff = Backoff(), rtt_floor_s: float = RTT_FLOOR_S):
        self.endpoint = endpoint
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.feature_size = feature_size
        self.num_layers = num_layers  # the target's decoder layers (which fused features it can send)
        self.name = name
        self.ctx = ctx or zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.DEALER, SocketOptions(immediate=True, curve=curve))
        if endpoint.startswith("tcp://["):  # an IPv6 address (a name that resolved to one)
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(endpoint)
        self.welcome: Welcome | None = None  # the latest WELCOME (its instance tells sessions to re-open)
        self.backoff = backoff
        self.state = LinkState.DOWN
        self.refusal: HandshakeError | None = None  # why the last HELLO was answered with an ERROR
        self._delay = backoff.initial_s
        self._retry_at = 0.0  # the first HELLO goes at once
        # a request to its acknowledgement, and a HELLO to its WELCOME: the wire and the daemon's
        # socket thread, which answers while its model computes
        self.ack_rtt = RttEstimator(max(rtt_floor_s, ACK_FLOOR_S))
        self._acks: dict[Key, tuple[float, float]] = {}  # acknowledged requests: when, and the estimate (s)
        self._hello_at: float | None = None
        self.suspect = False  # a request went unacknowledged and nothing was heard since
        self.unacked = 0  # requests given up with no acknowledgement
        self._pending: dict[Key, float] = {}  # requests waited for: when each was sent
        self._abandoned: dict[Key, float] = {}  # requests given up on: when each was sent
        self._replies: dict[Key, DraftReply | RemoteError] = {}  # routed, not yet taken
        self.heard_at = 0.0  # when the daemon last sent anything
        self.misses = 0  # requests in a row with no reply by their deadline
        self.missed = 0  # all of them
        self.stale_replies = 0  # replies that came after their session gave up on them
        self.unexpected = 0  # messages nobody asked for (replies to unknown requests, stray types)
        self.open_refusals = 0  # OPENs the daemon refused (busy, too large): their sessions back off
        self._open_refusals: dict[int, RemoteError] = {}  # session -> the refusal, until it looks
        self.hellos = 0
        self.reconnects = 0  # times the link came up
        self.errors: dict[str, int] = {}
        self._session_ids = itertools.count(1)
        # In a pool of draft daemons (starsd_target.pool): sessions move off a draining link at
        # their next round, and new ones go where the reported wait is least
        self.draining = False  # the daemon said it is draining (GOODBYE, PONG): it serves what it holds
        self.retired = False  # the pool no longer resolves this address: no new sessions
        self.sessions = 0  # this target's draft sessions living on this link
        self.wait_s = 0.0  # smoothed wait before its requests begin to be drafted, as the daemon reports it
        self.probation = False  # back after failing: one session probes it until a draft comes

    def close(self) -> None:
        self.sock.close(linger=0)

    def counters(self) -> dict:
        """The link's counts, for the target's STATS (read from another thread: plain numbers)."""
        return {"endpoint": self.endpoint, "state": self.state.value, "reconnects": self.reconnects, "hellos": self.hellos,
                "missed": self.missed, "unacked": self.unacked, "suspect": self.suspect,
                "stale_replies": self.stale_replies,
                "unexpected": self.unexpected, "open_refusals": self.open_refusals, "errors": dict(self.errors)}

    def next_session(self) -> int:
        """A session id not used before on this link: ids are never reused, so a late reply to a
        closed session cannot reach a new one."""
        return next(self._session_ids)

    def place(self, tokens, current: DraftClient | None = None) -> DraftClient | None:
        """A link of its own: itself while up (``starsd_target.pool.DraftPool.place`` chooses among several)."""
        return self if self.up else None

    WAIT_GAIN = 0.3  # weight of each new report of the daemon's wait

    def _waited(self, seconds: float) -> None:
        self.wait_s += self.WAIT_GAIN * (seconds - self.wait_s)

    # ------------------------------------------------------------ plumbing
    def _send(self, msg: Message) -> bool:
        """False when the message cannot go out now (not connected, or the pipe is full).
        A message that cannot be encoded (a value msgpack cannot hold) raises ValueError."""
        try:
            frames = P.encode(msg)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot encode {msg.type.name}: {exc}") from None
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=P.needs_copy(frames))
            return True
        except zmq.Again:
            return False

    def _count(self, name: str) -> None:
        errors = dict(self.errors)  # a new dict each time: other threads read it (counters())
        errors[name] = errors.get(name, 0) + 1
        self.errors = errors

    def poll(self, timeout_s: float = 0.0) -> int:
        """Read and route every message that has arrived, waiting up to ``timeout_s`` for the
        first; then send a HELLO if the link is not up and the backoff has passed. Returns how
        many messages were read."""
        n = 0
        while self.sock.poll(max(0, int(timeout_s * 1000)) if n == 0 else 0, zmq.POLLIN):
            frames = self.sock.recv_multipart()  # replies are small: bytes are cheaper than zmq.Frame objects
            n += 1
            self.heard_at = time.monotonic()
            self.suspect = False  # it answers
            try:
                msg = P.decode(frames)
            except ProtocolError as exc:
                self._count(exc.code.name)
                log.warning("undecodable message from the draft daemon: %s", exc)
                continue
            self._route(msg)
        self._maintain()
        return n

    # ------------------------------------------------------------ link state
    @property
    def up(self) -> bool:
        return self.state is LinkState.UP

    def _set_state(self, new: LinkState, why: str, retry_in: float | None = None) -> None:
        """The one place the link changes state. ``retry_in``: seconds until the next HELLO
        (None: leave the schedule as it is)."""
        old, now = self.state, time.monotonic()
        if retry_in is not None:
            self._retry_at = now + retry_in
        if new is old:
            return
        self.state = new
        if new is LinkState.UP:
            self.reconnects += 1
            self.misses = 0
            self._delay = self.backoff.initial_s
            w = self.welcome
            log.info("draft link to %s is up: daemon %s (backend %s, max depth %d, instance %s)",
                     self.endpoint, w.server, w.backend, w.max_depth, w.instance)
        elif old is LinkState.UP:
            self._delay = self.backoff.initial_s
            if retry_in is None:
                self._retry_at = now + self._delay
            log.warning("draft link to %s is %s (%s); rounds run without drafts", self.endpoint, new.value, why)
        else:
            log.debug("draft link to %s: %s -> %s (%s)", self.endpoint, old.value, new.value, why)

    def mark_down(self, why: str) -> None:
        """A send could not go out, or the daemon is gone: rounds run without drafts, and HELLO
        is retried on the backoff schedule."""
        self._set_state(LinkState.DOWN, why)

    def _send_hello(self) -> bool:
        hello = Message(MsgType.HELLO, {"vocab_size": self.vocab_size, "tokenizer": self.fingerprint,
                                        "feature_size": self.feature_size, "num_layers": self.num_layers,
                                        "name": self.name})
        if not self._send(hello):
            self._set_state(LinkState.DOWN, "not connected")
            return False
        self.hellos += 1
        self._hello_at = time.monotonic()
        self._set_state(LinkState.CONNECTING, "HELLO sent")
        return True

    def _maintain(self) -> None:
        """While not up: a HELLO once the backoff has passed (a send, never a wait); after each
        one that went out unanswered the backoff doubles, up to its cap. A HELLO that cannot go
        out (no connection: ZeroMQ reconnects with its own backoff) costs nothing and is tried
        again on the next poll."""
        if self.state is LinkState.UP or time.monotonic() < self._retry_at:
            return
        if self._send_hello():
            self._set_state(self.state, "next HELLO scheduled", retry_in=self._delay)
            self._delay = min(self.backoff.cap_s, self._delay * 2)

    def ready(self) -> bool:
        """True when drafts can be asked for now. Never waits: reads what has arrived (a
        WELCOME, say) and, while down, sends a HELLO when one is due."""
        self.poll(0)
        return self.up

    def heartbeat(self) -> None:
        """While idle: keep the daemon's lease on this peer alive and notice a restart (PONG);
        while the link is not up, retry it on the backoff schedule."""
        self.poll(0)
        if self.up and not self._send(Message(MsgType.PING)):
            self.mark_down("not connected")

    def handshake(self, timeout_s: float) -> Welcome:
        """Wait up to ``timeout_s`` for the link to come up (start-up only: serving never waits
        here). HandshakeRefused when the daemon cannot work with this target, HandshakeTimeout
        when none answered."""
        deadline = time.monotonic() + timeout_s
        self.refusal = None
        while not self.up:
            if self.refusal is not None:
                raise self.refusal
            left = deadline - time.monotonic()
            if left <= 0:
                what = "no answer from" if self.state is LinkState.CONNECTING else "no connection to"
                raise HandshakeTimeout(f"{what} a draft daemon at {self.endpoint} within {timeout_s:.1f}s")
            # DOWN: not connected yet, the next poll tries the HELLO again
            self.poll(min(left, 0.01 if self.state is LinkState.DOWN else 0.05))
        return self.welcome

    # ------------------------------------------------------------ routing
    def _route(self, msg: Message) -> None:
        h = msg.header
        if msg.type is MsgType.DRAFTED:
            queued, draft = h.get("queued_us"), h.get("draft_us")
            if queued is not None:
                self._waited(queued / 1e6)
            self.probation = False  # it drafts: the probe passed
            self._reply((h["session"], h["seq"]),
                        DraftReply(h["tokens"], msg.tensors.get("q_ids"), msg.tensors.get("q_probs"),
                                   _wire_parents(msg.tensors.get("parents")),
                                   None if queued is None else queued / 1e6, None if draft is None else draft / 1e6))
        elif msg.type is MsgType.ACK:
            key = (h["session"], h["seq"])
            sent = self._pending.get(key)
            if sent is not None:
                now = time.monotonic()
                self._acks[key] = (now, h["eta_us"] / 1e6)
                self.ack_rtt.observe(now - sent)
        elif msg.type is MsgType.ERROR:
            self._on_error(P.remote_error(h))
        elif msg.type is MsgType.WELCOME:
            self._on_welcome(h)
        elif msg.type is MsgType.PONG:
            if self.welcome is not None and h["instance"] != self.welcome.instance and self.up:
                self._set_state(LinkState.DOWN, "draft daemon restarted", retry_in=0.0)
                return
            self._on_load(h)
            if h["draining"] and not self.draining:
                self._drains()
        elif msg.type is MsgType.GOODBYE:
            if h.get("draining") and self.up and (self.welcome is None or h["instance"] == self.welcome.instance):
                self._drains()
            else:
                log.info("draft daemon at %s is stopping; its sessions draft elsewhere, or without drafts until "
                         "it is back", self.endpoint)
                self._set_state(LinkState.DOWN, "goodbye")
        else:
            self.unexpected += 1

    def _drains(self) -> None:
        self.draining = True
        log.info("draft daemon at %s is draining: its %d session(s) of this target move to another daemon at their "
                 "next round (where there is one)", self.endpoint, self.sessions)

    def _on_load(self, h: dict) -> None:
        """A WELCOME's or PONG's report of the daemon's load."""
        wait = h.get("wait_us")
        if wait is not None:
            self._waited(wait / 1e6)

    def _on_error(self, err: RemoteError) -> None:
        """Route an ERROR: to the draft request it answers, to the session whose OPEN it refuses,
        or to the handshake."""
        self._count(err.name)
        if err.code == ErrorCode.NO_HANDSHAKE:  # the daemon forgot this connection (restart, expiry): greet again
            self._set_state(LinkState.DOWN, "the draft daemon does not know this target", retry_in=0.0)
        if err.session is not None and err.seq is not None:
            self._reply((err.session, err.seq), err)
        elif err.re == MsgType.OPEN.name and err.session is not None:
            self.open_refusals += 1
            self._remember(self._open_refusals, err.session, err)
        elif err.re == MsgType.HELLO.name or (err.re is None and self.state is LinkState.CONNECTING):
            self._on_refusal(err)
        elif err.code != ErrorCode.NO_HANDSHAKE:
            self.unexpected += 1

    def take_open_refusal(self, session: int) -> RemoteError | None:
        """The ERROR that refused ``session``'s latest OPEN, if one came (taken once)."""
        return self._open_refusals.pop(session, None)

    def _reply(self, key: Key, reply: DraftReply | RemoteError) -> None:
        self._acks.pop(key, None)
        if key in self._pending:
            del self._pending[key]
            self._replies[key] = reply
        elif key in self._abandoned:
            del self._abandoned[key]
            self.stale_replies += 1
        else:
            self.unexpected += 1
            return
        if isinstance(reply, DraftReply):
            self.misses = 0  # the daemon answers

    def _on_welcome(self, h: dict) -> None:
        if self._hello_at is not None:  # answered on arrival, as an ACK is: it measures that round trip
            self.ack_rtt.observe(time.monotonic() - self._hello_at)
            self._hello_at = None
        w = Welcome(h["vocab_size"], h["tokenizer"], h["backend"], h["max_depth"], h["q_topk"],
                    h["feature_size"], h["instance"], h.get("server", ""), h.get("max_len", 0),
                    h.get("tree_topk", 1), h.get("max_tree_tokens", 0), tuple(h["feature_layers"])
                    if h.get("feature_layers") else None, h.get("stops_drafts", False))
        if (w.vocab_size, w.tokenizer) != (self.vocab_size, self.fingerprint):
            self._refused(HandshakeRefused(
                f"draft daemon at {self.endpoint} serves vocabulary {w.vocab_size} (tokenizer "
                f"{w.tokenizer}); this target has {self.vocab_size} (tokenizer {self.fingerprint})"))
            return
        why = self._feature_refusal(w)
        if why is not None:
            self._refused(HandshakeRefused(f"draft daemon at {self.endpoint} ({w.backend}) {why}"))
            return
        if self.up and self.welcome is not None and self.welcome.instance == w.instance:
            return  # the answer to an earlier HELLO
        self.probation = self.reconnects > 0  # a daemon back after failing takes one session before more
        self.welcome = w
        self.draining = False  # a new instance (one that drains refuses HELLO)
        self.wait_s = 0.0
        self._on_load(h)
        self._set_state(LinkState.UP, "WELCOME")

    def _feature_refusal(self, w: Welcome) -> str | None:
        """Why this target cannot send the features the daemon's head reads (None: it can)."""
        if not w.feature_size:
            return None
        if w.feature_layers is None:
            if w.feature_size != self.feature_size:
                return (f"reads final hidden states {w.feature_size} wide; this target's hidden size is "
                        f"{self.feature_size}")
            return None
        why = check_feature_layers(w.feature_layers, self.num_layers)
        if why is not None:
            return f"reads the hidden states entering layers {list(w.feature_layers)}: {why}"
        width = self.feature_size * len(w.feature_layers)
        if width != w.feature_size:
            return (f"reads features {w.feature_size} wide fused from layers {list(w.feature_layers)}; this target "
                    f"(hidden size {self.feature_size}) fuses them {width} wide")
        return None

    def _on_refusal(self, err: RemoteError) -> None:
        if err.code in (ErrorCode.SHUTTING_DOWN, ErrorCode.BUSY):
            self.refusal = HandshakeTimeout(f"draft daemon at {self.endpoint} cannot take this target now: {err}")
            self._set_state(LinkState.DOWN, str(err))
            return
        self._refused(HandshakeRefused(f"draft daemon at {self.endpoint} refused this target: {err}"))

    def _refused(self, exc: HandshakeRefused) -> None:
        log.error("%s", exc)
        self.refusal = exc
        self._set_state(LinkState.DOWN, "refused")

    # ------------------------------------------------------------ conversation
    def open(self, session: int, prompt: list[int], params: SamplingParams) -> bool:
        return self._send(Message(MsgType.OPEN, {"session": session, "prompt": list(prompt),
                                                 "sampling": params.to_wire()}))

    def close_session(self, session: int) -> None:
        self._send(Message(MsgType.CLOSE, {"session": session}))

    def request(self, session: int, seq: int, accepted: int, new: list[int], pos: int, depth: int,
                features: np.ndarray | torch.Tensor | None = None, tree_tokens: int = 0,
                min_survival: float = 0.0) -> bool:
        """Send a draft request; its reply is then routed to ``take(session, seq)``.
        ``tree_tokens`` > ``depth``: a tree of up to that many tokens may answer.
        ``min_survival`` > 0: a greedy chain may stop early (WELCOME.stops_drafts)."""
        tensors = {} if features is None else {"features": features}
        header = {"session": session, "seq": seq, "accepted": accepted, "new": list(new), "pos": pos, "depth": depth}
        if tree_tokens > depth:
            header["tree_tokens"] = tree_tokens
        if min_survival > 0.0:
            header["min_survival"] = float(min(min_survival, 1.0))
        if not self._send(Message(MsgType.DRAFT, header, tensors)):
            return False
        self._pending[(session, seq)] = time.monotonic()
        return True

    def ack_deadline_s(self, cap_s: float) -> float:
        """How long a request waits for its acknowledgement: adaptive, at most ``cap_s``."""
        return self.ack_rtt.deadline_s(cap_s)

    def acked(self, key: Key) -> bool:
        return key in self._acks

    def give_up_at(self, key: Key, sent_at: float, cap_s: float) -> float:
        """When to stop waiting for the request ``key`` sent at ``sent_at``: unacknowledged, an
        acknowledgement's deadline after sending; acknowledged, the daemon's estimate (times
        ETA_SLACK) plus that deadline after its ACK; ``cap_s`` after sending at the latest."""
        rto = self.ack_rtt.deadline_s(cap_s)
        ack = self._acks.get(key)
        at = sent_at + rto if ack is None else ack[0] + self.ETA_SLACK * ack[1] + rto
        return min(sent_at + cap_s, at)

    def expired(self, key: Key, sent_at: float, cap_s: float) -> bool:
        """Whether to stop waiting for the request ``key`` (``give_up_at``)."""
        return time.monotonic() >= self.give_up_at(key, sent_at, cap_s)

    def take(self, session: int, seq: int) -> DraftReply | RemoteError | None:
        """The reply routed to (session, seq), if it has come."""
        return self._replies.pop((session, seq), None)

    def waiting(self, session: int, seq: int) -> bool:
        return (session, seq) in self._pending

    def abandon(self, session: int, seq: int) -> None:
        """The session stops waiting for (session, seq): a reply that still comes is stale."""
        key = (session, seq)
        self._replies.pop(key, None)
        self._acks.pop(key, None)
        sent = self._pending.pop(key, None)
        if sent is not None:
            self._remember(self._abandoned, key, sent)

    def _remember(self, table: dict, key, value) -> None:
        """Add to a table of things kept for late arrivals, forgetting the oldest beyond ABANDONED_KEPT."""
        table[key] = value
        while len(table) > self.ABANDONED_KEPT:
            del table[next(iter(table))]

    def miss(self, acked: bool = True) -> None:
        """A request got no reply by its deadline (``acked``: it was acknowledged, so the daemon's
        estimate was wrong; not: the daemon did not answer, and the link is suspect until it
        does); after ``MISSES_TO_DOWN`` in a row the link is down."""
        self.misses += 1
        self.missed += 1
        if not acked:
            self.unacked += 1
            if not self.suspect:
                r = self.ack_rtt
                log.info("no acknowledgement within %.1f ms (srtt %.1f ms, rttvar %.1f ms): the draft daemon is "
                         "not answering; rounds go on without waiting for drafts until it does",
                         1000 * r.deadline_s(float("inf")), 1000 * (r.srtt or 0.0), 1000 * r.rttvar)
            self.suspect = True
        else:
            log.info("a draft came later than the daemon's estimate allowed; the round runs alone")
        if self.misses >= self.MISSES_TO_DOWN:
            self.mark_down(f"no drafts for {self.misses} requests in a row")

    def wait_draft(self, session: int, seq: int, timeout_s: float) -> DraftReply | RemoteError | None:
        """Wait up to ``timeout_s`` for the reply to (session, seq), routing whatever else
        arrives meanwhile; None at the deadline or when the link goes down (the request is then
        abandoned). For the bench's wire probes, which time bare requests: generations run their
        rounds through ``starsd_target.scheduler.Scheduler``, which never waits on one request."""
        deadline = time.monotonic() + timeout_s
        while (reply := self.take(session, seq)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self.up:
                self.abandon(session, seq)
                return None
            self.poll(left)
        return reply


def _wire_parents(arr: np.ndarray | None) -> list[int] | None:
    """A DRAFTED reply's parents as ints (None: a chain). A tensor that is no 1-D integer array
    reads as a tree no check passes (a parent before the root), so the engine counts the
    proposal invalid and verifies without it."""
    if arr is None:
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        return [-2]
    return arr.tolist()


class RemoteDraftSession:
    """One generation's drafts from a draft daemon, as the scheduler drives them.

    Tracks what the daemon has verified, so each request carries only the tokens (and, for
    feature backends, the features) verified since the previous one. A round that got no drafts
    reports 0 accepted next time; an error about the session (unknown after a restart, out of
    sync), or a different daemon instance after a reconnect, re-opens it with the full verified
    prefix. ``pool`` (a ``starsd_target.pool.DraftPool``, or one ``DraftClient``) says at each
    round which link the session asks (``client``): where it lives while that daemon is healthy;
    another once it fails or drains, where the session re-opens with its verified tokens.

    ``send()`` puts a request in flight; ``expired()`` says when to stop waiting for it:
    adaptive (``DraftClient.expired``: the RTT estimate, a PING probe), capped by ``timeout_s``;
    the request that opens the session waits up to the cap, as it carries the prompt's prefill. ``resolve()`` turns what came (None: nothing in time)
    into drafts, giving the request up when nothing came."""

    def __init__(self, pool, session: int, params: SamplingParams, timeout_s: float):
        self.pool = pool
        self.client: DraftClient | None = None  # the link it lives on (placed at its first request)
        self.moves = 0  # times it moved to another daemon
        self.session = session
        self.params = params
        self.timeout_s = timeout_s
        self.seq = 0
        self.synced = 0  # verified tokens the daemon held when it drafted the last proposal
        self.accepted = 0  # how many of that proposal the target kept
        self.features_sent = 0
        self.instance: str | None = None  # the daemon instance holding this session
        self.errors = 0
        self.disabled = False  # the sequence outgrew the drafter's context: no more drafts for it
        self.sent_at = 0.0  # the request in flight: when it went out,
        self.cap_at = 0.0  # and when waiting for it ends in any case
        self.open_refusals = 0  # OPENs of this session the daemon refused
        self._before = (0, 0, 0)  # (synced, accepted, features_sent) before the request in flight
        self.tree = False  # the last reply was a tree: what it kept is reported as new tokens
        self._retry_delay = pool.backoff.initial_s  # after a refusal (BUSY), the next request waits this
        self._retry_at = 0.0  # long, until then; doubling up to the backoff's cap

    @property
    def welcome(self) -> Welcome | None:
        """What its daemon said (before it is placed, what the pool's daemons said)."""
        return (self.client or self.pool).welcome

    @property
    def feature_size(self) -> int:
        w = self.welcome
        return w.feature_size if w is not None else 0

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The hidden states the daemon's head fuses per feature (None: the final one)."""
        w = self.welcome
        return w.feature_layers if w is not None else None

    @property
    def trees(self) -> bool:
        """The draft daemon drafts trees (a request's tree_tokens is then heeded)."""
        w = self.welcome
        return w is not None and w.trees

    @property
    def stops_drafts(self) -> bool:
        """The draft daemon stops greedy chains early (a request's min_survival is then heeded)."""
        w = self.welcome
        return w is not None and w.stops_drafts

    def _link(self, tokens: list[int]) -> DraftClient | None:
        """The link to ask this round (``pool.place``), moving the session when it changes: closed
        on the old daemon where that one still answers, re-opened on the new one with the verified
        tokens. None: no daemon is up."""
        link = self.pool.place(tokens, self.client)
        old = self.client
        if link is None or link is old:
            return link
        if old is not None:
            if self.instance is not None and old.up:
                old.close_session(self.session)
            old.take_open_refusal(self.session)
            old.sessions -= 1
            self.moves += 1
        link.sessions += 1
        self.client, self.instance = link, None
        self._retry_delay, self._retry_at = self.pool.backoff.initial_s, 0.0
        return link

    def send(self, tokens: list[int], depth: int, features: np.ndarray | torch.Tensor | None = None,
             tree_tokens: int = 0, feature_layers: tuple[int, ...] | None = None,
             min_survival: float = 0.0) -> int | None:
        """Ask for drafts following ``tokens``; the sequence number in flight, or None when no
        request could go out (link not up, no features): the round then runs without drafts.
        ``tree_tokens`` > ``depth``: a tree of up to that many tokens may answer, where the
        daemon drafts trees (within its ``max_tree_tokens``). ``feature_layers``: the hidden
        states ``features`` were fused from (None: the final one); features the daemon's head
        does not read (another head since the generation started) end its drafting, logged.
        ``min_survival``: where the daemon stops greedy chains early (``stops_drafts``), the
        chance of all drafts kept below which it stops."""
        if self.disabled or not self.pool.ready():
            return None
        client = self._link(tokens)
        if client is None or time.monotonic() < self._retry_at:
            return None
        welcome = client.welcome
        if welcome.max_len and len(tokens) + min(depth, welcome.max_depth) > welcome.max_len:
            self._stop_drafting(f"it outgrew the drafter's {welcome.max_len} positions")
            return None
        opening = self.instance != welcome.instance
        if opening:
            if not self._may_open():
                return None
            try:
                sent = client.open(self.session, tokens, self.params)
            except ValueError as exc:  # parameters the wire cannot carry
                self._stop_drafting(f"it cannot be opened: {exc}")
                return None
            if not sent:
                client.mark_down("not connected")
                return None
            self.instance = welcome.instance
            self.synced, self.accepted, self.features_sent = len(tokens), 0, 0
        new_features = None
        if welcome.feature_size:
            why = self._feature_mismatch(features, feature_layers, welcome)
            if why:
                self._stop_drafting(why)
                return None
            if features.shape[0] != len(tokens) - 1:
                return None  # its prefill is still under way
            new_features = features[self.features_sent:]
        self.seq += 1
        self._before = (self.synced, self.accepted, self.features_sent)  # to undo a request refused BUSY
        new = tokens[self.synced + self.accepted:]
        depth = min(depth, welcome.max_depth)
        tree = min(tree_tokens, welcome.max_tree_tokens) if welcome.trees else 0
        if not client.request(self.session, self.seq, self.accepted, new, len(tokens), depth, new_features,
                              tree if tree > depth else 0, min_survival if welcome.stops_drafts else 0.0):
            client.mark_down("not connected")
            self.instance = None  # whatever the daemon holds is unknown now
            return None
        self.synced, self.accepted = len(tokens), 0
        if new_features is not None:
            self.features_sent = len(tokens) - 1
        self.sent_at = time.monotonic()
        self.cap_at = self.sent_at + self.timeout_s
        return self.seq

    @staticmethod
    def _feature_mismatch(features, layers: tuple[int, ...] | None, welcome) -> str | None:
        """Why this generation's features cannot feed the daemon's head (None: they can). A
        generation fuses the layers named when it started, for its whole length; a daemon that
        restarted with another head, or a link that came up after the start, leaves it without
        the features the head reads, and its rounds run on the target alone."""
        if features is None:
            return "it collected no target features (it started before the draft daemon's head was known)"
        # both are tuples (the WELCOME's as parsed, the generation's as it started) or None
        if layers != welcome.feature_layers or features.shape[1] != welcome.feature_size:
            named = (lambda ls: "the final hidden state" if ls is None else f"layers {list(ls)}")
            return (f"its features ({features.shape[1]} wide, {named(layers)}) are not what the draft daemon's "
                    f"head reads ({welcome.feature_size} wide, {named(welcome.feature_layers)})")
        return None

    def _may_open(self) -> bool:
        """Whether to (re-)open the session now. After the daemon refused an OPEN, the next one
        waits a backoff that doubles up to the link's cap (a busy daemon is not sent the whole
        prompt every round); a refusal no retry can cure (the prompt outgrows the drafter, or
        parameters it rejects) ends drafting for this generation."""
        refusal = self.client.take_open_refusal(self.session)
        if refusal is None:
            return True
        self.open_refusals += 1
        if refusal.code in (ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST, ErrorCode.INCOMPATIBLE_MODEL):
            self._stop_drafting(f"the draft daemon refused it: {refusal}")
        else:
            self._back_off(refusal)
        return False

    def _stop_drafting(self, why: str) -> None:
        """This generation asks for no more drafts: the rest runs on the target alone."""
        log.info("session %d: %s; the rest runs on the target alone", self.session, why)
        self.disabled = True

    def _back_off(self, refusal: RemoteError) -> None:
        """The daemon is busy for this session: its next request waits, twice as long each time."""
        self._retry_at = time.monotonic() + self._retry_delay
        log.debug("the draft daemon refused session %d (%s); next OPEN in %.2fs", self.session, refusal,
                  self._retry_delay)
        self._retry_delay = min(self.client.backoff.cap_s, 2 * self._retry_delay)

    def expired(self, idle: bool = True) -> bool:
        """Whether to give the request in flight up now. Past the cap, always; before it, only
        while the target is ``idle`` (with other rounds to verify, waiting costs nothing): at once
        while the link is suspect, else when the link says so (``DraftClient.expired``: no ACK
        in a round trip, or no reply by the daemon's estimate)."""
        if time.monotonic() >= self.cap_at:
            return True
        if not idle:
            return False
        client = self.client
        return (client.suspect and not client.acked((self.session, self.seq))) or client.expired(
            (self.session, self.seq), self.sent_at, self.timeout_s)

    @property
    def wake_at(self) -> float:
        """When ``expired()`` has something new to decide."""
        return self.client.give_up_at((self.session, self.seq), self.sent_at, self.timeout_s)

    def resolve(self, reply: DraftReply | RemoteError | None) -> DraftReply | None:
        """Turn what came back for the request in flight (None: nothing in time, or the link
        went down meanwhile) into drafts."""
        if reply is None:
            acked = self.client.acked((self.session, self.seq))
            self.client.abandon(self.session, self.seq)
            if self.client.up:
                self.client.miss(acked)
            return None
        if isinstance(reply, RemoteError):
            self.errors += 1
            if reply.code == ErrorCode.TOO_LARGE:
                self._stop_drafting(f"it outgrew the drafter ({reply.message})")
                return None
            if reply.code == ErrorCode.BUSY:
                # refused before the daemon applied it (a BUSY DRAFT means its session exists and
                # stands as it was): ask again after a backoff, reporting what this request did
                self.synced, self.accepted, self.features_sent = self._before
                self._back_off(reply)
                return None
            log.debug("draft request failed (%s); re-opening session %d", reply, self.session)
            self.instance = None
            return None
        self._retry_delay = self.client.backoff.initial_s  # the session is served: a later refusal starts afresh
        self.tree = reply.parents is not None
        return reply

    def kept(self, n: int) -> None:
        """``n`` tokens of the last proposal were kept. A tree's kept path is no prefix of its
        tokens: the next request reports none accepted and sends the path as new tokens."""
        self.accepted = 0 if self.tree else n

    def close(self) -> None:
        client = self.client
        if client is None:
            return
        client.abandon(self.session, self.seq)  # a reply still in flight is nobody's now
        client.take_open_refusal(self.session)
        if self.instance is not None:
            client.close_session(self.session)
        client.sessions -= 1
        self.client = None
