"""Draft trees: the shape both daemons agree on, its checks, and the attention a tree forward needs.

A tree of n draft tokens is two lists: ``tokens[i]`` and ``parents[i]``, where ``parents[i]`` is
the index of node i's parent, or ``ROOT`` (-1) for a child of the last verified token. Every
parent precedes its children (``parents[i] < i``); a chain is the tree with ``parents[i] = i - 1``.
Siblings are ordered: the target tries a node's children in node order, and in sampling mode
they were drawn in that order, without replacement, from the distribution of their parent
(``common.verify.verify_tree_sampling``).

A node's depth is 1 for a child of the root, one more than its parent's otherwise; the token at
depth d lands at sequence position (verified length - 1) + d. A tree forward feeds the root (the
last verified token) and the n nodes; row 0 of its outputs belongs to the root, row 1 + i to
node i.
"""

from __future__ import annotations

import torch

ROOT = -1


class TreeError(ValueError):
    """A tree that breaks the shape above (a parent out of range or after its child, too deep)."""


def mask_refusal(config, architectures: tuple[str, ...] | None = None) -> str | None:
    """Why a model of this config cannot run a tree forward (a custom 4-D attention mask with
    position ids over an in-place cache), or None: it can. ``architectures``: the model types
    accepted (None: any whose attention and layers allow it)."""
    from common.slot_cache import SlotPool

    kind = getattr(config, "model_type", "?")
    if architectures is not None and kind not in architectures:
        return f"it is tested for {', '.join(architectures)} models, not {kind}"
    if not SlotPool.supports(config):
        return "the model has layers other than full attention (sliding windows, linear attention)"
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    if attn not in ("sdpa", "eager"):
        return f"its attention ({attn}) is not one that takes a custom 4-D mask (sdpa, eager)"
    return None


def check_parents(parents, n: int, max_depth: int | None = None) -> list[int]:
    """Each node's depth, after checking that ``parents`` (ints) fit a tree of ``n`` nodes: one
    parent per node, each ROOT or an earlier node, and no node deeper than ``max_depth``."""
    if len(parents) != n:
        raise TreeError(f"a tree of {n} tokens needs {n} parents, got {len(parents)}")
    depth: list[int] = []
    for i, p in enumerate(parents):
        p = int(p)
        if not ROOT <= p < i:
            raise TreeError(f"node {i}'s parent {p} is neither {ROOT} (the last verified token) nor an earlier node")
        d = 1 if p == ROOT else depth[p] + 1
        if max_depth is not None and d > max_depth:
            raise TreeError(f"node {i} lies at depth {d}, deeper than {max_depth}")
        depth.append(d)
    return depth


def is_chain(parents) -> bool:
    return all(int(p) == i - 1 for i, p in enumerate(parents))


def depths(parents) -> list[int]:
    return check_parents(parents, len(parents))


def children(parents) -> list[list[int]]:
    """Per row (0: the root, 1 + i: node i), the nodes whose parent it is, in node order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[int(p) + 1].append(i)
    return out


def path_to(parents, node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (ROOT: none)."""
    path = []
    while node != ROOT:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def ancestor_mask(parents, device=None) -> torch.Tensor:
    """[n + 1, n + 1] bool over (root, nodes): row r may see column c when c is r itself or one of
    its ancestors (the root is every node's ancestor)."""
    n = len(parents)
    check_parents(parents, n)  # a bad parent would read a row not built yet (or wrap around): TreeError
    see = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    see[:, 0] = True
    for i, p in enumerate(parents):
        row = see[int(p) + 1].clone()
        row[i + 1] = True
        see[i + 1] = row
    return see.to(device) if device is not None else see


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An attention mask a model adds to its scores: 0 where ``allowed``, dtype's minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def tree_attention(parents, cached: int, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-D attention mask [1, 1, n + 1, cached + n + 1] (0 where a query may look, dtype's
    minimum elsewhere) and position ids [1, n + 1] of a forward that feeds (root, nodes) after
    ``cached`` positions: each row sees every cached position and its own ancestors, at the
    position of its depth."""
    see = ancestor_mask(parents)
    n = len(parents)
    allowed = torch.cat([torch.ones(n + 1, cached, dtype=torch.bool), see], dim=1)
    mask = additive_mask(allowed, dtype)
    pos = torch.tensor([cached] + [cached + d for d in depths(parents)], dtype=torch.long)
    if device is not None:
        mask, pos = mask.to(device), pos.to(device)
    return mask[None, None], pos[None]
