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
from starsd_target.config import TargetConfig
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
    ETA_SLACK = TargetConfig.draft_patience  # a reply is waited for this times the daemon's estimate, plus an ACK's deadline
    ABANDONED_KEPT = 1024  # given-up requests remembered, so that a late reply is counted stale, not unexpected

    def __init__(self, endpoint: str, vocab_size: int, fingerprint: str, name: str = "",
                 ctx: zmq.Context | None = None, feature_size: int = 0, curve: CurveKeys | None = None,
                 num_layers: int = 0,
                 backoff: Backoff = Backoff(), rtt_floor_s: float = RTT_FLOOR_S, patience: float = ETA_SLACK,
                 ack_floor_s: float | None = None):
        self.endpoint = endpoint
        self.patience = patience  # an acknowledged request waits this times the daemon's estimate
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
        self.ack_rtt = RttEstimator(max(rtt_floor_s, ACK_FLOOR_S if ack_floor_s is None else ack_floor_s))
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
        # their next round, and new ones are placed by the load each daemon reports
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
                min_survival: float = 0.0, min_chance: float = 0.0) -> bool:
        """Send a draft request; its reply is then routed to ``take(session, seq)``.
        ``tree_tokens`` > ``depth``: a tree of up to that many tokens may answer.
        ``min_survival`` > 0: a greedy chain may stop early (WELCOME.stops_drafts);
        ``min_chance`` > 0: the lower threshold for a chain copied from text already seen."""
        tensors = {} if features is None else {"features": features}
        header = {"session": session, "seq": seq, "accepted": accepted, "new": list(new), "pos": pos, "depth": depth}
        if tree_tokens > depth:
            header["tree_tokens"] = tree_tokens
        if min_survival > 0.0:
            header["min_survival"] = float(min(min_survival, 1.0))
        if min_chance > 0.0:
            header["min_chance"] = float(min(min_chance, 1.0))
        if not self._send(Message(MsgType.DRAFT, header, tensors)):
            return False
        self._pending[(session, seq)] = time.monotonic()
        return True

    def ack_deadline_s(self, cap_s: float) -> float:
        """How long a request waits for its acknowledgement: adaptive, at most ``cap_s``."""
        return self.ack_rtt.deadline_s(cap_s)

    def acked(self, key: Key) -> bool:
        return key in self._acks

    def answer_due(self, key: Key) -> float | None:
        """When (``time.monotonic``) the daemon's acknowledgement of ``key`` said it would be
        answered; None before the acknowledgement."""
        ack = self._acks.get(key)
        return None if ack is None else ack[0] + ack[1]

    def give_up_at(self, key: Key, sent_at: float, cap_s: float) -> float:
        """When to stop waiting for the request ``key`` sent at ``sent_at``: unacknowledged, an
        acknowledgement's deadline after sending; acknowledged, the daemon's estimate (times
        ``patience``) plus that deadline after its ACK; ``cap_s`` after sending at the latest."""
        rto = self.ack_rtt.deadline_s(cap_s)
        ack = self._acks.get(key)
        at = sent_at + rto if ack is None else ack[0] + self.patience * ack[1] + rto
        return min(sent_at + cap_s, at)

    def expired(self, key: Key, sent_at: float, cap_s: float) -> bool:
        """Whether to stop waiting for the request ``key`` (``give_up_at``)."""
        return time.monotonic() >= self.give_up_at(key, sent_at, cap_s)

    def replied(self, session: int, seq: int) -> bool:
        """Whether the reply to (session, seq) has come and waits to be taken."""
        return (session, seq) in self._replies

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
