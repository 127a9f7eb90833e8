"""Per-peer, per-session state of the draft daemon, isolated by the peer's principal: its CURVE
public key when the daemon authenticates peers, its connection's routing identity otherwise."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.protocol import ErrorCode, ProtocolError
from common.verify import SamplingParams


@dataclass
class Session:
    key: tuple[bytes, int]  # (peer principal, session id): one peer cannot name another's session
    params: SamplingParams
    state: object  # the backend's per-session state
    verified: list[int]
    last_draft: list[int] = field(default_factory=list)
    features: int = 0  # target features held (feature backends): one per verified token but the last
    last_seq: int = -1
    touched: float = field(default_factory=time.monotonic)
    replied_at: float | None = None  # when its last draft went out, until its next request arrives
    turnaround_s: float | None = None  # smoothed time from a reply to the session's next request

    def returned(self, now: float) -> None:
        """A request of this session arrived: learn how long the target took to come back."""
        if self.replied_at is not None:
            sample = now - self.replied_at
            t = self.turnaround_s
            self.turnaround_s = sample if t is None else t + 0.25 * (sample - t)
            self.replied_at = None

    def advance(self, accepted: int, new: list[int], pos: int, seq: int) -> None:
        """Apply a DRAFT request's report of what the target verified."""
        if seq <= self.last_seq:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"sequence number {seq} is not after {self.last_seq}",
                                self.key[1], seq)
        if accepted > len(self.last_draft):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"accepted={accepted} but only {len(self.last_draft)} tokens were drafted", self.key[1], seq)
        have = len(self.verified) + accepted + len(new)
        if have != pos:
            raise ProtocolError(
                ErrorCode.DESYNC,
                f"the session holds {len(self.verified)} verified tokens; with {accepted} accepted and "
                f"{len(new)} new that makes {have}, but the target says {pos}; re-open the session",
                self.key[1], seq)
        self.verified.extend(self.last_draft[:accepted])
        self.verified.extend(new)
        self.last_draft = []
        self.last_seq = seq
        self.touched = time.monotonic()


@dataclass
class Peer:
    principal: bytes
    identity: bytes  # routing identity of its latest connection: where replies go
    name: str = ""
    sessions: set[int] = field(default_factory=set)
    seen: float = field(default_factory=time.monotonic)


class SessionTable:
    """Bounded tables of peers and sessions. Only peers that completed the handshake get an
    entry; sessions untouched for ``ttl_s`` and peers silent for ``peer_ttl_s`` expire."""

    def __init__(self, max_sessions: int, max_sessions_per_peer: int, ttl_s: float,
                 peer_ttl_s: float = 60.0, max_peers: int = 4096, evict_idle_s: float = 10.0):
        self.max_sessions = max_sessions
        self.max_per_peer = max_sessions_per_peer
        self.ttl_s = ttl_s
        self.peer_ttl_s = peer_ttl_s
        self.max_peers = max_peers
        self.evict_idle_s = evict_idle_s
        self.peers: dict[bytes, Peer] = {}
        self.sessions: dict[tuple[bytes, int], Session] = {}

    def welcome(self, principal: bytes, identity: bytes, name: str) -> Peer:
        p = self.peers.get(principal)
        if p is None:
            if len(self.peers) >= self.max_peers:
                raise ProtocolError(ErrorCode.BUSY, f"the draft daemon serves its maximum of {self.max_peers} peers")
            p = self.peers[principal] = Peer(principal, identity)
        p.identity, p.name, p.seen = identity, name, time.monotonic()
        return p

    def touch(self, principal: bytes, identity: bytes) -> Peer | None:
        """The peer, if it completed the handshake; its reply address and lease are refreshed."""
        p = self.peers.get(principal)
        if p is not None:
            p.identity, p.seen = identity, time.monotonic()
        return p

    def open(self, principal: bytes, sid: int, params: SamplingParams, prompt: list[int], state: object,
             evicted: list | None = None) -> Session:
        """Add (or replace) a session. When the table is full, the least recently used session
        idle for ``evict_idle_s`` makes room (appended to ``evicted`` so its state can be freed);
        otherwise the request gets BUSY."""
        peer = self.peers[principal]
        key = (principal, sid)
        old = self.sessions.pop(key, None)  # re-opening replaces the session
        if old is None:
            if len(peer.sessions) >= self.max_per_peer:
                raise ProtocolError(ErrorCode.BUSY, f"this peer already holds {self.max_per_peer} sessions", sid)
            if len(self.sessions) >= self.max_sessions:
                lru = min(self.sessions.values(), key=lambda s: s.touched)
                if time.monotonic() - lru.touched < self.evict_idle_s:
                    raise ProtocolError(ErrorCode.BUSY,
                                        f"the draft daemon holds its maximum of {self.max_sessions} sessions", sid)
                self.close(*lru.key)
                if evicted is not None:
                    evicted.append(lru)
        s = Session(key, params, state, list(prompt))
        self.sessions[key] = s
        peer.sessions.add(sid)
        return s

    def get(self, principal: bytes, sid: int, seq: int | None = None) -> Session:
        s = self.sessions.get((principal, sid))
        if s is None:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"no session {sid} for this peer; open it first", sid, seq)
        return s

    def close(self, principal: bytes, sid: int) -> Session | None:
        s = self.sessions.pop((principal, sid), None)
        peer = self.peers.get(principal)
        if peer is not None:
            peer.sessions.discard(sid)
        return s

    def expire(self, now: float | None = None) -> list[Session]:
        """Drop sessions untouched for the session TTL, and silent peers with all their sessions;
        return the dropped sessions so their state can be freed."""
        now = time.monotonic() if now is None else now
        silent = {k for k, p in self.peers.items() if now - p.seen > self.peer_ttl_s}
        dropped = [s for s in self.sessions.values() if s.key[0] in silent or now - s.touched > self.ttl_s]
        for s in dropped:
            self.close(*s.key)
        for k in silent:
            del self.peers[k]
        return dropped
