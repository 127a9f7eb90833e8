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
import torch.nn.functional as F


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


class BatchedCaches:
    def __init__(self, model, caches: list, feeds: list[list[int]], device: torch.device):
        from transformers import DynamicCache

        self.model = model
        self.device = device
        self.lengths = [c.get_seq_length() for c in caches]
        self.feeds = feeds
        self.P = max(self.lengths)
        self.N = max(len(f) for f in feeds)
        B = len(caches)
        if self.P > 0:
            ref = next(c for c, n in zip(caches, self.lengths) if n > 0)
            n_layers = len(ref.layers)
            like = (ref.layers[0].keys, ref.layers[0].values)
            per_row = [_layer_tensors(c, n_layers, like) for c in caches]
            data = []
            for li in range(n_layers):
                ks = [F.pad(row[li][0], (0, 0, self.P - row[li][0].shape[2], 0)) for row in per_row]
                vs = [F.pad(row[li][1], (0, 0, self.P - row[li][1].shape[2], 0)) for row in per_row]
                data.append((torch.cat(ks), torch.cat(vs)))
            self.cache = DynamicCache(ddp_cache_data=data, config=model.config)
        else:
            self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(B, self.P + self.N, dtype=torch.long, device=device)
        ids = torch.zeros(B, self.N, dtype=torch.long, device=device)
        pos = torch.zeros(B, self.N, dtype=torch.long, device=device)
        for b, (c_b, feed) in enumerate(zip(self.lengths, feeds)):
            n_b = len(feed)
            self.mask[b, self.P - c_b: self.P + n_b] = 1
            ids[b, :n_b] = torch.tensor(feed, dtype=torch.long, device=device)
            pos[b] = c_b + torch.arange(self.N, device=device)
        self.next_pos = torch.tensor([c + len(f) for c, f in zip(self.lengths, feeds)], device=device)
        self._first = (ids, pos)
        self.steps = 0

    def first(self) -> torch.Tensor:
        """Forward the new tokens; logits [B, V] at each row's last real token."""
        ids, pos = self._first
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache, use_cache=True)
        last = torch.tensor([len(f) - 1 for f in self.feeds], device=self.device)
        return out.logits[torch.arange(len(self.feeds), device=self.device), last]

    def step(self, tokens: list[int], live: list[bool]) -> torch.Tensor:
        """Feed one token per row (rows not ``live`` feed a masked filler); logits [B, V]."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        col = torch.tensor(live, dtype=torch.long, device=self.device).unsqueeze(1)
        self.mask = torch.cat([self.mask, col], dim=1)
        pos = self.next_pos.unsqueeze(1).clone()
        self.next_pos = self.next_pos + 1
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, cache=self.cache, use_cache=True)
        self.steps += 1
        return out.logits[:, -1]

    def split(self, row: int):
        """Session ``row``'s own cache: its real slots only, in order."""
        from transformers import DynamicCache

        idx = torch.nonzero(self.mask[row], as_tuple=False).flatten()
        data = [(layer.keys[row: row + 1, :, idx], layer.values[row: row + 1, :, idx]) for layer in self.cache.layers]
        return DynamicCache(ddp_cache_data=data, config=self.model.config)
