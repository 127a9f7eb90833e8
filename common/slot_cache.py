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
from transformers.cache_utils import Cache, DynamicLayer

from common.tree import additive_mask, ancestor_mask, depths

MIN_SLOTS = 64


def grown_capacity(capacity: int, need: int) -> int:
    """The slots a buffer of ``capacity`` grows to when ``need`` positions must fit: a quarter of
    the capacity more (at least MIN_SLOTS), for amortised copies and a buffer at most 1.25x (plus
    64 slots) of what it holds, close to the draft daemon's KV accounting; and always one spare
    slot past ``need`` (a view covering the whole buffer would be contiguous where every other is
    not, and a compiled forward would need a graph for it)."""
    return max(need + 1, capacity + max(capacity // 4, MIN_SLOTS))


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
        if need < self.capacity:  # a spare slot always (see grown_capacity)
            return
        cap = grown_capacity(self.capacity, need)
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

    @torch.inference_mode()
    def keep(self, start: int, positions: list[int]) -> None:
        """Hold positions 0..start-1, then the cached ``positions`` (ascending, each >= start)
        moved up behind them, and nothing after: an accepted path through a draft tree kept by
        copying just its own slots (a chain's path needs no copy)."""
        m = len(positions)
        if positions and not (start <= positions[0] and positions[-1] < self.n
                              and all(a < b for a, b in zip(positions, positions[1:]))):
            raise ValueError(f"positions must ascend within {start}..{self.n - 1}")
        if positions != list(range(start, start + m)):
            idx = torch.tensor(positions, dtype=torch.long, device=self.k_buf.device)
            k, v = self.k_buf, self.v_buf  # read once: a pool row's buffers are views made per access
            k[:, :, start: start + m] = k.index_select(2, idx)
            v[:, :, start: start + m] = v.index_select(2, idx)
        self.n = start + m
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

    def keep(self, start: int, positions: list[int]) -> None:
        """Every layer keeps its first ``start`` positions and then ``positions`` (see
        ``SlotLayer.keep``): the accepted path of a tree forward."""
        for layer in self.layers:
            if not isinstance(layer, SlotLayer):
                raise NotImplementedError(f"{type(layer).__name__} layers cannot keep a tree's path")
            if layer.is_initialized:
                layer.keep(start, positions)

    def compact(self, positions: torch.Tensor) -> None:
        """Every layer keeps only ``positions`` (see ``SlotLayer.compact``)."""
        for layer in self.layers:
            if not isinstance(layer, SlotLayer):
                raise NotImplementedError(f"{type(layer).__name__} layers cannot be compacted")
            if layer.is_initialized:
                layer.compact(positions)


# ---------------------------------------------------------------- many sequences, one buffer
class SlotPool:
    """Rows of one preallocated buffer per layer, [rows, H, slots, D], one row per sequence:
    several generations' caches in one place, so that one forward can feed them all
    (``PoolBatch``) with no copy in or out when the rows it feeds are adjacent.

    ``acquire`` hands out a row as a ``PoolRowCache``, a one-sequence cache that behaves as a
    ``SlotCache`` (its own length, rollback by moving it) whose slots live in the pool; ``release``
    takes it back. Every row has the same number of slots: the pool grows (by a quarter, for all
    rows at once) when a row needs more, and never shrinks, as a serving engine's KV memory is
    held for its lifetime. Full-attention layers only (see ``supports``)."""

    def __init__(self, config, rows: int, capacity: int = 0):
        if rows < 1:
            raise ValueError(f"a pool needs at least one row, got {rows}")
        self.config = config
        self.rows = rows
        self.n_layers = config.get_text_config(decoder=True).num_hidden_layers
        self.slots_hint = max(int(capacity), MIN_SLOTS)
        self.k: list[torch.Tensor | None] = [None] * self.n_layers
        self.v: list[torch.Tensor | None] = [None] * self.n_layers
        self.free = list(range(rows))
        self.live: dict[int, PoolRowCache] = {}

    @staticmethod
    def supports(config) -> bool:
        """Whether every layer of this model is a full-attention layer (a plain ``DynamicLayer``
        in transformers' cache for it)."""
        layers = DynamicCache(config=config).layers
        return all(type(layer) is DynamicLayer for layer in layers)

    @property
    def slots(self) -> int:
        k = next((t for t in self.k if t is not None), None)
        return self.slots_hint if k is None else int(k.shape[2])

    @property
    def allocated(self) -> bool:
        """Whether the buffers are made (at the first forward that writes the pool)."""
        return any(t is not None for t in self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v) if t is not None)

    def acquire(self, capacity: int = 0) -> "PoolRowCache | None":
        """A free row with room for ``capacity`` positions (the pool grows if it must), or None
        when every row is taken."""
        if not self.free:
            return None
        self.reserve(capacity)  # first: a growth that fails takes no row
        row = self.free.pop(0)
        cache = PoolRowCache(self, row)
        self.live[row] = cache
        return cache

    def release(self, cache: "PoolRowCache") -> None:
        if self.live.get(cache.row) is cache:
            del self.live[cache.row]
            self.free.append(cache.row)
            self.free.sort()  # lowest rows first: the live ones stay adjacent where they can

    def _init_layer(self, li: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape_k = (self.rows, key_states.shape[1], self.slots, key_states.shape[3])
        shape_v = (self.rows, value_states.shape[1], self.slots, value_states.shape[3])
        self.k[li] = key_states.new_zeros(shape_k)  # zeros: masked slots stay finite
        self.v[li] = value_states.new_zeros(shape_v)

    @torch.inference_mode()  # the buffers are inference tensors, whichever thread grows them
    def reserve(self, positions: int) -> None:
        """Room for ``positions`` in every row (and a spare slot, as ``SlotLayer`` keeps)."""
        if positions < self.slots:
            return
        cap = grown_capacity(self.slots, positions)
        if all(t is None for t in self.k):
            self.slots_hint = cap
            return
        grown = {}
        for name in ("k", "v"):  # every new buffer first: a failed allocation leaves the pool as it was
            grown[name] = [None if old is None else old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                           for old in getattr(self, name)]
        for name, bufs in grown.items():
            for new, old in zip(bufs, getattr(self, name)):
                if old is not None:
                    new[:, :, : old.shape[2]] = old
        self.k, self.v = grown["k"], grown["v"]  # both at once, once every copy is made
        self.slots_hint = cap  # the rows' keys and values are views made when read: of the new buffers


def _filled_slots(buf: str, what: str) -> property:
    """A pool row layer's ``keys`` or ``values``: the filled part of its buffer ``buf``, made when
    read (None before its first forward). Only None may be set (as ``DynamicLayer`` does)."""

    def read(layer) -> torch.Tensor | None:
        return getattr(layer, buf)[:, :, : layer.n] if layer.is_initialized else None

    def write(layer, value) -> None:
        if value is not None:
            raise AttributeError(f"a pool row's {what} are its slots in the pool")

    return property(read, write)


class PoolLayer(SlotLayer):
    """One layer of one pool row: a ``SlotLayer`` whose buffer is the row's slice of the pool's.
    Its ``keys`` and ``values`` are made when read, so that a batched forward's commit (every
    row's every layer) only moves lengths."""

    def __init__(self, pool: SlotPool, row: int, li: int):
        DynamicLayer.__init__(self)
        self.pool, self.row, self.li = pool, row, li
        self.n = 0

    keys = _filled_slots("k_buf", "keys")
    values = _filled_slots("v_buf", "values")

    def _views(self) -> None:
        pass  # made when read

    @property
    def k_buf(self) -> torch.Tensor:
        return self.pool.k[self.li][self.row: self.row + 1]

    @property
    def v_buf(self) -> torch.Tensor:
        return self.pool.v[self.li][self.row: self.row + 1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError(f"a pool row holds one sequence, not a batch of {key_states.shape[0]}")
        if self.pool.k[self.li] is None:
            self.pool._init_layer(self.li, key_states, value_states)
        self.device = key_states.device
        self.n = 0
        self.is_initialized = True

    def _reserve(self, need: int) -> None:
        self.pool.reserve(need)

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError("a pool row is written by forwards only")

    def reset(self) -> None:
        self.n = 0


class PoolRowCache(SlotCache):
    """One sequence's cache in a ``SlotPool`` row (see there); ``release()`` gives the row back."""

    def __init__(self, pool: SlotPool, row: int):
        Cache.__init__(self, layers=[PoolLayer(pool, row, li) for li in range(pool.n_layers)])
        self.pool, self.row = pool, row

    def reserve(self, positions: int) -> None:
        self.pool.reserve(positions)

    def release(self) -> None:
        self.pool.release(self)

    @torch.inference_mode()
    def scrub(self) -> None:
        """Zero this row's slots in every layer (after a failure that may have written NaN there)."""
        for li in range(self.pool.n_layers):
            for bufs in (self.pool.k, self.pool.v):
                if bufs[li] is not None:
                    bufs[li][self.row].zero_()


def flat_places(rows: torch.Tensor, heads: int, slots: int, lengths: torch.Tensor, m: int) -> torch.Tensor:
    """Where ``m`` new positions of each of ``rows`` (whose lengths are ``lengths``) go in a
    layer's buffer [pool rows, heads, slots, D] seen flat as [pool rows * heads * slots, D], in
    the order of keys [len(rows), heads, m, D] reshaped to [-1, D]."""
    heads_of = rows[:, None, None] * heads + torch.arange(heads, device=rows.device)[None, :, None]
    return (heads_of * slots + lengths[:, None, None] + torch.arange(m, device=rows.device)[None, None, :]).reshape(-1)


class _BatchLayer(DynamicLayer):
    def __init__(self, batch: "PoolBatch", li: int):
        super().__init__()
        self.batch, self.li = batch, li
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.batch._update(self.li, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.batch.base

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop the rows' own caches")


class PoolBatch(DynamicCache):
    """A cache for one forward over several pool rows at once, each with its own length: row b
    (``caches[b]``, holding n_b positions) feeds ``fed[b]`` new tokens, right-padded to the
    longest feed M. Its keys and values go to its own slots n_b..n_b+M-1 (the pad positions
    beyond n_b + fed[b] are written but stay outside the row's length), and attention reads
    each row's first max(n) + M slots: a view of the pool when the rows are adjacent, else one
    gather of just those rows. ``mask()`` and ``positions()`` are the 4-D attention mask and
    position ids that make each row see exactly its own positions, causally; models must take
    custom 4-D masks (rotary Llama and Qwen2 do). ``commit()``, once the forward has returned,
    makes each row's cache hold its n_b + fed[b] positions; a forward that fails part way leaves
    every row's length as it was (what it wrote lies past those lengths).

    ``trees``: per row, None (its feed is a sequence) or the parents of a draft tree its feed
    (root, then nodes) is (``common.tree``): that row's new positions see the cache and their own
    ancestors, at the positions of their depths."""

    def __init__(self, caches: list[PoolRowCache], fed: list[int], trees: list[list[int] | None] | None = None):
        if not caches or len(caches) != len(fed) or min(fed) < 1:
            raise ValueError("a batch needs one row cache per feed and at least one token per feed")
        pool = caches[0].pool
        if any(c.pool is not pool for c in caches) or len({c.row for c in caches}) != len(caches):
            raise ValueError("a batch takes distinct rows of one pool")
        Cache.__init__(self, layers=[_BatchLayer(self, li) for li in range(pool.n_layers)])
        self.pool, self.caches, self.fed = pool, caches, list(fed)
        self.trees = list(trees) if trees is not None else [None] * len(caches)
        if any(t is not None and len(t) + 1 != m for t, m in zip(self.trees, self.fed)):
            raise ValueError("a tree row feeds its root and one token per node")
        self.lengths = [c.get_seq_length() for c in caches]
        self.M = max(fed)
        self.base = max(self.lengths)
        self.kv_len = self.base + self.M
        pool.reserve(self.kv_len)
        rows = [c.row for c in caches]
        self._span = (rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None
        self._rows = torch.tensor(rows, dtype=torch.long)
        self._slots = None  # [B * H * M] on the model's device, built at the first layer
        self._fresh = [c for c in caches if not all(layer.is_initialized for layer in c.layers)]

    def _causal(self, device) -> torch.Tensor:
        n = torch.tensor(self.lengths, device=device)[:, None]
        j = torch.arange(self.M, device=device)[None, :]
        last = torch.tensor(self.fed, device=device)[:, None] - 1
        return n + torch.minimum(j, last)

    def positions(self, device) -> torch.Tensor:
        """Position ids [B, M]: n_b + j for a real token j, a pad repeating its row's last
        position; in a tree row, n_b + the node's depth (the root's 0)."""
        pos = self._causal(device)
        for b, parents in enumerate(self.trees):
            if parents is not None:
                d = torch.tensor([0, *depths(parents)], device=device)
                pos[b, : d.shape[0]] = self.lengths[b] + d
        return pos

    def mask(self, dtype: torch.dtype, device) -> torch.Tensor:
        """[B, 1, M, max(n) + M], 0 where a query may look and dtype's minimum elsewhere: query j
        of row b sees slots 0..n_b + j (a pad sees what its row's last token sees); in a tree
        row, its own slots 0..n_b - 1 and those of its ancestors (a pad sees the root's)."""
        see = self._causal(device)[:, :, None]  # the last slot each query may see
        slots = torch.arange(self.kv_len, device=device)[None, None, :]
        allowed = slots <= see
        for b, parents in enumerate(self.trees):
            if parents is not None:
                n, m = self.lengths[b], self.fed[b]
                row = torch.zeros(self.M, self.kv_len, dtype=torch.bool, device=device)
                row[:, :n] = True
                row[:m, n: n + m] = ancestor_mask(parents, device)
                row[m:, n] = True
                allowed[b] = row
        return additive_mask(allowed, dtype)[:, None]

    def flat(self, li: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``li``'s key and value buffers and each new position's place in them, the buffers
        seen as [rows * heads * slots, D] (the places are built once per forward)."""
        keys, values = self.pool.k[li], self.pool.v[li]
        if self._slots is None or self._slots.device != device:
            _, heads, slots, _ = keys.shape
            if self.kv_len >= slots:  # reserve() made room; a flat index past a row's slots would land in the next
                raise RuntimeError(f"the pool holds {slots} slots per row, the batch needs {self.kv_len + 1}")
            self._rows = self._rows.to(device)
            self._slots = flat_places(self._rows, heads, slots, torch.tensor(self.lengths, device=device), self.M)
        return keys, values, self._slots

    def adjacent_rows(self) -> tuple[int, int] | None:
        """The rows' span [a, b) in the pool where they are adjacent and every layer's buffers are
        made (then a layer's keys and values are ``buffer[a:b, :, :kv_len]``), else None."""
        return self._span if not self._fresh and self.pool.allocated else None

    def _update(self, li: int, key_states: torch.Tensor, value_states: torch.Tensor):
        pool = self.pool
        if self._fresh:  # a first forward on a fresh pool or row allocates and marks its layers
            if pool.k[li] is None:
                pool._init_layer(li, key_states[:1], value_states[:1])
            for c in self._fresh:
                layer = c.layers[li]
                if not layer.is_initialized:
                    layer.device, layer.n, layer.is_initialized = key_states.device, 0, True
        keys, values, flat = self.flat(li, key_states.device)
        width = key_states.shape[-1]
        keys.view(-1, width).index_copy_(0, flat, key_states.reshape(-1, width))
        values.view(-1, value_states.shape[-1]).index_copy_(0, flat, value_states.reshape(-1, value_states.shape[-1]))
        if self._span is not None:
            a, b = self._span
            return keys[a:b, :, : self.kv_len], values[a:b, :, : self.kv_len]
        return keys[:, :, : self.kv_len].index_select(0, self._rows), values[:, :, : self.kv_len].index_select(0, self._rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.base

    def commit(self) -> None:
        """The forward went through: every row's layers now hold its new positions."""
        for c, n, m in zip(self.caches, self.lengths, self.fed):
            for layer in c.layers:
                layer.n = n + m
