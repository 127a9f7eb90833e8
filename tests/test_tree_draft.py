"""Draft trees on the draft side: greedy sessions get EAGLE-2 style dynamic trees whose nodes'
children are the draft's best tokens after their paths (checked against plain forwards of the
draft, no cache), and whose first-child path is the chain; sampled sessions get the chain with
alternatives drawn without replacement from the same distributions, seeded alike. Both backends
(draft model, EAGLE head); a tree leaves a session as a fresh one would be, and batches may mix
trees and chains."""

import random

import pytest
import torch

from common.models import load_causal_lm
from common.tree import ROOT, check_parents, children, path_to
from common.verify import SamplingParams, logits_to_probs
from starsd_draftd.backends.base import DraftRequest
from starsd_draftd.suffix import SuffixIndex
from starsd_draftd.backends.eagle import EagleBackend
from starsd_draftd.backends.eagle_compat import build_head
from starsd_draftd.backends.model import ModelBackend
from starsd_draftd.backends.trees import draw_siblings
from starsd_draftd.demo.eagle_train import head_config_for, save_eagle_head

TOPK, DEPTH = 3, 4
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, seed=7)


@pytest.fixture(scope="module")
def draft_model(tiny_draft):
    return load_causal_lm(str(tiny_draft), dtype="float32")


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, loaded_target):
    cfg = head_config_for(loaded_target.model.config, 48, 259)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(5)
    return save_eagle_head(build_head(cfg, bias=True), cfg, tmp_path_factory.mktemp("head"), "safetensors")


class ModelCase:
    """The draft-model backend, and the draft model's own distributions for reference."""

    def __init__(self, loaded, lookup=None, tree_topk=TOPK):
        self.backend = ModelBackend(loaded, q_topk=16, lookup=lookup, tree_topk=tree_topk)
        self.model = loaded.model

    def draft(self, st, verified, depth=DEPTH, tree_tokens=0, **floors):
        return self.backend.draft(st, verified, depth, tree_tokens=tree_tokens, **floors)

    def request(self, st, verified, depth=DEPTH, tree_tokens=0, min_survival=0.0):
        return DraftRequest(st, list(verified), depth, None, tree_tokens, min_survival)

    def logits(self, verified, path):
        """The draft's logits after ``verified`` + ``path``: one plain forward, no cache."""
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([verified + path])).logits[0, -1].float()


class EagleCase:
    """The EAGLE backend fed the tiny target's features; reference distributions from whole
    forwards of the head from scratch (each predicted feature fed back as a pair)."""

    def __init__(self, head_dir, target_dir, target, tree_topk=TOPK):
        self.backend = EagleBackend.from_dirs(head_dir, target_dir, dtype="float32", q_topk=16, tree_topk=tree_topk)
        self.target = target.model

    def features(self, tokens):
        with torch.inference_mode():
            return self.target(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]

    def _new(self, st, verified):
        return self.features(verified[:-1])[st.features:]

    def draft(self, st, verified, depth=DEPTH, tree_tokens=0, **floors):
        return self.backend.draft(st, verified, depth, self._new(st, verified), tree_tokens=tree_tokens, **floors)

    def request(self, st, verified, depth=DEPTH, tree_tokens=0, min_survival=0.0):
        return DraftRequest(st, list(verified), depth, self._new(st, verified), tree_tokens, min_survival)

    def logits(self, verified, path):
        b = self.backend
        feats = self.features(verified[:-1])
        ids = list(verified[1:])
        with torch.inference_mode():
            for tok in [None] + path:
                if tok is not None:  # the pair (the head's last output, the path's next token)
                    feats = torch.cat([feats, out[0, -1:]])
                    ids.append(tok)
                out = b.module(feats[None], input_ids=torch.tensor([ids]))
                out = out[0] if isinstance(out, tuple) else out
            return b.head.lm_logits(out[0, -1])[: b.vocab_size].float()


@pytest.fixture(scope="module", params=["model", "eagle"])
def case(request, draft_model, head_dir, tiny_target, loaded_target):
    if request.param == "model":
        return ModelCase(draft_model)
    return EagleCase(head_dir, tiny_target, loaded_target)


def _prompt(seed, n=12):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def _first_child_path(d):
    kids, node, out = children(d.parents), ROOT, []
    while kids[node + 1]:
        node = kids[node + 1][0]
        out.append(d.tokens[node])
    return out


def _check_children(d, verified, logits):
    """Each node's children (the root's: row 0) are the draft's best tokens after its path, in
    order, all different."""
    for row, nodes in enumerate(children(d.parents)):
        if not nodes:
            continue
        toks = [d.tokens[i] for i in nodes]
        assert len(set(toks)) == len(toks) <= TOPK  # siblings differ
        path = [] if row == 0 else [d.tokens[i] for i in path_to(d.parents, row - 1)]
        best = torch.topk(logits(verified, path), TOPK).indices.tolist()
        assert toks == best[: len(toks)], (row, path)


def _same(a, b):
    assert a.tokens == b.tokens and a.parents == b.parents
    assert (a.q_ids is None) == (b.q_ids is None)
    if a.q_ids is not None:
        assert torch.equal(torch.as_tensor(a.q_ids), torch.as_tensor(b.q_ids))
        assert torch.allclose(torch.as_tensor(a.q_probs), torch.as_tensor(b.q_probs), atol=1e-4)


# ------------------------------------------------------------------------ greedy: dynamic trees


@pytest.mark.parametrize("budget", [7, 40])
def test_greedy_tree_is_the_drafts_top_children_along_each_path(case, budget):
    b = case.backend
    verified = _prompt(budget)
    d = case.draft(b.new_state(GREEDY), verified, tree_tokens=budget)
    depths = check_parents(d.parents, len(d.tokens), max_depth=DEPTH)
    assert d.q_ids is None and DEPTH < len(d.tokens) <= budget and max(depths) == DEPTH
    chain = case.draft(b.new_state(GREEDY), verified)
    assert chain.parents is None and _first_child_path(d) == chain.tokens
    kids = children(d.parents)
    _check_children(d, verified, case.logits)
    if budget == 40:  # room for every candidate: each node fed has all its TOPK children
        assert len(kids[0]) == TOPK
        assert sum(len(k) == TOPK for k in kids) == 1 + TOPK * (DEPTH - 1)  # the root, TOPK per level above the last
        assert len(d.tokens) == TOPK + (DEPTH - 1) * TOPK * TOPK


def test_greedy_tree_keeps_the_best_scored_nodes(case):
    """The kept nodes besides the chain are those with the highest path log-probability."""
    b = case.backend
    verified = _prompt(3)
    full = case.draft(b.new_state(GREEDY), verified, tree_tokens=100)
    small = case.draft(b.new_state(GREEDY), verified, tree_tokens=DEPTH + 3)

    logp = {}

    def scored(d):
        out = {}
        for i in range(len(d.tokens)):
            path = tuple(d.tokens[j] for j in path_to(d.parents, i))
            if path[:-1] not in logp:
                logp[path[:-1]] = torch.log_softmax(case.logits(verified, list(path[:-1])), -1)
            out[path] = out.get(path[:-1], 0.0) + float(logp[path[:-1]][path[-1]])
        return out

    every, kept = scored(full), scored(small)
    chain = {tuple(_first_child_path(full)[:k]) for k in range(1, DEPTH + 1)}
    assert chain <= set(kept)
    extra = set(kept) - chain
    worst_kept = min(kept[p] for p in extra)
    # no node left out beats a kept one unless an ancestor it needs did not fit
    for p, s in every.items():
        if p not in kept and p[:-1] in kept:
            assert s <= worst_kept + 1e-4


def test_a_greedy_tree_feeds_and_keeps_only_the_nodes_that_pay_their_row(case):
    """With the target's min_survival, a node whose chance of lying on the target's path (its
    tokens' probabilities under a fresh session's calibration, which takes them at their word) is
    below it is neither fed nor sent: a threshold near 0 leaves the whole tree, one no chance
    reaches leaves an empty one, and the chain sent is what the calibration learns from. Both
    backends: a draft model's trees and an EAGLE head's."""
    b, verified = case.backend, _prompt(5)
    full = case.draft(b.new_state(GREEDY), verified, tree_tokens=40)
    low = case.draft(b.new_state(GREEDY), verified, tree_tokens=40, min_survival=1e-9)
    assert (low.tokens, low.parents) == (full.tokens, full.parents)

    def chances(d):
        out = {}
        for i in range(len(d.tokens)):
            path = [d.tokens[j] for j in path_to(d.parents, i)]
            p = float(torch.softmax(case.logits(verified, path[:-1]), -1)[path[-1]])
            out[tuple(path)] = out.get(tuple(path[:-1]), 1.0) * min(p, 0.99)
        return out

    every = chances(full)
    floor = sorted(every.values())[len(every) // 2]  # about half the nodes pay
    st = b.new_state(GREEDY)
    pruned = case.draft(st, verified, tree_tokens=40, min_survival=floor)
    kept = set(chances(pruned)) if pruned.tokens else set()
    assert kept == {path for path, c in every.items() if c >= floor * (1 + 1e-5)} or \
        kept == {path for path, c in every.items() if c >= floor * (1 - 1e-5)}
    assert 0 < len(pruned.tokens) < len(full.tokens)
    check_parents(pruned.parents, len(pruned.tokens), max_depth=DEPTH)
    start, tokens, probs = st.calibration._last
    assert start == len(verified) and tokens == _first_child_path(pruned) and all(p is not None for p in probs)
    # in a batch (two sessions drafting together), a floor between two nodes' chances (a batch's
    # last bits differ from a lone forward's) keeps the same nodes as alone
    ranked = sorted(every.values())
    between = (ranked[len(ranked) // 2 - 1] * ranked[len(ranked) // 2]) ** 0.5
    alone = case.draft(b.new_state(GREEDY), verified, tree_tokens=40, min_survival=between)
    pair = [b.new_state(GREEDY), b.new_state(GREEDY)]
    for d in b.draft_many([case.request(s, verified, tree_tokens=40, min_survival=between) for s in pair]):
        assert (d.tokens, d.parents) == (alone.tokens, alone.parents) and 0 < len(d.tokens) < len(full.tokens)
    nothing = case.draft(b.new_state(GREEDY), verified, tree_tokens=40, min_survival=0.995)
    assert nothing.tokens == [] and nothing.parents == []  # no chance reaches it (at most 0.99)
    # the target's min_chance (a verified row's cost alone) is the floor where it is sent
    cheap_rows = case.draft(b.new_state(GREEDY), verified, tree_tokens=40, min_survival=0.995, min_chance=1e-9)
    assert (cheap_rows.tokens, cheap_rows.parents) == (full.tokens, full.parents)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_greedy_trees_of_other_architectures(tmp_path, arch):
    """The tree forwards' 4-D masks and position ids work beyond Llama."""
    from tiny_models import make_tiny_checkpoint

    case = ModelCase(load_causal_lm(str(make_tiny_checkpoint(tmp_path, arch, seed=4, hidden=32, layers=2)),
                                    dtype="float32"))
    verified = _prompt(9)
    d = case.draft(case.backend.new_state(GREEDY), verified, tree_tokens=40)
    assert len(d.tokens) == TOPK + (DEPTH - 1) * TOPK * TOPK
    _check_children(d, verified, case.logits)
    assert _first_child_path(d) == case.draft(case.backend.new_state(GREEDY), verified).tokens


def test_greedy_tree_keeps_the_lookup_chain(draft_model):
    """With lookup, the chain's copied tokens are its first children; the model's best others
    are their siblings."""
    case = ModelCase(draft_model, lookup=SuffixIndex())
    verified = _prompt(1, 10) * 2 + _prompt(1, 3)  # repeats: lookup copies what followed before
    chain = case.draft(case.backend.new_state(GREEDY), verified)
    hits = case.backend.lookup_hits
    d = case.draft(case.backend.new_state(GREEDY), verified, tree_tokens=12)
    assert case.backend.lookup_hits - hits == hits > 0
    check_parents(d.parents, len(d.tokens), DEPTH)
    assert _first_child_path(d) == chain.tokens == _prompt(1, 10)[3: 3 + DEPTH]


def test_chains_stay_chains(case, draft_model):
    b = case.backend
    verified = _prompt(4)
    for params in (GREEDY, SAMPLED):
        # the budget is no more than the depth: a chain, as before trees
        d = case.draft(b.new_state(params), verified, tree_tokens=DEPTH)
        assert d.parents is None and len(d.tokens) == DEPTH
        _same(d, case.draft(b.new_state(params), verified))
    chains_only = ModelCase(draft_model, tree_topk=1)
    d = chains_only.draft(chains_only.backend.new_state(GREEDY), verified, tree_tokens=20)
    assert d.parents is None and len(d.tokens) == DEPTH
    for bad in (0, -1):
        with pytest.raises(ValueError, match="tree_topk"):
            ModelBackend(draft_model, tree_topk=bad)


# ------------------------------------------------------------------------ sampling: the chain and alternatives


def test_sampled_tree_is_the_seeded_chain_with_alternatives_drawn_without_replacement(case):
    b = case.backend
    verified = _prompt(5)
    budget = DEPTH + 5
    d = case.draft(b.new_state(SAMPLED), verified, tree_tokens=budget)
    depths = check_parents(d.parents, len(d.tokens), max_depth=DEPTH)
    assert len(d.tokens) == budget and d.q_ids.shape == d.q_probs.shape == (budget, 16)
    chain = case.draft(b.new_state(SAMPLED), verified)
    assert _first_child_path(d) == chain.tokens  # today's seeded draws
    kids = children(d.parents)
    chain_nodes = []
    node = ROOT
    for level in range(DEPTH):
        sibs = kids[node + 1]
        # from the top down: TOPK - 1 alternatives while the budget lasts
        assert len(sibs) == 1 + min(TOPK - 1, max(0, budget - DEPTH - (TOPK - 1) * level))
        toks = [d.tokens[i] for i in sibs]
        assert len(set(toks)) == len(toks)
        for i in sibs:  # one row, the parent's distribution, for all siblings
            assert torch.equal(d.q_ids[i], d.q_ids[sibs[0]]) and torch.equal(d.q_probs[i], d.q_probs[sibs[0]])
            row = d.q_ids[i].tolist()
            assert d.q_probs[i][row.index(d.tokens[i])] > 0
        assert torch.equal(d.q_ids[sibs[0]], chain.q_ids[level])
        assert torch.allclose(d.q_probs[sibs[0]], chain.q_probs[level])
        assert all(not kids[i + 1] for i in sibs[1:])  # alternatives are leaves
        node = sibs[0]
        chain_nodes.append(node)
    assert depths == sorted(depths)
    # the root's row is the truncated, renormalised q of the draft after the verified tokens
    probs = logits_to_probs(case.logits(verified, []), SAMPLED)
    top = torch.topk(probs, 16)
    assert torch.equal(d.q_ids[0], top.indices.to(torch.int32))
    assert torch.allclose(d.q_probs[0], top.values / top.values.sum(), atol=1e-5)
    again = case.draft(b.new_state(SAMPLED), verified, tree_tokens=budget)
    _same(again, d)
    other = case.draft(b.new_state(SamplingParams(temperature=0.9, seed=8)), verified, tree_tokens=budget)
    assert other.tokens != d.tokens


def test_siblings_are_drawn_without_replacement():
    ids = torch.tensor([5, 9, 2, 7], dtype=torch.int32)
    mass = torch.tensor([0.4, 0.3, 0.2, 0.1])
    gen = torch.Generator().manual_seed(0)
    counts = {9: 0, 2: 0, 7: 0}
    n = 4000
    for seed in range(n):
        sibs = draw_siblings(ids, mass, 5, 2, seed, 17, gen)
        assert len(set(sibs)) == 2 and 5 not in sibs
        counts[sibs[0]] += 1
        assert sibs == draw_siblings(ids, mass, 5, 2, seed, 17, gen)  # seeded: reproducible
    for tok, p in ((9, 0.5), (2, 1 / 3), (7, 1 / 6)):  # q without the first draw, renormalised
        assert abs(counts[tok] / n - p) < 0.03
    assert draw_siblings(ids, torch.tensor([0.5, 0.5, 0.0, 0.0]), 9, 1, 3, 0, gen) == [5]
    assert len(set(draw_siblings(ids, mass, 5, 3, None, 0, gen))) == 3  # unseeded: the generator's stream


# ------------------------------------------------------------------------ state after a tree


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_after_a_tree_a_session_drafts_as_a_fresh_one(case, params):
    b = case.backend
    rng = random.Random(11)
    verified = _prompt(6)
    st = b.new_state(params)
    for rnd in range(5):
        tree_tokens = 10 if rnd % 3 != 2 else 0
        d = case.draft(st, verified, tree_tokens=tree_tokens)
        _same(d, case.draft(b.new_state(params), verified, tree_tokens=tree_tokens))
        if isinstance(case, ModelCase) and d.parents is not None and params.greedy:
            assert st.cached == verified and st.cache.get_seq_length() == len(verified)
        # the target keeps some path of the tree (not always the first-child one), then its own token
        node = rng.choice([ROOT] + list(range(len(d.tokens))))
        kept = [d.tokens[i] for i in path_to(d.parents, node)] if d.parents is not None else \
            d.tokens[: rng.randrange(len(d.tokens) + 1)]
        verified = verified + kept + [rng.randrange(3, 259)]


def test_no_lookahead_after_a_tree(draft_model):
    case = ModelCase(draft_model)
    st = case.backend.new_state(GREEDY)
    verified = _prompt(7)
    d = case.draft(st, verified, tree_tokens=10)
    assert case.backend.lookahead(st, verified, d, DEPTH) is None
    chain = case.draft(st, verified)
    task = case.backend.lookahead(st, verified, chain, DEPTH)
    assert task is not None
    task.close()


# ------------------------------------------------------------------------ batches


def _batched_as_alone(case, kinds, verified, seed: int, rounds: int) -> None:
    """``rounds`` batches of the sessions ``kinds`` ((params, tree tokens) each) after
    ``verified``: each draft, and each session's next draft after a random kept path, as when
    drafted alone."""
    b = case.backend
    batched = [b.new_state(p) for p, _ in kinds]
    alone = [b.new_state(p) for p, _ in kinds]
    rng = random.Random(seed)
    for _ in range(rounds):
        many = b.draft_many([case.request(st, v, tree_tokens=t) for st, v, (_, t) in zip(batched, verified, kinds)])
        for i, (st, v, (_, t)) in enumerate(zip(alone, verified, kinds)):
            _same(many[i], case.draft(st, v, tree_tokens=t))
            assert (many[i].parents is None) == (t == 0)
        for i, d in enumerate(many):
            node = rng.choice([ROOT] + list(range(len(d.tokens))))
            kept = [d.tokens[j] for j in path_to(d.parents, node)] if d.parents is not None else d.tokens[:2]
            verified[i] = verified[i] + kept + [rng.randrange(3, 259)]


def test_draft_many_mixes_trees_and_chains(case):
    """Greedy and sampled sessions, trees and chains, in one batch, two rounds: each draft and
    each session's next draft as when drafted alone."""
    kinds = [(GREEDY, 10), (SAMPLED, 9), (GREEDY, 0), (SamplingParams(temperature=0.8, seed=3), 0),
             (SamplingParams(temperature=0.7, seed=9), 12)]
    _batched_as_alone(case, kinds, [_prompt(20 + i, 5 + 2 * i) for i in range(len(kinds))], seed=2, rounds=2)


def test_greedy_trees_of_several_sessions_draft_as_alone(case):
    """Greedy trees of sessions with different lengths and budgets in one batch (the EAGLE head
    feeds all their frontiers per level in one forward): each tree and each session's next draft
    as when drafted alone."""
    budgets = [10, 6, 16, 0]
    _batched_as_alone(case, [(GREEDY, t) for t in budgets], [_prompt(40 + i, 4 + 5 * i) for i in range(len(budgets))],
                      seed=5, rounds=3)


def test_serve_takes_tree_topk():
    from click.testing import CliRunner

    from starsd_draftd.cli import main

    out = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200)
    text = " ".join(out.output.split())  # the help as words, however it was wrapped
    assert out.exit_code == 0 and "--tree-topk" in text and "EAGLE-2 dynamic trees" in text
    out = CliRunner().invoke(main, ["serve", "--tree-topk", "0"])
    assert out.exit_code != 0 and "--tree-topk" in out.output
