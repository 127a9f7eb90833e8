"""Several sessions' KV caches as one padded batch, and back.

Row layout for session b with c_b cached positions and n_b new tokens, in a batch whose longest
cache holds P positions and whose longest feed has N tokens::

    [P - c_b zero slots][its c_b cached slots][its n_b new tokens][N - n_b pad tokens][steps...]

Masked slots never receive attention. Pads sit to the right of a row's new tokens, so every
query, pad or not, sees at least one real key (no all-masked softmax rows), and each row's last
real token is at index n_b - 1 of the new block. Cached keys keep their original rotary
positions; new tokens get explicit position ids.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence


def _layer_tensors(cache, n_layers: int, like: tuple[torch.Tensor, torch.Tensor] | None):
    out = []
    for i in range(n_layers):
        layer = cache.layers[i] if i < len(cache.layers) else None
        if layer is not None and layer.keys is not None and layer.keys.numel():
            out.append((layer.keys, layer.values))
        else:
            k, v = like
            out.append((k.new_zeros(1, k.shape[1], 0, k.shape[3]), v.new_zeros(1, v.shape[1], 0, v.shape[3])))
    return out


def left_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Cached keys or values [1, H, n_b, D] of several sessions as one batch [B, H, max n_b, D],
    each row right-aligned with zeros (finite) on the left, for the attention mask to hide."""
    return pad_sequence([t[0].transpose(0, 1) for t in rows], batch_first=True, padding_side="left").transpose(1, 2)


def padded_layout(lengths: list[int], news: list[int], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout's attention mask [B, P + N] (1 on each row's cached slots and new tokens), the
    new tokens' position ids [B, N] (each row's from its own cached length ``lengths[b]``) and
    the position of each row's first step after them [B]; ``news[b]``: the row's new tokens."""
    P, N = max(lengths, default=0), max(news, default=0)
    cached = torch.tensor(lengths, dtype=torch.long, device=device)
    fed = torch.tensor(news, dtype=torch.long, device=device)
    cols = torch.arange(P + N, device=device)
    mask = ((cols >= P - cached[:, None]) & (cols < P + fed[:, None])).long()
    return mask, cached[:, None] + torch.arange(N, device=device), cached + fed


def row_ranges(P: int, N: int, cached: int, new: int, kept: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """A row's column ranges in the layout: its own (``cached`` positions and ``new`` tokens) and
    the first ``kept`` steps after the new block, as ``row_slots`` takes them."""
    return (P - cached, P + new), (P + N, P + N + kept)


def row_slots(t: torch.Tensor, row: int, own: tuple[int, int], kept: tuple[int, int]) -> torch.Tensor:
    """Row ``row`` of a batched cache tensor [B, H, T, D] as a session's own [1, H, n, D]: the
    column range ``own`` (its cached positions and new tokens), then ``kept`` (the steps it
    keeps), copied so that the batch can be freed."""
    r = t[row: row + 1]
    if kept[1] <= kept[0]:
        return r[:, :, own[0]: own[1]].clone()
    if kept[0] == own[1]:  # adjacent: one slice
        return r[:, :, own[0]: kept[1]].clone()
    return torch.cat([r[:, :, own[0]: own[1]], r[:, :, kept[0]: kept[1]]], dim=2)


def _set_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make a cache layer hold exactly these keys and values. A slot layer copies them into its
    buffer; a plain DynamicLayer takes the tensors as they are (its ``update`` would copy them
    once more, onto an empty tensor); other layer kinds go through ``update`` and keep their
    own semantics."""
    from transformers.cache_utils import DynamicLayer

    from common.slot_cache import SlotLayer

    if isinstance(layer, SlotLayer):
        layer.replace(keys, values)
    elif type(layer) is DynamicLayer:
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    else:
        if layer.is_initialized:
            layer.reset()
        layer.update(keys, values)


class _ViewLayer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class CacheView:
    """The first ``length`` positions of a cache as a batch row, read only: what
    ``BatchedCaches`` reads of a row's cache (each layer's keys and values, and the length),
    without copying or cropping it. Lookahead batches several guesses over one session's
    cache this way, each row copied into the batch, the session's own cache left as it is."""

    def __init__(self, cache, length: int):
        self.length = length
        self.layers = [_ViewLayer(None if layer.keys is None else layer.keys[:, :, :length],
                                  None if layer.values is None else layer.values[:, :, :length])
                       for layer in cache.layers]

    def get_seq_length(self) -> int:
        return self.length


class BatchedCaches:
    def __init__(self, runner, caches: list, feeds: list[list[int]], device: torch.device, steps: int = 0):
        """``runner``: a ``common.runner.ModelRunner``; ``steps``: single-token steps to come
        (room for them is allocated with the batch)."""
        self.runner = runner
        self.device = device
        self.lengths = [c.get_seq_length() for c in caches]
        self.feeds = feeds
        self.P = max(self.lengths)
        self.N = max(len(f) for f in feeds)
        B = len(caches)
        self.cache = runner.new_cache(self.P + self.N + steps + 1)  # a slot to spare: never grows
        if self.P > 0:
            # one zeroed tensor per layer, each row's cache copied right-aligned into it
            ref = next(c for c, n in zip(caches, self.lengths) if n > 0)
            n_layers = len(ref.layers)
            like = (ref.layers[0].keys, ref.layers[0].values)
            per_row = [_layer_tensors(c, n_layers, like) for c in caches]
            for li in range(n_layers):
                _set_layer(self.cache.layers[li], left_padded([row[li][0] for row in per_row]),
                           left_padded([row[li][1] for row in per_row]))
        self.mask, pos, self.next_pos = padded_layout(self.lengths, [len(f) for f in feeds], device)
        ids = torch.tensor([f + [0] * (self.N - len(f)) for f in feeds], dtype=torch.long, device=device)
        self._first = (ids, pos)
        self.live_steps = [0] * B  # steps whose token each row keeps (a prefix of the steps)
        self.steps = 0

    def first(self) -> torch.Tensor:
        """Forward the new tokens; logits [B, V] at each row's last real token."""
        ids, pos = self._first
        out = self.runner(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache, use_cache=True)
        last = torch.tensor([len(f) - 1 for f in self.feeds], device=self.device)
        return out.logits[torch.arange(len(self.feeds), device=self.device), last]

    def step(self, tokens: list[int], live: list[bool]) -> torch.Tensor:
        """Feed one token per row (rows not ``live`` feed a masked filler; a row, once not live,
        stays so); logits [B, V]."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        col = torch.tensor(live, dtype=torch.long, device=self.device).unsqueeze(1)
        self.mask = torch.cat([self.mask, col], dim=1)
        pos = self.next_pos.unsqueeze(1).clone()
        self.next_pos = self.next_pos + 1
        out = self.runner(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache, use_cache=True)
        for b, keep in enumerate(live):
            if keep:
                self.live_steps[b] += 1
        self.steps += 1
        return out.logits[:, -1]

    def split(self, row: int, into) -> None:
        """Give session ``row``'s own cache ``into`` its real slots only, in order: its cached
        positions and new tokens, then the steps it kept (copies, so the batch can be freed)."""
        if len(into.layers) != len(self.cache.layers):
            raise RuntimeError(f"a session cache with {len(into.layers)} layers cannot take a batch row of "
                               f"{len(self.cache.layers)}")
        own, kept = row_ranges(self.P, self.N, self.lengths[row], len(self.feeds[row]), self.live_steps[row])
        for layer, mine in zip(self.cache.layers, into.layers):
            _set_layer(mine, row_slots(layer.keys, row, own, kept), row_slots(layer.values, row, own, kept))
