"""A KV cache that writes in place: preallocated slots per layer, rollback by moving a position.

transformers' ``DynamicCache`` appends every forward's keys and values with ``torch.cat``, which
copies the whole cache each step (on the demo target, 30 layers at 200 cached positions, about a
quarter of a decode step's time on a CPU core), and crops by slicing, so the next step copies
again. ``SlotCache`` keeps the same interface and mask semantics (it is a ``DynamicCache`` whose
full-attention layers are ``SlotLayer``s) but holds each layer's keys and values in a buffer sized
once (or grown by a quarter at a time when a size was not known) and hands attention a view of the filled
part: a step writes only its new positions, a rollback moves a position and copies nothing.
Attention still runs over the filled positions only, not over the whole buffer as
``StaticCache`` does.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_SLOTS = 64


class SlotLayer(DynamicLayer):
    """One layer's keys and values [B, H, capacity, D], of which the first ``n`` positions hold
    the cache; ``keys`` and ``values`` are views of those (what the model's attention reads)."""

    def __init__(self, capacity: int = 0, **kwargs):
        super().__init__()
        self.capacity_hint = max(int(capacity), 0)
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.n = 0

    @property
    def capacity(self) -> int:
        return 0 if self.k_buf is None else int(self.k_buf.shape[2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        cap = max(self.capacity_hint, key_states.shape[-2] + 1, MIN_SLOTS)
        self.k_buf = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[3])
        self.v_buf = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[3])
        self.n = 0
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self.k_buf[:, :, : self.n]
        self.values = self.v_buf[:, :, : self.n]

    def _reserve(self, need: int) -> None:
        # always a free slot past the filled ones: a view that covered the whole buffer would be
        # contiguous where every other is not, and a compiled forward would need a graph for it
        if need < self.capacity:
            return
        # a quarter of the capacity more (at least 64 slots): amortised copies, and a buffer at most
        # 1.25x (plus 64 slots) of what a session holds, close to the draft daemon's KV accounting
        cap = max(need + 1, self.capacity + max(self.capacity // 4, MIN_SLOTS))
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], cap, old.shape[3])
            new[:, :, : self.n] = old[:, :, : self.n]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m = key_states.shape[-2]
        if key_states.shape[0] != self.k_buf.shape[0]:
            raise ValueError(f"a cache of batch {self.k_buf.shape[0]} cannot take keys of batch {key_states.shape[0]}")
        self._reserve(self.n + m)
        self.k_buf[:, :, self.n: self.n + m] = key_states
        self.v_buf[:, :, self.n: self.n + m] = value_states
        self.n += m
        self._views()
        return self.keys, self.values

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly these keys and values (copied into the buffer, which is reused)."""
        if self.is_initialized and keys.shape[0] == self.k_buf.shape[0]:
            self.n = 0
        else:
            self.k_buf = self.v_buf = None
            self.is_initialized = False
        self.update(keys, values)

    def compact(self, positions: torch.Tensor) -> None:
        """Keep only the cached ``positions`` (ascending), moved to the front in that order: an
        accepted path through a draft tree, kept with one index copy instead of a recompute."""
        idx = positions.to(self.k_buf.device, torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise ValueError(f"positions must lie in 0..{self.n - 1}")
        m = int(idx.numel())
        self.k_buf[:, :, :m] = self.k_buf.index_select(2, idx)
        self.v_buf[:, :, :m] = self.v_buf.index_select(2, idx)
        self.n = m
        self._views()

    def get_seq_length(self) -> int:
        return self.n

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of positions to remove as a negative count")
        if self.is_initialized and tokens_to_remove:
            self.n = max(self.n + tokens_to_remove, 0)
            self._views()

    def reset(self) -> None:
        self.k_buf = self.v_buf = None
        self.n = 0
        super().reset()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise NotImplementedError("SlotLayer does not reorder (no beam search here)")

    def offload(self):
        raise NotImplementedError("SlotLayer stays on its device")

    def prefetch(self):
        raise NotImplementedError("SlotLayer stays on its device")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("SlotLayer holds one batch shape; build a new cache instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("SlotLayer holds one batch shape; build a new cache instead")


class SlotCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers write in place (``SlotLayer``); layers of
    other kinds (sliding windows, linear attention) stay as transformers builds them, with
    their own limits (a sliding-window layer cannot be rolled back past its window).
    ``capacity``: positions to preallocate (0: start small and grow as needed)."""

    def __init__(self, config, capacity: int = 0):
        super().__init__(config=config)
        if not self.layers:
            n = config.get_text_config(decoder=True).num_hidden_layers
            self.layers = [SlotLayer(capacity) for _ in range(n)]
            self.layer_class_to_replicate = None
        else:
            self.layers = [SlotLayer(capacity) if type(layer) is DynamicLayer else layer for layer in self.layers]

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` in every initialised slot layer, made now (eagerly), so that a
        compiled forward never takes the growth path inside its graph."""
        for layer in self.layers:
            if isinstance(layer, SlotLayer) and layer.is_initialized:
                layer._reserve(positions)

    def compact(self, positions: torch.Tensor) -> None:
        """Every layer keeps only ``positions`` (see ``SlotLayer.compact``)."""
        for layer in self.layers:
            if not isinstance(layer, SlotLayer):
                raise NotImplementedError(f"{type(layer).__name__} layers cannot be compacted")
            if layer.is_initialized:
                layer.compact(positions)
