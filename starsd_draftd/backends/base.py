"""The interface every draft backend implements; the server loop knows nothing else about drafting."""

from __future__ import annotations

import abc
import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch

from common.verify import SamplingParams, logits_to_probs


@dataclass
class DraftRequest:
    """One session's request as the server hands it to a backend. ``new_features`` is a wire
    array (a read-only numpy view of the request's frame; ``common.tensors.as_torch`` views it
    as a tensor). ``tree_tokens``: the most draft tokens (tree nodes) the target verifies this
    round; a backend drafts a tree when it exceeds ``depth`` and the backend's ``tree_topk`` is
    above 1, else a chain of ``depth``."""

    state: object
    verified: list[int]
    depth: int
    new_features: np.ndarray | torch.Tensor | None = None
    tree_tokens: int = 0


@dataclass
class Draft:
    """k proposed tokens; in sampling mode also the sparse proposal distribution each was drawn
    from: ``q_ids`` [k, K] int32 and ``q_probs`` [k, K] float32 (rows sum to 1), as torch
    tensors or numpy arrays. ``parents``: None for a chain; for a tree (``common.tree``), each
    node's parent (ROOT or an earlier node), and row i of q is the distribution node i was
    drawn from, its parent's (siblings share a row; they were drawn from it in node order
    without replacement)."""

    tokens: list[int]
    q_ids: torch.Tensor | np.ndarray | None = None
    q_probs: torch.Tensor | np.ndarray | None = None
    # per token, the draft's most likely other token there (None: not known, e.g. copied from
    # the context): lookahead's guess of what the target puts there when it rejects the draft
    # (kept on this side; never sent)
    alternatives: list[int | None] | None = None
    parents: list[int] | None = None


_MASK64 = (1 << 64) - 1


def position_seed(base: int, position: int) -> int:
    """The seed of a session's draft draw at sequence ``position`` (splitmix64 of the pair): a
    draw depends on the session's seed and where it lands, never on how many draws came before,
    so drafting ahead of a request (lookahead) and on request draw alike, and a seeded
    generation gives the same tokens whatever the timing. Each position's draw decides an
    output at most once (a position's draft is examined in one round only: kept, or replaced by
    the target's token), so reusing it across rounds keeps speculative sampling exact."""
    z = (base * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def session_seed(params: SamplingParams) -> int:
    """The base of a session's position seeds: its seed, or fresh entropy when it has none."""
    return int(params.seed) & _MASK64 if params.seed is not None else secrets.randbits(64)


class ChainDrafter:
    """Collects a chain of draft tokens: argmax when greedy; otherwise each token is drawn from
    the top-k truncation of q (after the request's temperature / top-k / top-p), and that
    truncated q is what the target verifies against, so speculative sampling stays exact.
    ``seed``: the session's ``session_seed``; with it, the draw for the token at sequence
    position ``start + j`` is the inverse CDF of q at the uniform ``position_seed(seed, start + j)``
    makes (its top 53 bits); without it, a draw from the generator's running stream."""

    def __init__(self, params: SamplingParams, generator: torch.Generator, q_topk: int,
                 seed: int | None = None, start: int = 0):
        self.params = params
        self.generator = generator
        self.q_topk = q_topk
        self.seed, self.start = seed, start
        self.tokens: list[int] = []
        self.alternatives: list[int | None] = []
        self._ids: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            best = torch.topk(logits, 2).indices.tolist() if logits.shape[-1] > 1 else [int(torch.argmax(logits))] * 2
            tok = best[0]
            self.alternatives.append(best[1])
        else:
            top = torch.topk(logits_to_probs(logits, self.params), min(self.q_topk, logits.shape[-1]))
            mass = (top.values / top.values.sum()).cpu()
            if self.seed is not None:  # inverse CDF at a uniform taken from all 64 bits of the position's seed
                u = (position_seed(self.seed, self.start + len(self.tokens)) >> 11) * 2.0 ** -53
                cdf = torch.cumsum(mass.double(), 0)
                at = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
                tok = int(top.indices[min(int(torch.searchsorted(cdf, at, right=True)), mass.shape[0] - 1)])
            else:
                tok = int(top.indices[int(torch.multinomial(mass, 1, generator=self.generator))])
            first = top.indices[:2].tolist()
            self.alternatives.append(first[0] if first[0] != tok or len(first) < 2 else first[1])
            self._ids.append(top.indices.to(torch.int32).cpu())
            self._probs.append(mass)
        self.tokens.append(tok)
        return tok

    def take(self, tok: int, alternative: int | None = None) -> int:
        """Record a greedy pick made outside (one argmax over a whole batch, a token copied from
        the context), with the model's most likely other token there if known."""
        self.tokens.append(tok)
        self.alternatives.append(alternative)
        return tok

    def result(self) -> Draft:
        if not self._ids:
            return Draft(self.tokens, alternatives=list(self.alternatives))
        return Draft(self.tokens, torch.stack(self._ids), torch.stack(self._probs), list(self.alternatives))


class ContextLookup:
    """Drafting from the context: the token that followed the latest earlier occurrence of the
    sequence's last n tokens (n from ``n_max`` down to ``n_min``), or None when they never occurred.

    Outputs repeat their prompts and themselves (code, lists, quoted text), and there a small draft
    model is weakest: copying needs attention over the whole context. Lookup is tried first at
    each greedy draft step, and the model picks where it finds nothing. It costs a vectorised scan
    of the sequence per step and changes nothing in the output: the target verifies every draft."""

    def __init__(self, n_max: int = 4, n_min: int = 2):
        if not 1 <= n_min <= n_max:
            raise ValueError("lookup needs 1 <= n_min <= n_max")
        self.n_max, self.n_min = n_max, n_min

    def __call__(self, seq: np.ndarray) -> int | None:
        """``seq``: the session's tokens so far (verified, then drafted), as an int64 array."""
        length = int(seq.shape[0])
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            starts = length - n  # candidate occurrences end before the last token: seq[i:i+n], i < length - n
            hit = np.ones(starts, dtype=bool)
            for j in range(n):
                hit &= seq[j: j + starts] == seq[length - n + j]
            found = np.flatnonzero(hit)
            if found.size:
                return int(seq[found[-1] + n])
        return None


class Lookahead:
    """A session's next round drafted ahead of its request, in small steps (one model forward
    each) while the draft daemon has nothing queued, for one or more guesses of the sequence
    its next request brings (the drafts just sent all kept and the draft's guess of the
    target's next token; or kept up to a position and the draft's second choice there).

    ``guesses`` holds each guessed sequence once known (None until then: the all-kept guess
    needs the first forward); ``result`` the drafts for each once done. ``step()`` runs one
    step; ``take(i)`` finishes the work (a request for exactly ``guesses[i]`` came) and returns
    guess i's drafts, leaving the session's state as if drafted for it on request; ``close()``
    drops the work (the session's state is untouched, or consistent, after every step)."""

    def __init__(self, start: Callable[["Lookahead"], Generator[None, None, list[Draft]]],
                 guesses: list[list[int] | None], adopt: Callable[[int], None] | None = None,
                 steps: int | None = None):
        """``start(task)``: the steps, a generator that yields after each forward, fills in
        ``task.guesses`` as they become known and returns one Draft per guess. ``adopt(i)``:
        make the session's state that of guess i's drafting (None: nothing to do). ``steps``:
        how many forwards the work takes in all, if known."""
        self.guesses = guesses
        self.result: list[Draft] | None = None
        self.total_steps = steps
        self.steps = 0
        self.seconds = 0.0  # the time its steps took
        self._adopt = adopt
        self._steps = start(self)

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def steps_left(self) -> int | None:
        return None if self.total_steps is None else max(self.total_steps - self.steps, 0)

    def match(self, sequence: list[int]) -> int | None:
        """Which guess ``sequence`` is, if any."""
        for i, g in enumerate(self.guesses):
            if g is not None and len(g) == len(sequence) and g == sequence:
                return i
        return None

    def step(self) -> bool:
        """Run one step; whether the work is done."""
        if self.result is None:
            t0 = time.perf_counter()
            try:
                next(self._steps)
                self.steps += 1
            except StopIteration as stop:
                if stop.value is None:
                    raise RuntimeError("drafting ahead ended without drafts") from None
                self.result = stop.value
            finally:
                self.seconds += time.perf_counter() - t0
        return self.result is not None

    def take(self, i: int) -> Draft:
        while not self.step():
            pass
        if self._adopt is not None:
            self._adopt(i)
        return self.result[i]

    def close(self) -> None:
        self._steps.close()


def frontier_width(topk: int, depth: int, budget: int) -> int:
    """Nodes a greedy tree feeds per level: about the budget's nodes per level (ceil(budget /
    depth)), at most ``topk``. EAGLE-2's 60 tokens over depth 6 feed its top-k of 10."""
    return max(1, min(topk, -(-budget // max(depth, 1))))


class DraftBackend(abc.ABC):
    """Per-session state is opaque to the server; the backend creates, uses and frees it."""

    name: str = "base"
    vocab_size: int
    fingerprint: str
    feature_size: int = 0  # >0: each request must bring target features of this width
    feature_layers: tuple[int, ...] | None = None  # the target hidden states fused per feature (None: the final one)
    max_len: int | None = None  # longest sequence (verified + drafts) the drafter can attend over
    kv_bytes_per_token: int = 0  # cache memory a session holds per position (0: none worth bounding)
    tree_topk: int = 1  # most children a draft tree's node gets (1: chains only)

    def drafts_tree(self, depth: int, tree_tokens: int) -> bool:
        """Whether a request for ``depth`` tokens and up to ``tree_tokens`` nodes gets a tree."""
        return self.tree_topk > 1 and depth >= 1 and tree_tokens > depth

    def tree_room(self, depth: int, tree_tokens: int, greedy: bool) -> int:
        """Cache positions beyond the verified ones that drafting a request takes: a chain's
        depth; a greedy tree feeds its frontier (``frontier_width``) at every level below the
        first; a sampled tree (the chain with leaves beside it) its chain only."""
        if not greedy or not self.drafts_tree(depth, tree_tokens):
            return depth
        return max(depth, frontier_width(self.tree_topk, depth, tree_tokens) * (depth - 1))

    @abc.abstractmethod
    def new_state(self, params: SamplingParams) -> object:
        """Fresh state for one session (caches, a seeded generator...)."""

    @abc.abstractmethod
    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None, tree_tokens: int = 0) -> Draft:
        """Propose ``depth`` tokens following ``verified`` (the whole verified sequence), or a
        tree of up to ``tree_tokens`` nodes at most ``depth`` deep (``drafts_tree``).

        The backend reuses whatever of its cached work still matches ``verified`` and
        rolls back the rest. ``new_features`` ([m, feature_size], only for backends with
        feature_size > 0) are the target's features for the positions after those this
        session already holds; with them it holds one per verified token but the last.
        Backends that draft no trees (``tree_topk`` 1) may leave ``tree_tokens`` out."""

    def draft_many(self, requests: list[DraftRequest]) -> list[Draft]:
        """Serve several sessions' requests at once. The default serves them one after another;
        backends that can batch the sessions' forwards override it."""
        if self.tree_topk <= 1:  # a chains-only backend need not take tree_tokens
            return [self.draft(r.state, r.verified, r.depth, r.new_features) for r in requests]
        return [self.draft(r.state, r.verified, r.depth, r.new_features, tree_tokens=r.tree_tokens) for r in requests]

    drafts_ahead: bool = False  # lookahead() returns work (the server reserves memory for it first)

    def lookahead_rows(self, drafts: int) -> int:
        """How many copies of a session's cache its work ahead holds after ``drafts`` drafts."""
        return 1

    def lookahead(self, state: object, verified: list[int], draft: Draft, depth: int) -> Lookahead | None:
        """Start drafting a session's next round (``depth`` tokens) ahead of its request:
        ``verified`` is its verified sequence and ``draft`` the drafts just sent for it. None:
        this backend does not draft ahead (the default)."""
        return None

    def release(self, state: object) -> None:
        """Free a session's state (default: let garbage collection do it)."""

    def counters(self) -> dict:
        """The backend's own counts for STATS (default: none)."""
        return {}
