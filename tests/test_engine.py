"""The target's generation loop driven by in-process draft sources (no sockets): output must equal
the target model's own generate() whatever the drafts are."""

import dataclasses

import pytest

from common.verify import SamplingParams
from starsd_target.engine import TargetEngine
from tiny_models import reference_greedy


class ListDrafts:
    """Proposes from a fixed script of token lists (or None for "no draft this round")."""

    def __init__(self, script):
        self.script = list(script)
        self.kept_log = []
        self.closed = False

    feature_size = 0

    def propose(self, tokens, depth, features=None):
        if not self.script:
            return None
        nxt = self.script.pop(0)
        if nxt is None:
            return None
        return type("P", (), {"tokens": nxt[:depth], "q_ids": None, "q_probs": None})()

    def kept(self, n):
        self.kept_log.append(n)

    def close(self):
        self.closed = True


class OracleDrafts:
    """Drafts with the target's own reference continuation: every draft is right."""

    def __init__(self, prompt, reference):
        self.full = list(prompt) + list(reference)
        self.kept_log = []

    feature_size = 0

    def propose(self, tokens, depth, features=None):
        nxt = self.full[len(tokens): len(tokens) + depth]
        return type("P", (), {"tokens": nxt, "q_ids": None, "q_probs": None})()

    def kept(self, n):
        self.kept_log.append(n)

    def close(self):
        pass


PROMPT_TEXT = "def parse(line):\n    "


@pytest.fixture(scope="module")
def engine(loaded_target):
    return TargetEngine(loaded_target, depth=4)


def test_no_drafts_equals_generate(engine, tiny_target):
    prompt = engine.encode(PROMPT_TEXT)
    ref = reference_greedy(tiny_target, prompt, 40)
    r = engine.generate(prompt, 40, SamplingParams())
    assert r.token_ids == ref
    assert r.stats.rounds == len(ref) and r.stats.drafted == 0


def test_perfect_drafts_are_all_kept(engine, tiny_target):
    prompt = engine.encode(PROMPT_TEXT)
    ref = reference_greedy(tiny_target, prompt, 40)
    src = OracleDrafts(prompt, ref)
    r = engine.generate(prompt, 40, SamplingParams(), src)
    assert r.token_ids == ref
    # each round keeps every draft and adds the target's own token
    assert r.stats.mean_accepted_length > 3.0
    assert r.stats.accepted == r.stats.drafted


def test_wrong_and_missing_drafts_never_change_output(engine, tiny_target):
    prompt = engine.encode(PROMPT_TEXT)
    ref = reference_greedy(tiny_target, prompt, 30)
    garbage = [[(t + 1) % 259 for t in ref[:4]], None, [5, 6, 7, 8], [300, 1], [1, 2, 3, 4, 5, 6, 7]] * 20
    src = ListDrafts(garbage)
    r = engine.generate(prompt, 30, SamplingParams(), src)
    assert r.token_ids == ref
    assert r.stats.fallback_rounds > 0  # the None rounds and the invalid ones
    assert r.stats.invalid_drafts > 0  # id 300 is outside the vocabulary
    assert src.closed


def test_max_tokens_is_exact(engine):
    prompt = engine.encode(PROMPT_TEXT)
    for n in (1, 2, 5, 7):
        r = engine.generate(prompt, n, SamplingParams(), ListDrafts([[1, 2, 3, 4]] * 10))
        assert len(r.token_ids) <= n
        assert r.finish_reason == "length" or r.token_ids[-1] in engine.loaded.eos_token_ids


def test_eos_ends_generation(loaded_target, tiny_target):
    # declare the token the model emits 6th to be EOS: generation must stop right after it,
    # with or without drafts, just like generate() with that eos_token_id
    prompt = TargetEngine(loaded_target).encode(PROMPT_TEXT)
    ref = reference_greedy(tiny_target, prompt, 20)
    eos = ref[5]
    first = ref.index(eos)
    eng = TargetEngine(dataclasses.replace(loaded_target, eos_token_ids=frozenset({eos})), depth=3)
    for src in (None, OracleDrafts(prompt, ref)):
        r = eng.generate(prompt, 50, SamplingParams(), src)
        assert r.finish_reason == "stop"
        assert r.token_ids == ref[: first + 1]


def test_stop_string_cuts_text_and_tokens(engine):
    prompt = engine.encode(PROMPT_TEXT)
    full = engine.generate(prompt, 40, SamplingParams())
    text = full.text
    assert len(text) > 6
    stop = text[3:5]
    r = engine.generate(prompt, 40, SamplingParams(), stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == text[: text.find(stop)]
    assert stop in engine.decode(r.token_ids) and stop not in engine.decode(r.token_ids[:-1])


def test_sampling_with_seed_is_reproducible(engine):
    prompt = engine.encode(PROMPT_TEXT)
    params = SamplingParams(temperature=0.9, top_k=40, seed=11)
    a = engine.generate(prompt, 30, params)
    b = engine.generate(prompt, 30, params)
    c = engine.generate(prompt, 30, SamplingParams(temperature=0.9, top_k=40, seed=12))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_bad_arguments(engine):
    with pytest.raises(ValueError):
        engine.generate([], 5, SamplingParams())
    with pytest.raises(ValueError):
        engine.generate([1], 0, SamplingParams())
    with pytest.raises(ValueError):
        engine.generate([10**6], 5, SamplingParams())


def _fewest_holding(engine, ids, stop):
    """By brute force: the fewest tokens whose full decode holds ``stop``, and that decode up to it."""
    for i in range(1, len(ids) + 1):
        text = engine.decode(ids[:i])
        if stop in text:
            return i, text[: text.find(stop)]
    return None


def test_stop_strings_spanning_rounds_cut_at_the_fewest_tokens(engine, tiny_target):
    prompt = engine.encode(PROMPT_TEXT)
    ref = reference_greedy(tiny_target, prompt, 40)
    text = engine.decode(ref)
    cuts = 0
    for start in range(0, len(text) - 4, 3):
        stop = text[start: start + 1 + start % 4]
        want = _fewest_holding(engine, ref, stop)
        r = engine.generate(prompt, 40, SamplingParams(), OracleDrafts(prompt, ref), stop=[stop])
        assert r.stats.accepted == r.stats.drafted > 0  # rounds of 5 tokens: stops span their boundaries
        assert (r.token_ids, r.text, r.finish_reason) == (ref[: want[0]], want[1], "stop"), stop
        cuts += want[0] % 5 != 0  # a cut inside a round of 5 tokens, not at its end
    assert cuts > 5


def test_tokens_stop_at_eos_like_out(loaded_target, tiny_target):
    """Drafts run past the EOS a round accepts: neither the output nor the verified tokens keep them."""
    prompt = loaded_target.tokenizer.encode(PROMPT_TEXT)
    ref = reference_greedy(tiny_target, prompt, 20)
    eos = ref[6]
    first = ref.index(eos)
    eng = TargetEngine(dataclasses.replace(loaded_target, eos_token_ids=frozenset({eos})), depth=4)
    g = eng.start(prompt, 50, SamplingParams())
    while g.prefilling:
        g.prefill()
    src = OracleDrafts(prompt, ref)
    while not g.done:
        g.verify(src.propose(g.tokens, g.draft_depth()))
    assert g.stats.accepted > len(g.out) - g.stats.rounds  # the round kept drafts past the EOS
    assert g.out == ref[: first + 1] and g.tokens == prompt + g.out
    assert g.result().stats.generated == first + 1


def test_streamed_text_is_final_and_decodes_one_window_per_token(engine):
    """The text a round makes final is never taken back, and what the rounds decode does not grow
    with the output (a full decode per round would be quadratic)."""
    prompt = engine.encode(PROMPT_TEXT)
    g = engine.start(prompt, 400, SamplingParams(temperature=1.0, seed=5))
    while g.prefilling:
        g.prefill()
    seen, costs = [], []
    while not g.done:
        before = g.detok.decoded
        g.verify(None, wanted=False)
        costs.append(g.detok.decoded - before)
        seen.append(g.text_so_far())
    assert len(g.out) == 400
    final = g.result().text
    assert final == engine.decode(g.out)
    assert all(final.startswith(s) for s in seen)
    assert max(costs[200:]) <= max(costs[:20]) + 16  # bounded, whatever the length so far
