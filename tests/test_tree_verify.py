"""Draft trees: their shape and attention (``common.tree``) and their verification
(``common.verify.verify_tree_greedy`` / ``verify_tree_sampling``): forced branches with +/-inf
logits, one tree forward of a real model against plain forwards (KV compaction included), then
statistical tests of exactness, and of the statistic's power to catch a wrong sampler."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.slot_cache import SlotCache, SlotLayer
from common.tree import (ROOT, TreeError, ancestor_mask, check_parents, children, depths, is_chain, path_to,
                         tree_attention)
from common.verify import make_generator, sample, verify_tree_greedy, verify_tree_sampling

NEG = float("-inf")

# The tree most tests use (node: token):
#
#                 root
#          /       |       \
#       0: 3     1: 5     2: 1
#       /   \      |
#    3: 2  4: 4  5: 2
#                  |
#                6: 0
PARENTS = [ROOT, ROOT, ROOT, 0, 0, 1, 5]
TOKENS = [3, 5, 1, 2, 4, 2, 0]


# --------------------------------------------------------------------------- common.tree
def test_check_parents_accepts_trees_and_gives_depths():
    assert check_parents(PARENTS, 7) == [1, 1, 1, 2, 2, 2, 3]
    assert check_parents(PARENTS, 7, max_depth=3) == [1, 1, 1, 2, 2, 2, 3]
    assert check_parents([ROOT, 0, 1, 2], 4, max_depth=4) == [1, 2, 3, 4]  # a chain
    assert check_parents([ROOT] * 5, 5, max_depth=1) == [1] * 5  # a star
    assert check_parents([], 0) == []
    assert check_parents(torch.tensor([ROOT, 0, 0]), 3) == [1, 2, 2]  # tensors of ints are fine
    assert depths(PARENTS) == [1, 1, 1, 2, 2, 2, 3]


@pytest.mark.parametrize("parents, n, max_depth, what", [
    ([ROOT, 2, 0], 3, None, "parent"),  # node 1's parent comes after it
    ([0], 1, None, "parent"),  # its own parent
    ([ROOT, 1], 2, None, "parent"),  # node 1 its own parent
    ([-2], 1, None, "parent"),  # below ROOT
    ([ROOT, 5], 2, None, "parent"),  # past the end
    ([ROOT], 2, None, "needs 2 parents"),  # too short
    ([ROOT, ROOT, ROOT], 2, None, "needs 2 parents"),  # too long
    ([ROOT, 0, 1, 2], 4, 3, "deeper than 3"),
    (PARENTS, 7, 2, "deeper than 2"),  # node 6, at depth 3
])
def test_check_parents_rejects(parents, n, max_depth, what):
    with pytest.raises(TreeError, match=what):
        check_parents(parents, n, max_depth)
    assert issubclass(TreeError, ValueError)


def test_is_chain():
    assert is_chain([]) and is_chain([ROOT]) and is_chain([ROOT, 0, 1, 2])
    assert not is_chain([ROOT, ROOT])
    assert not is_chain([ROOT, 0, 0])
    assert not is_chain(PARENTS)


def test_children_and_path_to():
    assert children(PARENTS) == [[0, 1, 2], [3, 4], [5], [], [], [], [6], []]
    assert children([]) == [[]]
    assert children([ROOT, 0, 1]) == [[0], [1], [2], []]
    assert path_to(PARENTS, ROOT) == []
    assert path_to(PARENTS, 2) == [2]
    assert path_to(PARENTS, 4) == [0, 4]
    assert path_to(PARENTS, 6) == [1, 5, 6]


def test_ancestor_mask_of_a_hand_built_tree():
    want = torch.tensor([
        # root n0 n1 n2 n3 n4 n5 n6
        [1, 0, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0, 0],  # n0
        [1, 0, 1, 0, 0, 0, 0, 0],  # n1
        [1, 0, 0, 1, 0, 0, 0, 0],  # n2
        [1, 1, 0, 0, 1, 0, 0, 0],  # n3: root, n0
        [1, 1, 0, 0, 0, 1, 0, 0],  # n4: root, n0
        [1, 0, 1, 0, 0, 0, 1, 0],  # n5: root, n1
        [1, 0, 1, 0, 0, 0, 1, 1],  # n6: root, n1, n5
    ], dtype=torch.bool)
    got = ancestor_mask(PARENTS)
    assert got.dtype == torch.bool
    assert torch.equal(got, want)
    # a chain's mask is causal
    assert torch.equal(ancestor_mask([ROOT, 0, 1]), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert torch.equal(ancestor_mask([]), torch.ones(1, 1, dtype=torch.bool))


def _random_parents(g: torch.Generator, n: int) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cached", [0, 5])
def test_tree_attention_mask_and_positions(dtype, cached):
    g = torch.Generator().manual_seed(3)
    for parents in [PARENTS, [ROOT, 0, 1], [], *(_random_parents(g, n) for n in (1, 4, 9, 16))]:
        n = len(parents)
        mask, pos = tree_attention(parents, cached, dtype, device="cpu")
        assert mask.shape == (1, 1, n + 1, cached + n + 1) and mask.dtype == dtype
        assert pos.shape == (1, n + 1) and pos.dtype == torch.long
        # only two values: 0 (may look) and the dtype's minimum
        lo = torch.finfo(dtype).min
        assert bool(((mask == 0) | (mask == lo)).all())
        visible = mask[0, 0] == 0
        assert bool(visible[:, :cached].all())  # every cached position, for every row
        new = visible[:, cached:]
        assert set(new[0].nonzero()[:, 0].tolist()) == {0}  # the root sees itself only
        for i in range(n):
            want = {0} | {1 + a for a in path_to(parents, i)}  # the root, the ancestors, itself
            assert set(new[1 + i].nonzero()[:, 0].tolist()) == want, (parents, i)
        assert pos[0].tolist() == [cached] + [cached + d for d in depths(parents)]


def test_tree_attention_checks_the_tree():
    with pytest.raises(TreeError):
        tree_attention([ROOT, 2, ROOT], 2, torch.float32)  # a parent after its child
    with pytest.raises(TreeError):
        tree_attention([-2], 2, torch.float32)  # below ROOT


def test_ancestor_mask_and_tree_attention_reject_bad_parents_with_tree_error():
    for bad in ([ROOT, 3], [-2], [ROOT, 2, ROOT]):
        with pytest.raises(TreeError):
            ancestor_mask(bad)
    with pytest.raises(TreeError):
        tree_attention([ROOT, 3], 2, torch.float32)  # a parent past the end


# --------------------------------------------------------------------------- greedy
def onehot_logits(rows: list[int], vocab: int = 6) -> torch.Tensor:
    """One row per argmax: 0 there, -inf elsewhere."""
    t = torch.full((len(rows), vocab), NEG)
    for i, r in enumerate(rows):
        t[i, r] = 0.0
    return t


def greedy(rows: list[int]) -> tuple[list[int], int]:
    """``rows``: the target's argmax per row (0: the root, 1 + i: node i) of the PARENTS tree."""
    return verify_tree_greedy(onehot_logits(rows), TOKENS, PARENTS)


def test_tree_greedy_first_child_kept():
    # root's argmax 3 = node 0; node 0's argmax 5 is none of its children (2, 4)
    assert greedy([3, 5, 0, 0, 0, 0, 0, 0]) == ([0], 5)


def test_tree_greedy_second_and_third_child_kept():
    # root's argmax 5: node 0 (3) is wrong, node 1 (5) kept; node 1's argmax 1 is not node 5's 2
    assert greedy([5, 0, 1, 0, 0, 0, 0, 0]) == ([1], 1)
    # root's argmax 1: the third child; it is a leaf, so the bonus is the argmax of its row (4)
    assert greedy([1, 0, 0, 4, 0, 0, 0, 0]) == ([2], 4)
    # inside node 0: its second child (node 4, token 4) kept, a leaf: bonus from row 5
    assert greedy([3, 4, 0, 0, 0, 3, 0, 0]) == ([0, 4], 3)


def test_tree_greedy_no_child_kept():
    assert greedy([4, 1, 1, 1, 1, 1, 1, 1]) == ([], 4)  # 4 is no child of the root
    assert greedy([0, 3, 3, 3, 3, 3, 3, 3]) == ([], 0)


def test_tree_greedy_deepest_path_and_leaf_bonus():
    # root -> node 1 (5) -> node 5 (2) -> node 6 (0), a leaf: bonus = argmax of node 6's row (5)
    assert greedy([5, 0, 2, 0, 0, 0, 0, 5]) == ([1, 5, 6], 5)
    # stops one short: node 5's argmax 3 is not node 6's 0
    assert greedy([5, 0, 2, 0, 0, 0, 3, 5]) == ([1, 5], 3)


def test_tree_greedy_takes_the_first_matching_sibling():
    # siblings with one token (a tree need not forbid it): the first in node order wins
    logits = onehot_logits([2, 4, 1])
    assert verify_tree_greedy(logits, [2, 2], [ROOT, ROOT]) == ([0], 4)


def test_tree_greedy_on_finite_logits_and_chains():
    # a large value at the wanted argmax, and finite logits otherwise, behave like the one-hot rows
    logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    for r, a in enumerate([5, 0, 2, 0, 0, 0, 0, 5]):
        logits[r, a] = 50.0
    assert verify_tree_greedy(logits, TOKENS, PARENTS) == ([1, 5, 6], 5)
    # a chain as a tree: what verify_greedy would keep
    assert verify_tree_greedy(onehot_logits([3, 1, 4, 5]), [3, 1, 4], [ROOT, 0, 1]) == ([0, 1, 2], 5)
    assert verify_tree_greedy(onehot_logits([3, 1, 4, 5]), [3, 2, 4], [ROOT, 0, 1]) == ([0], 1)
    assert verify_tree_greedy(onehot_logits([2]), [], []) == ([], 2)  # no tree: plain argmax


def test_tree_greedy_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="rows"):
        verify_tree_greedy(onehot_logits([0] * 7), TOKENS, PARENTS)  # n rows, not n + 1
    with pytest.raises(ValueError, match="rows"):
        verify_tree_greedy(onehot_logits([0] * 9), TOKENS, PARENTS)


# --------------------------------------------------------------------------- a real tree forward
@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                      attn_implementation="sdpa")
    # initializer_range 0.3 (the default is 0.02): logits of order 1-10 that differ from row to row
    # and context to context, so that a 1e-4 agreement says something
    return LlamaForCausalLM(cfg).to(torch.float32).eval()


PREFIX = [5, 17, 42, 8, 33, 12]


def plain_last(model, ids: list[int]) -> torch.Tensor:
    """The logits after ``ids`` from one forward without a cache (the ground truth)."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def tree_forward(model, prefix: list[int], tokens: list[int], parents: list[int], causal: bool = False):
    """Cache prefix[:-1], then ONE forward over (prefix[-1], tree nodes) with the tree's mask and
    positions; its logits [n + 1, V] and the cache. ``causal``: a plain causal mask instead (wrong
    for a tree: for the test to show that it would notice)."""
    cache = SlotCache(model.config)
    model(input_ids=torch.tensor([prefix[:-1]]), cache=cache, use_cache=True)
    cached = len(prefix) - 1
    assert cache.get_seq_length() == cached
    mask, pos = tree_attention(parents, cached, model.dtype)
    if causal:
        mask, _ = tree_attention([ROOT + i for i in range(len(parents))], cached, model.dtype)  # a chain's
    out = model(input_ids=torch.tensor([[prefix[-1], *tokens]]), attention_mask=mask, position_ids=pos,
                cache=cache, use_cache=True)
    assert cache.get_seq_length() == cached + len(tokens) + 1
    return out.logits[0], cache


@torch.inference_mode()
def test_tree_forward_rows_equal_plain_forwards(llama):
    logits, _ = tree_forward(llama, PREFIX, TOKENS, PARENTS)
    assert logits.shape == (len(TOKENS) + 1, 64)
    torch.testing.assert_close(logits[0], plain_last(llama, PREFIX), rtol=0, atol=1e-4)
    for i in range(len(TOKENS)):
        want = plain_last(llama, PREFIX + [TOKENS[j] for j in path_to(PARENTS, i)])
        torch.testing.assert_close(logits[1 + i], want, rtol=0, atol=1e-4, msg=f"node {i}")
    # the check has teeth: rows differ from one another by far more than the tolerance, and a
    # causal mask over the same tokens (each node seeing its earlier siblings too) misses
    assert float((logits[1] - logits[2]).abs().max()) > 0.1
    wrong, _ = tree_forward(llama, PREFIX, TOKENS, PARENTS, causal=True)
    node = 2  # depth 1, after siblings 0 and 1 in the feed
    want = plain_last(llama, PREFIX + [TOKENS[node]])
    assert float((wrong[1 + node] - want).abs().max()) > 1e-2


@torch.inference_mode()
def test_tree_forward_with_greedy_verification_keeps_the_models_own_continuation(llama):
    g = []  # the model's greedy continuation of PREFIX, three tokens
    for _ in range(3):
        g.append(int(plain_last(llama, PREFIX + g).argmax()))
    wrong = [(t + 1) % 64 for t in g]
    # the right tokens on the second branch of the root and the second child of that node
    tokens = [wrong[0], g[0], wrong[1], g[1]]
    parents = [ROOT, ROOT, 1, 1]
    logits, _ = tree_forward(llama, PREFIX, tokens, parents)
    assert verify_tree_greedy(logits, tokens, parents) == ([1, 3], g[2])


@pytest.mark.parametrize("path", [[1, 5, 6], [0, 4], [0, 3], [2], []])
@torch.inference_mode()
def test_compacting_to_a_kept_path_equals_a_fresh_prefill(llama, path):
    assert path == path_to(PARENTS, path[-1] if path else ROOT)  # a root path of the tree
    _, cache = tree_forward(llama, PREFIX, TOKENS, PARENTS)
    keep = list(range(len(PREFIX))) + [len(PREFIX) + node for node in path]
    cache.compact(torch.tensor(keep))
    kept = PREFIX + [TOKENS[j] for j in path]
    fresh = SlotCache(llama.config)
    llama(input_ids=torch.tensor([kept]), cache=fresh, use_cache=True)
    for layer, ref in zip(cache.layers, fresh.layers):
        assert isinstance(layer, SlotLayer) and layer.n == len(kept)
        torch.testing.assert_close(layer.k_buf[:, :, : layer.n], ref.k_buf[:, :, : ref.n], rtol=0, atol=1e-4)
        torch.testing.assert_close(layer.v_buf[:, :, : layer.n], ref.v_buf[:, :, : ref.n], rtol=0, atol=1e-4)
    nxt = 9
    got = llama(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(got, plain_last(llama, kept + [nxt]), rtol=0, atol=1e-4)
    assert cache.get_seq_length() == len(kept) + 1


# --------------------------------------------------------------------------- sampling: forced branches
def probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def onehot(t: int, vocab: int = 5) -> list[float]:
    return [1.0 if i == t else 0.0 for i in range(vocab)]


# a small tree: root -> node 0 (token 1), node 1 (token 2); node 0 -> node 2 (token 3)
S_PARENTS = [ROOT, ROOT, 0]
S_TOKENS = [1, 2, 3]
Q_ROOT = [0.1, 0.4, 0.3, 0.1, 0.1]
Q_0 = [0.2, 0.2, 0.2, 0.2, 0.2]
S_Q = probs([Q_ROOT, Q_ROOT, Q_0])  # node i's row: its parent's draft distribution, undeducted


def sampled(p_rows, q=S_Q, tokens=S_TOKENS, parents=S_PARENTS, seeds=range(20)) -> set:
    return {(tuple(path), tok) for path, tok in
            (verify_tree_sampling(probs(p_rows), q, tokens, parents, make_generator(s)) for s in seeds)}


def test_tree_sampling_keeps_the_first_child_target_is_sure_of():
    # rows: root, node 0, node 1, node 2
    assert sampled([onehot(1), onehot(3), onehot(0), onehot(4)]) == {((0, 2), 4)}  # down to the leaf: bonus
    assert sampled([onehot(1), onehot(0), onehot(0), onehot(4)]) == {((0,), 0)}  # node 0's child rejected


def test_tree_sampling_second_child_after_the_first_is_rejected():
    # p(first child's token) = 0: rejected; the residual puts all mass on the second's: kept
    assert sampled([onehot(2), onehot(0), onehot(4), onehot(0)]) == {((1,), 4)}


def test_tree_sampling_no_child_kept_draws_the_residual():
    assert sampled([onehot(4), onehot(0), onehot(0), onehot(0)]) == {((), 4)}
    assert sampled([onehot(0), onehot(1), onehot(1), onehot(1)]) == {((), 0)}


def test_tree_sampling_rejects_a_child_its_q_could_not_draw():
    # q(1) = 0 for node 0: rejected although the target is sure of it; the draw is then token 1
    q = probs([[0.5, 0.0, 0.5, 0, 0], [0.5, 0.0, 0.5, 0, 0], Q_0])
    assert sampled([onehot(1), onehot(3), onehot(0), onehot(4)], q=q) == {((), 1)}
    # the residual update still applies after that rejection: p = (0, .5, .5, 0, 0) gives the
    # residual onehot(1), so the second child (token 2) is rejected too, and 1 is drawn
    assert sampled([[0, 0.5, 0.5, 0, 0], onehot(0), onehot(0), onehot(0)], q=q) == {((), 1)}
    # a lone child with q(x) = 0
    q1 = probs([[1.0, 0, 0, 0, 0]])
    assert sampled([onehot(3), onehot(0)], q=q1, tokens=[3], parents=[ROOT]) == {((), 3)}


def test_tree_sampling_without_a_tree_samples_the_root_row():
    assert sampled([[0.0, 0.5, 0.0, 0.5, 0.0]], q=torch.zeros(0, 5), tokens=[], parents=[],
                   seeds=range(40)) == {((), 1), ((), 3)}


def test_tree_sampling_is_deterministic_for_a_seed_and_checks_shapes():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, 6, generator=g), -1)
    q = torch.softmax(torch.randn(7, 6, generator=g), -1)
    runs = [verify_tree_sampling(p, q, TOKENS, PARENTS, make_generator(11)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    with pytest.raises(ValueError, match="shapes"):
        verify_tree_sampling(p[:7], q, TOKENS, PARENTS, make_generator(0))
    with pytest.raises(ValueError, match="shapes"):
        verify_tree_sampling(p, q[:6], TOKENS, PARENTS, make_generator(0))


# --------------------------------------------------------------------------- statistics
def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, stat/2),
    by its series (stat/2 < df/2 + 1) or its continued fraction (Numerical Recipes' gser / gcf).
    Deterministic, accurate to ~1e-12 (scipy is not installed here)."""
    a, x = df / 2.0, stat / 2.0
    if x <= 0.0:
        return 1.0
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1.0:
        ap, term = a, 1.0 / a
        total = term
        for _ in range(100000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return 1.0 - front * total
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return front * h


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """The (1 - alpha) quantile of chi-square(df), by bisection on chi2_sf."""
    lo, hi = 0.0, df + 100.0 * math.sqrt(df) + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def test_chi2_helper_against_known_values():
    for x in (0.5, 3.0, 13.8, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)  # df 2: exactly exp(-x/2)
    # tabulated 0.999 quantiles (df 3, 15, 24) and 0.95 (df 1: 1.96 ** 2)
    assert chi2_critical(3) == pytest.approx(16.266, abs=2e-3)
    assert chi2_critical(15) == pytest.approx(37.697, abs=2e-3)
    assert chi2_critical(24) == pytest.approx(51.179, abs=2e-3)
    assert chi2_critical(1, 0.05) == pytest.approx(1.959964 ** 2, abs=1e-4)
    assert chi2_sf(5000.0, 24) < 1e-300 or chi2_sf(5000.0, 24) == 0.0


V = 5


def _tables(seed: int, sharp: float = 1.5):
    """A Markov target and draft: row t is the next-token distribution after token t, row V the
    one at the root (after the verified prefix); so p conditioned on a path is the row of its
    last token."""
    g = torch.Generator().manual_seed(seed)
    p_tab = torch.softmax(torch.randn(V + 1, V, generator=g) * sharp, -1)
    q_tab = torch.softmax(torch.randn(V + 1, V, generator=g) * sharp, -1)
    return p_tab, q_tab


def draw_trees(parents: list[int], q_tab: torch.Tensor, trials: int, gen: torch.Generator) -> torch.Tensor:
    """[trials, n] tree tokens drawn honestly: each node's children, in node order, one after the
    other from the parent's draft distribution without the siblings drawn before (renormalised:
    torch.multinomial normalises each row), vectorised over the trials."""
    n = len(parents)
    x = torch.zeros(trials, n, dtype=torch.long)
    start = torch.full((trials,), V, dtype=torch.long)
    for row, kids in enumerate(children(parents)):  # a row's token is drawn before its children
        if not kids:
            continue
        q = q_tab[start if row == 0 else x[:, row - 1]].clone()
        for c in kids:
            t = torch.multinomial(q, 1, generator=gen)[:, 0]
            x[:, c] = t
            q[torch.arange(trials), t] = 0.0
    return x


def tree_rows(parents: list[int], x: torch.Tensor, p_tab, q_tab):
    """The rows verification gets per trial: p [trials, n + 1, V] (row 0 the root's, row 1 + i the
    target after node i's path) and q [trials, n, V] (node i's parent's draft row, undeducted)."""
    trials = x.shape[0]
    start = torch.full((trials, 1), V, dtype=torch.long)
    ctx = torch.cat([start, x], 1)  # the last token of row r's context
    p = p_tab[ctx]
    q = q_tab[ctx[:, [int(par) + 1 for par in parents]]] if parents else torch.zeros(trials, 0, V)
    return p, q


def joint_chi2(verify, parents: list[int], p_tab, q_tab, trials: int, seed: int) -> tuple[float, float]:
    """Speculate ``trials`` times with ``verify`` over trees of ``parents``; the chi-square
    statistic of the first two output tokens against the target's exact joint
    p_root(t1) p(t2 | t1), and its p-value (df V^2 - 1)."""
    gen = make_generator(seed)
    x = draw_trees(parents, q_tab, trials, gen)
    p, q = tree_rows(parents, x, p_tab, q_tab)
    xs = x.tolist()
    counts = [0] * (V * V)
    for i in range(trials):
        path, tok = verify(p[i], q[i], xs[i], parents, gen)
        out = [xs[i][j] for j in path] + [tok]
        if len(out) < 2:  # nothing kept: the second token is the target's next draw
            out.append(sample(p_tab[out[0]], gen))
        counts[out[0] * V + out[1]] += 1
    want = (p_tab[V][:, None] * p_tab[:V]).flatten().double() * trials
    stat = sum((c - float(e)) ** 2 / float(e) for c, e in zip(counts, want))
    return stat, chi2_sf(stat, V * V - 1)


# root: 3 children; nodes 0 and 1: 2 children each; node 2 a leaf at depth 1, nodes 3..6 at depth 2
BUSHY = [ROOT, ROOT, ROOT, 0, 0, 1, 1]
# Trials per statistical test: the statistic of a sampler at chi-square divergence 0.01 from the
# target's joint (sum of (q - p)^2 / p) reaches the critical value on average (about 2700). The
# broken samplers below sit at about 0.13 and 0.22: more trials would only find what no known
# mistake makes.
TRIALS = math.ceil((chi2_critical(V * V - 1) - (V * V - 1)) / 0.01)


def test_tree_sampling_joint_of_two_tokens_follows_the_target():
    p_tab, q_tab = _tables(0)
    stat, pval = joint_chi2(verify_tree_sampling, BUSHY, p_tab, q_tab, trials=TRIALS, seed=2024)
    assert pval > 1e-3, f"chi2={stat:.1f} (p={pval:.2e}) >= {chi2_critical(V * V - 1):.1f}"


def test_tree_sampling_exact_on_a_binary_tree_of_depth_three():
    # two children at every node to depth 3 (14 nodes): depth-2 nodes' subtrees matter too
    parents = [ROOT, ROOT, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    p_tab, q_tab = _tables(1)
    stat, pval = joint_chi2(verify_tree_sampling, parents, p_tab, q_tab, trials=TRIALS, seed=7)
    assert pval > 1e-3, f"chi2={stat:.1f} (p={pval:.2e})"


def test_chain_as_a_tree_follows_the_target():
    p_tab, q_tab = _tables(2)
    stat, pval = joint_chi2(verify_tree_sampling, [ROOT, 0, 1], p_tab, q_tab, trials=TRIALS, seed=99)
    assert pval > 1e-3, f"chi2={stat:.1f} (p={pval:.2e})"


def local_tree_sampling(p, q, x, parents, generator, residual: bool = True, remove_drawn: bool = True):
    """A copy of verify_tree_sampling's algorithm with two switches to break it: ``residual`` False
    keeps p^(j) = p_u for every sibling (no residual update); ``remove_drawn`` False verifies each
    sibling against q_u itself, as if siblings were drawn with replacement. Both True: the same
    decisions and draws as verify_tree_sampling (checked below)."""
    kids = children(parents)
    p, q = p.float(), q.float()
    path: list[int] = []
    row = 0
    while True:
        target = p[row]
        draft = None
        for c in kids[row]:
            if draft is None:
                draft = q[c].clone()
            xc = x[c]
            p_x, q_x = float(target[xc]), float(draft[xc])
            r = float(torch.rand(1, generator=generator, device=generator.device))
            if q_x > 0.0 and r < min(1.0, p_x / q_x):
                path.append(c)
                break
            if residual:
                res = torch.clamp(target - draft, min=0.0)
                total = float(res.sum())
                if total > 0.0:
                    target = res / total
            if remove_drawn:
                draft[xc] = 0.0
                mass = float(draft.sum())
                if mass > 0.0:
                    draft = draft / mass
        else:
            return path, sample(target, generator)
        row = path[-1] + 1


def test_local_copy_matches_verify_tree_sampling():
    p_tab, q_tab = _tables(0)
    gen = make_generator(5)
    x = draw_trees(BUSHY, q_tab, 300, gen)
    p, q = tree_rows(BUSHY, x, p_tab, q_tab)
    seen = set()
    for i, xi in enumerate(x.tolist()):
        a, b = make_generator(i), make_generator(i)
        want = verify_tree_sampling(p[i], q[i], xi, BUSHY, a)
        assert local_tree_sampling(p[i], q[i], xi, BUSHY, b) == want
        assert torch.equal(a.get_state(), b.get_state())
        seen.add(len(want[0]))
    assert seen == {0, 1, 2}  # every path length happened


def _broken(**flags):
    return lambda p, q, x, parents, gen: local_tree_sampling(p, q, x, parents, gen, **flags)


def test_the_statistic_rejects_a_sampler_without_residual_updates():
    # the same setup and trials as the exactness test: the statistic is about 570 here (p about
    # 1e-105), against a 0.999 quantile of 51.2
    p_tab, q_tab = _tables(0)
    critical = chi2_critical(V * V - 1)
    stat, pval = joint_chi2(_broken(residual=False), BUSHY, p_tab, q_tab, trials=TRIALS, seed=2024)
    assert stat > 5 * critical, f"chi2={stat:.1f} (p={pval:.2e}), critical {critical:.1f}"


def test_the_statistic_rejects_a_sampler_that_ignores_sampling_without_replacement():
    # siblings drawn without replacement but verified as if drawn with it (against q_u, not q_u
    # without the earlier siblings): on the same setup, the bias is far beyond the threshold
    # (chi2 about 430, p about 1e-76, against a 0.999 quantile of 51.2 at this seed)
    p_tab, q_tab = _tables(0)
    critical = chi2_critical(V * V - 1)
    stat, pval = joint_chi2(_broken(remove_drawn=False), BUSHY, p_tab, q_tab, trials=TRIALS, seed=2024)
    assert stat > 5 * critical, f"chi2={stat:.1f} (p={pval:.2e}), critical {critical:.1f}"
