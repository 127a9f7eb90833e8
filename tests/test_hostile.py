"""The draft daemon under hostile or careless peers: each attack tried on the real server loop
(real sockets on loopback, limits scaled down so each runs in seconds). The daemon survives,
the attacker gets a typed error, and a legitimate target on its own connection keeps getting
drafts. No assertion on time."""

from __future__ import annotations

import threading
import time

import zmq

from common.protocol import ErrorCode, Message, MsgType
from common.sockets import SocketOptions, make_socket
from common.verify import SamplingParams
from fakes import CountingBackend, RawPeer, running_server
from starsd_draftd.sessions import SessionTable, TableLimits
from starsd_target.client import Backoff, DraftClient, DraftReply
from starsd_target.drafts import RemoteDraftSession


def _client(server, ctx, backoff=Backoff(0.2, 0.4)) -> DraftClient:
    client = DraftClient(server.endpoint, 259, "fake-tok", name="legit", ctx=ctx, backoff=backoff)
    client.handshake(10.0)
    return client


def _reply(client: DraftClient, session: int, seq: int, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (reply := client.take(session, seq)) is None and time.monotonic() < deadline:
        client.poll(0.05)
    return reply


def test_a_refused_open_reaches_its_session_which_backs_off():
    with running_server(max_sessions=1, evict_idle_s=3600) as (server, ctx):
        squatter = RawPeer(ctx, server.endpoint)
        assert squatter.hello().type is MsgType.WELCOME
        squatter.open(1, [5, 6, 7])
        assert squatter.draft(1, 1, 0, [], 3).type is MsgType.DRAFTED  # it holds the only session
        client = _client(server, ctx)
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 5.0)
        seq = s.send([1, 2, 3], 3)
        reply = _reply(client, s.session, seq)
        assert reply is not None and reply.name == "UNKNOWN_SESSION"  # the DRAFT behind the refused OPEN
        assert s.resolve(reply) is None
        assert client.open_refusals == 1 and client.counters()["open_refusals"] == 1
        # the refusal reached the session: no new OPEN with the whole prompt every round
        opens = server.stats.errors["BUSY"]
        assert opens == 1
        assert s.send([1, 2, 3, 4], 3) is None and s.open_refusals == 1
        assert server.stats.errors["BUSY"] == opens
        squatter.send(Message(MsgType.CLOSE, {"session": 1}))
        time.sleep(0.25)  # past the first backoff: the next round opens again, and is served
        seq = s.send([1, 2, 3, 4], 3)
        assert seq is not None
        reply = _reply(client, s.session, seq)
        assert isinstance(reply, DraftReply) and reply.tokens == [5, 6, 7]
        client.close()


def test_an_open_no_retry_can_cure_ends_drafting_for_that_generation():
    with running_server() as (server, ctx):
        client = _client(server, ctx)
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 5.0)
        seq = s.send([1, 2, 300], 3)  # 300 lies outside the daemon's vocabulary: BAD_REQUEST
        s.resolve(_reply(client, s.session, seq))
        assert s.send([1, 2, 300, 4], 3) is None and s.disabled and s.open_refusals == 1
        client.close()


class SlowBackend(CountingBackend):
    """Drafting that takes a while, so that requests pile up in the queue meanwhile."""

    def draft(self, state, verified, depth, new_features=None):
        time.sleep(0.05)
        return super().draft(state, verified, depth, new_features)


def _long_draft(peer: RawPeer, sid: int, n: int) -> None:
    # a well-formed request reporting n newly verified tokens: it holds queue memory until served
    peer.send(Message(MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [200] * n,
                                      "pos": 3 + n, "depth": 2}))


def test_queued_requests_stay_within_their_byte_budgets():
    budget, per_peer = 1 << 20, 512 << 10
    with running_server(SlowBackend(), max_queue_bytes=budget, max_peer_queue_bytes=per_peer) as (server, ctx):
        hostile = [RawPeer(ctx, server.endpoint) for _ in range(3)]
        for peer in hostile:
            assert peer.hello().type is MsgType.WELCOME
            for sid in range(1, 21):
                peer.open(sid, [1, 2, 3])
        client = _client(server, ctx)
        for peer in hostile:
            for sid in range(1, 21):
                _long_draft(peer, sid, 20_000)  # 40 kB on the wire, about 0.5 MB once decoded
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 30.0)
        seq = s.send([1, 2, 3], 2)
        replies = [[peer.recv(10.0) for _ in range(20)] for peer in hostile]
        assert isinstance(_reply(client, s.session, seq, 30.0), DraftReply)  # the legitimate target is served
        codes = [ErrorCode(r.header["code"]).name if r.type is MsgType.ERROR else r.type.name for rs in replies
                 for r in rs]
        assert set(codes) <= {"BUSY", "DRAFTED"} and codes.count("BUSY") >= 30, codes  # all answered
        snap = server.snapshot()
        assert 0 < snap["queue_bytes_peak"] <= budget and snap["queue_bytes"] == 0
        client.close()


def test_a_request_larger_than_any_budget_is_refused_before_it_is_decoded():
    with running_server(max_peer_queue_bytes=64 << 10) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        assert peer.hello().type is MsgType.WELCOME
        peer.open(1, [1, 2, 3])
        _long_draft(peer, 1, 20_000)
        r = peer.recv()
        assert ErrorCode(r.header["code"]).name == "TOO_LARGE" and r.header["re"] == "DRAFT"
        assert (r.header["session"], r.header["seq"]) == (1, 1)  # read from the header, not decoded
        assert peer.draft(1, 2, 0, [], 3).type is MsgType.DRAFTED  # the connection goes on


# ---------------------------------------------------------------- the tables: connections, addresses
def _peer_from(ctx, endpoint: str, source: str, identity: bytes | None = None) -> RawPeer:
    """A raw peer whose TCP connection leaves from ``source`` (another loopback address stands
    for another host)."""
    peer = RawPeer.__new__(RawPeer)
    peer.acks = []
    peer.sock = make_socket(ctx, zmq.DEALER, SocketOptions())
    if identity is not None:
        peer.sock.setsockopt(zmq.ROUTING_ID, identity)
    host, port = endpoint.rsplit(":", 1)
    peer.sock.connect(f"tcp://{source}:0;{host.split('//')[1]}:{port}")
    return peer


def _code(msg: Message) -> str:
    return ErrorCode(msg.header["code"]).name if msg.type is MsgType.ERROR else msg.type.name


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def _idle_for(server, seconds: float) -> None:
    """Age every connection, peer and session the daemon holds by ``seconds``, as if that long had
    passed without a word from any of them (instead of waiting it out). Called while the daemon
    has nothing to answer, so its loop touches none of them meanwhile."""
    table = server.sessions
    for entry in [*table.conns.values(), *table.peers.values()]:
        entry.seen -= seconds
    for s in list(table.sessions.values()):
        s.touched -= seconds


def test_every_connection_says_hello_before_anything_is_served():
    with running_server() as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.send(Message(MsgType.PING))
        assert _code(peer.recv()) == "NO_HANDSHAKE"
        peer.open(1, [1, 2, 3])
        assert _code(peer.recv()) == "NO_HANDSHAKE"
        peer.send(Message(MsgType.STATS))  # operators' status, from this machine
        assert peer.recv().type is MsgType.STATS_REPLY
        assert peer.hello().type is MsgType.WELCOME
        peer.send(Message(MsgType.PING))
        assert peer.recv().type is MsgType.PONG


def test_an_identity_reused_by_a_new_connection_starts_from_nothing():
    with running_server() as (server, ctx):
        first = _peer_from(ctx, server.endpoint, "127.0.0.1", identity=b"target-1")
        assert first.hello().type is MsgType.WELCOME
        first.open(1, [5, 6, 7])
        assert first.draft(1, 1, 0, [], 3).type is MsgType.DRAFTED
        first.sock.close(linger=0)
        assert _until(lambda: server.stats.disconnects == 1)  # ZeroMQ frees the identity only then
        second = _peer_from(ctx, server.endpoint, "127.0.0.1", identity=b"target-1")
        reply = second.draft(1, 2, 0, [], 3)  # the old connection's session, without a HELLO
        assert _code(reply) == "NO_HANDSHAKE"
        assert second.hello().type is MsgType.WELCOME
        assert _code(second.draft(1, 3, 0, [], 3)) == "UNKNOWN_SESSION"  # nothing of the old one is left
        assert server.stats.sessions_disconnected == 1


def test_a_connection_that_goes_takes_its_entry_and_sessions_with_it():
    backend = CountingBackend()
    with running_server(backend, peer_ttl_s=3600) as (server, ctx):
        peers = [RawPeer(ctx, server.endpoint) for _ in range(10)]
        for peer in peers:
            assert peer.hello().type is MsgType.WELCOME
            peer.open(1, [1, 2])
            assert peer.draft(1, 1, 0, [], 2).type is MsgType.DRAFTED  # its backend state is made
        assert _until(lambda: server.snapshot()["live_sessions"] == 10)
        for peer in peers:
            peer.sock.close(linger=0)
        # not a TTL later: as soon as the daemon sees the connections close
        assert _until(lambda: server.snapshot()["peers"] == 0 and server.snapshot()["live_sessions"] == 0)
        # the sessions leave the tables on the socket's thread; their backend states are freed on
        # the compute loop's, which may come a moment later on a loaded host
        assert _until(lambda: backend.released == 10), backend.released
        assert server.stats.sessions_disconnected == 10


def test_one_address_cannot_fill_the_tables():
    cfg = dict(max_peers_per_address=4, max_sessions_per_address=12, max_sessions=64, evict_idle_s=3600)
    with running_server(**cfg) as (server, ctx):
        hostile = [_peer_from(ctx, server.endpoint, "127.0.0.2") for _ in range(6)]
        greeted = [_code(p.hello()) for p in hostile]
        assert greeted.count("WELCOME") == 4 and greeted.count("BUSY") == 2
        opened = []
        for p in hostile[:2]:
            for sid in range(1, 11):
                p.open(sid, [1, 2, 3])
            p.send(Message(MsgType.STATS))
            while (r := p.recv()).type is not MsgType.STATS_REPLY:
                opened.append(_code(r))
        # the second connection takes its share (12 over the address's 4 connections) from the first
        assert opened.count("BUSY") == 7 and server.snapshot()["live_sessions"] == 12
        # a target on another address still gets in, and gets drafts
        client = _client(server, ctx)
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 5.0)
        assert isinstance(_reply(client, s.session, s.send([1, 2, 3], 3)), DraftReply)
        client.close()


def test_throwaway_hellos_give_way_to_a_new_target():
    with running_server(max_peers=20, max_peers_per_address=1000, evict_idle_s=3.0) as (server, ctx):
        squatters = [RawPeer(ctx, server.endpoint) for _ in range(40)]
        codes = [_code(p.hello()) for p in squatters]  # connections that greet and then stay silent
        assert codes.count("WELCOME") == 20 and codes.count("BUSY") == 20
        _idle_for(server, 3.1)  # they are idle now: the least recently seen makes room for a newcomer
        client = _client(server, ctx)
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 5.0)
        assert isinstance(_reply(client, s.session, s.send([1, 2, 3], 3)), DraftReply)
        assert server.snapshot()["peers"] <= 20
        # the evicted squatter has to greet again
        squatters[0].send(Message(MsgType.PING))
        assert _code(squatters[0].recv()) == "NO_HANDSHAKE"
        client.close()


def test_the_table_tells_a_reused_identity_by_its_socket():
    """Should the disconnect be read after the new connection's first message, the socket it
    came on still tells the two connections apart."""
    table = SessionTable(TableLimits())
    table.welcome(b"id", b"id", "t", "10.0.0.1", fd=7)
    table.open(b"id", 1, SamplingParams(), [1, 2], state=None, address="10.0.0.1")
    assert table.touch(b"id", b"id", fd=7) is not None
    assert table.touch(b"id", b"id", fd=9) is None  # same identity, another socket: a new connection
    assert not table.sessions and not table.conns and [why for _, why in table.take_dropped()] == ["replaced"]
    assert not table.address_conns and not table.address_sessions


def test_a_connection_reported_gone_twice_is_dropped_once():
    table = SessionTable(TableLimits())
    conn = table.welcome(b"id", b"id", "t", "10.0.0.1", fd=7)
    assert table.disconnected([conn, conn]) == 1 and not table.conns and not table.address_conns


# ---------------------------------------------------------------- cache memory
class CacheBackend(CountingBackend):
    kv_bytes_per_token = 1000


def _opened(peer: RawPeer, sid: int, prompt_len: int) -> str:
    """OPEN then STATS: the OPEN's refusal, if any, arrives before the STATS reply."""
    peer.open(sid, [1] * prompt_len)
    peer.send(Message(MsgType.STATS))
    got = "OK"
    while (r := peer.recv()).type is not MsgType.STATS_REPLY:
        got = _code(r)
        assert r.header.get("re") == "OPEN" and r.header.get("session") == sid
    return got


def test_cache_memory_is_bounded_per_session_per_target_and_in_all():
    # 1000 bytes per position; an OPEN reserves its prompt plus the daemon's depth (5)
    cfg = dict(max_session_kv_bytes=100_000, max_peer_kv_bytes=200_000, max_kv_bytes=300_000, evict_idle_s=3.0)
    with running_server(CacheBackend(), **cfg) as (server, ctx):
        a, b = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        assert a.hello().type is MsgType.WELCOME and b.hello().type is MsgType.WELCOME
        assert _opened(a, 1, 100) == "TOO_LARGE"  # 105 positions: beyond one session's 100 kB
        assert [_opened(a, sid, 45) for sid in (1, 2, 3, 4, 5)] == ["OK", "OK", "OK", "OK", "BUSY"]  # 50 kB each
        assert [_opened(b, sid, 45) for sid in (1, 2)] == ["OK", "OK"]
        assert server.snapshot()["kv_bytes"] == 300_000
        assert _opened(b, 3, 45) == "BUSY"  # the daemon's 300 kB are taken, and no session is idle yet
        _idle_for(server, 3.1)
        assert _opened(b, 3, 45) == "OK"  # now the least recently used idle session makes room
        # (the batcher counts and frees what the socket's thread evicted at its next pass)
        assert _until(lambda: server.snapshot()["sessions_evicted"] == 1)
        snap = server.snapshot()
        assert snap["kv_bytes"] == 300_000 and snap["sessions_evicted"] == 1 and snap["live_sessions"] == 6
        # a session's reservation grows with what it verifies (here to 90 positions): room is made
        # again by an idle session, and the total holds
        assert b.draft(3, 1, 0, [2] * 40, 85, depth=5).type is MsgType.DRAFTED
        snap = server.snapshot()
        assert snap["kv_bytes"] == 290_000 and snap["sessions_evicted"] == 2
        r = b.draft(3, 2, 0, [2] * 11, 96, depth=5)  # 101 positions: beyond one session's bound
        assert _code(r) == "TOO_LARGE" and r.header["re"] == "DRAFT"
        for p, sids in ((a, (3, 4)), (b, (1, 2, 3))):
            for sid in sids:
                p.send(Message(MsgType.CLOSE, {"session": sid}))
        assert _until(lambda: server.snapshot()["kv_bytes"] == 0 and server.snapshot()["live_sessions"] == 0)


def test_the_cache_estimate_matches_what_the_drafter_holds(near_draft):
    from common.models import load_causal_lm
    from starsd_draftd.backends.model import ModelBackend

    backend = ModelBackend(load_causal_lm(str(near_draft)))
    state = backend.new_state(SamplingParams())
    backend.draft(state, list(range(3, 203)), 4)
    cache = state.cache
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    positions = cache.get_seq_length()
    assert positions >= 200 and held == positions * backend.kv_bytes_per_token


class FirstDraftHeldCacheBackend(CacheBackend):
    """The first draft waits until the test lets it go (``let_go``): requests sent meanwhile are
    served as one batch."""

    def __init__(self):
        super().__init__()
        self.first = True
        self.drafting = threading.Event()  # the first draft has begun
        self._gate = threading.Event()

    def draft(self, state, verified, depth, new_features=None):
        if self.first:
            self.first = False
            self.drafting.set()
            self._gate.wait(10.0)
        return super().draft(state, verified, depth, new_features)

    def let_go(self) -> None:
        """Once requests sent during the first draft have had time to reach the daemon's socket
        (loopback: milliseconds, but the daemon's I/O thread needs a core, which a loaded CI
        machine may not give it at once), the first draft ends. The daemon reads its socket only
        between batches, so there is no counter to wait on instead."""
        time.sleep(1.0)
        self._gate.set()


def test_room_is_never_made_by_evicting_a_session_of_the_same_batch():
    backend = FirstDraftHeldCacheBackend()
    with running_server(backend, max_kv_bytes=20_000, evict_idle_s=0) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        assert peer.hello().type is MsgType.WELCOME
        for sid in (1, 2):  # 10 kB each (5 prompt tokens + depth 5): the daemon's 20 kB are taken
            peer.open(sid, [1, 2, 3, 4, 5])
        peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 5, "depth": 2}))
        assert backend.drafting.wait(10.0)
        # while that is drafted, session 1's next request and session 2's, which grows by 5
        # positions (5 kB more), come in: one batch. The only session that could make room is 1,
        # which is in the batch: 2 is refused, and 1 is drafted on its own, intact, state
        peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 2, "accepted": 0, "new": [], "pos": 5, "depth": 2}))
        peer.send(Message(MsgType.DRAFT, {"session": 2, "seq": 1, "accepted": 0, "new": [6, 7, 8, 9, 10],
                                          "pos": 10, "depth": 5}))
        backend.let_go()
        replies = [(r.header["session"], r.header["seq"], _code(r)) for r in (peer.recv(), peer.recv(), peer.recv())]
        assert sorted(replies) == [(1, 1, "DRAFTED"), (1, 2, "DRAFTED"), (2, 1, "BUSY")]
        assert server.stats.sessions_evicted == 0 and "INTERNAL" not in server.stats.errors


def test_a_busy_draft_request_leaves_the_session_standing():
    """BUSY on a DRAFT means it was not applied: the target keeps its session (no OPEN with the
    whole prompt again), backs off, and its next request reports what that one would have."""
    with running_server(CacheBackend(), max_peer_kv_bytes=25_000) as (server, ctx):
        client = _client(server, ctx)
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 5.0)
        tokens = list(range(10, 15))
        assert isinstance(_reply(client, s.session, s.send(tokens, 3)), DraftReply)  # 10 positions, 10 kB
        s.kept(1)
        other = RemoteDraftSession(client, client.next_session(), SamplingParams(), 5.0)
        assert isinstance(_reply(client, other.session, other.send([1] * 10, 3)), DraftReply)  # 15 kB more
        tokens = [*tokens, 15, 16]  # one kept, one new: 7 positions + depth 5 = 12 kB > what is left
        seq = s.send(tokens, 5)
        reply = _reply(client, s.session, seq)
        assert reply is not None and reply.name == "BUSY" and s.resolve(reply) is None
        assert s.send(tokens, 5) is None  # backing off
        other.close()  # the peer's share has room again
        time.sleep(0.25)
        tokens = [*tokens, 17]
        reply = _reply(client, s.session, s.send(tokens, 3))
        assert isinstance(reply, DraftReply) and reply.tokens == [18, 19, 20]  # the session holds all 8
        assert server.stats.sessions_opened == 2  # nothing was re-opened
        client.close()


def test_a_target_asks_for_no_drafts_beyond_the_drafters_context():
    with running_server(CountingBackend(max_len=8)) as (server, ctx):
        client = _client(server, ctx)
        assert client.welcome.max_len == 8
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 5.0)
        assert s.send(list(range(1, 7)), 3) is None and s.disabled  # 6 + 3 > 8: never sent
        assert server.stats.sessions_opened == 0 and not server.stats.errors
        client.close()


class OrderBackend(FirstDraftHeldCacheBackend):
    """Records which prompt each draft was for, in the order drafted."""

    kv_bytes_per_token = 0

    def __init__(self):
        super().__init__()
        self.order: list[int] = []

    def draft(self, state, verified, depth, new_features=None):
        self.order.append(verified[0])
        return super().draft(state, verified, depth, new_features)


def test_one_hosts_backlog_delays_another_by_one_batch_at_most():
    backend = OrderBackend()
    with running_server(backend, batch_max=2) as (server, ctx):
        hostile = _peer_from(ctx, server.endpoint, "127.0.0.2")
        assert hostile.hello().type is MsgType.WELCOME
        for sid in range(1, 21):
            hostile.open(sid, [sid, 1, 2])
        client = _client(server, ctx)
        for sid in range(1, 21):  # the first is held while drafted; the other 19 queue behind it
            hostile.send(Message(MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [], "pos": 3,
                                                 "depth": 2}))
        assert backend.drafting.wait(10.0)
        s = RemoteDraftSession(client, client.next_session(), SamplingParams(), 30.0)
        seq = s.send([99, 1, 2], 2)
        backend.let_go()
        assert isinstance(_reply(client, s.session, seq, 30.0), DraftReply)
        assert _until(lambda: len(backend.order) == 21)
        # batches of 2: the first held the slow draft; the legitimate target's request went into
        # the next one, ahead of the 18 or so that had queued before it
        assert backend.order.index(99) <= 3, backend.order
        client.close()


def test_a_hosts_connections_take_turns_inside_its_turn():
    """Two processes on one host (one address): one queues twenty sessions' requests, the other
    one request after them; the other's goes in the next batch, not behind the twenty."""
    backend = OrderBackend()
    with running_server(backend, batch_max=2) as (server, ctx):
        busy, other = _peer_from(ctx, server.endpoint, "127.0.0.2"), _peer_from(ctx, server.endpoint, "127.0.0.2")
        assert busy.hello().type is MsgType.WELCOME and other.hello().type is MsgType.WELCOME
        for sid in range(1, 21):
            busy.open(sid, [sid, 1, 2])
        other.open(1, [99, 1, 2])
        for sid in range(1, 21):  # the first is held while drafted; the other 19 queue behind it
            busy.send(Message(MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [], "pos": 3,
                                              "depth": 2}))
        assert backend.drafting.wait(10.0)
        other.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 3, "depth": 2}))
        assert other.recv(acks=True).type is MsgType.ACK  # queued behind the nineteen
        backend.let_go()
        assert other.recv().header["tokens"] == [3, 4]
        assert _until(lambda: len(backend.order) == 21)
        assert backend.order.index(99) <= 3, backend.order  # the batch after the held one


def test_an_addresss_session_budget_is_shared_fairly_by_its_connections():
    """Eight sessions an address: one connection took all eight; a second connection on the
    same host takes its share (four) from it, least recently used first, and no more; the first
    cannot take them back while it is at its share."""
    backend = CountingBackend()
    with running_server(backend, max_sessions_per_address=8) as (server, ctx):
        hog, late = _peer_from(ctx, server.endpoint, "127.0.0.2"), _peer_from(ctx, server.endpoint, "127.0.0.2")
        assert hog.hello().type is MsgType.WELCOME and late.hello().type is MsgType.WELCOME
        for sid in range(1, 9):
            hog.open(sid, [sid])
        assert hog.draft(8, 1, 0, [], 1).type is MsgType.DRAFTED  # session 8 was used: it is evicted last
        for sid in range(1, 5):
            late.open(sid, [50 + sid])
        late.open(5, [60])
        assert _code(late.recv()) == "BUSY"  # at its share of four
        hog.open(9, [9])
        assert _code(hog.recv()) == "BUSY"  # at its share too: nothing is taken back
        assert _until(lambda: server.snapshot()["sessions_evicted"] == 4)
        snap = server.snapshot()
        assert snap["live_sessions"] == 8
        for sid in range(1, 5):  # the late connection's sessions serve
            assert late.draft(sid, 1, 0, [], 1).header["tokens"] == [50 + sid + 1, 50 + sid + 2, 50 + sid + 3]
        assert _code(hog.draft(1, 1, 0, [], 1)) == "UNKNOWN_SESSION"  # its least recently used went first
        assert hog.draft(8, 2, 0, [], 1).type is MsgType.DRAFTED
