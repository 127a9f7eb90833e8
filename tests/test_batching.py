"""Batched drafting: several sessions drafted with one forward per step give the same drafts,
and leave the same caches behind, as drafting them one at a time."""

import random

import pytest
import torch

from common.models import load_causal_lm
from common.verify import SamplingParams
from starsd_draftd.backends.base import DraftRequest
from starsd_draftd.backends.model import ModelBackend
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
