"""The draft daemon's bounded tables: connections that completed the handshake, the peers
(principals) behind them, and their sessions.

A session belongs to a principal: its CURVE public key when the daemon authenticates peers
(``durable``: the key's sessions outlive a reconnect), the connection's routing identity
otherwise (a connection's sessions go with it). Every connection completes its own HELLO
before anything else is served to it; one that disconnects, or a new connection that reuses a
routing identity, starts from nothing. Without CURVE, what one remote address may hold
(connections, sessions) is bounded too, so one host cannot fill the tables with throwaway
identities. Whatever a table drops on its own (expiry, eviction, a disconnect) is kept in
``dropped`` until the server takes it and frees the sessions' backend state."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from common.protocol import ErrorCode, ProtocolError
from common.verify import SamplingParams


@dataclass
class Session:
    key: tuple[bytes, int]  # (peer principal, session id): one peer cannot name another's session
    params: SamplingParams
    state: object  # the backend's per-session state (None until the batcher first drafts for it)
    verified: list[int]
    address: str = ""  # the remote address that opened it (per-address accounting)
    reserved: int = 0  # positions of cache memory reserved for it (verified tokens plus drafts)
    last_draft: list[int] = field(default_factory=list)
    last_reply: object | None = None  # its last chain drafted (a records.LastReply), which a repeat gets again
    features: int = 0  # target features held (feature backends): one per verified token but the last
    pending_features: list = field(default_factory=list)  # features of rounds suffix drafts answered (one tensor)
    backend_held: int = 0  # verified tokens the backend had when it last drafted for it (suffix rounds skip it)
    suffix: object | None = None  # its text in the suffix index (a suffix.SuffixText), from its first request
    last_seq: int = -1
    touched: float = field(default_factory=time.monotonic)
    replied_at: float | None = None  # when its last draft went out, until its next request arrives
    turnaround_s: float | None = None  # smoothed time from a reply to the session's next request
    ahead: object | None = None  # its next round drafted ahead (a backends.base.Lookahead), done or not
    ahead_score: float = 0.5  # smoothed share of its requests that work ahead answered (hit 1, miss 0)
    ahead_skipped: int = 0  # rounds in a row not drafted ahead for it (its score too low)

    def returned(self, now: float) -> None:
        """A request of this session arrived: learn how long the target took to come back."""
        if self.replied_at is not None:
            sample = now - self.replied_at
            t = self.turnaround_s
            self.turnaround_s = sample if t is None else t + 0.25 * (sample - t)
            self.replied_at = None

    def check(self, accepted: int, new: list[int], pos: int, seq: int) -> None:
        """Whether a DRAFT request's report of what the target verified fits this session."""
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

    def advance(self, accepted: int, new: list[int], pos: int, seq: int) -> None:
        """Apply a DRAFT request's report of what the target verified, once ``check`` passed it
        (the server reserves the cache memory in between, so a refusal leaves the session as it was)."""
        self.verified.extend(self.last_draft[:accepted])
        self.verified.extend(new)
        self.last_draft = []
        self.last_seq = seq
        self.touched = time.monotonic()


@dataclass
class Conn:
    """One connection that completed the handshake."""

    identity: bytes  # its routing identity: where replies go
    principal: bytes
    address: str  # the remote address ZeroMQ reports ("" for ipc)
    fd: int  # the socket it arrives on: a reused identity on another fd is another connection
    name: str = ""
    seen: float = field(default_factory=time.monotonic)


@dataclass
class Peer:
    principal: bytes
    conns: set[bytes] = field(default_factory=set)  # identities of its live connections
    sessions: set[int] = field(default_factory=set)
    seen: float = field(default_factory=time.monotonic)
    kv_bytes: int = 0  # cache memory reserved for its sessions


@dataclass(frozen=True)
class TableLimits:
    max_sessions: int = 1024
    max_sessions_per_peer: int = 64
    session_ttl_s: float = 600.0
    peer_ttl_s: float = 60.0
    max_peers: int = 4096  # connections that completed the handshake, all addresses
    evict_idle_s: float = 10.0  # a full table gives way to its least recently used entry idle this long
    max_peers_per_address: int = 64  # without CURVE
    max_sessions_per_address: int = 256  # without CURVE
    # Cache memory, estimated from the drafter's config (0 bytes per token: nothing to bound)
    kv_bytes_per_token: int = 0
    max_kv_bytes: int = 4 << 30
    max_peer_kv_bytes: int = 1 << 30
    max_session_kv_bytes: int = 256 << 20


class SessionTable:
    def __init__(self, limits: TableLimits = TableLimits(), durable: bool = False):
        self.limits = limits
        self.durable = durable  # principals are keys (CURVE): a key's sessions survive its reconnects
        self.conns: dict[bytes, Conn] = {}
        self.peers: dict[bytes, Peer] = {}
        self.sessions: dict[tuple[bytes, int], Session] = {}
        self.address_conns: collections.Counter[str] = collections.Counter()
        self.address_sessions: collections.Counter[str] = collections.Counter()
        self.kv_bytes = 0  # cache memory reserved, all sessions
        self.dropped: list[tuple[Session, str]] = []  # (session, why) dropped by the table, not yet freed

    def take_dropped(self) -> list[tuple[Session, str]]:
        out, self.dropped = self.dropped, []
        return out

    # ------------------------------------------------------------ connections
    def welcome(self, principal: bytes, identity: bytes, name: str, address: str, fd: int) -> Conn:
        """Register a connection that completed HELLO (again, for one already known). A full
        table, in all or for this address, first gives way to its least recently seen
        connection idle for ``evict_idle_s``; otherwise the HELLO gets BUSY."""
        lim = self.limits
        old = self.conns.get(identity)
        if old is not None and (old.fd != fd or old.principal != principal):
            self._drop_conn(old, "replaced")  # a new connection reusing the identity starts from nothing
            old = None
        if old is None:
            if not self.durable and self.address_conns[address] >= lim.max_peers_per_address:
                self._make_room([c for c in self.conns.values() if c.address == address],
                                f"address {address or 'ipc'} already holds {lim.max_peers_per_address} connections")
            if len(self.conns) >= lim.max_peers:
                self._make_room(list(self.conns.values()),
                                f"the draft daemon serves its maximum of {lim.max_peers} connections")
            old = self.conns[identity] = Conn(identity, principal, address, fd)
            self.address_conns[address] += 1
            self.peers.setdefault(principal, Peer(principal)).conns.add(identity)
        now = time.monotonic()
        old.name, old.seen = name, now
        self.peers[principal].seen = now
        return old

    def _make_room(self, candidates: list[Conn], why: str) -> None:
        idle = min(candidates, key=lambda c: c.seen, default=None)
        if idle is None or time.monotonic() - idle.seen < self.limits.evict_idle_s:
            raise ProtocolError(ErrorCode.BUSY, why)
        self._drop_conn(idle, "evicted")

    def touch(self, principal: bytes, identity: bytes, fd: int) -> Conn | None:
        """The connection, if it completed the handshake on this very socket; its lease is
        renewed. A message on another socket under a known identity is a new connection that
        reused the identity: the old one is dropped, and the new one must say HELLO."""
        c = self.conns.get(identity)
        if c is None:
            return None
        if c.fd != fd or c.principal != principal:
            self._drop_conn(c, "replaced")
            return None
        now = time.monotonic()
        c.seen = now
        self.peers[principal].seen = now
        return c

    def conns_on(self, fd: int) -> list[Conn]:
        return [c for c in self.conns.values() if c.fd == fd]

    def seeded(self, key: tuple[bytes, int]) -> bool:
        """Whether the session ``key`` is a live seeded sampled one: its drafts must follow its own
        requests alone, never what else the daemon was doing."""
        session = self.sessions.get(key)
        return session is not None and session.params.seeded

    def disconnected(self, conns: list[Conn]) -> int:
        """These connections are gone (the socket monitor said so): forget those still known as
        they were (a connection registered since, on a reused socket, stays)."""
        gone = 0
        for c in conns:  # one connection may be named twice (two events for one socket)
            if self.conns.get(c.identity) is c:
                self._drop_conn(c, "disconnected")
                gone += 1
        return gone

    def _drop_conn(self, c: Conn, why: str) -> None:
        del self.conns[c.identity]
        self.address_conns[c.address] -= 1
        if not self.address_conns[c.address]:
            del self.address_conns[c.address]
        peer = self.peers.get(c.principal)
        if peer is None:
            return
        peer.conns.discard(c.identity)
        if not peer.conns and not self.durable:  # a connection's sessions go with it
            self._drop_peer(peer, why)

    def _drop_peer(self, peer: Peer, why: str) -> None:
        for sid in list(peer.sessions):
            s = self.close(peer.principal, sid)
            if s is not None:
                self.dropped.append((s, why))
        self.peers.pop(peer.principal, None)

    # ------------------------------------------------------------ sessions
    def open(self, principal: bytes, sid: int, params: SamplingParams, prompt: list[int], state: object,
             address: str = "", reserve: int = 0) -> Session:
        """Add (or replace) a session, with cache memory for ``reserve`` positions. Beyond a
        peer's or an address's share the request gets BUSY; when the whole table is full, its
        least recently used session idle for ``evict_idle_s`` makes room (it lands in
        ``dropped``), otherwise BUSY."""
        lim = self.limits
        peer = self.peers[principal]
        key = (principal, sid)
        old = self.close(principal, sid)  # re-opening replaces the session
        if old is None:
            if len(peer.sessions) >= lim.max_sessions_per_peer:
                raise ProtocolError(ErrorCode.BUSY, f"this peer already holds {lim.max_sessions_per_peer} sessions",
                                    sid)
            if not self.durable and self.address_sessions[address] >= lim.max_sessions_per_address:
                self._fair_room(peer, address, sid)
            if len(self.sessions) >= lim.max_sessions:
                lru = min(self.sessions.values(), key=lambda s: s.touched)
                if time.monotonic() - lru.touched < lim.evict_idle_s:
                    raise ProtocolError(ErrorCode.BUSY,
                                        f"the draft daemon holds its maximum of {lim.max_sessions} sessions", sid)
                self.close(*lru.key)
                self.dropped.append((lru, "evicted"))
        s = Session(key, params, state, list(prompt), address)
        self.sessions[key] = s
        peer.sessions.add(sid)
        self.address_sessions[address] += 1
        try:
            self.reserve(s, reserve)
        except ProtocolError:
            self.close(principal, sid)
            raise
        return s

    def _fair_room(self, peer: Peer, address: str, sid: int) -> None:
        """An address's session budget is shared fairly by its connections (eight targets on one
        host share its address): a connection under its share (the budget over the address's
        connections) takes room from the one furthest over its share,
        whose least recently used session is evicted; at or over its share it gets BUSY. So one
        process's many sessions cannot starve its neighbours on the host."""
        lim = self.limits
        holders = {self.conns[i].principal for i in self.conns if self.conns[i].address == address}
        holders = [self.peers[p] for p in holders | {peer.principal} if p in self.peers]
        share = max(1, lim.max_sessions_per_address // len(holders))
        if len(peer.sessions) >= share:
            raise ProtocolError(ErrorCode.BUSY, f"address {address or 'ipc'} holds its {lim.max_sessions_per_address} "
                                                f"sessions and this connection its share of {share}", sid)
        victim = max(holders, key=lambda p: len(p.sessions))
        if len(victim.sessions) <= share:
            raise ProtocolError(ErrorCode.BUSY, f"address {address or 'ipc'} holds its "
                                                f"{lim.max_sessions_per_address} sessions", sid)
        lru = min((self.sessions[(victim.principal, v)] for v in victim.sessions), key=lambda s: s.touched)
        self.close(*lru.key)
        self.dropped.append((lru, "evicted"))

    def reserve(self, s: Session, positions: int, seq: int | None = None, keep=frozenset()) -> None:
        """Reserve cache memory for ``positions`` of session ``s`` (it only grows). TOO_LARGE
        beyond one session's bound; BUSY beyond the peer's share, or beyond the total once no
        idle session (least recently used first, idle ``evict_idle_s``, not in ``keep``: the
        keys of sessions about to be drafted) can make room."""
        lim = self.limits
        per = lim.kv_bytes_per_token
        if not per or positions <= s.reserved:
            return
        sid = s.key[1]
        if positions * per > lim.max_session_kv_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{positions} positions need {positions * per} bytes of cache, "
                                f"beyond one session's {lim.max_session_kv_bytes}", sid, seq)
        extra = (positions - s.reserved) * per
        peer = self.peers[s.key[0]]
        if peer.kv_bytes + extra > lim.max_peer_kv_bytes:
            raise ProtocolError(ErrorCode.BUSY, f"this peer's sessions hold {peer.kv_bytes} of its "
                                f"{lim.max_peer_kv_bytes} bytes of cache", sid, seq)
        while self.kv_bytes + extra > lim.max_kv_bytes:
            now = time.monotonic()
            idle = [o for o in self.sessions.values()
                    if o is not s and o.key not in keep and now - o.touched >= lim.evict_idle_s]
            if not idle:
                raise ProtocolError(ErrorCode.BUSY, f"the sessions hold {self.kv_bytes} of the daemon's "
                                    f"{lim.max_kv_bytes} bytes of cache", sid, seq)
            lru = min(idle, key=lambda o: o.touched)
            self.close(*lru.key)
            self.dropped.append((lru, "evicted"))
        s.reserved = positions
        self.kv_bytes += extra
        peer.kv_bytes += extra

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
        if s is not None:
            self.address_sessions[s.address] -= 1
            if not self.address_sessions[s.address]:
                del self.address_sessions[s.address]
            freed = s.reserved * self.limits.kv_bytes_per_token
            self.kv_bytes -= freed
            if peer is not None:
                peer.kv_bytes -= freed
        return s

    def expire(self, now: float | None = None) -> None:
        """Drop connections silent for the peer TTL (with them, their peers' sessions unless
        durable), peers with no connection silent that long, and sessions untouched for the
        session TTL; the sessions land in ``dropped``."""
        now = time.monotonic() if now is None else now
        lim = self.limits
        for c in [c for c in self.conns.values() if now - c.seen > lim.peer_ttl_s]:
            self._drop_conn(c, "expired")
        for peer in [p for p in self.peers.values() if not p.conns and now - p.seen > lim.peer_ttl_s]:
            self._drop_peer(peer, "expired")
        for s in [s for s in self.sessions.values() if now - s.touched > lim.session_ttl_s]:
            self.close(*s.key)
            self.dropped.append((s, "expired"))
