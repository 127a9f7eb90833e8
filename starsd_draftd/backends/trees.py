"""Draft trees on the draft side: the shapes a backend drafts when a target verifies more draft
tokens than its depth (``common.tree``: the shape both daemons agree on).

Greedy sessions get an EAGLE-2 style dynamic tree (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees"), grown level by level with the backend's forwards:
``GreedyTree``. Sampled sessions get a tree whose shape is settled before any draw it depends
on, drawn like the chain plus alternatives: ``CaterpillarDrafter``. The target verifies sampled
trees with recursive rejection sampling without replacement over each node's children, which is
exact when siblings were drawn in node order without replacement from their parent's q and no
node's number of children depends on those children's own values (or on nodes off its path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.tree import ROOT
from common.verify import SamplingParams
from starsd_draftd.backends.base import ChainDrafter, Draft, position_seed


MIN_LOGP = -30.0  # a node's log-probability floor (-inf: an id a cut output layer never computes)


@dataclass
class _Node:
    token: int
    parent: int  # ROOT, or the parent's index in GreedyTree.nodes
    depth: int
    score: float  # the draft's log-probability of the path down to this node
    chain: bool  # on the greedy chain (the first child of every chain node)
    prob: float | None = None  # the draft's probability of this token here (None: copied from the context)
    chance: float = 1.0  # the calibrated chance that the target's path comes through this node


class GreedyTree:
    """An EAGLE-2 style dynamic tree of a greedy session, built with a backend's forwards.

    Level 1 holds the root's best ``topk`` tokens (``grow(ROOT, ...)``). Each next level: the
    ``width`` (default ``topk``) nodes of the level above with the highest path score (the sum of
    the draft's log-probabilities along the path; ``frontier``) are fed in one forward (``feed``
    says what each of them sees), and each gets its best ``topk`` tokens as children (``grow``).
    ``draft(budget)`` keeps the best-scored nodes, ancestor-closed. A forward's cost grows with
    the nodes it feeds (each also takes a row of the LM head), so a small budget is best drafted
    with a narrow frontier: ``base.frontier_width``.

    One departure from EAGLE-2: the greedy chain (at each chain node its first child, the draft's
    best token, or the token a backend's lookup copied from the context there) is always fed and
    always kept (where it pays, below), even where other paths score higher. The tree's
    first-child path is then the chain the backend drafts for the same request, and a tree never
    gets fewer tokens accepted than that chain would.

    **Nodes that must pay their row** (``chance`` and ``floor``: the session's ``Calibration``
    and the request's threshold, its ``min_chance`` or else ``min_survival``): a node's chance
    is its parent's times the calibrated chance of its own token (``chance(prob)``, ``prob``
    None for a copy), the chance that the target's greedy path runs through it. A node below
    ``floor`` is neither fed nor kept, the chain's included: the marginal rule a chain stops by
    (``base.Stopping``), node by node, so that where a verified row costs much (a CPU) the tree
    shrinks towards the chain, or to nothing, and where rows are nearly free (a GPU: a low
    floor) it fills its budget. Chances fall along a path, so what is kept stays ancestor-closed."""

    def __init__(self, topk: int, width: int | None = None, chance=None, floor: float = 0.0):
        self.topk = topk
        self.width = topk if width is None else max(1, width)
        self.chance_of = chance  # prob (None: copied) -> chance kept given the parent was; None: no floor
        self.floor = floor if chance is not None else 0.0
        self.sent_chain = Draft([])  # the chain the last draft() kept, with its probabilities (Calibration.sent)
        self.nodes: list[_Node] = []
        self.fed: list[int] = []  # the nodes forwards have fed, in the order they entered the cache
        self.chain: list[int] = []  # the chain's node at each depth (index depth - 1)

    def grow(self, parent: int, logits: torch.Tensor, first: int | None = None) -> None:
        """Give ``parent`` (ROOT or a fed node) its candidate children: the best ``topk`` tokens of
        ``logits`` [V] (the draft's logits after the parent's path); ``first``, for a chain node
        only, is the chain's next token when it did not come from these logits (lookup)."""
        on_chain = parent == ROOT or self.nodes[parent].chain
        if first is not None and not on_chain:
            raise ValueError("only the chain's nodes take a first child from outside")
        top = torch.topk(logits, min(self.topk, logits.shape[-1])).indices.tolist()
        if first is not None:
            top = [first] + [t for t in top if t != first][: self.topk - 1]
        full = torch.log_softmax(logits.float(), dim=-1)
        logp = full[top].clamp(min=MIN_LOGP).tolist()
        if first is not None and not torch.isfinite(full[first]):
            # a token copied from the context that a cut output layer (common.draft_vocab) cannot
            # score: rated as the head's own best pick (copies are kept at least as often), not
            # -inf, which would rank the chain's whole subtree below every other branch
            logp[0] = float(full.max())
        base, depth = (0.0, 1) if parent == ROOT else (self.nodes[parent].score, self.nodes[parent].depth + 1)
        above = 1.0 if parent == ROOT else self.nodes[parent].chance
        for rank, (tok, lp) in enumerate(zip(top, logp)):
            if on_chain and rank == 0:
                self.chain.append(len(self.nodes))
            prob = None if first is not None and rank == 0 else math.exp(lp)
            chance = above * self.chance_of(prob) if self.chance_of is not None else 1.0
            self.nodes.append(_Node(int(tok), parent, depth, base + lp, on_chain and rank == 0, prob, chance))

    def pays(self, node: int) -> bool:
        """Whether ``node``'s chance reaches the floor (always, without one)."""
        return self.nodes[node].chance >= self.floor

    def frontier(self, depth: int) -> list[int]:
        """The nodes at ``depth`` to feed next, in node order: the ``width`` best-scored, the
        chain's node among them (in place of the last if it was not); only nodes that pay (none:
        the tree stops growing)."""
        level = [i for i, n in enumerate(self.nodes) if n.depth == depth and self.pays(i)]
        best = sorted(level, key=lambda i: (-self.nodes[i].score, i))[: self.width]
        chain = self.chain[depth - 1] if depth <= len(self.chain) else None
        if best and chain is not None and self.pays(chain) and chain not in best:
            best[-1] = chain
        return sorted(best)

    def token(self, node: int) -> int:
        return self.nodes[node].token

    def parent(self, node: int) -> int:
        return self.nodes[node].parent

    def on_chain(self, node: int) -> bool:
        return self.nodes[node].chain

    def feed(self, nodes: list[int]) -> torch.Tensor:
        """Record that a forward feeds ``nodes`` after those fed before; which of the fed nodes
        and ``nodes`` each of them sees (its ancestors and itself): bool [len(nodes), fed + len(nodes)].
        Every ancestor was fed: only fed nodes have children."""
        cols = {n: c for c, n in enumerate(self.fed + nodes)}
        see = torch.zeros(len(nodes), len(cols), dtype=torch.bool)
        for row, node in enumerate(nodes):
            while node != ROOT:
                see[row, cols[node]] = True
                node = self.nodes[node].parent
        self.fed.extend(nodes)
        return see

    def draft(self, budget: int) -> Draft:
        """The tree sent: the chain, then the other nodes by score (each with whatever of its
        ancestors is missing, as long as all fit), up to ``budget`` nodes; renumbered by depth, and
        under each parent the chain's node first, then by score, so that parents precede
        children and the target tries the likelier children first."""
        chain = [i for i in self.chain if self.pays(i)]
        if len(chain) > budget:
            raise ValueError(f"a tree of {budget} nodes cannot hold the {len(chain)}-token chain")
        nodes = self.nodes
        self.sent_chain = Draft([nodes[i].token for i in chain], top_probs=[nodes[i].prob for i in chain])
        keep = set(chain)
        for i in sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i)):
            if not self.pays(i):
                continue
            if len(keep) >= budget:
                break
            path, node = [], i
            while node != ROOT and node not in keep:
                path.append(node)
                node = nodes[node].parent
            if len(keep) + len(path) <= budget:
                keep.update(path)
        if not keep:  # nothing pays its row: the round verifies the target's own token alone
            return Draft([], parents=[])  # still a tree to the daemon (no work ahead for a chain)
        order = sorted(keep, key=lambda i: (nodes[i].depth, not nodes[i].chain, -nodes[i].score, i))
        index = {node: j for j, node in enumerate(order)}
        return Draft([nodes[i].token for i in order],
                     parents=[ROOT if nodes[i].parent == ROOT else index[nodes[i].parent] for i in order])


def draw_siblings(ids: torch.Tensor, mass: torch.Tensor, first: int, count: int, seed: int | None,
                  position: int, generator: torch.Generator) -> list[int]:
    """``count`` more tokens of the sparse q (``ids`` [K], ``mass`` [K]) after ``first`` was
    drawn from it: each drawn from what is left of q once the tokens before it are removed,
    renormalised. Seeded, sibling j (1, 2, ...) is the inverse CDF of what is left at the uniform
    its own stream gives at ``position``: ``position_seed(position_seed(seed, j), position)``
    (the first child's is ``position_seed(seed, position)``, as in a chain)."""
    left = mass.double().clone()
    left[ids == first] = 0.0
    out = []
    for j in range(1, count + 1):
        if seed is not None:
            u = (position_seed(position_seed(seed, j), position) >> 11) * 2.0 ** -53
            cdf = torch.cumsum(left, 0)
            at = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
            k = int(torch.searchsorted(cdf, at, right=True))
            if k >= left.shape[0] or left[k] <= 0:  # rounding at the top end: the last token left
                k = int(torch.nonzero(left > 0)[-1])
        else:
            k = int(torch.multinomial(left, 1, generator=generator))
        out.append(int(ids[k]))
        left[k] = 0.0
    return out


class CaterpillarDrafter(ChainDrafter):
    """A sampled session's tree: the chain ``ChainDrafter`` draws (the same draws, seeded
    alike) and, at each chain position from the top down, up to ``topk`` - 1 more children of
    the chain's node there (siblings of its token: leaves drawn from the same q without
    replacement, ``draw_siblings``), until ``budget`` nodes in all. How many a position gets
    depends only on the budget left and on how many tokens its q holds, both known before
    anything there is drawn, and q depends only on the chain's path above: the target's
    rejection sampling without replacement over siblings stays exact. The alternatives are
    leaves, so the tree costs the chain's forwards. Nodes in order: each chain token, then its
    siblings; row i of q is node i's parent's distribution."""

    def __init__(self, params: SamplingParams, generator: torch.Generator, q_topk: int, seed: int | None,
                 start: int, topk: int, depth: int, budget: int):
        if params.greedy:
            raise ValueError("greedy sessions draft dynamic trees (GreedyTree)")
        super().__init__(params, generator, q_topk, seed, start)
        self.topk = topk
        self.spare = budget - depth  # nodes left for the alternatives
        self.nodes: list[tuple[int, int, int]] = []  # (token, parent, q row)
        self._last = ROOT  # the chain's latest node

    def pick(self, logits: torch.Tensor, top_prob: float | None = None) -> int:
        position = self.start + len(self.tokens)
        tok = super().pick(logits, top_prob)
        row = len(self._ids) - 1
        parent, self._last = self._last, len(self.nodes)
        self.nodes.append((tok, parent, row))
        ids, mass = self._ids[row], self._probs[row]
        extra = min(self.topk - 1, int((mass > 0).sum()) - 1, self.spare)
        if extra > 0:
            self.spare -= extra
            for sib in draw_siblings(ids, mass, tok, extra, self.seed, position, self.generator):
                self.nodes.append((sib, parent, row))
        return tok

    def take(self, tok: int, alternative: int | None = None) -> int:
        raise TypeError("a sampled tree's tokens are drawn, never taken")

    def result(self) -> Draft:
        if not self.nodes:
            return Draft([], parents=[])
        rows = torch.tensor([r for _, _, r in self.nodes], dtype=torch.long)
        return Draft([t for t, _, _ in self.nodes], torch.stack(self._ids)[rows], torch.stack(self._probs)[rows],
                     parents=[p for _, p, _ in self.nodes])


def chain_drafter(backend, st, start: int, depth: int, tree_tokens: int) -> ChainDrafter:
    """What picks a session's tokens along its chain, the first at sequence position ``start``:
    a ChainDrafter, or for a sampled tree (``backend.drafts_tree``) the chain's drafter that
    adds alternatives to it (leaves: the tree costs the chain's forwards). ``st``: the
    backend's session (its params, generator and position-seed base)."""
    if not st.params.greedy and backend.drafts_tree(depth, tree_tokens):
        return CaterpillarDrafter(st.params, st.generator, backend.q_topk, st.seed, start, backend.tree_topk,
                                  depth, tree_tokens)
    return ChainDrafter(st.params, st.generator, backend.q_topk, st.seed, start)
