"""The draft daemon under hostile or careless peers: each attack tried on the real server loop
(real sockets on loopback, limits scaled down so each runs in seconds). The daemon survives,
the attacker gets a typed error, and a legitimate target on its own connection keeps getting
drafts. No assertion on time."""

from __future__ import annotations

import time

import pytest
import zmq

from common.protocol import ErrorCode, Message, MsgType
from common.verify import SamplingParams
from fakes import CountingBackend, RawPeer, running_server
from starsd_target.client import Backoff, DraftClient, DraftReply, RemoteDraftSession


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
        assert client.open_refusals == 1
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
        assert peer.draft(1, 2, 0, [], 3).type is MsgType.DRAFTED  # the connection goes on
