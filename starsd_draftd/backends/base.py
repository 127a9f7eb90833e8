"""The interface every draft backend implements; the server loop knows nothing else about drafting."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from common.verify import SamplingParams, logits_to_probs


@dataclass
class DraftRequest:
    """One session's request as the server hands it to a backend. ``new_features`` is a wire
    array (a read-only numpy view of the request's frame; ``common.tensors.as_torch`` views it
    as a tensor)."""

    state: object
    verified: list[int]
    depth: int
    new_features: np.ndarray | torch.Tensor | None = None


@dataclass
class Draft:
    """k proposed tokens; in sampling mode also the sparse proposal distribution each was drawn
    from: ``q_ids`` [k, K] int32 and ``q_probs`` [k, K] float32 (rows sum to 1), as torch
    tensors or numpy arrays."""

    tokens: list[int]
    q_ids: torch.Tensor | np.ndarray | None = None
    q_probs: torch.Tensor | np.ndarray | None = None


class ChainDrafter:
    """Collects a chain of draft tokens: argmax when greedy; otherwise each token is drawn from
    the top-k truncation of q (after the request's temperature / top-k / top-p), and that
    truncated q is what the target verifies against, so speculative sampling stays exact."""

    def __init__(self, params: SamplingParams, generator: torch.Generator, q_topk: int):
        self.params = params
        self.generator = generator
        self.q_topk = q_topk
        self.tokens: list[int] = []
        self._ids: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            tok = int(torch.argmax(logits))
        else:
            top = torch.topk(logits_to_probs(logits, self.params), min(self.q_topk, logits.shape[-1]))
            mass = (top.values / top.values.sum()).cpu()
            tok = int(top.indices[int(torch.multinomial(mass, 1, generator=self.generator))])
            self._ids.append(top.indices.to(torch.int32).cpu())
            self._probs.append(mass)
        self.tokens.append(tok)
        return tok

    def take(self, tok: int) -> int:
        """Record a greedy pick made outside (e.g. one argmax over a whole batch)."""
        self.tokens.append(tok)
        return tok

    def result(self) -> Draft:
        if not self._ids:
            return Draft(self.tokens)
        return Draft(self.tokens, torch.stack(self._ids), torch.stack(self._probs))


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


class DraftBackend(abc.ABC):
    """Per-session state is opaque to the server; the backend creates, uses and frees it."""

    name: str = "base"
    vocab_size: int
    fingerprint: str
    feature_size: int = 0  # >0: each request must bring target features of this width
    max_len: int | None = None  # longest sequence (verified + drafts) the drafter can attend over
    kv_bytes_per_token: int = 0  # cache memory a session holds per position (0: none worth bounding)

    @abc.abstractmethod
    def new_state(self, params: SamplingParams) -> object:
        """Fresh state for one session (caches, a seeded generator...)."""

    @abc.abstractmethod
    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None) -> Draft:
        """Propose ``depth`` tokens following ``verified`` (the whole verified sequence).

        The backend reuses whatever of its cached work still matches ``verified`` and
        rolls back the rest. ``new_features`` ([m, feature_size], only for backends with
        feature_size > 0) are the target's features for the positions after those this
        session already holds; with them it holds one per verified token but the last."""

    def draft_many(self, requests: list[DraftRequest]) -> list[Draft]:
        """Serve several sessions' requests at once. The default serves them one after another;
        backends that can batch the sessions' forwards override it."""
        return [self.draft(r.state, r.verified, r.depth, r.new_features) for r in requests]

    def release(self, state: object) -> None:
        """Free a session's state (default: let garbage collection do it)."""

    def counters(self) -> dict:
        """The backend's own counts for STATS (default: none)."""
        return {}
