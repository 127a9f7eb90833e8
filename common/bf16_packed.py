"""bfloat16 on a CPU: every linear layer's weight packed once in oneDNN's blocked layout.

``torch.nn.functional.linear`` on bfloat16 CPU tensors hands oneDNN a plain row-major weight
at each call, and oneDNN reorders it into its blocked layout on the way: at one row, where a
forward only streams weights, that costs about a third of the time. Packed once at load
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight freezing does for compiled
graphs), the same kernel reads the blocked weight directly. On a 2-vCPU Xeon with AMX, the
linear layers of a Qwen2.5-1.5B-shaped model at one row took 310 ms as plain weights and 224 ms
packed, and a whole one-row forward 330 ms against 256 ms; a 256-row prefill chunk costs about
the same either way. A one-row product is bit-identical either way (the same kernel;
``tests/test_bf16_packed.py`` checks it, and the loader checks it on the model's first layer);
on one thread, up to 27 rows (on a Qwen2.5-1.5B's shapes; the down projection's blocking changes
beyond, and two threads split the work differently from 12) each row keeps those bits too, whatever
the other rows, which is what makes a bfloat16 verification exact
(``common.lean.row_exact_rows``, ``LeanForward._attend_by_row``). Other row counts (a 256-row
prefill chunk) may block the sums differently, within bfloat16's rounding.

The packed weight replaces the plain one: no copy stays beside it. A tied output layer (its
weight the embedding table's) is left as it is, since packing it would hold the table twice.
``torch.compile`` cannot trace the packed tensors; ``unpack_bf16`` restores plain layers for it
(inductor then packs them itself). CPUs without bfloat16 support in oneDNN, and GPUs, keep plain
layers.

Where the CPU has no bfloat16 units (x86 with AVX2 only), oneDNN's bfloat16 kernel widens each
weight to float32 as it goes and reads weights at about half the speed fbgemm's float16 kernel
does (a Qwen2.5-1.5B MLP projection at one row: 2.8 ms against 1.5 on one core; at five rows 13
ms against 2.2). There a bfloat16 layer is held for fbgemm instead (``Bf16FbgemmLinear``): each
output row of the weight is scaled by a power of two that brings its largest value to float16's
top binade, where bfloat16's 8 significant bits fit float16's 11 exactly over 33 binades (a value
below its row's largest by more than 2**32 is rounded, and counted); fbgemm sums in float32, the
output columns are scaled back (exact), the bias added, and the result rounded to bfloat16: a
bfloat16 linear with float32 sums, as oneDNN's is, in another order of summation. An output
layer tied to the embedding table is held this way too, in a float16 copy of its own (a
Qwen2.5-1.5B's: 0.47 GB; its step reads it at fbgemm's rate), while the embedding keeps the table
(a bfloat16 checkpoint's stays in its mapped file, resident as rows are looked up). This is done
on x86 CPUs whose oneDNN has no packed bfloat16 kernel, where it was measured; elsewhere
(AVX-512 without BF16, ARM) bfloat16 layers stay oneDNN's.
"""

from __future__ import annotations

import torch

from common.fp16_weights import Fp16Linear, in_order, layer_slots


def packed_bf16_available() -> bool:
    """Whether this PyTorch build and CPU can run oneDNN's packed bfloat16 linear."""
    mkldnn = torch.ops.mkldnn
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
                and hasattr(mkldnn, "_linear_pointwise") and bool(mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


class Bf16Linear(torch.nn.Module):
    """``nn.Linear`` in bfloat16 with its weight held packed for oneDNN; bfloat16 in and out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        w = weight.detach()
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            raise ValueError(f"a packed bfloat16 linear takes a CPU bfloat16 weight, not {w.dtype} on {w.device}")
        # packed for one row: the shape a decoding step has; more rows run the same packed weight
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
        b = None if bias is None else bias.detach().to(torch.bfloat16).clone()
        self.register_buffer("bias", b)

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear) -> "Bf16Linear":
        return cls(lin.weight, lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def to_linear(self) -> torch.nn.Linear:
        """The plain layer it was made from (the same values)."""
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                              device="meta", dtype=torch.bfloat16)
        lin.weight = torch.nn.Parameter(self._packed.to_dense(), requires_grad=False)
        if self.bias is not None:
            lin.bias = torch.nn.Parameter(self.bias.clone(), requires_grad=False)
        return lin

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


BF16_FBGEMM_ENV = "STARSD_BF16_FBGEMM"  # 0: bfloat16 layers stay oneDNN's where the CPU has no bfloat16 units


class Bf16FbgemmLinear(torch.nn.Module):
    """``nn.Linear`` in bfloat16 multiplied by fbgemm's float16-weight GEMM (see the module's
    docstring): bfloat16 in and out, the weight's values exactly the bfloat16 ones but for the
    counted few (``inexact``) far below their row's largest."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        w = weight.detach()
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            raise ValueError(f"a bfloat16 linear for fbgemm takes a CPU bfloat16 weight, not {w.dtype} on {w.device}")
        top = w.abs().amax(dim=1).float()
        _, exp = torch.frexp(top)  # top = m * 2**exp, 0.5 <= m < 1
        # each row's largest lands in [2**15, 2**16), where bfloat16's largest value (65280) is
        # within float16's (65504); float16 holds 8 significant bits down to 2**-17
        shift = torch.where(top > 0, 16 - exp, torch.zeros_like(exp)).clamp(-100, 100)
        scaled = w.float().mul_(torch.pow(2.0, shift.float())[:, None])
        self.inexact = sum(int(torch.count_nonzero(block.half().float() != block))  # a few rows at a time
                           for block in scaled.split(256))
        self.inner = Fp16Linear(scaled)  # fbgemm's GEMM of the scaled weight, float32 in and out
        del scaled
        self.register_buffer("unscale", torch.pow(2.0, -shift.float()), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)

    @classmethod
    def from_linear(cls, lin: torch.nn.Linear) -> "Bf16FbgemmLinear":
        return cls(lin.weight, lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.inner(x.reshape(-1, self.in_features))
        # the scaling back is exact, so one op with the bias rounds as the sum alone would
        y = y.mul_(self.unscale) if self.bias is None else torch.addcmul(self.bias, y, self.unscale)
        return y.to(torch.bfloat16).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "weights=bfloat16 values scaled into float16 (fbgemm)")


def pack_bf16_fbgemm(model: torch.nn.Module, done=None) -> tuple[int, int, int]:
    """Replace every bfloat16 ``nn.Linear`` of ``model`` on the CPU by a ``Bf16FbgemmLinear``,
    in place, an output layer tied to the embedding table included (it then holds its own
    copy); returns (layers replaced, weights rounded, weights in them). ``done(weight)``: called
    with each plain weight once its layer is replaced (to give its pages back)."""
    n = inexact = total = 0
    slots = layer_slots(model, lambda m: (type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16
                                          and m.weight.device.type == "cpu"))
    # a few layers at once (fbgemm packs on one thread and lets go of the GIL), replaced in order
    for (parent, name), new in in_order(lambda slot: Bf16FbgemmLinear.from_linear(getattr(*slot)), slots):
        child = getattr(parent, name)
        inexact, total = inexact + new.inexact, total + child.weight.numel()
        setattr(parent, name, new)
        if done is not None:  # (a tied table's pages too: the embedding reads its rows from the file again)
            done(child.weight)
        del child
        n += 1
    return n, inexact, total


def pack_bf16(model: torch.nn.Module, done=None) -> tuple[int, str | None]:
    """Replace every bfloat16 ``nn.Linear`` of ``model`` on the CPU by a ``Bf16Linear``, in
    place, except an output layer tied to the embedding table; returns how many, and why none
    were (None when packing ran). The first layer is tried on a row first: where the packed
    kernel fails or gives other bits than the plain layer, nothing is packed, and a failure on a
    later layer unpacks those done. ``done(weight)``: called with each plain weight once its layer
    is replaced (to give its pages back)."""
    tied = _tied_head(model)
    replaced: list[tuple[torch.nn.Module, str]] = []
    for parent, name in layer_slots(model, lambda m: type(m) is torch.nn.Linear):
        child = getattr(parent, name)
        if child is tied or child.weight.dtype != torch.bfloat16 or child.weight.device.type != "cpu":
            continue
        try:
            new = Bf16Linear.from_linear(child)
            why = _differs(child, new) if not replaced else None
        except RuntimeError as exc:  # oneDNN refused the layout on this CPU
            why = f"the packed kernel failed: {exc}"
        if why is not None:
            for p, n in replaced:
                setattr(p, n, getattr(p, n).to_linear())
            return 0, why
        setattr(parent, name, new)
        if done is not None:
            done(child.weight)
        del child  # the plain layer goes now, not when packing ends
        replaced.append((parent, name))
    return len(replaced), None


def _differs(plain: torch.nn.Linear, packed: Bf16Linear) -> str | None:
    """Why the packed layer cannot stand in for the plain one (None: the same bits on a probe row)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, plain.in_features, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        if torch.equal(packed(x), torch.nn.functional.linear(x, plain.weight, plain.bias)):
            return None
    return "the packed kernel's results differ from the plain layer's on this CPU"


def unpack_bf16(model: torch.nn.Module) -> int:
    """Undo ``pack_bf16``: plain ``nn.Linear`` layers again (for ``torch.compile``); returns how many."""
    slots = layer_slots(model, lambda m: type(m) is Bf16Linear)
    for parent, name in slots:
        setattr(parent, name, getattr(parent, name).to_linear())
    return len(slots)


def _tied_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer, where it shares its weight with the input embedding table."""
    get_out, get_in = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    if get_out is None or get_in is None:
        return None
    head, table = get_out(), get_in()
    # a cut draft head (common.draft_vocab.SubsetHead) has no weight of its own: it holds a copy
    w, t = getattr(head, "weight", None), getattr(table, "weight", None)
    if w is None or t is None:
        return None
    return head if w is t or w.data_ptr() == t.data_ptr() else None
