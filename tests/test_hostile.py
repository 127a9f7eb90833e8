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
