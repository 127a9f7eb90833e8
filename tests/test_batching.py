"""Batched drafting: several sessions drafted with one forward per step give the same drafts,
and leave the same caches behind, as drafting them one at a time."""

import random
import time

import pytest
import torch

from common.models import load_causal_lm
from common.protocol import Message, MsgType
from common.verify import SamplingParams
from starsd_draftd.backends.base import DraftRequest
from starsd_draftd.backends.model import ModelBackend
from fakes import CountingBackend, RawPeer, running_server
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def backend(request, tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3, hidden=32, layers=2)
    return ModelBackend(load_causal_lm(str(d)))


def _script(seed, n_sessions=5, rounds=6):
    """Per session: a prompt, then per round (tokens kept of the previous draft, new tokens, depth)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sessions):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
        steps = [(rng.randrange(0, 5), [rng.randrange(3, 250) for _ in range(rng.randrange(1, 3))],
                  rng.randrange(1, 6)) for _ in range(rounds)]
        out.append((prompt, steps))
    return out


def _run(backend, script, params, batched):
    states = [backend.new_state(params) for _ in script]
    verified = [list(p) for p, _ in script]
    last = [[] for _ in script]
    drafts_log = []
    for r in range(len(script[0][1])):
        reqs = []
        for i, (_, steps) in enumerate(script):
            keep, new, depth = steps[r]
            verified[i] += last[i][: min(keep, len(last[i]))] + new
            reqs.append(DraftRequest(states[i], list(verified[i]), depth))
        drafts = backend.draft_many(reqs) if batched else [backend.draft(q.state, q.verified, q.depth) for q in reqs]
        for i, d in enumerate(drafts):
            last[i] = d.tokens
        drafts_log.append([d.tokens for d in drafts])
    return drafts_log, states


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_greedy_drafts_equal_one_at_a_time(backend, seed):
    script = _script(seed)
    one, s1 = _run(backend, script, SamplingParams(), batched=False)
    many, s2 = _run(backend, script, SamplingParams(), batched=True)
    assert one == many
    for a, b in zip(s1, s2):
        assert a.cached == b.cached
        assert a.cache.get_seq_length() == b.cache.get_seq_length() == len(a.cached)
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert torch.allclose(la.keys, lb.keys, atol=1e-4)


def test_batched_sampling_keeps_each_sessions_own_generator(backend):
    script = _script(5, n_sessions=3, rounds=3)
    params = SamplingParams(temperature=1.0, top_k=20, seed=9)
    one, _ = _run(backend, script, params, batched=False)
    many, _ = _run(backend, script, params, batched=True)
    assert one == many


# ---------------------------------------------------------------- the batch window (server loop)
class BatchRecorder(CountingBackend):
    """Records the size of every batch the server drafts."""

    def __init__(self):
        super().__init__()
        self.batches: list[int] = []

    def draft_many(self, requests):
        self.batches.append(len(requests))
        return super().draft_many(requests)


def _round(peer: RawPeer, sid: int, seq: int, pos: int) -> None:
    peer.send(Message(MsgType.DRAFT, {"session": sid, "seq": seq, "accepted": 0, "new": [] if seq == 1 else [7],
                                      "pos": pos, "depth": 2}))


def _reply(peer: RawPeer) -> Message:
    msg = peer.recv(10.0)
    assert msg is not None and msg.type is MsgType.DRAFTED, msg
    return msg


@pytest.mark.parametrize("window_s", [0.0, 3.0])
def test_batch_window_waits_only_for_sessions_due_back(window_s):
    """Two targets that always answer at once: with a window, the one that comes back 0.2 s
    late is waited for (one batch of 2); without, the loop drafts at once (two batches)."""
    be = BatchRecorder()
    with running_server(be, batch_max=8, batch_window_s=window_s) as (server, ctx):
        a, b = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        for p in (a, b):
            p.hello()
        a.open(1, [3, 4])
        b.open(1, [5, 6])
        pos = 2
        for seq in (1, 2, 3):  # the daemon learns that both come back at once
            _round(a, 1, seq, pos)
            _round(b, 1, seq, pos)
            _reply(a)
            _reply(b)
            pos += 1
        before = len(be.batches)
        _round(a, 1, 4, pos)
        time.sleep(0.2)
        _round(b, 1, 4, pos)
        _reply(a)
        _reply(b)
        last = be.batches[before:]
        if window_s:
            assert last == [2]
            assert server.snapshot()["batch_waits"] >= 1
        else:
            assert last == [1, 1]
            assert server.snapshot()["batch_waits"] == 0


def test_batch_window_never_holds_a_lone_session():
    be = BatchRecorder()
    with running_server(be, batch_max=8, batch_window_s=3.0) as (server, ctx):
        a = RawPeer(ctx, server.endpoint)
        a.hello()
        a.open(1, [3, 4])
        for seq in range(1, 6):
            _round(a, 1, seq, 1 + seq)
            _reply(a)
        assert server.snapshot()["batch_waits"] == 0  # nobody else is due: no pass waited


def test_batch_window_gives_up_on_a_session_that_does_not_come_back():
    be = BatchRecorder()
    with running_server(be, batch_max=8, batch_window_s=0.3) as (server, ctx):
        a, b = RawPeer(ctx, server.endpoint), RawPeer(ctx, server.endpoint)
        for p in (a, b):
            p.hello()
        a.open(1, [3, 4])
        b.open(1, [5, 6])
        for seq in (1, 2):
            for p in (a, b):
                _round(p, 1, seq, 1 + seq)
            for p in (a, b):
                _reply(p)
        _round(a, 1, 3, 4)  # b has stopped for good: a is served alone once the window passes
        assert _reply(a).header["seq"] == 3
        assert be.batches[-1] == 1 and server.snapshot()["batch_waits"] >= 1


def test_a_prompt_fed_in_chunks_drafts_what_a_whole_one_does(near_draft):
    """The draft daemon's prefill budget feeds a long prompt a chunk per pass
    (``ModelBackend.prefill``); the drafts that follow equal those of the prompt fed at once,
    greedy and seeded sampled."""
    backend = ModelBackend(load_causal_lm(str(near_draft)))
    prompt = [3 + (7 * i) % 240 for i in range(77)]
    for params in (SamplingParams(), SamplingParams(temperature=0.9, seed=3)):
        whole, chunked = backend.new_state(params), backend.new_state(params)
        steps = [backend.prefill(chunked, prompt, 30) for _ in range(4)]
        assert steps == [(30, 47), (30, 17), (16, 1), (0, 1)]  # the last token is left to drafting
        assert backend.draft(chunked, prompt, 4).tokens == backend.draft(whole, prompt, 4).tokens


def test_the_model_backend_says_what_its_cache_holds_the_kept_drafts_included(near_draft):
    """``held``: what an idle feed (``LookaheadServing.catch_up``) need not feed again: the
    prompt fed, and of a chain drafted after it the drafts the target kept (the cache took all
    but the last draft in)."""
    backend = ModelBackend(load_causal_lm(str(near_draft)))
    prompt = [3 + (7 * i) % 240 for i in range(20)]
    state = backend.new_state(SamplingParams())
    assert backend.held(state, prompt) == 0
    assert backend.prefill(state, prompt, 8) == (8, 12) and backend.held(state, prompt) == 8
    d = backend.draft(state, prompt, 4).tokens
    assert backend.held(state, prompt + d[:2] + [5]) == len(prompt) + 2  # two kept, then the target's own
    assert backend.held(state, prompt + d + [5]) == len(prompt) + 3  # the last draft was never fed
    assert backend.held(state, prompt[:10] + [250]) == 10  # another text from the 11th token on


def test_a_seeded_sampled_session_drafts_the_same_bits_in_a_batch_as_alone(backend):
    """Which sessions share a batch depends on timing; a seeded session's drafts (their q too,
    which its target's acceptance reads) must not: it is drafted on its own."""
    seeded = SamplingParams(temperature=0.9, seed=3)
    prompt, other = [3 + (7 * i) % 240 for i in range(100)], [5 + (11 * i) % 200 for i in range(37)]
    alone = backend.draft(backend.new_state(seeded), prompt, 4)
    batched, _ = backend.draft_many([DraftRequest(backend.new_state(seeded), prompt, 4),
                                     DraftRequest(backend.new_state(SamplingParams(temperature=0.9)), other, 4)])
    assert batched.tokens == alone.tokens
    assert torch.equal(torch.as_tensor(batched.q_ids), torch.as_tensor(alone.q_ids))
    assert torch.equal(torch.as_tensor(batched.q_probs), torch.as_tensor(alone.q_probs))
