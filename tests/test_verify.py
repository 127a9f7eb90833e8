"""Verification math: forced branches with +/-inf logits, then a statistical test of exactness."""

import itertools
import random

import pytest
import torch

from common.verify import (SamplingParams, dense_q, logits_to_probs, make_generator, verify_greedy,
                           verify_greedy_host, verify_greedy_tensor, verify_sampling, verify_sampling_tensor)
from fakes import assert_follows, samples_for

NEG = float("-inf")


def onehot_logits(rows: list[int], vocab: int = 6) -> torch.Tensor:
    t = torch.full((len(rows), vocab), NEG)
    for i, r in enumerate(rows):
        t[i, r] = 0.0
    return t


def test_greedy_all_accepted_gives_bonus():
    n, tok = verify_greedy(onehot_logits([3, 1, 4, 5]), torch.tensor([3, 1, 4]))
    assert (n, tok) == (3, 5)


def test_greedy_first_mismatch_gives_target_token():
    n, tok = verify_greedy(onehot_logits([3, 1, 4, 5]), torch.tensor([3, 2, 4]))
    assert (n, tok) == (1, 1)
    n, tok = verify_greedy(onehot_logits([0, 1]), torch.tensor([5]))
    assert (n, tok) == (0, 0)


def test_greedy_without_drafts_is_plain_argmax():
    assert verify_greedy(onehot_logits([2]), torch.tensor([], dtype=torch.long)) == (0, 2)


def test_greedy_rejects_wrong_shapes():
    with pytest.raises(ValueError):
        verify_greedy(onehot_logits([1, 2]), torch.tensor([1, 2]))


def probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_sampling_accepts_when_p_dominates_q():
    # p puts all mass on the drafted tokens: min(1, p/q) = 1, every draft survives, bonus from p_k.
    p = probs([[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    q = probs([[0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0]])
    for seed in range(20):
        assert verify_sampling(p, q, torch.tensor([1, 2]), make_generator(seed)) == (2, 3)


def test_sampling_rejects_token_target_never_produces():
    # p(x_1) = 0: always rejected; the residual max(0, p - q) has all its mass on token 0.
    p = probs([[1, 0, 0, 0], [0, 1, 0, 0]])
    q = probs([[0, 1, 0, 0]])
    for seed in range(20):
        assert verify_sampling(p, q, torch.tensor([1]), make_generator(seed)) == (0, 0)


def test_sampling_rejection_at_second_position():
    p = probs([[0, 1, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]])
    q = probs([[0, 1, 0, 0], [0, 0, 1, 0]])
    assert verify_sampling(p, q, torch.tensor([1, 2]), make_generator(0)) == (1, 3)


def test_sampling_guards_zero_q_and_zero_residual():
    # x was "drafted" with q(x) = 0: it cannot have come from q, so it is rejected (no division by
    # zero); p == q makes the residual all zero, so the correction is drawn from p itself.
    p = probs([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    q = probs([[0.5, 0.5, 0, 0]])
    seen = set()
    for seed in range(40):
        n, tok = verify_sampling(p, q, torch.tensor([2]), make_generator(seed))
        assert n == 0
        seen.add(tok)
    assert seen == {0, 1}


def test_sampling_is_deterministic_for_a_seed():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 8), -1)
    q = torch.softmax(torch.randn(3, 8), -1)
    x = torch.tensor([1, 5, 2])
    a = [verify_sampling(p, q, x, make_generator(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_logits_to_probs_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    pk = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert pk[0, 2] == 0 and pk[0, 3] == 0 and pk[0, :2].sum() == pytest.approx(1.0)
    full = torch.softmax(logits, -1)[0]
    # top_p just above p(0) keeps tokens 0 and 1: the token that crosses the threshold stays.
    pp = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (pp[0, :2] > 0).all() and (pp[0, 2:] == 0).all()
    # a low temperature sharpens, a high one flattens
    cold = logits_to_probs(logits, SamplingParams(temperature=0.1))
    hot = logits_to_probs(logits, SamplingParams(temperature=10.0))
    assert cold[0, 0] > full[0] > hot[0, 0]


def test_sampling_params_validation():
    for bad in ({"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_dense_q_scatters_sparse_rows():
    q = dense_q(torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([[0.75, 0.25]]), 4)
    assert q.tolist() == [[0.25, 0.0, 0.75, 0.0]]


# --------------------------------------------------------------------------- statistics
V = 4
# The chi-square divergence the statistical test is sized to reject (about 4000 samples): far below
# what known mistakes give on these tables (drawing from p instead of the residual after a
# rejection: 0.3-0.4; the bonus token from the last draft's row instead of the next: 0.26)
MATH_DIVERGENCE = 0.01


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    # p and q depend on the previous token, so the test checks joint, not just marginal, exactness
    p_tab = torch.softmax(torch.randn(V + 1, V, generator=g) * 1.5, -1)  # row V: start of sequence
    q_tab = torch.softmax(torch.randn(V + 1, V, generator=g) * 1.5, -1)
    return p_tab, q_tab


def _tensor_sampling(p, q, x, gen) -> tuple[int, int]:
    n, tok, valid = verify_sampling_tensor(p, q, x, gen).tolist()
    assert valid == 1
    return n, tok


SAMPLERS = {"reference": verify_sampling, "tensor": _tensor_sampling}


def _speculate(p_tab, q_tab, depth: int, length: int, gen: torch.Generator,
               verify, draws: random.Random, q_cum: list[list[float]]) -> tuple[int, ...]:
    """Sample ``length`` tokens by rounds of ``depth`` drafts from q, verified against p. The
    drafts are drawn with ``draws`` over ``q_cum``, q's cumulative rows (Python's generator: the
    harness's own cost kept small), the verification with ``gen``."""
    out: list[int] = []
    while len(out) < length:
        prev = out[-1] if out else V
        x, ctx = [], prev
        for _ in range(depth):
            ctx = draws.choices(range(V), cum_weights=q_cum[ctx])[0]
            x.append(ctx)
        ctxs = [prev, *x]
        n, tok = verify(p_tab[ctxs], q_tab[ctxs[:-1]], torch.tensor(x), gen)
        out.extend([*x[:n], tok])
    return tuple(out[:length])


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("depth", [2, 3])
def test_speculative_sampling_follows_target_distribution(depth, sampler):
    p_tab, q_tab = _tables(depth)
    gen = make_generator(1234 + depth)
    draws = random.Random(1234 + depth)
    q_cum = [list(itertools.accumulate(row)) for row in q_tab.tolist()]
    exact = {(a, b, c): float(p_tab[V, a] * p_tab[a, b] * p_tab[b, c])
             for a, b, c in itertools.product(range(V), repeat=3)}
    samples = samples_for(exact, MATH_DIVERGENCE)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        key = _speculate(p_tab, q_tab, depth, 3, gen, SAMPLERS[sampler], draws, q_cum)
        counts[key] = counts.get(key, 0) + 1
    assert_follows(counts, exact, samples)


def test_statistical_test_detects_a_wrong_sampler():
    # The same statistic must reject a sampler that ignores p (accepts every draft): the test can fail.
    p_tab, q_tab = _tables(2)
    gen = make_generator(99)
    samples = 20000
    counts: dict[int, int] = {}
    for _ in range(samples):
        t = int(torch.multinomial(q_tab[V], 1, generator=gen))
        counts[t] = counts.get(t, 0) + 1
    chi2 = sum((counts.get(a, 0) - samples * float(p_tab[V, a])) ** 2 / (samples * float(p_tab[V, a])) for a in range(V))
    assert chi2 > 16.27  # alpha = 1e-3, df = 3


# --------------------------------------------------------------------------- the tensor path
def _random_round(g: torch.Generator, k: int, vocab: int, degenerate: bool, posinf: bool = False):
    """Target logits [k+1, V], dense q [k, V] (sparse rows, as the wire carries them) and drafts;
    ``degenerate``: logits with -inf (filtered tokens) and +inf entries, q(x) = 0 for some
    drafts, and a row where p = q exactly (an all-zero residual)."""
    logits = torch.randn(k + 1, vocab, generator=g) * 3
    q = torch.zeros(k, vocab)
    for i in range(k):
        ids = torch.randperm(vocab, generator=g)[:8]
        q[i, ids] = torch.softmax(torch.randn(8, generator=g) * 2, -1)
    x = torch.multinomial(q, 1, generator=g)[:, 0] if k else torch.zeros(0, dtype=torch.long)
    if degenerate and k:
        logits[:, torch.randperm(vocab, generator=g)[: vocab // 3]] = float("-inf")
        if posinf:
            logits[0, int(x[0])] = float("inf")  # one certain token (argmax only: softmax gives NaN)
        else:
            logits[0] = float("-inf")
            logits[0, int(x[0])] = 0.0  # one certain token: every other p is 0
        if k > 1:
            q[1, int(x[1])] = 0.0  # a draft its own q could not have produced
        p_last = torch.softmax(logits[k - 1], -1)
        q[k - 1] = p_last  # p = q on this row: the residual is all zero
    return logits, q, x


@pytest.mark.parametrize("degenerate", [False, True])
def test_tensor_greedy_equals_reference(degenerate):
    g = torch.Generator().manual_seed(5)
    seen = set()
    for trial in range(300):
        k = trial % 6
        logits, _, x = _random_round(g, k, 50, degenerate, posinf=True)
        if trial % 3 == 0:  # drafts the target agrees with, up to a point
            best = logits.argmax(-1)
            x = best[:k].clone()
            cut = (trial // 3) % (k + 1)  # the first disagreement (k: none)
            if cut < k:
                x[cut] = (x[cut] + 1) % 50
        want = verify_greedy(logits, x)
        *got, valid = verify_greedy_tensor(logits, x).tolist()
        assert tuple(got) == want and valid == 1, (trial, k)
        assert verify_greedy_host(logits, x.tolist()) == (*want, 1), (trial, k)
        seen.add(want[0])
    assert len(seen) >= 4  # acceptance lengths were varied, not all zero


@pytest.mark.parametrize("degenerate", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_tensor_sampling_equals_reference_for_one_generator_state(degenerate, params):
    g = torch.Generator().manual_seed(9)
    kept = []
    for trial in range(200):
        k = trial % 6
        logits, q, x = _random_round(g, k, 50, degenerate)
        p = logits_to_probs(logits, params)
        a, b = make_generator(trial), make_generator(trial)
        want = verify_sampling(p, q, x, a)
        got = _tensor_sampling(p, q, x, b)
        assert got == want, (trial, k)
        assert torch.equal(a.get_state(), b.get_state())  # the same draws were consumed
        kept.append(want[0])
    assert len(set(kept)) >= 3


def test_tensor_paths_check_shapes():
    with pytest.raises(ValueError, match="rows"):
        verify_greedy_tensor(torch.zeros(2, 4), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="shapes"):
        verify_sampling_tensor(torch.zeros(2, 4), torch.zeros(2, 4), torch.tensor([1]), make_generator(0))


def test_tensor_paths_flag_what_is_no_distribution_instead_of_failing():
    """NaN logits (an overflow in 16 bits): the tensor path draws from a stand-in and says
    valid = 0, so that on a GPU nothing asserts on the device and the round can be refused."""
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    logits[1, 4] = float("nan")
    x = logits.argmax(-1)[:2]  # drafts the first row agrees with: the NaN row is read
    assert verify_greedy_tensor(logits, x).tolist()[2] == 0
    other = (logits[0].argmax() + 1) % 10  # a draft rejected at once: the NaN row is not read
    assert verify_greedy_tensor(logits, torch.tensor([int(other), 2])).tolist()[0::2] == [0, 1]
    p = torch.softmax(logits, -1)
    q = torch.full((2, 10), 0.1)
    x = torch.tensor([3, 5])
    outcomes = {tuple(verify_sampling_tensor(p, q, x, make_generator(s)).tolist()) for s in range(20)}
    assert all(valid == 0 for n, _, valid in outcomes if n == 1)  # row 1 is NaN: refused
    assert all(valid == 1 for n, _, valid in outcomes if n == 0)  # row 0 is a distribution: fine
    assert {n for n, _, _ in outcomes} >= {0, 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_argmax_rows_is_torch_argmax_ties_nan_and_infinities_included(dtype):
    """The CPU path (numpy's argmax) gives torch.argmax's indices: the first maximum, the first NaN
    of a row holding one, rows of infinities; views and inference-mode tensors too."""
    from common.verify import argmax_rows

    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        rows, vocab = 1 + trial % 6, (50, 49152)[trial % 2]
        x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
        r = int(torch.randint(rows, (1,), generator=g))
        cols = torch.randint(vocab, (3,), generator=g)
        kind = trial % 5
        if kind == 1:  # a tie at the top: the lower index wins
            x[r, cols] = x[r].max() + 1
        elif kind == 2:  # NaNs: the first NaN's index
            x[r, cols] = float("nan")
        elif kind == 3:
            x[r] = float("-inf")
            x[r, cols[1:]] = float("inf")
        elif kind == 4:
            x = x[:, ::2] if trial % 4 == 0 else x.t().contiguous().t()  # strided views
        assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1)), (trial, dtype)
    with torch.inference_mode():
        y = torch.randn(3, 700, generator=g)
        assert torch.equal(argmax_rows(y), torch.argmax(y, dim=-1))


def test_the_host_greedy_decision_is_the_tensor_paths_nan_rows_included():
    """``verify_greedy_host`` (the engine's CPU path) against ``verify_greedy_tensor``: the same
    (n, token, valid) wherever NaNs sit, read or not, in float32, float16 and float64, and through
    the tensor path for dtypes numpy lacks."""
    g = torch.Generator().manual_seed(11)
    outcomes = set()
    for trial in range(400):
        k = trial % 6
        dtype = (torch.float32, torch.float16, torch.float64, torch.bfloat16)[trial % 4]
        logits = (torch.randn(k + 1, 300, generator=g) * 3).to(dtype)
        best = logits.float().argmax(-1)
        x = best[:k].clone()
        cut = trial % (k + 1)
        if cut < k:
            x[cut] = (x[cut] + 1) % 300
        if trial % 3:  # NaNs in a random row, before, at or after the first rejection
            logits[int(torch.randint(k + 1, (1,), generator=g)), int(torch.randint(300, (1,), generator=g))] = float("nan")
        want = tuple(verify_greedy_tensor(logits, x).tolist())
        assert verify_greedy_host(logits, x.tolist()) == want, (trial, k, dtype)
        outcomes.add((want[0], want[2]))
    assert {v for _, v in outcomes} == {0, 1} and len({n for n, _ in outcomes}) >= 4
    with pytest.raises(ValueError, match="rows"):
        verify_greedy_host(torch.zeros(2, 4), [1, 2])
