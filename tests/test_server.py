"""The draft daemon's loop with a fake backend over real sockets: handshake, sessions, isolation,
limits, and bad input answered with typed errors while the daemon keeps serving."""

import time

import msgpack
import pytest

from common import protocol as P
from common.protocol import ErrorCode, Message, MsgType
from fakes import CountingBackend, RawPeer, running_server
from starsd_draftd.server import DraftServer, ServerConfig


def code_of(msg: Message) -> str:
    assert msg is not None, "no reply"
    assert msg.type is MsgType.ERROR, f"expected ERROR, got {msg.type.name} {msg.header}"
    return ErrorCode(msg.header["code"]).name


def test_handshake_and_draft():
    with running_server() as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        w = peer.hello()
        assert w.type is MsgType.WELCOME and w.header["vocab_size"] == 259 and w.header["max_depth"] == 5
        peer.open(1, [10, 11, 12])
        r = peer.draft(1, 1, 0, [], 3, depth=3)
        assert r.type is MsgType.DRAFTED and r.header["tokens"] == [13, 14, 15] and r.header["seq"] == 1
        # two of [13, 14, 15] kept, then the target's own token 40: the prefix is now ..., 13, 14, 40
        r = peer.draft(1, 2, 2, [40], 6, depth=2)
        assert r.header["tokens"] == [41, 42]


def _last_chain_recorded(server, seq: int) -> bool:
    """Whether the compute loop has noted the chain it answered ``seq`` with: it does so after
    the reply leaves, off the target's critical path, so a repeat that overtakes that bookkeeping
    is drafted the usual way."""
    with server.lock:
        return any(s.last_reply is not None and s.last_reply.seq == seq for s in server.sessions.sessions.values())


def test_a_draft_that_brings_and_asks_nothing_new_is_answered_without_a_batch():
    """A DRAFT with no verified tokens and nothing accepted, asking what the last chain was
    drafted for, gets that chain again from the socket's thread: no batch, no backend call.
    Asking anything else, or with a stale sequence number, it goes the usual way."""
    with running_server() as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        peer.open(1, [10, 11, 12])
        assert peer.draft(1, 1, 0, [], 3, depth=3).header["tokens"] == [13, 14, 15]
        assert _wait_for(lambda: _last_chain_recorded(server, 1)), "the chain answering seq 1 was never noted"
        r = peer.draft(1, 2, 0, [], 3, depth=3)
        assert r.type is MsgType.DRAFTED and r.header["tokens"] == [13, 14, 15] and r.header["seq"] == 2
        snap = server.snapshot()
        assert snap["repeats"] == 1 and snap["batches"] == 1 and snap["requests"] == 1
        assert peer.draft(1, 3, 0, [], 3, depth=3).header["seq"] == 3  # repeated again
        assert peer.draft(1, 4, 0, [], 3, depth=2).header["tokens"] == [13, 14]  # asks less: drafted
        assert server.snapshot()["batches"] == 2
        assert _wait_for(lambda: _last_chain_recorded(server, 4)), "the chain answering seq 4 was never noted"
        assert code_of(peer.draft(1, 4, 0, [], 3, depth=2)) == "BAD_REQUEST"  # stale, as ever
        peer.draft(1, 5, 0, [], 3, depth=2, min_chance=0.3)  # another floor for copied drafts: drafted
        assert server.snapshot()["batches"] == 3
        # the session goes on from its last drafts: two of [13, 14] kept, then the target's 40
        assert peer.draft(1, 6, 2, [40], 6, depth=2).header["tokens"] == [41, 42]
        snap = server.snapshot()
        assert snap["repeats"] == 2 and snap["batches"] == 4


def test_mismatched_model_is_refused_with_both_values():
    with running_server() as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        r = peer.hello(vocab=32000, tok="other-tok")
        assert code_of(r) == "INCOMPATIBLE_MODEL"
        assert "32000" in r.header["message"] and "259" in r.header["message"]
        assert "other-tok" in r.header["message"] and "fake-tok" in r.header["message"]
        peer.open(1, [1])
        assert code_of(peer.draft(1, 1, 0, [], 1)) == "NO_HANDSHAKE"


def test_wrong_version_hello_is_refused():
    with running_server() as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.send_raw([b"HELLO", msgpack.packb({"v": 0, "vocab_size": 259, "tokenizer": "fake-tok"})])
        r = peer.recv()
        assert code_of(r) == "VERSION_MISMATCH" and str(P.PROTOCOL_VERSION) in r.header["message"]


BAD_INPUTS = [
    ([b"\x00\x01"], "MALFORMED"),
    ([b"DRAFT", b"\xc1"], "MALFORMED"),
    ([b"NOPE", msgpack.packb({"v": P.PROTOCOL_VERSION})], "UNKNOWN_TYPE"),
    ([b"DRAFT", msgpack.packb({"v": P.PROTOCOL_VERSION, "session": 1})], "BAD_REQUEST"),
    ([b"DRAFTED", msgpack.packb({"v": P.PROTOCOL_VERSION, "session": 1, "seq": 1, "tokens": []})], "UNKNOWN_TYPE"),
    ([b"DRAFT", msgpack.packb({"v": P.PROTOCOL_VERSION, "session": 99, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 1})],
     "UNKNOWN_SESSION"),
    ([b"OPEN", msgpack.packb({"v": P.PROTOCOL_VERSION, "session": 5, "prompt": [], "sampling": {"temperature": 0.0}})],
     "BAD_REQUEST"),
    ([b"OPEN", msgpack.packb({"v": P.PROTOCOL_VERSION, "session": 5, "prompt": [1], "sampling": {"temperature": -1.0}})],
     "BAD_REQUEST"),
    ([b"OPEN", msgpack.packb({"v": P.PROTOCOL_VERSION, "session": 5, "prompt": [100000], "sampling": {"temperature": 0.0}})],
     "BAD_REQUEST"),
    ([b"DRAFT", msgpack.packb({"v": P.PROTOCOL_VERSION})] + [b"x"] * 12, "TOO_LARGE"),
]


def test_bad_input_gets_typed_errors_and_counters_and_the_daemon_keeps_serving():
    with running_server() as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        for frames, expected in BAD_INPUTS:
            peer.send_raw(frames)
            assert code_of(peer.recv()) == expected, frames
        peer.open(1, [7])
        assert code_of(peer.draft(1, 1, 0, [], 1, depth=99)) == "BAD_REQUEST"  # beyond max depth
        assert code_of(peer.draft(1, 2, 5, [], 1)) == "BAD_REQUEST"  # more accepted than drafted
        assert code_of(peer.draft(1, 3, 0, [8], 5)) == "DESYNC"  # 1 + 1 tokens, not 5
        r = peer.draft(1, 4, 0, [8], 2, depth=2)
        assert r.type is MsgType.DRAFTED and r.header["tokens"] == [9, 10]
        assert code_of(peer.draft(1, 4, 0, [], 2)) == "BAD_REQUEST"  # sequence number reused
        errors = server.snapshot()["errors"]
        assert errors["MALFORMED"] == 2 and errors["UNKNOWN_TYPE"] == 2 and errors["DESYNC"] == 1
        assert errors["TOO_LARGE"] == 1 and errors["UNKNOWN_SESSION"] == 1
        assert sum(errors.values()) == len(BAD_INPUTS) + 4


def test_oversized_message_is_dropped_by_the_socket_and_the_daemon_survives():
    with running_server() as (server, ctx):
        big = RawPeer(ctx, server.endpoint)
        big.send_raw([b"DRAFT", b"\x00" * (P.DEFAULT_LIMITS.max_message_bytes + 1024)])
        time.sleep(0.3)
        peer = RawPeer(ctx, server.endpoint)
        assert peer.hello().type is MsgType.WELCOME


def test_session_isolation_same_session_id():
    """Two targets use session id 1 with different prompts, interleaving requests: each gets drafts
    for its own prefix, and neither can touch the other's session."""
    with running_server() as (server, ctx):
        a, b = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        a.hello(), b.hello()
        a.open(1, [10])
        b.open(1, [100])
        # A keeps 1 of each 2-token draft and adds token seq; B keeps both and adds 200 + seq.
        plan = {a: (10, 1, 0), b: (100, 2, 200)}
        pos = {a: 1, b: 1}
        for seq in range(1, 6):
            for peer, (first, keep, offset) in plan.items():
                accepted, new = (0, []) if seq == 1 else (keep, [offset + seq])
                pos[peer] += accepted + len(new)
                r = peer.draft(1, seq, accepted, new, pos[peer], depth=2)
                last = first if seq == 1 else offset + seq
                assert r.header["tokens"] == [last + 1, last + 2], (seq, r.header)
        # b closing "session 1" closes only its own
        b.send(Message(MsgType.CLOSE, {"session": 1}))
        time.sleep(0.1)
        assert server.snapshot()["live_sessions"] == 1
        assert code_of(b.draft(1, 9, 0, [], 99)) == "UNKNOWN_SESSION"


def test_session_limits_answer_busy():
    with running_server(max_sessions_per_peer=2, max_sessions=3) as (server, ctx):
        a, b = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        a.hello(), b.hello()
        a.open(1, [1]), a.open(2, [1]), a.open(3, [1])
        r = a.recv()
        assert code_of(r) == "BUSY" and r.header["session"] == 3
        a.open(1, [5])  # re-opening an existing session is always allowed
        b.open(1, [1]), b.open(2, [1])
        assert code_of(b.recv()) == "BUSY"  # total limit of 3
        assert server.snapshot()["live_sessions"] == 3


def _wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_untouched_sessions_expire_and_free_state():
    backend = CountingBackend()
    with running_server(backend, session_ttl_s=0.3) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        peer.open(1, [3])
        assert peer.draft(1, 1, 0, [], 1).type is MsgType.DRAFTED
        assert _wait_for(lambda: server.snapshot()["live_sessions"] == 0)
        assert server.snapshot()["sessions_expired"] == 1 and backend.released == 1
        assert code_of(peer.draft(1, 2, 0, [], 2)) == "UNKNOWN_SESSION"


def test_silent_peers_are_purged_with_their_sessions():
    backend = CountingBackend()
    with running_server(backend, peer_ttl_s=0.5) as (server, ctx):
        quiet, chatty = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        quiet.hello(), chatty.hello()
        quiet.open(1, [3]), quiet.open(2, [4])
        for sid in (1, 2):  # drafted for, so each holds backend state to free
            assert quiet.draft(sid, 1, 0, [], 1).type is MsgType.DRAFTED
        chatty.open(1, [5])
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # the chatty peer keeps its lease with PINGs
            chatty.send(Message(MsgType.PING))
            assert chatty.recv().type is MsgType.PONG
            time.sleep(0.1)
        assert server.snapshot()["peers"] == 1 and server.snapshot()["live_sessions"] == 1
        assert backend.released == 2
        # the purged peer must greet again; its sessions are gone
        assert code_of(quiet.draft(1, 1, 0, [], 1)) == "NO_HANDSHAKE"
        assert quiet.hello().type is MsgType.WELCOME
        assert code_of(quiet.draft(1, 2, 0, [], 1)) == "UNKNOWN_SESSION"
        assert chatty.draft(1, 1, 0, [], 1, depth=1).header["tokens"] == [6]


def test_backend_failure_costs_one_request_not_the_daemon():
    class Exploding(CountingBackend):
        def draft(self, state, verified, depth, new_features=None):
            if verified[-1] == 13:
                raise RuntimeError("boom")
            return super().draft(state, verified, depth, new_features)

    with running_server(Exploding()) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        peer.open(1, [13])
        assert code_of(peer.draft(1, 1, 0, [], 1)) == "INTERNAL"
        assert peer.draft(1, 2, 0, [20], 2, depth=1).header["tokens"] == [21]


def test_fifo_across_targets_and_stats():
    with running_server() as (server, ctx):
        peers = [RawPeer(ctx, server.endpoint) for _ in range(3)]
        for i, p in enumerate(peers):
            p.hello()
            p.open(1, [i])
        for p in peers:
            p.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 2}))
        for i, p in enumerate(peers):
            assert p.recv().header["tokens"] == [i + 1, i + 2]
        stats = peers[0]
        stats.send(Message(MsgType.STATS))
        s = stats.recv().header["stats"]
        assert s["requests"] == 3 and s["drafted_tokens"] == 6 and s["live_sessions"] == 3 and s["busy_s"] > 0
        mem = s["memory"]  # resident memory, whose ratio to the weights is unknown for a fake drafter
        assert 0 < mem["rss_bytes"] <= mem["peak_rss_bytes"] and mem["weights_bytes"] == 0
        assert mem["rss_over_weights"] is None


def test_refuses_public_bind_without_insecure():
    with pytest.raises(ValueError, match="--insecure"):
        DraftServer(CountingBackend(), ServerConfig(bind="tcp://0.0.0.0:5555"))
    DraftServer(CountingBackend(), ServerConfig(bind="tcp://0.0.0.0:5555", insecure=True))  # allowed


class GatedBackend(CountingBackend):
    """Holds its first call until released, recording the size of every batch it serves."""

    def __init__(self):
        super().__init__()
        import threading

        self.gate = threading.Event()
        self.batches = []

    def draft_many(self, requests):
        self.gate.wait(10)
        self.batches.append(len(requests))
        return super().draft_many(requests)


@pytest.mark.parametrize("batch_max, expected", [(8, [1, 3]), (2, [1, 2, 1]), (1, [1, 1, 1, 1])])
def test_waiting_sessions_are_drafted_together(batch_max, expected):
    backend = GatedBackend()
    with running_server(backend, batch_max=batch_max) as (server, ctx):
        peers = [RawPeer(ctx, server.endpoint) for _ in range(4)]
        for i, p in enumerate(peers):
            p.hello()
            p.open(1, [10 * i + 1])
        for p in peers:
            p.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 2}))
            time.sleep(0.1)  # the first request is being served (held) while the others queue up
        backend.gate.set()
        for i, p in enumerate(peers):
            assert p.recv().header["tokens"] == [10 * i + 2, 10 * i + 3]
        assert backend.batches == expected
        assert server.snapshot()["batches"] == len(expected)


def test_one_sessions_requests_stay_in_order_across_batches():
    backend = GatedBackend()
    with running_server(backend) as (server, ctx):
        holder, peer = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        holder.hello(), peer.hello()
        holder.open(1, [1])
        peer.open(1, [20])
        holder.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 1}))
        time.sleep(0.1)
        # two requests of the same session while the daemon is busy: the second must see the first applied
        peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 1}))
        peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 2, "accepted": 1, "new": [30], "pos": 3,
                                          "depth": 1}))
        time.sleep(0.1)
        backend.gate.set()
        assert peer.recv().header["tokens"] == [21]
        assert peer.recv().header["tokens"] == [31]
        assert backend.batches == [1, 1, 1]


def test_stop_says_goodbye_to_every_peer_and_refuses_new_sessions():
    backend = GatedBackend()
    backend.gate.set()
    with running_server(backend, drain_s=2.0) as (server, ctx):
        a, b = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        a.hello(), b.hello()
        a.open(1, [5])
        server.stop()
        for p in (a, b):
            bye = p.recv()
            assert bye.type is MsgType.GOODBYE and bye.header["instance"] == server.instance and bye.header["draining"]


def test_full_table_evicts_the_least_recently_used_idle_session():
    backend = CountingBackend()
    with running_server(backend, max_sessions=2, evict_idle_s=0.3) as (server, ctx):
        a, b = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        a.hello(), b.hello()
        a.open(1, [1]), a.open(2, [2])
        a.send(Message(MsgType.STATS))
        assert a.recv().header["stats"]["live_sessions"] == 2  # a's OPENs are in
        assert a.draft(1, 1, 0, [], 1, depth=1).header["tokens"] == [2]  # session 1 holds backend state now
        b.open(1, [3])
        assert code_of(b.recv()) == "BUSY"  # both sessions are fresh
        time.sleep(0.4)
        assert a.draft(2, 1, 0, [], 1, depth=1).header["tokens"] == [3]  # session 2 is used again
        b.open(1, [3])  # session 1 of a, idle the longest, makes room
        assert b.draft(1, 1, 0, [], 1, depth=1).header["tokens"] == [4]
        assert code_of(a.draft(1, 2, 0, [], 1)) == "UNKNOWN_SESSION"
        # freed: the evicted session's state (none is made for an OPEN, refused or not, until it is drafted for)
        assert server.snapshot()["sessions_evicted"] == 1 and backend.released == 1


def test_sequences_beyond_the_drafters_context_are_refused():
    backend = CountingBackend()
    backend.max_len = 8
    with running_server(backend) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        peer.open(1, list(range(3, 12)))
        r = peer.recv()
        assert code_of(r) == "TOO_LARGE" and "8" in r.header["message"]
        peer.open(2, [3, 4, 5])
        assert peer.draft(2, 1, 0, [], 3, depth=4).type is MsgType.DRAFTED
        assert code_of(peer.draft(2, 2, 4, [9], 8, depth=4)) == "TOO_LARGE"


# ---------------------------------------------------------------- the socket's own thread, acknowledgements
def test_the_daemon_answers_and_acknowledges_while_a_batch_computes():
    """The batcher is held inside a backend call; meanwhile the socket's thread greets a new
    target, answers PING and STATS, acknowledges draft requests with their place in the queue
    and refuses bad ones, so a target can tell a busy daemon from a hung one."""
    backend = GatedBackend()
    with running_server(backend, batch_max=1) as (server, ctx):
        busy, other = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        busy.hello()
        busy.open(1, [5])
        busy.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 2}))
        ack = busy.recv(acks=True)
        assert ack.type is MsgType.ACK and ack.header["session"] == 1 and ack.header["seq"] == 1
        assert ack.header["ahead"] == 0 and ack.header["eta_us"] > 0
        assert _wait_for(lambda: server.estimate.busy_until > 0)  # the batch is computing (held at the gate)
        assert other.hello().type is MsgType.WELCOME
        other.send(Message(MsgType.PING))
        assert other.recv().type is MsgType.PONG
        other.send(Message(MsgType.STATS))
        assert other.recv().header["stats"]["acks"] == 1
        other.open(1, [7]), other.open(2, [8])
        for sid in (1, 2):
            other.send(Message(MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [], "pos": 1,
                                               "depth": 2}))
        acks = [other.recv(acks=True) for _ in range(2)]
        assert [a.header["ahead"] for a in acks] == [0, 1]  # queued behind the batch, one after the other
        # the later one waits for more: the batch computing and the one queued before it
        assert acks[1].header["eta_us"] > acks[0].header["eta_us"]
        other.send(Message(MsgType.DRAFT, {"session": 9, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 2}))
        assert code_of(other.recv()) == "UNKNOWN_SESSION"  # refused on arrival: no ACK
        assert backend.batches == []  # all of it while the first batch was still held
        backend.gate.set()
        assert busy.recv().type is MsgType.DRAFTED
        replies = [other.recv() for _ in range(2)]
        assert all(r.type is MsgType.DRAFTED for r in replies)
        assert len(other.acks) == 0 and server.snapshot()["acks"] == 3


def test_the_estimate_learns_a_steps_and_a_prompt_tokens_cost():
    from starsd_draftd.eta import PREFILL_MIN, ServiceEstimate

    est = ServiceEstimate(batch_max=2)
    assert est.eta_s(0, 0, 4, 0, now=0.0) == pytest.approx(est.cost_s(4, 0))  # defaults before any measure
    est.finished(0.040, steps=4, fed=1)  # 10 ms a step
    est.finished(0.040 + 0.200, steps=4, fed=100)  # then 2 ms a prompt token
    assert est.step_s == pytest.approx(0.010) and est.token_s == pytest.approx(0.002)
    est.finished(0.5, steps=0, fed=PREFILL_MIN * 10)  # a prefill chunk alone (no drafting) teaches tokens too
    assert est.token_s > 0.002
    est.token_s = 0.002
    # three requests ahead with a batch of two: two batches before this request's own; 50 tokens ahead
    assert est.eta_s(3, 50, 4, 10, now=0.0) == pytest.approx(2 * 4 * 0.010 + 60 * 0.002)
    est.started(4, 0, now=1.0)  # a batch is computing: what is left of it comes first
    assert est.eta_s(0, 0, 4, 0, now=1.01) == pytest.approx(0.030 + 0.040)


class ChunkingBackend(CountingBackend):
    """Feeds prompts in chunks (``prefill``), logging each chunk and each batch (its requests'
    sequence lengths); its first batch is held until ``gate`` is set."""

    prefills = True

    def __init__(self):
        super().__init__()
        import threading

        self.gate = threading.Event()
        self.events: list[tuple] = []

    def new_state(self, params):
        return {"calls": 0, "cached": 0}

    def prefill(self, state, verified, budget):
        keep = state["cached"]
        upto = min(len(verified) - 1, keep + budget)
        state["cached"] = upto
        self.events.append(("chunk", upto - keep))
        time.sleep(0.2)  # a chunk's forward: the other target's next round arrives during it
        return upto - keep, len(verified) - upto

    def draft_many(self, requests):
        self.gate.wait(10)
        self.events.append(("batch", sorted(len(r.verified) for r in requests)))
        for r in requests:  # drafting feeds what no chunk fed
            r.state["cached"] = len(r.verified)
        return super().draft_many(requests)


def test_a_long_prompt_is_fed_in_chunks_between_batches_and_short_requests_go_first():
    """One target's 1,000-token prompt and another's short rounds queued together: with a budget
    of 256 prompt tokens a batch, the short request is drafted in the next batch without the long
    prompt, which is fed 256 tokens at a time after each batch, then drafted; every reply is exact."""
    backend = ChunkingBackend()
    with running_server(backend, batch_prefill_tokens=256) as (server, ctx):
        long_peer, short = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        long_peer.hello(), short.hello()
        short.open(1, [5])
        short.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 2}))
        assert _wait_for(lambda: server.estimate.busy_until > 0)  # held in its first batch
        prompt = [3 + i % 200 for i in range(1000)]
        long_peer.open(1, prompt)
        long_peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1000,
                                               "depth": 2}))
        assert long_peer.recv(acks=True).type is MsgType.ACK
        backend.gate.set()
        assert short.recv().header["tokens"] == [6, 7]
        short.send(Message(MsgType.DRAFT, {"session": 1, "seq": 2, "accepted": 2, "new": [8], "pos": 4, "depth": 2}))
        assert short.recv().header["tokens"] == [9, 10]
        reply = long_peer.recv()
        assert reply.type is MsgType.DRAFTED and reply.header["tokens"] == [prompt[-1] + 1, prompt[-1] + 2]
        ev = backend.events
        chunks = [n for kind, n in ev if kind == "chunk"]
        assert chunks and all(n <= 256 for n in chunks) and sum(chunks) <= 999
        batches = [b for kind, b in ev if kind == "batch"]
        assert [1000] in batches and all(len(b) == 1 or 1000 not in b for b in batches)
        # the short rounds never waited for the whole prompt: each was drafted before the prompt's last chunk
        last_chunk = max(i for i, e in enumerate(ev) if e[0] == "chunk")
        assert ev.index(("batch", [4])) < last_chunk
        assert server.snapshot()["prefill_chunks"] == len(chunks)


def test_a_session_closed_while_drafted_is_freed_after_its_batch():
    """The socket's thread takes a CLOSE while the batcher drafts that very session: its state
    is freed once the batch is done, never under the forward that uses it."""
    backend = GatedBackend()
    with running_server(backend) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        peer.open(1, [5])
        peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 2}))
        assert _wait_for(lambda: server.estimate.busy_until > 0)  # held in its batch
        peer.send(Message(MsgType.CLOSE, {"session": 1}))
        assert _wait_for(lambda: server.snapshot()["live_sessions"] == 0)  # closed at once...
        time.sleep(0.2)
        assert backend.released == 0  # ...but not freed while drafted
        backend.gate.set()
        assert peer.recv().type is MsgType.DRAFTED
        assert _wait_for(lambda: backend.released == 1)


def test_a_long_request_whose_session_closed_is_refused_not_chunked_forever():
    backend = ChunkingBackend()
    backend.gate.set()
    with running_server(backend, batch_prefill_tokens=256) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        peer.open(1, [3 + i % 200 for i in range(1000)])
        peer.send(Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1000, "depth": 2}))
        assert peer.recv(acks=True).type is MsgType.ACK
        assert _wait_for(lambda: server.snapshot()["prefill_chunks"] >= 1)
        peer.send(Message(MsgType.CLOSE, {"session": 1}))  # while its prompt is fed
        assert code_of(peer.recv()) == "UNKNOWN_SESSION"
        assert _wait_for(lambda: server.snapshot()["queue_depth"] == 0)
        assert server.ingress.queued_fed == 0
