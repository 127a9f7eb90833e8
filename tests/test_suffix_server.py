"""Suffix drafts in the draft daemon's loop, over real sockets with a fake backend: which requests
they answer and how, what the backend is spared, sampled and seeded sessions, features, and one
CURVE key's text kept from another."""

import contextlib
import shutil
import threading

import numpy as np
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from common import protocol as P
from common.protocol import Message, MsgType
from common.security import client_keys, keygen
from common.tensors import to_wire
from fakes import CountingBackend, RawPeer, running_server
from starsd_draftd.server import DraftServer, ServerConfig
from test_suffix import SECRET


def _report(peer: RawPeer, sid: int, prompt: list[int], output: list[int], step: int = 4) -> None:
    """A session that verified ``output`` after ``prompt``, reported a few tokens a round (the
    target kept none of the drafts)."""
    peer.open(sid, prompt)
    pos, seq = len(prompt), 1
    assert peer.draft(sid, seq, 0, [], pos, depth=2).type is MsgType.DRAFTED
    for i in range(0, len(output), step):
        chunk = output[i: i + step]
        seq, pos = seq + 1, pos + len(chunk)
        assert peer.draft(sid, seq, 0, chunk, pos, depth=2).type is MsgType.DRAFTED


class Calls(CountingBackend):
    """Counts the requests the backend drafted."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def draft(self, state, verified, depth, new_features=None):
        self.calls += 1
        return super().draft(state, verified, depth, new_features)


@contextlib.contextmanager
def _secret_seen():
    """A daemon (suffix drafts on, a counting backend) whose session 1 produced SECRET, and a
    peer: (server, peer, backend)."""
    backend = Calls()
    with running_server(backend, suffix=True, max_depth=16) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET)
        yield server, peer, backend


def test_a_session_quoting_an_earlier_output_gets_it_as_drafts_without_the_backend():
    with _secret_seen() as (server, peer, backend):
        calls = backend.calls
        peer.open(2, [6, *SECRET[:8]])
        r = peer.draft(2, 1, 0, [], 9, depth=16)
        assert r.header["tokens"] == SECRET[8:16] and backend.calls == calls  # its match is 8 long: 8 drafts
        session = next(s for s in server.sessions.sessions.values() if s.key[1] == 2)
        assert session.backend_held == 0  # so its next request is charged its whole text to feed
        assert "q_ids" not in r.tensors and "parents" not in r.tensors  # a greedy chain
        # all eight kept, then the target's own token: learnt, and drafted on
        r = peer.draft(2, 2, 8, [7], 18, depth=4)
        snap = server.snapshot()["suffix"]
        assert snap["requests"] == 1 and snap["tokens"] == 8 and snap["kept"] == 8
        assert snap["requests_held"] == 2 and snap["tokens_indexed"] == len(SECRET) + 9  # both outputs
        assert r.header["tokens"] == [8, 9, 10, 11]  # nothing after "..., 90, 7" was seen: the backend's
        registry = CollectorRegistry()
        registry.register(server.metrics)
        exposed = generate_latest(registry).decode()
        assert "starsd_draftd_suffix_requests_total 1.0" in exposed
        assert 'starsd_draftd_suffix_tokens_total{outcome="kept"} 8.0' in exposed


def test_a_copied_chain_stops_at_the_targets_min_chance_not_its_min_survival():
    """min_survival prices a draft model's token (drafting and verification); a copied token costs
    no drafting, so the target's lower min_chance is its floor. Text seen once: each copied token
    has a chance of 1/2."""
    with _secret_seen() as (server, peer, backend):
        calls = backend.calls
        for sid, extra, copied in [(2, {"min_survival": 0.6}, False),  # 1/2 < 0.6: the backend drafts
                                   (3, {"min_survival": 0.6, "min_chance": 0.4}, True),
                                   (4, {"min_survival": 0.3, "min_chance": 0.55}, False)]:
            peer.open(sid, [6, *SECRET[:8]])
            r = peer.draft(sid, 1, 0, [], 9, depth=16, **extra)
            assert (r.header["tokens"] == SECRET[8:16]) is copied, extra
        assert backend.calls == calls + 2  # sessions 2 and 4


def test_a_tree_where_the_target_asks_for_one_and_one_hot_q_for_sampled_sessions():
    with running_server(suffix=True, max_depth=8) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET[:12])
        _report(peer, 2, [1, 2], SECRET[:6] + [33, 34, 35, 36])
        peer.open(3, [9, *SECRET[:6]])
        peer.send(Message(MsgType.DRAFT, {"session": 3, "seq": 1, "accepted": 0, "new": [], "pos": 7, "depth": 6,
                                          "tree_tokens": 12}))
        r = peer.recv()
        assert r.header["tokens"][0] in (SECRET[6], 33) and "parents" in r.tensors
        assert set(r.header["tokens"]) == set(SECRET[6:12]) | {33, 34, 35, 36}  # both branches
        assert r.tensors["parents"].tolist().count(-1) == 2
        peer.open(4, [9, *SECRET[:8]], temperature=0.9)  # sampled: a chain, each q one-hot
        r = peer.draft(4, 1, 0, [], 9, depth=6)
        k = len(r.header["tokens"])
        assert r.header["tokens"] == SECRET[8:8 + k] and k >= 2
        assert r.tensors["q_ids"].reshape(-1).tolist() == r.header["tokens"]
        assert np.all(r.tensors["q_probs"] == 1.0) and r.tensors["q_probs"].shape == (k, 1)


def test_a_seeded_sampled_session_drafts_from_its_own_text_only():
    with running_server(suffix=True) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET)
        peer.send(Message(MsgType.OPEN, {"session": 2, "prompt": [9, *SECRET[:6]],
                                         "sampling": {"temperature": 0.9, "seed": 7}}))
        r = peer.draft(2, 1, 0, [], 7, depth=4)
        assert r.header["tokens"] == [SECRET[5] + i for i in (1, 2, 3, 4)]  # the backend's, not SECRET's
        assert server.snapshot()["suffix"]["requests"] == 0


class FeatureCounting(CountingBackend):
    """A backend that takes target features (EAGLE's contract: the session holds one per
    verified token but the last) and records how many each call brought."""

    feature_size = 4

    def __init__(self):
        super().__init__()
        self.brought = []

    def new_state(self, params):
        return {"calls": 0, "features": 0}

    def draft(self, state, verified, depth, new_features=None):
        m = 0 if new_features is None else int(new_features.shape[0])
        assert state["features"] + m == len(verified) - 1, "features lost or doubled"
        state["features"] += m
        self.brought.append(m)
        return super().draft(state, verified, depth)


def test_features_of_rounds_a_suffix_draft_answered_reach_the_backend_next_time():
    backend = FeatureCounting()
    with running_server(backend, suffix=True, max_depth=8) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.send(Message(MsgType.HELLO, {"vocab_size": 259, "tokenizer": "fake-tok", "feature_size": 4}))
        assert peer.recv().type is MsgType.WELCOME

        def draft(sid, seq, new, pos, feats, accepted=0, depth=2, bf16=False):
            f = np.zeros((feats, 4), dtype=np.float32)
            if bf16:  # a target may send bfloat16 features one round and float32 the next
                f = to_wire(torch.zeros((feats, 4), dtype=torch.bfloat16))
            peer.send(Message(MsgType.DRAFT, {"session": sid, "seq": seq, "accepted": accepted, "new": new,
                                              "pos": pos, "depth": depth}, {"features": f}))
            return peer.recv()

        peer.open(1, [1, 2])
        for seq, new, pos, feats in ((1, [], 2, 1), (2, SECRET[:8], 10, 8), (3, SECRET[8:], 18, 8)):
            assert draft(1, seq, new, pos, feats).type is MsgType.DRAFTED
        peer.open(2, [9, *SECRET[:6]])
        r = draft(2, 1, [], 7, 6, depth=6, bf16=True)
        assert r.header["tokens"] == SECRET[6:12]  # answered from the text: the backend got nothing
        brought = len(backend.brought)
        r = draft(2, 2, [42], 10, 3, accepted=2, depth=2)  # two kept, then the target's 42
        assert backend.brought[brought:] == [9]  # the six held back and the three new, at once
        assert r.header["tokens"] == [43, 44]


@pytest.fixture
def two_keys(tmp_path):
    keygen(tmp_path / "server", "draftd")
    allow = tmp_path / "allow"
    for name in ("a", "b"):
        keygen(tmp_path / "targets", name)
        allow.mkdir(exist_ok=True)
        shutil.copy(tmp_path / "targets" / f"{name}.key", allow / f"{name}.key")
    return tmp_path, allow


def _curve_server(root, allow, share):
    ctx = zmq.Context()
    server = DraftServer(CountingBackend(), ServerConfig(
        bind="tcp://127.0.0.1:0", curve_secret=root / "server" / "draftd.key_secret", curve_allow=allow,
        suffix=True, suffix_share=share, max_depth=8, drain_s=0.0), ctx)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, ctx, thread


@pytest.mark.parametrize("share", ["key", "all"])
def test_one_keys_outputs_never_draft_for_another_unless_shared_by_all(two_keys, share):
    root, allow = two_keys
    server, ctx, thread = _curve_server(root, allow, share)
    try:
        peers = {}
        for name in ("a", "b"):
            peers[name] = RawPeer(ctx, server.endpoint, client_keys(root / "targets" / f"{name}.key_secret",
                                                                       root / "server" / "draftd.key"))
            assert peers[name].hello().type is MsgType.WELCOME
        _report(peers["a"], 1, [1, 2], SECRET)  # A's output: SECRET
        _report(peers["b"], 1, [3, 4], [70, 71, 72, 73])  # B's own output
        b = peers["b"]
        b.open(2, [9, *SECRET[:6]])  # B quotes the start of A's output
        got = b.draft(2, 1, 0, [], 7, depth=6).header["tokens"]
        only_a = set(SECRET[6:]) - set(range(SECRET[5] + 1, SECRET[5] + 7))
        if share == "key":
            assert not set(got) & only_a, got  # nothing of what only A produced
            assert got == [SECRET[5] + i for i in range(1, 7)]  # the backend's drafts
        else:
            assert got == SECRET[6:12]
        # A itself drafts from its own key's outputs either way
        a = peers["a"]
        a.open(2, [9, *SECRET[:6]])
        assert a.draft(2, 1, 0, [], 7, depth=6).header["tokens"] == SECRET[6:12]
    finally:
        server.stop()
        thread.join(10)
        ctx.destroy(linger=0)


def test_no_suffix_drafts_when_turned_off():
    backend = Calls()
    with running_server(backend, suffix=False) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET)
        peer.open(2, [6, *SECRET[:8]])
        assert peer.draft(2, 1, 0, [], 9, depth=4).header["tokens"] == [SECRET[7] + i for i in (1, 2, 3, 4)]
        assert "suffix" not in server.snapshot() or server.snapshot()["suffix"]["requests"] == 0


def test_protocol_frames_of_a_suffix_reply_decode_as_any_other():
    """A suffix draft's reply is an ordinary DRAFTED message (nothing new on the wire)."""
    with running_server(suffix=True, max_depth=8) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET)
        peer.open(2, [6, *SECRET[:8]], temperature=0.7)
        peer.send(Message(MsgType.DRAFT, {"session": 2, "seq": 1, "accepted": 0, "new": [], "pos": 9, "depth": 4}))
        frames = peer.sock.recv_multipart()
        while P.decode(frames).type is MsgType.ACK:
            frames = peer.sock.recv_multipart()
        msg = P.decode(frames)
        assert msg.type is MsgType.DRAFTED and msg.tensors["q_ids"].dtype == np.int32


def test_a_suffix_draft_answers_before_the_backends_work_ahead():
    """A session whose next round the backend drafted ahead (and guessed right) gets the suffix
    draft where it scores above what the backend's drafts keep: the work ahead is superseded."""
    from test_lookahead import VOCAB, ScriptedBackend, _wait

    backend = ScriptedBackend()
    with running_server(backend, suffix=True, max_depth=8) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        assert peer.hello(VOCAB).type is MsgType.WELCOME
        copied = [21, 22, 23, 24, 70, 71, 72, 73, 74, 75, 76, 77]
        _report(peer, 1, [1, 2], [5, 6, 40, *copied, 8, 9])  # another session's output holds the text
        peer.open(2, [10, 20])
        la = server.snapshot()["lookahead"]
        assert peer.draft(2, 1, 0, [], 2, depth=3).header["tokens"] == [21, 22, 23]  # nothing to copy yet
        # its next round drafted ahead: the guess and three drafts, done
        _wait(lambda: server.stats.lookahead["steps"] >= la["steps"] + 4 and not server.lookahead.pending)
        assert server.stats.lookahead["started"] == la["started"] + 1
        calls = backend.draft_calls
        # all three kept and 24 added: the work ahead guessed it, but the earlier output goes on with 70...
        r = peer.draft(2, 2, 3, [24], 6, depth=8)
        assert r.header["tokens"] == [70, 71, 72, 73] and backend.draft_calls == calls  # its match is 4 long
        _wait(lambda: server.stats.lookahead["superseded"] == la["superseded"] + 1)  # counted after the reply left
        now = server.snapshot()["lookahead"]
        assert now["hits"] == now["late_hits"] == 0 and now["misses"] == la["misses"]
        peer.sock.close(0)


class Feeds(Calls):
    """Feeds prompts in chunks (``prefills``): counts the chunks and what it holds of each session."""

    prefills = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.chunks = 0

    def prefill(self, state, verified, budget):
        self.chunks += 1
        held = state.get("held", 0)
        upto = min(len(verified) - 1, held + budget)
        state["held"] = upto
        return upto - held, len(verified) - upto


def test_a_prompt_fed_in_chunks_is_not_charged_again_after_a_suffix_answer():
    """A long prompt is fed to the backend in chunks, then its request answered from the suffix
    index; the session's next request brings four tokens and is charged those (and the prompt's
    last), not the whole prompt again: it needs no chunk fed before its drafts (which cost a
    forward on the round's critical path: 5-60 ms a round on the agentic bench's demo draft)."""
    backend = Feeds()
    with running_server(backend, suffix=True, max_depth=16, batch_prefill_tokens=8) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET)
        prompt = [6, 7, 5, 4, 3, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, *SECRET[:8]]
        peer.open(2, prompt)
        r = peer.draft(2, 1, 0, [], len(prompt), depth=16)
        assert r.header["tokens"] == SECRET[8:16]  # from the index
        chunks, calls = backend.chunks, backend.calls
        assert chunks >= 3 and server.snapshot()["prefill_chunks"] == chunks
        session = next(s for s in server.sessions.sessions.values() if s.key[1] == 2)
        assert session.backend_held == session.state["held"] >= len(prompt) - 8  # what the chunks fed
        r = peer.draft(2, 2, 4, [SECRET[12]], len(prompt) + 5, depth=16)
        assert r.type is MsgType.DRAFTED and r.header["tokens"][:3] == SECRET[13:16]
        assert backend.chunks == chunks and backend.calls == calls  # no chunk, no model draft: the index's


def _lagging(server, peer, prompt: list[int], sampling: dict | None = None) -> object:
    """Session 2, whose first request the suffix index answers (``prompt`` ends in SECRET's
    first 8 tokens, which it has seen before): its draft model has taken in none of its prompt.
    Returns the session."""
    peer.send(Message(MsgType.OPEN, {"session": 2, "prompt": prompt, "sampling": sampling or {"temperature": 0.0}}))
    r = peer.draft(2, 1, 0, [], len(prompt), depth=16)
    assert r.header["tokens"] == SECRET[8:16]  # the index's
    return next(s for s in server.sessions.sessions.values() if s.key[1] == 2)


def test_idle_passes_feed_what_suffix_answered_sessions_missed():
    """A session the suffix index answered lags its draft model by its prompt; with nothing
    queued the daemon feeds those tokens (all but the last, drafting's), so the model's next
    drafting for it is charged one round's tokens, not the whole lag, on the target's critical
    path."""
    from test_lookahead import _wait

    backend = Feeds()
    with running_server(backend, suffix=True, max_depth=16) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET)
        calls = backend.calls
        session = _lagging(server, peer, [6, *SECRET[:8]])
        assert backend.calls == calls
        _wait(lambda: server.snapshot()["catch_up"]["tokens"] == 8)
        cu = server.snapshot()["catch_up"]
        assert cu["feeds"] == 1 and backend.chunks == 1 and session.state["held"] == 8
        assert session.backend_held == 8  # its next request is charged its own tokens only
        r = peer.draft(2, 2, 8, [7], 18, depth=4)  # nothing follows "..., 90, 7": the backend drafts
        assert r.header["tokens"] == [8, 9, 10, 11] and backend.calls == calls + 1
        registry = CollectorRegistry()
        registry.register(server.metrics)
        assert "starsd_draftd_catch_up_tokens_total 8.0" in generate_latest(registry).decode()


@pytest.mark.parametrize("sampling, cfg", [({"temperature": 0.7, "seed": 5}, {}), (None, {"lookahead": False})],
                         ids=["seeded-sampled", "no-lookahead"])
def test_no_idle_feeds_for_seeded_sessions_or_without_lookahead(sampling, cfg):
    """A seeded sampled session's drafts must not depend on when idle passes ran (how its text is
    split into forwards changes their last bits); --no-lookahead turns idle work off. (A seeded
    session's suffix drafts come from its own text: its prompt holds SECRET.)"""
    from test_lookahead import _wait

    backend = Feeds()
    with running_server(backend, suffix=True, max_depth=16, **cfg) as (server, ctx):
        peer = RawPeer(ctx, server.endpoint)
        peer.hello()
        _report(peer, 1, [1, 2], SECRET)
        prompt = [*SECRET, 6, *SECRET[:8]]
        session = _lagging(server, peer, prompt, sampling)
        r = peer.draft(2, 2, 0, [SECRET[8]], len(prompt) + 1, depth=4)
        assert r.type is MsgType.DRAFTED
        for _ in range(3):  # passes begun after the reply: an idle feed noted with it has run by the last
            mark = server.last_pass
            _wait(lambda: server.last_pass > mark)
        assert server.snapshot()["catch_up"]["feeds"] == 0 and backend.chunks == 0 and "held" not in session.state


def test_a_seeded_sessions_prompt_is_never_split_where_another_left_room():
    """The prefill budget: a request that does not fit what the batch's earlier requests left
    gets a chunk of its prompt fed, which splits the prompt where they left room. A seeded
    sampled session's drafts must not depend on what else was queued, so its prompt, when a
    whole budget holds it, waits for the next batch instead; a longer one is split at whole
    budgets from its start, whatever else came."""
    from common.verify import SamplingParams
    from starsd_draftd.records import QueuedRequest
    from starsd_draftd.sessions import Session

    server = DraftServer(Feeds(), ServerConfig(bind="tcp://127.0.0.1:0", batch_prefill_tokens=16, suffix=False))
    items = []
    for sid, (params, fed) in enumerate([(SamplingParams(), 10), (SamplingParams(temperature=0.8, seed=1), 12),
                                         (SamplingParams(temperature=0.8), 12), (SamplingParams(temperature=0.8,
                                                                                                seed=2), 30)]):
        server.sessions.sessions[(b"p", sid)] = Session((b"p", sid), params, None, [1] * fed)
        items.append(QueuedRequest(b"i", b"p", Message(MsgType.DRAFT, {"session": sid}), 0, "a", 0.0, 0.0, fed))
    # 10 fits; the seeded 12 would be split at the 6 left: it waits; the unseeded 12 gets the chunk
    assert server._within_budget(items, [0, 1, 2]) == ([0], items[2])
    assert server._within_budget(items, [0, 1]) == ([0], None)
    assert server._within_budget(items, [1, 0]) == ([1], items[0])  # first in a batch, it fits whole
    # a seeded prompt longer than a whole budget is fed in whole budgets from its start
    assert server._within_budget(items, [0, 3]) == ([0], items[3])
