"""The target's link to the draft daemon: one DEALER socket, a handshake, draft requests, and the
link's health (up, or down and retried with capped exponential backoff)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from common import protocol as P
from common.protocol import ErrorCode, Message, MsgType, ProtocolError, RemoteError
from common.security import CurveKeys
from common.sockets import SocketOptions, make_socket
from common.verify import SamplingParams

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


@dataclass
class DraftReply:
    """Drafts as they arrived: q as read-only numpy views of the reply's frames (the engine
    views them as tensors where it verifies)."""

    tokens: list[int]
    q_ids: np.ndarray | None
    q_probs: np.ndarray | None


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.25
    cap_s: float = 10.0


class DraftClient:
    """Synchronous client used by one generation loop at a time.

    The link is *up* after a successful handshake. A send that cannot go out (no connection),
    a draft that does not arrive in time, or a GOODBYE from a stopping daemon marks it *down*:
    rounds then run without drafts at once, and a new handshake is tried after a backoff that
    doubles up to ``Backoff.cap_s``."""

    def __init__(self, endpoint: str, vocab_size: int, fingerprint: str, name: str = "",
                 ctx: zmq.Context | None = None, feature_size: int = 0, curve: CurveKeys | None = None,
                 backoff: Backoff = Backoff()):
        self.endpoint = endpoint
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.feature_size = feature_size
        self.name = name
        self.ctx = ctx or zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.DEALER, SocketOptions(immediate=True, curve=curve))
        self.sock.connect(endpoint)
        self.welcome: Welcome | None = None
        self.backoff = backoff
        self.down = True  # until the first handshake; the first ready() tries at once
        self._delay = backoff.initial_s
        self._retry_at = 0.0
        self.stale_replies = 0
        self.errors: dict[str, int] = {}
        self.reconnects = 0

    def close(self) -> None:
        self.sock.close(linger=0)

    # ------------------------------------------------------------ plumbing
    def _send(self, msg: Message) -> bool:
        """False when the message cannot go out now (not connected, or the pipe is full)."""
        try:
            frames = P.encode(msg)
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=P.needs_copy(frames))
            return True
        except zmq.Again:
            return False

    def _recv(self, timeout_s: float) -> Message | None:
        if not self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        frames = self.sock.recv_multipart()  # replies are small: bytes are cheaper than zmq.Frame objects
        try:
            msg = P.decode(frames)
        except ProtocolError as exc:
            self._count(exc.code.name)
            log.warning("undecodable message from the draft daemon: %s", exc)
            return None
        if msg.type is MsgType.GOODBYE:
            log.info("draft daemon at %s is stopping; generating without drafts until it is back", self.endpoint)
            self.welcome = None
            self.mark_down("goodbye")
            return None
        return msg

    def _count(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1

    # ------------------------------------------------------------ link health
    @property
    def up(self) -> bool:
        return not self.down and self.welcome is not None

    def mark_down(self, why: str) -> None:
        """The link failed: rounds run without drafts; the first retry comes after the initial backoff."""
        if self.down:
            return
        log.warning("draft link to %s is down (%s); rounds run without drafts", self.endpoint, why)
        self.down = True
        self._delay = self.backoff.initial_s
        self._retry_at = time.monotonic() + self._delay

    def ready(self, probe_timeout_s: float) -> bool:
        """True when drafts can be asked for now; while down, retries the handshake once the
        backoff has passed (cheap: with no connection the send fails at once), doubling the
        backoff after each failed retry up to its cap."""
        self.poll_pending()
        if self.up:
            return True
        if time.monotonic() < self._retry_at:
            return False
        try:
            self.handshake(probe_timeout_s)
        except HandshakeError as exc:
            self.down = True
            self._delay = min(self.backoff.cap_s, self._delay * 2)
            self._retry_at = time.monotonic() + self._delay
            log.debug("draft daemon still unavailable (%s); next try in %.2fs", exc, self._delay)
            return False
        return True

    def poll_pending(self) -> None:
        """Handle whatever arrived meanwhile (GOODBYE, PONG, late replies) without waiting."""
        while (msg := self._recv(0)) is not None:
            if self._event(msg) is not None:
                self.stale_replies += 1  # a reply nobody waits for any more

    def heartbeat(self, probe_timeout_s: float = 0.5) -> None:
        """While idle: keep the daemon's lease on this peer alive and notice a restart; while
        the link is down, retry it on the backoff schedule so the next job finds it up."""
        if not self.up:
            self.ready(probe_timeout_s)
            return
        self.poll_pending()
        if not self._send(Message(MsgType.PING)):
            self.mark_down("not connected")

    # ------------------------------------------------------------ conversation
    def handshake(self, timeout_s: float) -> Welcome:
        hello = Message(MsgType.HELLO, {"vocab_size": self.vocab_size, "tokenizer": self.fingerprint,
                                        "feature_size": self.feature_size, "name": self.name})
        deadline = time.monotonic() + timeout_s
        while not self._send(hello):  # not connected yet
            if time.monotonic() >= deadline:
                raise HandshakeTimeout(f"no connection to a draft daemon at {self.endpoint}")
            time.sleep(0.01)
        while (left := deadline - time.monotonic()) > 0:
            msg = self._recv(left)
            if msg is None:
                continue
            if msg.type is MsgType.ERROR:
                err = RemoteError(msg.header["code"], msg.header["message"])
                if err.code in (ErrorCode.SHUTTING_DOWN, ErrorCode.BUSY):
                    raise HandshakeTimeout(f"draft daemon at {self.endpoint} cannot take this target now: {err}")
                raise HandshakeRefused(f"draft daemon at {self.endpoint} refused this target: {err}")
            if msg.type is MsgType.WELCOME:
                h = msg.header
                w = Welcome(h["vocab_size"], h["tokenizer"], h["backend"], h["max_depth"], h["q_topk"],
                            h["feature_size"], h["instance"], h.get("server", ""))
                if (w.vocab_size, w.tokenizer) != (self.vocab_size, self.fingerprint):
                    raise HandshakeRefused(
                        f"draft daemon at {self.endpoint} serves vocabulary {w.vocab_size} (tokenizer "
                        f"{w.tokenizer}); this target has {self.vocab_size} (tokenizer {self.fingerprint})")
                if self.welcome is not None or self.reconnects:
                    log.info("draft link to %s is back", self.endpoint)
                self.reconnects += 1
                self.welcome = w
                self.down = False
                self._delay = self.backoff.initial_s
                log.info("connected to draft daemon %s at %s (backend %s, max depth %d)",
                         w.server, self.endpoint, w.backend, w.max_depth)
                return w
            self.stale_replies += 1
        raise HandshakeTimeout(f"no answer from a draft daemon at {self.endpoint} within {timeout_s:.1f}s")

    def open(self, session: int, prompt: list[int], params: SamplingParams) -> bool:
        return self._send(Message(MsgType.OPEN, {"session": session, "prompt": list(prompt),
                                                 "sampling": params.to_wire()}))

    def close_session(self, session: int) -> None:
        self._send(Message(MsgType.CLOSE, {"session": session}))

    def request(self, session: int, seq: int, accepted: int, new: list[int], pos: int, depth: int,
                features: np.ndarray | torch.Tensor | None = None) -> bool:
        tensors = {} if features is None else {"features": features}
        return self._send(Message(MsgType.DRAFT, {"session": session, "seq": seq, "accepted": accepted,
                                                  "new": list(new), "pos": pos, "depth": depth}, tensors))

    def poll_events(self, timeout_s: float) -> list[tuple[int, int, DraftReply | RemoteError]]:
        """Every reply that arrives within ``timeout_s`` (waiting only for the first), as
        (session, seq, DRAFTED reply or ERROR): for a scheduler with many sessions in flight."""
        events = []
        msg = self._recv(timeout_s)
        while msg is not None:
            event = self._event(msg)
            if event is not None:
                events.append(event)
            msg = self._recv(0)
        return events

    def _event(self, msg: Message) -> tuple[int, int, DraftReply | RemoteError] | None:
        h = msg.header
        if msg.type is MsgType.DRAFTED:
            return h["session"], h["seq"], DraftReply(h["tokens"], msg.tensors.get("q_ids"), msg.tensors.get("q_probs"))
        if msg.type is MsgType.ERROR and h.get("session") is not None and h.get("seq") is not None:
            err = RemoteError(h["code"], h["message"], h.get("session"), h.get("seq"))
            self._count(err.name)
            if err.code == ErrorCode.NO_HANDSHAKE:
                self.welcome = None  # the daemon forgot this peer (restart, expiry): greet again
                self.down = True
            return h["session"], h["seq"], err
        if msg.type is MsgType.PONG:
            if self.welcome is not None and msg.header["instance"] != self.welcome.instance:
                self.welcome = None  # a new daemon: greet it again
                self.mark_down("draft daemon restarted")
            return None
        self.stale_replies += 1
        return None

    def wait_draft(self, session: int, seq: int, timeout_s: float) -> DraftReply | RemoteError | None:
        """The DRAFTED reply for (session, seq), the ERROR about it, or None at the deadline or
        when the daemon says goodbye. Replies to earlier requests (arriving late) are discarded."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self._recv(left)
            if msg is None:
                if self.down:  # GOODBYE arrived
                    return None
                continue
            event = self._event(msg)
            if event is None:
                continue
            if event[:2] == (session, seq):
                return event[2]
            self.stale_replies += 1
        return None


class RemoteDraftSession:
    """One generation's drafts from the draft daemon (a DraftSource for the engine).

    Tracks what the daemon has verified, so each request carries only the tokens (and, for
    feature backends, the features) verified since the previous one. A timed-out round reports
    0 accepted next time; an error about the session (unknown after a restart, out of sync), or
    a different daemon instance after a reconnect, re-opens it with the full verified prefix.
    """

    def __init__(self, client: DraftClient, session: int, params: SamplingParams, timeout_s: float):
        self.client = client
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

    @property
    def feature_size(self) -> int:
        return self.client.welcome.feature_size if self.client.welcome is not None else 0

    def send(self, tokens: list[int], depth: int, features: np.ndarray | torch.Tensor | None = None) -> int | None:
        """Ask for drafts following ``tokens``; the sequence number in flight, or None when no
        request could go out (link down, no features): the round then runs without drafts."""
        client = self.client
        if self.disabled or not client.ready(probe_timeout_s=min(self.timeout_s, 0.5)):
            return None
        welcome = client.welcome
        if self.instance != welcome.instance:
            if not client.open(self.session, tokens, self.params):
                client.mark_down("not connected")
                return None
            self.instance = welcome.instance
            self.synced, self.accepted, self.features_sent = len(tokens), 0, 0
        new_features = None
        if welcome.feature_size:
            if features is None or features.shape[0] != len(tokens) - 1:
                return None  # this generation collected no features
            new_features = features[self.features_sent:]
        self.seq += 1
        new = tokens[self.synced + self.accepted:]
        if not client.request(self.session, self.seq, self.accepted, new, len(tokens),
                              min(depth, welcome.max_depth), new_features):
            client.mark_down("not connected")
            self.instance = None  # whatever the daemon holds is unknown now
            return None
        self.synced, self.accepted = len(tokens), 0
        if new_features is not None:
            self.features_sent = len(tokens) - 1
        return self.seq

    def resolve(self, reply: DraftReply | RemoteError | None) -> DraftReply | None:
        """Turn what came back for the request in flight (None: nothing in time) into drafts."""
        if reply is None:
            if not self.client.down:
                self.client.mark_down(f"no draft within {self.timeout_s:.2f}s")
            return None
        if isinstance(reply, RemoteError):
            self.errors += 1
            if reply.code == ErrorCode.TOO_LARGE:
                log.info("session %d outgrew the drafter (%s); the rest runs on the target alone", self.session,
                         reply.message)
                self.disabled = True
                return None
            log.debug("draft request failed (%s); re-opening session %d", reply, self.session)
            self.instance = None
            return None
        return reply

    def propose(self, tokens: list[int], depth: int,
                features: np.ndarray | torch.Tensor | None = None) -> DraftReply | None:
        seq = self.send(tokens, depth, features)
        if seq is None:
            return None
        return self.resolve(self.client.wait_draft(self.session, seq, self.timeout_s))

    def kept(self, n: int) -> None:
        self.accepted = n

    def close(self) -> None:
        if self.instance is not None:
            self.client.close_session(self.session)
