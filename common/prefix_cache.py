"""Keys and values of recent prompts kept across sequences, so that a prompt that begins as an
earlier one did (a conversation's next turn, an agent's next step, requests sharing a system
prompt or a tool schema) skips computing what they share.

A target keeps whole prefill chunks only (``chunk`` = its ``--prefill-chunk``), so that what it
reuses is exact. A prefill feeds a prompt in chunks of that length from its first position, and
a chunk's keys and values depend on the rows it is computed with (fbgemm's and oneDNN's GEMMs,
attention, and wide prefill's bfloat16 all round by the chunk's shape; measured on the demo
target in fp16-weights: a prompt split at other places than 256 differs in its last bits). A
chunk computed for an earlier prompt from the same tokens, at the same place, with the same
rows, holds the bits a fresh prefill of the new prompt would compute. A generation's output
tokens, which rounds computed a few rows at a time, are never kept there.

A draft daemon keeps whole sequences at any length (``chunk`` 1): its keys and values only
shape its drafts, which the target verifies, so bits do not matter; its partitions (``share``)
keep one tenant's text from another's.

``remember`` copies the first positions of a finished sequence's cache out; ``lookup`` finds the
longest run a kept sequence of the same share has in common with a new one, and ``fill`` copies
it into the new sequence's (empty) cache. The memory is bounded (``budget_bytes``): the sequences
used longest ago go first; a kept sequence that a newer one begins with is dropped as it arrives.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from common.models import common_prefix_len
from common.slot_cache import SlotLayer


@dataclass
class _Kept:
    share: object  # whose sequence it is (None: the only partition)
    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, len(tokens), dim]
    nbytes: int


def cache_layers_kept(cache) -> bool:
    """Whether a cache's layers can be copied out and back (full-attention slot layers all)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(isinstance(layer, SlotLayer) for layer in layers)


class PrefixCache:
    """Recent sequences' keys and values (see the module's docstring). One thread (a target's
    scheduler, a draft daemon's batcher) uses it; ``snapshot`` may be read from another."""

    def __init__(self, budget_bytes: int, chunk: int = 1):
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

    def _shared(self, kept: list[int], tokens: list[int], limit: int) -> int:
        """Whole chunks ``kept`` and ``tokens`` share from their start, up to ``limit`` positions."""
        return min(common_prefix_len(kept, tokens), limit) // self.chunk * self.chunk

    def lookup(self, tokens: list[int], limit: int, share: object = None
               ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The most positions of ``tokens`` (whole chunks, at most ``limit``) a kept sequence of
        ``share`` holds, with their keys and values per layer; None when none holds a chunk of it."""
        if not self.enabled or limit < self.chunk:
            return None
        self.stats["lookups"] += 1
        best, best_id = 0, None
        for kid, kept in self._kept.items():
            if kept.share == share:
                n = self._shared(kept.tokens, tokens, limit)
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
    def fill(self, cache, tokens: list[int], limit: int, share: object = None) -> int:
        """Write into ``cache`` (empty) the keys and values ``lookup`` finds for ``tokens``;
        returns how many positions it holds now."""
        hit = self.lookup(tokens, limit, share) if cache_layers_kept(cache) else None
        if hit is None:
            return 0
        n, kv = hit
        for li, (k, v) in enumerate(kv):
            cache.update(k, v, li)
        return n

    @torch.inference_mode()
    def remember(self, tokens: list[int], computed: int, cache, share: object = None) -> None:
        """Keep the whole chunks of ``tokens`` among the first ``computed`` positions of
        ``cache`` (a finished sequence's, which computed them), unless a kept sequence of
        ``share`` holds them already."""
        if not self.enabled or not cache_layers_kept(cache):
            return
        n = min(computed, len(tokens), cache.get_seq_length()) // self.chunk * self.chunk
        if n == 0:
            return
        tokens = list(tokens[:n])
        for kid, kept in list(self._kept.items()):
            if kept.share != share:
                continue
            shared = self._shared(kept.tokens, tokens, n)
            if shared == n:  # held already (by this sequence, or a longer one it begins)
                self._kept.move_to_end(kid)
                return
            if shared == len(kept.tokens):  # one this sequence begins with: the longer one replaces it
                self._drop(kid)
        kv = [(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()) for layer in cache.layers]
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.budget_bytes:
            return
        while self.bytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._kept)))
            self.stats["evicted"] += 1
        self._kept[self._next_id] = _Kept(share, tokens, kv, nbytes)
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
