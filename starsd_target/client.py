"""The target's link to the draft daemon: one DEALER socket, a handshake, and draft requests."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import zmq

from common import protocol as P
from common.protocol import ErrorCode, Message, MsgType, ProtocolError, RemoteError
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
    server: str


@dataclass
class DraftReply:
    tokens: list[int]
    q_ids: torch.Tensor | None
    q_probs: torch.Tensor | None


class DraftClient:
    """Synchronous client used by one generation loop at a time."""

    def __init__(self, endpoint: str, vocab_size: int, fingerprint: str, name: str = "",
                 ctx: zmq.Context | None = None, feature_size: int = 0):
        self.endpoint = endpoint
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.feature_size = feature_size
        self.name = name
        self.ctx = ctx or zmq.Context.instance()
        self.sock = make_socket(self.ctx, zmq.DEALER, SocketOptions())
        self.sock.connect(endpoint)
        self.welcome: Welcome | None = None
        self.stale_replies = 0
        self.errors: dict[str, int] = {}

    def close(self) -> None:
        self.sock.close(linger=0)

    # ------------------------------------------------------------ plumbing
    def _send(self, msg: Message) -> None:
        try:
            self.sock.send_multipart(P.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.debug("draft link is congested; %s dropped", msg.type.name)

    def _recv(self, timeout_s: float) -> Message | None:
        if not self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        frames = self.sock.recv_multipart(copy=False)
        try:
            return P.decode(frames)
        except ProtocolError as exc:
            self._count(exc.code.name)
            log.warning("undecodable message from the draft daemon: %s", exc)
            return None

    def _count(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1

    # ------------------------------------------------------------ conversation
    def handshake(self, timeout_s: float) -> Welcome:
        self._send(Message(MsgType.HELLO, {"vocab_size": self.vocab_size, "tokenizer": self.fingerprint,
                                           "feature_size": self.feature_size, "name": self.name}))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self._recv(left)
            if msg is None:
                continue
            if msg.type is MsgType.ERROR:
                err = RemoteError(msg.header["code"], msg.header["message"])
                raise HandshakeRefused(f"draft daemon at {self.endpoint} refused this target: {err}")
            if msg.type is MsgType.WELCOME:
                h = msg.header
                w = Welcome(h["vocab_size"], h["tokenizer"], h["backend"], h["max_depth"], h["q_topk"],
                            h["feature_size"], h.get("server", ""))
                if (w.vocab_size, w.tokenizer) != (self.vocab_size, self.fingerprint):
                    raise HandshakeRefused(
                        f"draft daemon at {self.endpoint} serves vocabulary {w.vocab_size} (tokenizer "
                        f"{w.tokenizer}); this target has {self.vocab_size} (tokenizer {self.fingerprint})")
                self.welcome = w
                log.info("connected to draft daemon %s at %s (backend %s, max depth %d)",
                         w.server, self.endpoint, w.backend, w.max_depth)
                return w
            self.stale_replies += 1
        raise HandshakeTimeout(f"no answer from a draft daemon at {self.endpoint} within {timeout_s:.1f}s")

    def open(self, session: int, prompt: list[int], params: SamplingParams) -> None:
        self._send(Message(MsgType.OPEN, {"session": session, "prompt": list(prompt), "sampling": params.to_wire()}))

    def close_session(self, session: int) -> None:
        self._send(Message(MsgType.CLOSE, {"session": session}))

    def request(self, session: int, seq: int, accepted: int, new: list[int], pos: int, depth: int,
                features: torch.Tensor | None = None) -> None:
        tensors = {} if features is None else {"features": features}
        self._send(Message(MsgType.DRAFT, {"session": session, "seq": seq, "accepted": accepted,
                                           "new": list(new), "pos": pos, "depth": depth}, tensors))

    def wait_draft(self, session: int, seq: int, timeout_s: float) -> DraftReply | RemoteError | None:
        """The DRAFTED reply for (session, seq), the ERROR about it, or None at the deadline.
        Replies to earlier requests (arriving late) are discarded."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self._recv(left)
            if msg is None:
                continue
            h = msg.header
            if h.get("session") != session or h.get("seq") not in (seq, None):
                self.stale_replies += 1
                continue
            if msg.type is MsgType.DRAFTED and h["seq"] == seq:
                return DraftReply(h["tokens"], msg.tensors.get("q_ids"), msg.tensors.get("q_probs"))
            if msg.type is MsgType.ERROR:
                err = RemoteError(h["code"], h["message"], h.get("session"), h.get("seq"))
                self._count(err.name)
                if err.code == ErrorCode.NO_HANDSHAKE:
                    self.welcome = None  # the daemon forgot this peer (restart, expiry): greet again
                return err
            self.stale_replies += 1
        return None


class RemoteDraftSession:
    """One generation's drafts from the draft daemon (a DraftSource for the engine).

    Tracks what the daemon has verified, so each request carries only the tokens verified
    since the previous one. A timed-out round just reports 0 accepted next time; an error
    about the session (unknown after a restart, out of sync) re-opens it with the full prefix.
    """

    def __init__(self, client: DraftClient, session: int, params: SamplingParams, timeout_s: float):
        self.client = client
        self.session = session
        self.params = params
        self.timeout_s = timeout_s
        self.seq = 0
        self.synced = 0  # verified tokens the daemon held when it drafted the last proposal
        self.accepted = 0  # how many of that proposal the target kept
        self.reopen = True
        self.errors = 0
        self.features_sent = 0

    @property
    def feature_size(self) -> int:
        return self.client.welcome.feature_size if self.client.welcome is not None else 0

    def propose(self, tokens: list[int], depth: int, features: torch.Tensor | None = None) -> DraftReply | None:
        if self.client.welcome is None:
            try:
                self.client.handshake(self.timeout_s)
            except HandshakeError as exc:  # this round is verified without drafts
                log.warning("draft daemon unavailable: %s", exc)
                return None
            self.reopen = True
        if self.reopen:
            self.client.open(self.session, tokens, self.params)
            self.synced, self.accepted, self.reopen, self.features_sent = len(tokens), 0, False, 0
        new_features = None
        if self.feature_size:
            if features is None or features.shape[0] != len(tokens) - 1:
                return None  # this generation collected no features; the round runs without drafts
            new_features = features[self.features_sent:]
        if self.client.welcome is not None:
            depth = min(depth, self.client.welcome.max_depth)
        self.seq += 1
        new = tokens[self.synced + self.accepted:]
        self.client.request(self.session, self.seq, self.accepted, new, len(tokens), depth, new_features)
        self.synced, self.accepted = len(tokens), 0
        if new_features is not None:
            self.features_sent = len(tokens) - 1
        reply = self.client.wait_draft(self.session, self.seq, self.timeout_s)
        if isinstance(reply, RemoteError):
            self.errors += 1
            log.debug("draft request failed (%s); re-opening session %d", reply, self.session)
            self.reopen = True
            return None
        return reply

    def kept(self, n: int) -> None:
        self.accepted = n

    def close(self) -> None:
        self.client.close_session(self.session)
