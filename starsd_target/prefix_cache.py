"""Prompt prefixes kept across generations, so that a prompt that begins as an earlier one did
(a conversation's next turn, an agent's next step, requests sharing a system prompt or a tool
schema) skips the prefill of what they share.

What is kept is exact. A prefill feeds a prompt in chunks of the engine's ``prefill_chunk``
from its first position, and a chunk's keys and values depend on the rows it is computed with
(fbgemm's and oneDNN's GEMMs, attention, and wide prefill's bfloat16 all round by the chunk's
shape; measured on the demo target in fp16-weights: a prompt split at other places than 256
differs in its last bits). So only whole chunks are kept and reused: a chunk computed for an
earlier prompt holds the bits a fresh prefill of the new prompt would compute for it, since
both computed it from the same tokens with the same rows. A generation's output tokens,
which rounds computed a few rows at a time, are never kept.

A finished generation leaves the whole chunks of its prompt (``remember``), copied out of its
cache; a new generation takes the longest run of whole chunks it shares with one kept prompt
(``lookup``), copied into its own cache, and prefills from there. The memory is bounded
(``budget_bytes``): the prompts used longest ago go first; a prompt that another kept one
begins with is dropped as the longer one arrives. Feature-based drafters (EAGLE) need the
target's hidden states of every prompt position, which are not kept: such generations prefill
in full.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch

from common.slot_cache import SlotLayer

log = logging.getLogger("starsd.target")


@dataclass
class _Kept:
    tokens: list[int]  # whole chunks of a prompt
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, len(tokens), dim]
    nbytes: int


def cache_layers_kept(cache) -> bool:
    """Whether a cache's layers can be copied out and back (full-attention slot layers all)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer, SlotLayer) for layer in layers)


class PrefixCache:
    """Whole prefill chunks of recent prompts (see the module's docstring). The target's
    scheduler thread is its only user; ``snapshot`` may be read from another."""

    def __init__(self, budget_bytes: int, chunk: int):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.budget_bytes = max(int(budget_bytes), 0)
        self.chunk = chunk
        self._kept: collections.OrderedDict[int, _Kept] = collections.OrderedDict()  # oldest use first
        self._next_id = 0
        self.bytes = 0
        self.tokens = 0  # positions kept
        self.stats = {"lookups": 0, "hits": 0, "tokens_reused": 0, "kept": 0, "evicted": 0}

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._kept)

    def snapshot(self) -> dict:
        """What STATS reports."""
        return {**self.stats, "prompts": len(self._kept), "tokens": self.tokens, "bytes": self.bytes,
                "budget_bytes": self.budget_bytes}

    def _shared(self, kept: list[int], prompt: list[int], limit: int) -> int:
        """Whole chunks ``kept`` and ``prompt`` share from their start, up to ``limit`` positions."""
        c, n = self.chunk, 0
        end = min(len(kept), limit) // c * c
        while n < end and kept[n: n + c] == prompt[n: n + c]:
            n += c
        return n

    def lookup(self, prompt: list[int], limit: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The most positions of ``prompt`` (whole chunks, at most ``limit``: the positions its
        prefill feeds) a kept prompt holds, with their keys and values per layer; None when none
        holds a whole chunk of it."""
        if not self.enabled or limit < self.chunk:
            return None
        self.stats["lookups"] += 1
        best, best_id = 0, None
        for kid, kept in self._kept.items():
            n = self._shared(kept.tokens, prompt, limit)
            if n > best:
                best, best_id = n, kid
        if best_id is None:
            return None
        kept = self._kept[best_id]
        self._kept.move_to_end(best_id)
        self.stats["hits"] += 1
        self.stats["tokens_reused"] += best
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in kept.kv]

    @torch.inference_mode()
    def fill(self, cache, prompt: list[int], limit: int) -> int:
        """Write into ``cache`` (empty) the keys and values ``lookup`` finds for ``prompt``;
        returns how many positions it holds now."""
        hit = self.lookup(prompt, limit) if cache_layers_kept(cache) else None
        if hit is None:
            return 0
        n, kv = hit
        for li, (k, v) in enumerate(kv):
            cache.update(k, v, li)
        return n

    def remember(self, prompt: list[int], prefilled: int, cache) -> None:
        """Keep the whole chunks of ``prompt`` among the first ``prefilled`` positions of
        ``cache`` (a generation's, which prefilled them), unless a kept prompt holds them already."""
        if not self.enabled or not cache_layers_kept(cache):
            return
        n = min(prefilled, len(prompt), cache.get_seq_length()) // self.chunk * self.chunk
        if n == 0:
            return
        tokens = list(prompt[:n])
        for kid, kept in list(self._kept.items()):
            shared = self._shared(kept.tokens, tokens, n)
            if shared == n:  # held already (by this prompt, or a longer one it begins)
                self._kept.move_to_end(kid)
                return
            if shared == len(kept.tokens):  # a prompt this one begins with: the longer one replaces it
                self._drop(kid)
        kv = [(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()) for layer in cache.layers]
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.budget_bytes:
            return
        while self.bytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._kept)))
            self.stats["evicted"] += 1
        self._kept[self._next_id] = _Kept(tokens, kv, nbytes)
        self._next_id += 1
        self.bytes += nbytes
        self.tokens += n
        self.stats["kept"] += 1

    def _drop(self, kid: int) -> None:
        kept = self._kept.pop(kid)
        self.bytes -= kept.nbytes
        self.tokens -= len(kept.tokens)

    def clear(self) -> None:
        self._kept.clear()
        self.bytes = self.tokens = 0
