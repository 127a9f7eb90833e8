"""The target engine verifies draft trees: one forward with a tree mask, the cache kept to the
accepted path, output token for token equal to the target's own generate."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from common.models import load_causal_lm
from common.tree import check_parents
from common.verify import SamplingParams
from starsd_target.engine import TargetEngine
from tests.tiny_models import make_tiny_checkpoint, reference_greedy

PROMPT = [5, 17, 42, 9, 33, 71, 2, 88]


@dataclass
class TreeProposal:
    tokens: list[int]
    parents: list[int] | None
    q_ids: None = None
    q_probs: None = None


class OracleTrees:
    """Drafts trees around the target's own continuation ``ref``: at every level the right token
    hides among wrong siblings (first, second or last child, by a seeded choice), wrong nodes get
    wrong children, and the right path sometimes stops short (a rejection at a chosen depth)."""

    feature_size = 0

    def __init__(self, prompt: list[int], ref: list[int], vocab: int, seed: int = 0, width: int = 3):
        self.prompt, self.ref, self.vocab, self.width = prompt, ref, vocab, width
        self.rng = random.Random(seed)
        self.calls = 0

    def _wrong(self, right: int) -> int:
        while (t := self.rng.randrange(3, self.vocab)) == right:
            pass
        return t

    def propose(self, tokens, depth, features=None, tree_tokens=0):
        self.calls += 1
        at = len(tokens) - len(self.prompt)
        truth = self.ref[at: at + depth]
        stop = self.rng.choice([len(truth), len(truth), self.rng.randrange(0, len(truth) + 1)])
        nodes: list[int] = []
        parents: list[int] = []
        parent = -1
        for d in range(depth):
            right = truth[d] if d < len(truth) else self._wrong(-1)
            slot = self.rng.randrange(self.width)
            mine = None
            for c in range(self.width):
                if c == slot and d < stop:
                    tok = right
                else:
                    tok = self._wrong(right)
                    while tok in [nodes[i] for i, p in enumerate(parents) if p == parent]:
                        tok = self._wrong(right)
                nodes.append(tok)
                parents.append(parent)
                if c == slot:
                    mine = len(nodes) - 1
            if d + 1 < depth and self.rng.random() < 0.5:  # a wrong sibling with a child of its own
                wrong = next(i for i, p in enumerate(parents) if p == parent and i != mine)
                nodes.append(self._wrong(-1))
                parents.append(wrong)
            parent = mine
        # parents precede children by construction; shuffle nothing (order is the wire's)
        check_parents(parents, len(nodes), depth)
        keep = min(len(nodes), tree_tokens or len(nodes))
        while keep < len(nodes) and any(p >= keep for p in parents[:keep]):
            keep += 1
        return TreeProposal(nodes[:keep], parents[:keep])

    def kept(self, n):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tree_target"), "llama", seed=3, layers=3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_tree_rounds_equal_generate(target, seed):
    ref = reference_greedy(target, PROMPT, 40)
    engine = TargetEngine(load_causal_lm(str(target), dtype="float32"), depth=4, draft_tokens=24)
    drafts = OracleTrees(PROMPT, ref + [0] * 8, engine.loaded.logits_size, seed=seed)
    res = engine.generate(PROMPT, 40, SamplingParams(), drafts=drafts)
    assert res.token_ids == ref
    s = res.stats
    # every round but one with no room left for drafts (the last token) verified a tree
    assert s.tree_rounds >= s.rounds - 1 > 0 and s.fallback_rounds == 0 and s.invalid_drafts == 0
    assert s.accepted > s.rounds  # the right path was found among the siblings, often several deep
    assert s.generated / s.rounds > 2.0


def test_tree_needs_a_mask_architecture(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "gpt2", "gpt2", seed=0)
    loaded = load_causal_lm(str(ckpt), dtype="float32")
    with pytest.raises(ValueError, match="tree attention mask"):
        TargetEngine(loaded, depth=4, draft_tokens=16)
    with pytest.raises(ValueError, match="at least the depth"):
        TargetEngine(loaded, depth=4, draft_tokens=3)
    TargetEngine(loaded, depth=4)  # chains need no mask


def test_invalid_trees_are_refused_not_verified(target):
    engine = TargetEngine(load_causal_lm(str(target), dtype="float32"), depth=3, draft_tokens=6)
    g = engine.start(PROMPT, 10, SamplingParams())
    while g.prefilling:
        g.prefill()
    for bad in (TreeProposal([4, 5, 6], [-1, 2, 0]),  # a parent after its child
                TreeProposal([4, 5, 6, 7], [-1, 0, 1, 2]),  # a chain deeper than the depth
                TreeProposal([4, 5], [-1]),  # parents and tokens differ in number
                TreeProposal([4] * 7, [-1] * 7)):  # more tokens than the budget
        before = list(g.tokens)
        assert g.verify(bad) is None, bad
        assert len(g.tokens) == len(before) + 1  # the round ran on the target alone
    assert g.stats.invalid_drafts == 4 and g.stats.tree_rounds == 0


def test_tree_cache_matches_a_fresh_forward(target):
    """After a tree round, the cache holds exactly the verified sequence's keys and values."""
    ref = reference_greedy(target, PROMPT, 12)
    engine = TargetEngine(load_causal_lm(str(target), dtype="float32"), depth=4, draft_tokens=12)
    g = engine.start(PROMPT, 12, SamplingParams())
    while g.prefilling:
        g.prefill()
    drafts = OracleTrees(PROMPT, ref + [0] * 8, engine.loaded.logits_size, seed=5)
    g.verify(drafts.propose(g.tokens, 4, tree_tokens=12))
    assert g.stats.tree_rounds == 1
    held = g.cache.get_seq_length()
    assert held == len(g.tokens) - 1
    fresh = engine.runner.new_cache()
    with torch.inference_mode():
        engine.loaded.model(input_ids=torch.tensor([g.tokens[:-1]]), cache=fresh, use_cache=True)
    for a, b in zip(g.cache.layers, fresh.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def test_batched_tree_verification_equals_generate(target):
    """Trees and chains of several generations in one forward (pool rows, per-row tree masks)."""
    prompts = [PROMPT, PROMPT[:5] + [61, 62], [7, 8, 9]]
    refs = [reference_greedy(target, p, 24) for p in prompts]
    engine = TargetEngine(load_causal_lm(str(target), dtype="float32"), depth=4, draft_tokens=16, max_batch=4)
    gens = [engine.start(p, 24, SamplingParams()) for p in prompts]
    oracles = [OracleTrees(p, r + [0] * 8, engine.loaded.logits_size, seed=i) for i, (p, r) in
               enumerate(zip(prompts, refs))]
    for g in gens:
        while g.prefilling:
            g.prefill()
    batched = 0
    while not all(g.done for g in gens):
        live = [i for i, g in enumerate(gens) if not g.done]
        rounds = []
        for i in live:
            g = gens[i]
            depth = g.draft_depth()
            if depth == 0:
                prop = None
            elif i == 2:  # one generation verifies chains beside the others' trees
                prop = TreeProposal(refs[i][len(g.out): len(g.out) + depth], None)
            else:
                prop = oracles[i].propose(g.tokens, depth, tree_tokens=g.draft_budget())
            rounds.append((g, prop, depth > 0))
        batched += len(rounds) > 1
        engine.verify_batch(rounds)
    assert batched > 0
    for g, ref in zip(gens, refs):
        assert g.out == ref
    assert gens[0].stats.tree_rounds > 0 and gens[2].stats.tree_rounds == 0 and gens[2].stats.accepted > 0
