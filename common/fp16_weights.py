"""``--dtype fp16-weights``: a CPU weight format where PyTorch has fbgemm (x86 builds, and PyPI's
aarch64 ones; the demo's first choice there).

Every linear layer's weight is held in float16, packed once for fbgemm (PyTorch's CPU GEMM
library), and multiplied in float32 (``torch.ops.quantized.linear_dynamic_fp16``). No activation is
quantized, so a row's result differs between a one-row and a five-row forward only by float
rounding (about 1e-4 relative, from the kernel's blocking), as float32 GEMMs already do. Weights cross the
memory bus in half the bytes, and fbgemm's kernel streams them once for a few rows: on a 2-core
AVX2 server, a SmolLM2-135M forward over one new token fell from about 80 ms (float32) to 57 ms,
and over five from about 170 ms to 62 ms. That second figure is what speculative decoding needs:
verifying k drafts costs about what one plain decoding step does.

Norms and attention run in float32. The model is the checkpoint with its linear weights rounded
to float16, in both the target-alone and the speculative path. ``pack_model`` builds it from the
checkpoint's own dtype one layer at a time, and keeps a bfloat16 or float16 checkpoint's embedding
table as it is, in its mapped file (its rows are read when looked up and widened to float32, the
same values a float32 copy holds): a 1.5B model then holds its packed weights and the runtime,
not a float32 copy beside them nor a second copy of a tied table.

Wide prefill. fbgemm's kernel multiplies in float32 arithmetic, which is what a one-row step
needs but costs a long prompt dearly: a 512-token prompt took 13 s to prefill in a 1.5B model on
one core, against 2-3 s in bfloat16 on the same core's matrix units. Where the CPU has bfloat16
matrix instructions (x86 with AMX or AVX-512 BF16) and a layer's weight was read from the
checkpoint's mapped file, the layer keeps that view (``Fp16Linear.source``: no memory while
unread, its pages given back after each use) and a prompt chunk of at least ``WIDE_ROWS`` rows
(``WIDE_ROWS_CONVERTED`` where the weights must be converted) multiplies it in bfloat16 with
float32 sums (``wide_linear``): a bfloat16 checkpoint's weights as they are, a bfloat16 model's
arithmetic; a float32 checkpoint's through oneDNN's bf16 math mode.
Only prefill goes wide: a verification, whose rows must match one-row steps, never does
(``common.lean``). A bfloat16 GEMM's rounding of a row depends on how many rows it has, so a
target prefills each wide chunk alone (its length follows from the prompt's, never from what
else is waiting). ``STARSD_WIDE_PREFILL=0`` keeps prefill in fbgemm's float32 arithmetic.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from common.switches import switched_off

FP16_WEIGHTS = "fp16-weights"

# fbgemm's packed weights are a TorchScript object, which torch.compile cannot pass through a
# graph; compiled graphs call the GEMM through this op instead, naming the packed weights by a key.
_PACKED: dict[int, object] = {}
_KEYS = itertools.count()
# the op's C++ entry: calling the Python packet first scans the arguments for traced script
# objects, 4-5 us a call, a tenth of a small model's GEMM (compiled graphs use the op below)
LINEAR_FP16 = getattr(torch.ops.quantized.linear_dynamic_fp16, "_op", torch.ops.quantized.linear_dynamic_fp16)


@torch.library.custom_op("starsd::fp16_linear", mutates_args=())
def _fp16_linear_op(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, _PACKED[int(key)])


@_fp16_linear_op.register_fake
def _(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


# the chunk length from which a prefill goes wide: a bfloat16 checkpoint's weights pass fbgemm's
# cost at about 8 rows on the 1.5B shapes; a float32 (or float16) checkpoint's are converted on
# every call, which on the demo target (135M) cost more than fbgemm's whole forward at 16 rows
# (166-176 ms wide against 90 plain) and as much at 64 (185 against 183; 128 rows: 205 against 310)
WIDE_ROWS = 16
WIDE_ROWS_CONVERTED = 64


def wide_rows_for(weights: list[torch.Tensor]) -> int:
    """The chunk length from which a prefill multiplying ``weights`` (the sources) goes wide."""
    return WIDE_ROWS if all(w.dtype == torch.bfloat16 for w in weights) else WIDE_ROWS_CONVERTED


WIDE_PREFILL_ENV = "STARSD_WIDE_PREFILL"


def wide_prefill_available() -> tuple[bool, str]:
    """Whether prefill may multiply in bfloat16 here (see the module docstring), and why not."""
    if switched_off(WIDE_PREFILL_ENV):
        return False, f"{WIDE_PREFILL_ENV}={os.environ[WIDE_PREFILL_ENV]}"
    if not hasattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision"):
        return False, f"PyTorch {torch.__version__} has no oneDNN bf16 math mode (2.9 or later has)"
    if not bf16_matrix_units():
        return False, "this CPU has no bfloat16 matrix instructions (AMX or AVX-512 BF16)"
    return True, "AMX or AVX-512 BF16"


def bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX-512 BF16); without, PyTorch's
    bfloat16 products convert to float32 and multiply there."""
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


_SCRATCH = threading.local()  # per thread: the float32 copy a 16-bit source weight is widened into


def wide_linear(source: list[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) times each (weight, bias) of ``source``, outputs side by side (float32),
    multiplied in bfloat16 with float32 sums. A bfloat16 weight (a bfloat16 checkpoint's, as
    read) multiplies ``x`` rounded to bfloat16, its outputs rounded to bfloat16 (as a bfloat16
    model's are) and the bias added in float32; the rows' rounding then depends on how many rows
    the GEMM has. A float32 weight goes through oneDNN's bf16 math mode (float32 inputs, sums and
    outputs; a row's bits do not depend on the rows beside it); a float16 one is widened into
    this thread's scratch first (exact)."""
    outs, low = [], None
    # the mode is the process's, not the thread's: a target runs its forwards on one thread (its
    # scheduler's) and a draft daemon never goes wide, so no other forward runs meanwhile
    mm = torch.backends.mkldnn.matmul
    before = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        for w, b in source:
            if w.dtype == torch.bfloat16:
                if low is None:
                    low = x.to(torch.bfloat16)
                y = torch.nn.functional.linear(low, w).float()
                outs.append(y if b is None else y.add_(b))
                continue
            if w.dtype != torch.float32:
                scratch = getattr(_SCRATCH, "buf", None)
                if scratch is None or scratch.numel() < w.numel():
                    scratch = _SCRATCH.buf = torch.empty(w.numel())
                w = scratch[: w.numel()].view(w.shape).copy_(w)
            outs.append(torch.nn.functional.linear(x, w, b))
    finally:
        mm.fp32_precision = before
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def wide_begin(source_weights: list[torch.Tensor], ranges: list[tuple[int, int]]) -> None:
    """Before a wide forward: the source weights' file pages mapped in one call each, where the
    kernel can (``common.memory.populate_file_pages``); ``wide_done`` gives them back."""
    from common.memory import populate_file_pages

    for w in source_weights:
        populate_file_pages(w, ranges)


def wide_done(source_weights: list[torch.Tensor], ranges: list[tuple[int, int]]) -> None:
    """After a wide forward: this thread's scratch dropped, and the source weights' file pages
    given back, so that serving holds the packed weights only."""
    from common.memory import release_file_pages

    _SCRATCH.buf = None
    for w in source_weights:
        release_file_pages(w, ranges)


def fp16_weights_available() -> bool:
    """Whether this PyTorch build has fbgemm: x86 builds do, and so do PyPI's aarch64 builds of
    2.13 (`make edge-check` ran it under emulation); builds without it (older ARM ones) do not."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Fp16Linear(torch.nn.Module):
    """``nn.Linear`` with its weight in float16, packed for fbgemm; float32 in and out."""

    # the checkpoint's weight as loaded, a view of its mapped file, and the float32 bias, per block
    # of output columns (several after ``fuse``): what a wide prefill multiplies (``wide_linear``)
    source: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        w = weight.detach().to("cpu", torch.float32).contiguous()
        b = None if bias is None else bias.detach().to("cpu", torch.float32).contiguous()
        self._packed = torch.ops.quantized.linear_prepack_fp16(w, b)
        key = next(_KEYS)
        _PACKED[key] = self._packed
        weakref.finalize(self, _PACKED.pop, key, None)
        # a tensor, not an int: a graph compiled for one layer then serves every layer of its shape
        self.register_buffer("_key", torch.tensor(key), persistent=False)

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear) -> "Fp16Linear":
        return cls(lin.weight, lin.bias)

    @classmethod
    def fuse(cls, linears: list["Fp16Linear"]) -> "Fp16Linear":
        """One layer computing the given layers' outputs side by side (their weights stacked; the
        float16 values are kept exactly). A missing bias among others is zeros."""
        weights, biases = zip(*(torch.ops.quantized.linear_unpack_fp16(lin._packed) for lin in linears))
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(weights, biases)])
        whole = cls(torch.cat(weights), bias)
        if all(lin.source is not None for lin in linears):
            whole.source = [part for lin in linears for part in lin.source]
        return whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        if x.dim() == 1:  # fbgemm wants rows
            return self.forward(x[None])[0]
        if torch.compiler.is_compiling():
            return _fp16_linear_op(x, self._key, self.out_features)
        return LINEAR_FP16(x, self._packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=float16 (fbgemm)"


class Fp16Part(torch.nn.Module):
    """Output columns ``start:stop`` of a fused ``Fp16Linear`` (``whole``): what one of the layers
    fused into it computed, bit for bit, with no second copy of its weights. The lean forward
    (``common.lean``) runs ``whole`` once for all its parts; a forward through the model's own
    modules runs it once per part."""

    def __init__(self, whole: Fp16Linear, start: int, stop: int):
        super().__init__()
        self.whole = whole
        self.start, self.stop = start, stop
        self.in_features, self.out_features = whole.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start: self.stop].contiguous()

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of a fused fp16-weights layer"


FP16_MAX = 65504.0  # torch.finfo(torch.float16).max


def linears_beyond_fp16(module: torch.nn.Module) -> tuple[int, int]:
    """(weights whose magnitude exceeds float16's largest value, all weights) over every
    ``nn.Linear`` in ``module``: a weight beyond it would become infinite in fp16-weights. Counted
    one layer at a time in the weights' own dtype, so a bfloat16 checkpoint is never copied whole."""
    over = total = 0
    for child in module.modules():
        if isinstance(child, torch.nn.Linear):
            w = child.weight.detach()
            over += int(torch.count_nonzero(w.abs() > FP16_MAX))
            total += w.numel()
    return over, total


class CompactEmbedding(torch.nn.Embedding):
    """An embedding table kept in the checkpoint's 16-bit dtype whose looked-up rows are float32:
    exactly the rows a float32 copy of the table gives, at half its memory. The model's ``dtype``
    property (its first parameter's) then reads 16-bit although it computes in float32: StarSD
    builds masks and caches from the activations' dtype (``LoadedModel.dtype``), never from it."""

    rows: FileRows | None = None  # where set, looked-up rows are read from the checkpoint's file

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if (self.rows is not None and input.dtype in (torch.int64, torch.int32)
                and not torch.compiler.is_compiling()):  # (a graph reads the mapping)
            return self.rows.lookup(input)
        return super().forward(input).float()


class FileRows:
    """An embedding table's rows read from its checkpoint file with ``pread``, instead of through
    the file's mapping: a page fault in a mapped file can bring in far more than the row it
    reads (a large page-cache folio, or the kernel's fault-around), so a few hundred distinct
    tokens of a 1.5B model's 0.47 GB table made 341 MiB of it resident, where reading each row
    keeps none. The bytes are the mapping's own (the same file, checked on setup); a lookup of a
    few hundred tokens costs a syscall each, next to a forward over them."""

    def __init__(self, weight: torch.Tensor, path: str, offset: int, inode: int):
        self.num, self.dim = weight.shape
        self.dtype = weight.dtype
        self.row_bytes = self.dim * weight.element_size()
        self.path, self.offset, self.inode = path, offset, inode
        self._open()

    def _open(self) -> None:
        """Open the file, where it is still the one mapped (else ValueError): the path is looked
        at again after opening, so a file renamed over it in between is never read."""
        fd = os.open(self.path, os.O_RDONLY)
        if os.fstat(fd).st_ino != self.inode:
            os.close(fd)
            raise ValueError(f"{self.path} is no longer the file the embedding table is mapped from")
        self.fd = fd
        weakref.finalize(self, os.close, fd)

    def __getstate__(self) -> dict:  # a copy opens the file for itself: a descriptor is not shared
        return {k: v for k, v in self.__dict__.items() if k != "fd"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    @classmethod
    def for_table(cls, weight: torch.Tensor) -> FileRows | None:
        """Rows read from the file ``weight`` (a 16-bit table) is mapped from, where its first and
        last rows read from there equal the table's; else None (the mapping is read as ever)."""
        from common.memory import file_location

        if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[0] == 0 or weight.shape[1] == 0:
            return None
        where = file_location(weight)
        if where is None:
            return None
        try:
            rows = cls(weight, *where)
            ends = torch.tensor([0, weight.shape[0] - 1])
            if not torch.equal(rows.lookup(ends, widen=False).view(torch.uint8), weight[ends].view(torch.uint8)):
                return None
        except (OSError, ValueError):
            return None
        return rows

    def lookup(self, input: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """``input``'s rows as an embedding lookup gives them (float32 where ``widen``); an id
        outside the table raises IndexError, as the lookup does."""
        ids = input.reshape(-1)
        if not ids.numel():
            return torch.empty(*input.shape, self.dim, dtype=torch.float32 if widen else self.dtype)
        if int(ids.min()) < 0 or int(ids.max()) >= self.num:
            raise IndexError(f"index out of range in self: token ids must be in [0, {self.num})")
        out = torch.empty(ids.numel(), self.dim, dtype=self.dtype)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        rb, fd, base = self.row_bytes, self.fd, self.offset
        for i, t in enumerate(ids.tolist()):
            if os.preadv(fd, [view[i * rb:(i + 1) * rb]], base + t * rb) != rb:
                raise OSError(f"short read of row {t} of the embedding table's file")
        out = out.reshape(*input.shape, self.dim)
        return out.float() if widen else out


def pack_model(model: torch.nn.Module) -> int:
    """The fp16-weights model from one loaded in its checkpoint's dtype, in place: every linear
    packed (a few at a time, so only their float32 copies exist at once, and the pages of a
    weight read from its mapped file are given back once packed), each 16-bit embedding table kept
    in its dtype behind ``CompactEmbedding``, and every other floating tensor (norms, rotary
    tables) made float32. Returns how many linears were packed.

    An embedding table read from its mapped file stays a view of it, its pages given back: a
    lookup reads the rows it needs from the page cache, so the table costs resident memory only
    for the tokens in use (a tied output layer, packed, holds its own float16 copy: the table is
    not held twice). Where wide prefill is available, each packed layer keeps its weight's view
    of the file as its ``source`` the same way (resident only while a wide prefill reads it). As
    with every format that serves a checkpoint's tensors as loaded, the file must not be
    rewritten in place while a daemon serves it (replace it by renaming)."""
    from common.memory import give_back_freed_memory, release_file_pages, weight_file_ranges

    ranges = weight_file_ranges()
    def mapped(weight: torch.Tensor) -> bool:  # read from the mapped file, in a dtype wide_linear takes
        start = weight.data_ptr()
        return (weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.is_contiguous()
                and any(lo <= start < hi for lo, hi in ranges))
    packed = pack_linears(model, done=lambda weight: release_file_pages(weight, ranges),
                          keep_source=mapped if wide_prefill_available()[0] else None)
    for m in list(model.modules()):
        if type(m) is torch.nn.Embedding and m.weight.dtype in (torch.bfloat16, torch.float16):
            m.__class__ = CompactEmbedding  # the same module and table
            if m.max_norm is None:  # (max_norm renormalises looked-up rows in the table itself)
                m.rows = FileRows.for_table(m.weight)
            release_file_pages(m.weight, ranges)  # a view of the mapped file: rows are read from the file
    for m in model.modules():
        if isinstance(m, CompactEmbedding):
            continue
        for name, p in m.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        for name, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                m._buffers[name] = b.float()
    give_back_freed_memory()
    return packed


MAX_PACK_WORKERS = 4  # layers packed at once at most: each holds a float32 copy of its weight


def layer_slots(module: torch.nn.Module, match) -> list[tuple[torch.nn.Module, str]]:
    """(parent, attribute name) of every submodule of ``module`` that ``match`` takes: the slots,
    not the layers, so that a layer replaced while walking them is not kept alive by the list."""
    return [(parent, name) for parent in module.modules() if not match(parent)
            for name, child in parent.named_children() if match(child)]


def in_order(fn, items: list, workers: int | None = None):
    """``(item, fn(item))`` for each item, in order, with ``fn`` run on up to ``workers`` threads
    at once (default: torch's threads, at most MAX_PACK_WORKERS): for fbgemm's packing, which runs
    on one thread and lets go of the GIL. No more than ``workers`` results wait to be taken."""
    workers = max(1, min(workers or torch.get_num_threads(), MAX_PACK_WORKERS, len(items) or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="fp16-pack") as pool:
        pending: deque = deque()
        for i, item in enumerate(items):
            pending.append((item, pool.submit(fn, item)))
            while len(pending) > workers or (pending and i == len(items) - 1):
                done, fut = pending.popleft()
                yield done, fut.result()


def pack_linears(module: torch.nn.Module, done=None, workers: int | None = None, keep_source=None) -> int:
    """Replace every ``nn.Linear`` inside ``module`` by an ``Fp16Linear``, in place; returns how
    many. The module must be on the CPU; each weight is widened to float32 for packing and
    dropped with the layer it replaces. fbgemm packs on one thread and lets go of the GIL, so
    ``workers`` layers (default: torch's threads, at most MAX_PACK_WORKERS) are packed at once,
    and replaced in order: a 1.5B model loaded in 31 s on one core and 24 s on two, of which
    packing took 24 s and about 12 s. ``done(weight)``: called with each weight once its layer
    is replaced. ``keep_source(weight)``: whether the new layer keeps ``weight`` as its
    ``source`` (a view of the mapped checkpoint, for wide prefill)."""
    if not fp16_weights_available():
        raise RuntimeError("fp16-weights needs PyTorch's fbgemm kernels; this build has "
                           f"{torch.backends.quantized.supported_engines}: use --dtype float32")
    slots = layer_slots(module, lambda m: isinstance(m, torch.nn.Linear))
    for parent, name in slots:
        device = getattr(parent, name).weight.device
        if device.type != "cpu":
            raise RuntimeError("fp16-weights is a CPU format; the model is on " + str(device))
    packed = 0
    for (parent, name), layer in in_order(lambda slot: Fp16Linear.from_linear(getattr(*slot)), slots, workers):
        old = getattr(parent, name)
        weight = old.weight
        if keep_source is not None and keep_source(weight):
            bias = None if old.bias is None else old.bias.detach().float().clone()
            layer.source = [(weight.detach(), bias)]
        del old
        setattr(parent, name, layer)
        if done is not None:
            done(weight)  # packed: what the float16 copy replaces may go
        del weight
        packed += 1
    return packed
