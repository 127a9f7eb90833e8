"""A target's pool of draft daemons with fake backends over real sockets: endpoints and their
resolution, placement (affinity, the busier daemon passed over), failover and drain, a refused
daemon left out, and the draft daemon's health answers on its metrics port."""

import contextlib
import json
import time
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from common.sockets import free_tcp_endpoint
from common.verify import SamplingParams
from common.protocol import Message, MsgType
from fakes import CountingBackend, RawPeer, running_server
from starsd_target.client import HandshakeRefused
from starsd_target.drafts import RemoteDraftSession
from starsd_target.pool import DraftPool, healthy, parse_endpoints, resolve

VOCAB, TOK = 259, "fake-tok"


def _pool(endpoints, **kw) -> DraftPool:
    return DraftPool(endpoints, VOCAB, TOK, "pool-test", **kw)


@contextlib.contextmanager
def _up(servers, ctx):
    """A pool of ``servers``' endpoints, every link up, closed at the end."""
    pool = _pool([s.endpoint for s in servers], ctx=ctx)
    try:
        pool.handshake(5)
        assert _wait(lambda: all(link.up for link in pool.links.values()), pool=pool)
        yield pool
    finally:
        pool.close()


def _round(d: RemoteDraftSession, tokens: list[int], depth: int = 3, timeout_s: float = 5.0):
    """One draft request of ``d`` and its reply (waited for)."""
    seq = d.send(tokens, depth)
    assert seq is not None, "no request went out"
    deadline = time.monotonic() + timeout_s
    while (reply := d.client.take(d.session, seq)) is None:
        assert time.monotonic() < deadline, "no reply"
        d.pool.poll(0.01)
    return d.resolve(reply)


def _wait(cond, timeout_s: float = 5.0, pool: DraftPool | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pool is not None:
            pool.poll(0.01)
        if cond():
            return True
        time.sleep(0.005)
    return False


def test_endpoints_are_given_by_commas_spaces_or_several_values():
    assert parse_endpoints("tcp://a:1, tcp://b:2  tcp://a:1") == ["tcp://a:1", "tcp://b:2"]
    assert parse_endpoints(["tcp://a:1", "ipc:///run/x,tcp://c:3"]) == ["tcp://a:1", "ipc:///run/x", "tcp://c:3"]
    assert parse_endpoints(None) == [] and parse_endpoints(" ") == []


def test_a_name_is_one_link_per_address_and_addresses_stay_as_they_are():
    assert resolve("tcp://127.0.0.1:5555") == ["tcp://127.0.0.1:5555"]
    assert resolve("ipc:///tmp/x.sock") == ["ipc:///tmp/x.sock"]
    assert "tcp://127.0.0.1:5555" in resolve("tcp://localhost:5555")
    assert resolve("tcp://no-such-host.invalid:5555") is None  # not now
    pool = _pool("tcp://no-such-host.invalid:5555")  # never resolved: connected by name (ZeroMQ retries it)
    try:
        assert list(pool.links) == ["tcp://no-such-host.invalid:5555"]
    finally:
        pool.close()


def test_targets_sharing_a_key_name_different_sessions():
    """Replicas given one CURVE key are one principal to a draft daemon: their session ids start at
    random points, so they do not name (and re-open, and close) each other's sessions."""
    pools = [_pool("tcp://127.0.0.1:1") for _ in range(8)]
    try:
        firsts = [p.next_session() for p in pools]
        assert len(set(firsts)) == 8 and all(0 < f < 2**63 for f in firsts)
        assert pools[0].next_session() == firsts[0] + 1
    finally:
        for p in pools:
            p.close()


def test_the_cli_takes_draft_endpoints_from_several_options_and_the_environment(monkeypatch):
    from starsd_target import cli

    seen = {}
    monkeypatch.setattr(cli.app, "run", lambda config: seen.setdefault("draft", config.draft))
    r = CliRunner().invoke(cli.main, ["serve", "--draft", "tcp://a:1", "--draft", "tcp://b:2,tcp://c:3"])
    assert r.exit_code == 0, r.output
    assert seen.pop("draft") == "tcp://a:1,tcp://b:2,tcp://c:3"
    r = CliRunner().invoke(cli.main, ["serve"], env={"STARSD_TARGET_DRAFT": "tcp://a:1, tcp://b:2"})
    assert r.exit_code == 0, r.output
    assert seen.pop("draft") == "tcp://a:1,tcp://b:2"


def test_re_resolving_adds_new_addresses_and_retires_vanished_ones():
    answers = {"tcp://draft.svc:5555": ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]}
    pool = _pool("tcp://draft.svc:5555", resolver=lambda ep: answers[ep], resolve_interval_s=3600)
    try:
        assert list(pool.links) == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        held = pool.links["tcp://127.0.0.1:1"]
        held.sessions = 1  # a session still lives there
        answers["tcp://draft.svc:5555"] = ["tcp://127.0.0.1:2", "tcp://127.0.0.1:3"]
        pool.resolve_now()
        assert list(pool.links) == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"]
        assert held.retired and not healthy(held)  # no new sessions; closed once its last one leaves
        held.sessions = 0
        pool.resolve_now()
        assert list(pool.links) == ["tcp://127.0.0.1:2", "tcp://127.0.0.1:3"]
        answers["tcp://draft.svc:5555"] = None  # a DNS hiccup: the links stay as they are
        pool.resolve_now()
        assert list(pool.links) == ["tcp://127.0.0.1:2", "tcp://127.0.0.1:3"]
        assert not any(link.retired for link in pool.links.values())
        counters = pool.counters()
        assert set(counters["endpoints"]) == {"tcp://127.0.0.1:2", "tcp://127.0.0.1:3"}
    finally:
        pool.close()


def test_new_sessions_spread_by_prompt_and_a_shared_prefix_keeps_to_one_daemon():
    with running_server() as (a, ctx), running_server() as (b, _), _up([a, b], ctx) as pool:
        placed = {}
        for i in range(24):
            d = RemoteDraftSession(pool, pool.next_session(), SamplingParams(), 5.0)
            prompt = [3 + i, 7 + 2 * i, 11]
            assert _round(d, prompt).tokens == [12, 13, 14]
            placed[i] = d.client.endpoint
            d.close()
        assert set(placed.values()) == {a.endpoint, b.endpoint}  # 24 prompts: both take some
        shared = {RemoteDraftSession(pool, pool.next_session(), SamplingParams(), 5.0) for _ in range(6)}
        where = set()
        for i, d in enumerate(shared):
            _round(d, [5] * 40 + [i + 1])  # the same first 32 tokens
            where.add(d.client.endpoint)
            d.close()
        assert len(where) == 1
        assert pool.counters()["placements"] == 30


def test_a_clearly_busier_daemon_is_passed_over_for_new_sessions():
    with running_server() as (a, ctx), running_server() as (b, _), _up([a, b], ctx) as pool:
        busy = pool.links[a.endpoint]
        for i in range(12):
            busy.wait_s = 1.0  # as its reports would say (each reply refreshes it)
            d = RemoteDraftSession(pool, pool.next_session(), SamplingParams(), 5.0)
            _round(d, [3 + i, 9, 11])
            assert d.client.endpoint == b.endpoint
            d.close()


def test_a_session_moves_when_its_daemon_goes_and_drafts_go_on_from_its_verified_tokens():
    with running_server() as (b, ctx):
        pool = None
        try:
            with running_server(drain_s=0.2) as (a, _):  # its session stays: it leaves after 0.2 s
                pool = _pool([a.endpoint, b.endpoint], ctx=ctx)
                pool.handshake(5)
                assert _wait(lambda: all(link.up for link in pool.links.values()), pool=pool)
                d = RemoteDraftSession(pool, pool.next_session(), SamplingParams(), 5.0)
                # place it on a: b looks busy for this one placement
                pool.links[b.endpoint].wait_s = 10.0
                assert _round(d, [10, 11, 12]).tokens == [13, 14, 15]
                assert d.client.endpoint == a.endpoint and pool.links[a.endpoint].sessions == 1
                d.kept(2)
                pool.links[b.endpoint].wait_s = 0.0
            # a is gone (its connection closed; the heartbeat finds out): the next round re-opens on b
            # with every verified token
            gone = pool.links[a.endpoint]
            assert _wait(lambda: (pool.heartbeat(), not gone.up)[1], pool=pool)
            reply = _round(d, [10, 11, 12, 13, 14, 40])
            assert reply.tokens == [41, 42, 43] and d.client.endpoint == b.endpoint and d.moves == 1
            c = pool.counters()
            assert c["failovers"] == 1 and c["endpoints"][b.endpoint]["sessions"] == 1
            assert c["endpoints"][a.endpoint]["sessions"] == 0
            d.close()
        finally:
            if pool is not None:
                pool.close()


def test_a_draining_daemon_keeps_serving_until_its_sessions_move_then_exits():
    with running_server() as (b, ctx):
        with running_server(drain_s=10.0) as (a, _):
            pool = _pool([a.endpoint, b.endpoint], ctx=ctx)
            try:
                pool.handshake(5)
                assert _wait(lambda: all(link.up for link in pool.links.values()), pool=pool)
                pool.links[b.endpoint].wait_s = 10.0
                d = RemoteDraftSession(pool, pool.next_session(), SamplingParams(), 5.0)
                assert _round(d, [10, 11, 12]).tokens == [13, 14, 15] and d.client.endpoint == a.endpoint
                pool.links[b.endpoint].wait_s = 0.0
                a.stop()  # SIGTERM's path: it drains
                assert _wait(lambda: pool.links[a.endpoint].draining, pool=pool)
                assert pool.links[a.endpoint].up  # still serving what it holds
                assert a.health()[0] == 200 and a.readiness()[0] == 503
                d.kept(3)
                reply = _round(d, [10, 11, 12, 13, 14, 15, 50])  # the next round: moved, no round alone
                assert reply is not None and reply.tokens == [51, 52, 53] and d.client.endpoint == b.endpoint
                assert pool.counters()["drained"] == 1
                # its session closed there, it holds none and leaves well before its drain timeout
                assert _wait(lambda: not a.sessions.sessions and a.ingress.sock is None, timeout_s=5, pool=pool)
                d.close()
            finally:
                pool.close()


def test_a_daemon_that_refuses_this_target_is_left_out_and_the_rest_serve():
    with running_server() as (good, ctx), running_server(CountingBackend(vocab_size=32000)) as (bad, _):
        pool = _pool([bad.endpoint, good.endpoint], ctx=ctx)
        try:
            pool.handshake(5)
            assert _wait(lambda: pool.links[bad.endpoint].refusal is not None, pool=pool)
            assert "32000" in str(pool.links[bad.endpoint].refusal)
            d = RemoteDraftSession(pool, pool.next_session(), SamplingParams(), 5.0)
            assert _round(d, [10, 11]).tokens == [12, 13, 14] and d.client.endpoint == good.endpoint
            d.close()
        finally:
            pool.close()
        only_bad = _pool([bad.endpoint], ctx=ctx)
        try:
            with pytest.raises(HandshakeRefused, match="32000"):
                only_bad.handshake(5)
        finally:
            only_bad.close()


def test_the_draft_daemon_answers_health_and_readiness_on_its_metrics_port():
    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    with running_server(metrics_port=port, drain_s=5.0) as (server, ctx):
        def get(path):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()

        assert _wait(lambda: get("/health")[0] == 200)
        code, body = get("/health")
        assert json.loads(body)["status"] == "ok" and json.loads(body)["instance"] == server.instance
        assert get("/ready")[0] == 200
        assert b"starsd_draftd" in get("/metrics")[1]
        assert get("/nope")[0] == 404
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        peer.open(1, [5, 6])  # a session: the drain waits for it
        assert peer.draft(1, 1, 0, [], 2).header["tokens"]
        server.stop()
        assert _wait(lambda: get("/ready")[0] == 503)
        code, body = get("/health")
        assert code == 200 and json.loads(body)["status"] == "draining"
        peer.send(Message(MsgType.CLOSE, {"session": 1}))  # its last session gone, it leaves


def test_every_link_waits_the_pools_ack_timeout_at_least():
    """``--ack-timeout`` reaches each daemon's link: a fast measured round trip still waits the floor."""
    from starsd_target.config import TargetConfig
    from starsd_target.rtt import ACK_FLOOR_S

    assert TargetConfig().ack_timeout_s == ACK_FLOOR_S  # the default is the link's own floor
    pool = _pool(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], ack_floor_s=0.3)
    try:
        assert len(pool.links) == 2
        for link in pool.links.values():
            link.ack_rtt.observe(0.001)
            assert link.ack_deadline_s(2.0) == pytest.approx(0.3)
    finally:
        pool.close()
    default = _pool(["tcp://127.0.0.1:1"])
    try:
        link = next(iter(default.links.values()))
        link.ack_rtt.observe(0.001)
        assert link.ack_deadline_s(2.0) == pytest.approx(ACK_FLOOR_S)
    finally:
        default.close()
