"""The suffix index's next token in the model backend's greedy steps: what it proposes, and that
speculation with it stays exact."""

import numpy as np
import pytest

from common.models import load_causal_lm
from common.verify import SamplingParams
from fakes import running_server, speculate
from starsd_draftd.backends.base import DraftRequest
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.suffix import SuffixIndex
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from tiny_models import reference_greedy


def test_next_token_is_what_followed_the_longest_match_most_often_then_latest():
    index = SuffixIndex()

    def look(seq):
        return index.next_token(None, seq)

    a = lambda *xs: np.array(xs, dtype=np.int64)  # noqa: E731
    assert look(a(5, 6, 7, 9, 5, 6, 7)) == 9  # "5 6 7" occurred before, followed by 9
    assert look(a(1, 2, 8, 1, 2, 9, 4, 1, 2)) == 9  # the latest occurrence wins a tie
    assert look(a(1, 2, 8, 1, 2, 8, 1, 2, 9, 4, 1, 2)) == 8  # the most frequent wins
    assert look(a(3, 4, 0, 7, 4, 1, 3, 4)) == 0  # a 2-token match when no 3-token one exists
    assert look(a(9, 4, 0, 7, 3, 4)) is None  # one matching token is not enough (MIN_MATCH = 2)
    assert look(a(1, 2, 3)) is None and look(a(4)) is None and look(a(2, 2)) is None
    assert look(a(2, 2, 2)) == 2  # the suffix itself is never its own match, an earlier overlap is
    with pytest.raises(ValueError, match="share"):
        SuffixIndex(share="everyone")


@pytest.fixture(scope="module")
def draft_model(tiny_draft):
    return load_causal_lm(str(tiny_draft))


def test_greedy_drafts_copy_a_repeated_context_single_and_batched(draft_model):
    backend = ModelBackend(draft_model, lookup=SuffixIndex())
    fed = []
    forward = backend._forward
    backend._forward = lambda st, tokens: fed.append(list(tokens)) or forward(st, tokens)
    rep = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43]
    st = backend.new_state(SamplingParams())
    d = backend.draft(st, rep, 4)
    assert d.tokens == [44, 45, 40, 41] and backend.lookup_hits == 4
    assert fed == []  # copied tokens cost no forward
    # the next request (all four kept, then a token the context never had): one forward feeds the
    # whole backlog, and the model picks what follows it
    nxt = rep + d.tokens + [7]
    plain = ModelBackend(draft_model)
    want = plain.draft(plain.new_state(SamplingParams()), nxt, 1).tokens
    assert SuffixIndex().next_token(None, np.array(nxt, dtype=np.int64)) is None  # "43 7" never occurred: the model picks
    assert backend.draft(st, nxt, 1).tokens == want and fed == [nxt]
    backend._forward = forward
    # batched: the same drafts, beside a session with nothing to copy (the model's own picks)
    plain = ModelBackend(draft_model)
    other = [7, 9, 11, 13, 17]
    alone = plain.draft(plain.new_state(SamplingParams()), other, 3)
    before = backend.counters()
    both = backend.draft_many([DraftRequest(backend.new_state(SamplingParams()), rep, 4),
                               DraftRequest(backend.new_state(SamplingParams()), other, 3)])
    assert both[0].tokens == [44, 45, 40, 41]
    after = backend.counters()
    assert after["lookup_hits"] - before["lookup_hits"] == 4 and after["model_picks"] - before["model_picks"] == 3
    # nothing to copy anywhere along the model's chain: exactly the model's chain
    assert all(SuffixIndex().next_token(None, np.array(other + alone.tokens[:j], dtype=np.int64)) is None
               for j in range(3))
    assert both[1].tokens == alone.tokens


def test_sampled_sessions_draft_from_the_model_only(draft_model):
    backend = ModelBackend(draft_model, lookup=SuffixIndex())
    rep = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43]
    params = SamplingParams(temperature=0.8, seed=3)
    d = backend.draft(backend.new_state(params), rep, 4)
    plain = ModelBackend(draft_model)
    assert d.tokens == plain.draft(plain.new_state(params), rep, 4).tokens  # same seed, same draws
    assert backend.lookup_hits == 0 and d.q_probs is not None


def test_speculation_with_lookup_is_exact_and_uses_the_context(tiny_target, tiny_draft, loaded_target):
    backend = ModelBackend(load_causal_lm(str(tiny_draft)), lookup=SuffixIndex())
    engine = TargetEngine(loaded_target, depth=4)
    prompt = engine.encode("for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n" * 2)
    with running_server(backend, suffix=True) as (server, ctx):
        client = DraftClient(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        r = speculate(engine, client, prompt, 60, SamplingParams(), 30)
        stats = server.snapshot()
        client.close()
    assert r.token_ids == reference_greedy(tiny_target, prompt, 60)
    assert r.stats.fallback_rounds == 0 and r.stats.drafted > 0
    # the repeats are drafted from the text: whole suffix drafts or the model's steps
    assert stats["backend"]["lookup"] is True
    assert stats["backend"]["lookup_hits"] + stats["suffix"]["tokens"] > 0
