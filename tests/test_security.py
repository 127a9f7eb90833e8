"""CURVE: only allowed keys get answers; sessions follow the authenticated key; SIGHUP-style reload."""

import shutil
import time

import pytest
import zmq

from common import protocol as P
from common.protocol import ErrorCode, Message, MsgType
from common.security import client_keys, keygen, server_keys
from common.sockets import SocketOptions, make_socket
from fakes import CountingBackend
from starsd_draftd.server import DraftServer, ServerConfig
import threading


@pytest.fixture
def keys(tmp_path):
    keygen(tmp_path / "server", "draftd")
    keygen(tmp_path / "targets", "good")
    keygen(tmp_path / "targets", "stranger")
    allow = tmp_path / "allow"
    allow.mkdir()
    shutil.copy(tmp_path / "targets" / "good.key", allow / "good.key")
    return tmp_path, allow


@pytest.fixture
def curve_server(keys):
    root, allow = keys
    ctx = zmq.Context()
    server = DraftServer(CountingBackend(), ServerConfig(bind="tcp://127.0.0.1:0",
                                                         curve_secret=root / "server" / "draftd.key_secret",
                                                         curve_allow=allow), ctx)
    server.bind()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server, ctx, root, allow
    server.stop()
    t.join(10)
    ctx.destroy(linger=0)


def peer(ctx, endpoint, curve=None):
    sock = make_socket(ctx, zmq.DEALER, SocketOptions(curve=curve))
    sock.connect(endpoint)
    return sock


def ask(sock, msg, timeout_ms=1500):
    try:
        # never block: a peer whose CURVE handshake failed has no connection to queue on
        sock.send_multipart(P.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        return None
    while sock.poll(timeout_ms):
        reply = P.decode(sock.recv_multipart())
        if reply.type is not MsgType.ACK:  # a queued draft request's acknowledgement comes first
            return reply
    return None


HELLO = Message(MsgType.HELLO, {"vocab_size": 259, "tokenizer": "fake-tok"})


def test_allowed_key_works_others_get_nothing(curve_server):
    server, ctx, root, allow = curve_server
    server_key = root / "server" / "draftd.key"
    good = peer(ctx, server.endpoint, client_keys(root / "targets" / "good.key_secret", server_key))
    assert ask(good, HELLO).type is MsgType.WELCOME
    stranger = peer(ctx, server.endpoint, client_keys(root / "targets" / "stranger.key_secret", server_key))
    assert ask(stranger, HELLO) is None
    plain = peer(ctx, server.endpoint)
    assert ask(plain, HELLO) is None
    assert ask(plain, Message(MsgType.STATS)) is None
    s = server.snapshot()
    assert s["peers"] == 1 and s["live_sessions"] == 0
    # a peer that thinks the server has another key fails the CURVE handshake as well
    wrong = peer(ctx, server.endpoint, client_keys(root / "targets" / "good.key_secret",
                                                   root / "targets" / "stranger.key"))
    assert ask(wrong, HELLO) is None


def test_sessions_follow_the_key_across_connections(curve_server):
    server, ctx, root, allow = curve_server
    keys = client_keys(root / "targets" / "good.key_secret", root / "server" / "draftd.key")
    first = peer(ctx, server.endpoint, keys)
    assert ask(first, HELLO).type is MsgType.WELCOME
    first.send_multipart(P.encode(Message(MsgType.OPEN, {"session": 1, "prompt": [10],
                                                         "sampling": {"temperature": 0.0}})))
    first.close(linger=0)
    # the same key on a new connection reaches its session once that connection has said HELLO
    # (replies go to the new connection)
    second = peer(ctx, server.endpoint, keys)
    draft = Message(MsgType.DRAFT, {"session": 1, "seq": 1, "accepted": 0, "new": [], "pos": 1, "depth": 2})
    r = ask(second, draft)
    assert r.type is MsgType.ERROR and ErrorCode(r.header["code"]) is ErrorCode.NO_HANDSHAKE
    assert ask(second, HELLO).type is MsgType.WELCOME
    r = ask(second, draft)
    assert r.type is MsgType.DRAFTED and r.header["tokens"] == [11, 12]


def test_reload_admits_new_keys(curve_server):
    server, ctx, root, allow = curve_server
    keys = client_keys(root / "targets" / "stranger.key_secret", root / "server" / "draftd.key")
    sock = peer(ctx, server.endpoint, keys)
    assert ask(sock, HELLO) is None
    sock.close(linger=0)
    shutil.copy(root / "targets" / "stranger.key", allow / "stranger.key")
    server.reload_keys()  # what SIGHUP does
    deadline = time.monotonic() + 5
    while server.snapshot()["key_reloads"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    sock = peer(ctx, server.endpoint, keys)
    assert ask(sock, HELLO, timeout_ms=5000).type is MsgType.WELCOME


def test_keygen_refuses_overwrite_and_protects_secret(tmp_path):
    pub, sec = keygen(tmp_path, "a")
    assert oct(sec.stat().st_mode & 0o777) == "0o600"
    assert server_keys(sec).public == client_keys(sec, pub).server_public
    with pytest.raises(FileExistsError):
        keygen(tmp_path, "a")
    with pytest.raises(ValueError, match="no secret"):
        server_keys(pub)


def test_config_errors():
    with pytest.raises(ValueError, match="both"):
        DraftServer(CountingBackend(), ServerConfig(curve_allow=None, curve_secret="x"))
