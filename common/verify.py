"""Speculative verification as pure functions over tensors.

Notation (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

* ``x``  -- the k draft tokens x_1..x_k proposed by the draft model Mq;
* ``p``  -- target distributions, shape [k+1, V]: row i is Mp's distribution of the token
  that follows the prefix and x_1..x_i (row k gives the bonus token);
* ``q``  -- draft distributions, shape [k, V]: row i is the distribution x_{i+1} was sampled from;
* ``r``  -- uniform draws deciding acceptance.

The chain functions return ``(n, token)``: the first n draft tokens are kept, followed by
``token`` drawn from Mp (the correction on rejection, the bonus when all k are kept). The tree
functions (at the end) return ``(path, token)``: the kept nodes' indices, then that token.
The kept sequence is distributed exactly as sampling from p token by token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.tree import children


MIN_TEMPERATURE = 1e-5  # below it, logits / temperature overflows float32
MAX_TOP_K = (1 << 31) - 1  # token ids are int32 on the wire and in torch.topk
MAX_SEED = (1 << 63) - 1  # the wire protocol's uint range (msgpack cannot carry more)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        """Every field within what the verification math and the wire can carry: a value
        beyond (a top_k msgpack cannot encode, a seed torch cannot take) raises here, where the
        request came in, instead of in the scheduler thread that later uses it."""
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, inf), got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in 0..{MAX_TOP_K}, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..{MAX_SEED}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: the same seed must give the same tokens, so nothing about such a
        generation (its draft length, how its drafts are batched or fed) may follow timing."""
        return not self.greedy and self.seed is not None

    def to_wire(self) -> dict:
        return {"temperature": float(self.temperature), "top_k": int(self.top_k),
                "top_p": float(self.top_p), "seed": self.seed}

    @classmethod
    def from_wire(cls, d: dict) -> "SamplingParams":
        return cls(float(d["temperature"]), int(d.get("top_k", 0)), float(d.get("top_p", 1.0)), d.get("seed"))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private generator per request: seeded when a seed is given, fresh entropy otherwise."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, then top-p to logits [..., V]; return probabilities in float32.

    Top-p keeps the smallest set of highest-probability tokens whose mass reaches top_p
    (the token that crosses the threshold is kept)."""
    if params.greedy:
        raise ValueError("logits_to_probs is for sampling; greedy decoding uses argmax")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token always stays, however small top_p is
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


# dtypes numpy reads as they are (no bfloat16)
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def _numpy_rows(logits: torch.Tensor):
    """A numpy view of ``logits`` (no copy) where numpy can read them: on the CPU, in a dtype it
    has, outside autograd; else None."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and not logits.requires_grad:
        return logits.numpy()
    return None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)``, the same indices: each row's first maximum, or its first
    NaN where it holds one. On the CPU it is numpy's vectorised argmax over the same memory: torch's
    index-tracking reduction took 29 us per 49,152-logit row on one core, numpy 3 us."""
    a = _numpy_rows(logits)
    return torch.argmax(logits, dim=-1) if a is None else torch.from_numpy(a.argmax(-1))


def verify_greedy(target_logits: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    """Keep x_i while it equals argmax p_{i-1}; then Mp's own argmax token."""
    k = int(x.shape[0])
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of target logits for {k} drafts, got {target_logits.shape[0]}")
    best = argmax_rows(target_logits)
    n = 0
    while n < k and int(x[n]) == int(best[n]):
        n += 1
    return n, int(best[n])


def verify_sampling(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling: keep x_i with probability min(1, p(x_i) / q(x_i)); on the first
    rejection draw from norm(max(0, p - q)); if all k survive draw the bonus from p_k.

    Guards: a draft token with q(x) = 0 cannot have been drawn from q and is rejected;
    an all-zero residual (p <= q everywhere, only possible through rounding) falls back to p.
    """
    k = int(x.shape[0])
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"shapes: p {tuple(p.shape)} and q {tuple(q.shape)} do not fit {k} drafts")
    p = p.float()
    q = q.float()
    # all k uniforms first, in one draw: the tensor path (verify_sampling_tensor) draws them the
    # same way, so one generator state gives both paths the same tokens
    r = torch.rand(k, generator=generator, device=generator.device)
    for i in range(k):
        xi = int(x[i])
        p_x = float(p[i, xi])
        q_x = float(q[i, xi])
        if q_x > 0.0 and float(r[i]) < min(1.0, p_x / q_x):
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0.0 else p[i]
        return i, sample(dist, generator)
    return k, sample(p[k], generator)


def dense_q(q_ids: torch.Tensor, q_probs: torch.Tensor, vocab: int,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Scatter sparse top-k proposals ([k, K] ids and probabilities) into dense rows [k, vocab]."""
    q = torch.zeros(q_ids.shape[0], vocab, dtype=torch.float32, device=device)
    if q_ids.numel():
        q.scatter_(1, q_ids.to(device, torch.long), q_probs.to(device, torch.float32))
    return q


# ---------------------------------------------------------------- the tensor path
# The same decisions as verify_greedy and verify_sampling, as tensor operations on whatever device
# the logits are on: no Python loop over positions and no host sync. Each returns a long tensor
# [n, token, valid] on that device; the caller moves it to the host once (for a batch of
# generations, once for all of them) and refuses the round when valid is 0: NaN logits where the
# round reads them, or a row that is no distribution, from which a categorical draw would fail (or
# return nonsense) on the device instead of failing the one request.


def verify_greedy_tensor(target_logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``verify_greedy`` as tensor ops: n is the length of the prefix of x that matches the
    argmax rows (a cumulative product of matches), the token is the argmax after it; valid is 0
    if a row it read (0..n) holds a NaN."""
    k = int(x.shape[0])
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of target logits for {k} drafts, got {target_logits.shape[0]}")
    top, best = target_logits.max(dim=-1)  # the first maximum's index, as argmax
    n = (x.to(best.device) == best[:k]).long().cumprod(0).sum()
    read = torch.arange(k + 1, device=best.device) <= n  # the rows the decision read: up to the token's
    if target_logits.device.type in ("cpu", "cuda"):
        nan_rows = torch.isnan(top)  # max propagates NaN there: a row's max is NaN iff it holds one
    else:
        nan_rows = torch.isnan(target_logits).any(-1)
    valid = (~(nan_rows & read).any()).long()
    return torch.stack([n, best.gather(0, n.view(1))[0], valid])


def verify_greedy_host(target_logits: torch.Tensor, x: list[int]) -> tuple[int, int, int]:
    """``verify_greedy_tensor``'s (n, token, valid) for logits on the CPU, decided through numpy
    over the same memory: two vectorised passes (each row's first maximum, and its maximum for the
    NaN check: numpy's max propagates NaN) and a walk over n + 1 integers. Right after a forward
    has streamed the model's weights through the caches, each small torch op of the tensor path
    cost 10-60 us on one core: for the demo target the tensor path took 321 us for a round on the
    target alone and 574 us for a 5-token verification, this 148 and 167 us. Logits elsewhere, or
    in a dtype numpy lacks, go through the tensor path."""
    a = _numpy_rows(target_logits)
    if a is None:  # the tensor path checks the shapes itself
        return tuple(verify_greedy_tensor(target_logits, torch.tensor(x, dtype=torch.long)).tolist())
    k = len(x)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of target logits for {k} drafts, got {target_logits.shape[0]}")
    best = a.argmax(-1).tolist()
    n = 0
    while n < k and x[n] == best[n]:
        n += 1
    nan = a[: n + 1].max(-1)  # the rows the decision read
    return n, best[n], int(not (nan != nan).any())


def verify_sampling_tensor(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor,
                           generator: torch.Generator) -> torch.Tensor:
    """``verify_sampling`` as tensor ops, consuming ``generator`` the same way (k uniforms, then
    one categorical draw), so that one generator state gives the same [n, token]:

    - x_i is accepted when q(x_i) > 0 and r_i < min(1, p(x_i) / q(x_i)) (the ratio in float64,
      as the reference computes it); n is the count of leading acceptances;
    - the token comes from row n of norm(max(0, p - q)), or of p where n = k (the bonus) or where
      that residual is all zero (rounding); one row is built, never all k + 1;
    - valid is 0 when that row is no distribution (NaN, negative, or all zero); the draw is then
      made from a stand-in, so that nothing fails on the device, and the caller refuses the round.
    """
    k = int(x.shape[0])
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"shapes: p {tuple(p.shape)} and q {tuple(q.shape)} do not fit {k} drafts")
    p = p.float()
    q = q.float()
    r = torch.rand(k, generator=generator, device=generator.device).to(p.device)
    idx = x.to(p.device, torch.long).view(k, 1)
    p_x = p[:k].gather(1, idx)[:, 0]
    q_x = q.gather(1, idx)[:, 0]
    wide = torch.float32 if p.device.type == "mps" else torch.float64  # MPS has no float64
    ratio = torch.clamp(p_x.to(wide) / torch.where(q_x > 0, q_x, 1.0).to(wide), max=1.0)
    accept = (q_x > 0) & (r.to(wide) < ratio)
    n = accept.long().cumprod(0).sum()
    at = n.view(1)
    p_n = p.index_select(0, at)
    q_n = torch.cat([q, q.new_zeros(1, q.shape[-1])]).index_select(0, at)
    residual = torch.clamp(p_n - q_n, min=0.0)
    total = residual.sum(-1, keepdim=True)
    use_residual = (at < k).view(1, 1) & (total > 0)
    dist = torch.where(use_residual, residual / torch.where(total > 0, total, 1.0), p_n)
    valid = torch.isfinite(dist).all() & (dist >= 0).all() & (dist.sum() > 0)
    safe = torch.zeros_like(dist)
    safe[:, 0] = 1.0
    token = torch.multinomial(torch.where(valid, dist, safe), 1, generator=generator).view(()).to(n.device)
    return torch.stack([n, token, valid.long().to(n.device)])


# ---------------------------------------------------------------- trees
# A draft tree (``common.tree``): tokens x_0..x_{n-1} with parents; row 0 of p (or of the logits)
# is the target's distribution after the last verified token (the root), row 1 + i its
# distribution after node i's path. The kept tokens are a root path: node indices, from the root's
# child down, followed by one token the target draws (the correction, or the bonus at a leaf).


def verify_tree_greedy(target_logits: torch.Tensor, x: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Greedy verification of a tree: from the root, go to the child whose token equals the
    target's argmax there (the first such child in node order) while there is one; the kept path
    is the longest root path whose every token is the target's argmax, then the target's argmax
    at its end. One transfer of the argmax rows to the host; the walk is over n + 1 integers."""
    n = len(x)
    if target_logits.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} rows of target logits for a tree of {n} nodes, got {target_logits.shape[0]}")
    best = argmax_rows(target_logits).tolist()
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids[row] if x[c] == best[row]), None)
        if nxt is None:
            return path, best[row]
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampling(p: torch.Tensor, q: torch.Tensor, x: list[int], parents: list[int],
                         generator: torch.Generator) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over a tree: recursive rejection sampling (SpecInfer:
    Miao et al. 2024, "SpecInfer: Accelerating Large Language Model Serving with Tree-based
    Speculative Inference and Verification", multi-step speculative sampling) in its form for
    siblings drawn without replacement (Jeon et al. 2024, "Recursive Speculative Decoding:
    Accelerating LLM Inference via Sampling Without Replacement").

    At a node u with target distribution p_u and children c_1..c_m (node order, the order they
    were drawn in from u's draft distribution q_u, each without the ones before):

    - q^(1) = q_u; child c_j (token x) is kept with probability min(1, p^(j)(x) / q^(j)(x)),
      where p^(1) = p_u;
    - after a rejection, p^(j+1) = norm(max(0, p^(j) - q^(j))) and q^(j+1) = q^(j) with x
      removed and renormalised (the distribution the next sibling was drawn from);
    - a kept child becomes u; when all children of u are rejected, the token is drawn from the
      last residual p^(m+1); at a node without children, from p_u (the bonus).

    ``q`` row i is node i's row as sent: the distribution it was drawn from before its earlier
    siblings were removed, i.e. its parent's draft distribution. Guards: a child with
    q^(j)(x) = 0 cannot have been drawn and is rejected (the residual update still applies); a
    residual with no mass (p <= q everywhere, only through rounding) falls back to p^(j); a q
    with no mass left is not updated. Returns (kept node indices from the root's child down,
    the token the target draws)."""
    n = len(x)
    if p.shape[0] != n + 1 or q.shape[0] != n:
        raise ValueError(f"shapes: p {tuple(p.shape)} and q {tuple(q.shape)} do not fit a tree of {n} nodes")
    p = p.float()
    q = q.float()
    kids = children(parents)
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
            residual = torch.clamp(target - draft, min=0.0)
            total = float(residual.sum())
            if total > 0.0:
                target = residual / total
            draft[xc] = 0.0
            mass = float(draft.sum())
            if mass > 0.0:
                draft = draft / mass
        else:
            return path, sample(target, generator)
        row = path[-1] + 1
