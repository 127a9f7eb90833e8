"""Array codec: tensors as zero-copy trailing frames described by a msgpack-able spec.

An array travels as one raw frame holding its bytes (C order) and a spec
``{"dtype": "bfloat16", "shape": [2, 3]}`` in the message header. The dtype is a
string so that bfloat16 and other types numpy lacks survive the trip.

The wire side speaks numpy, not torch: decoding gives read-only numpy views of the frames,
and encoding takes numpy arrays or torch tensors. Torch stays in the model code, which
converts with ``as_torch`` where it computes. A first call into torch after a wait for the
network costs tens of microseconds on a busy host, more than the bytes themselves; the
protocol path makes none. numpy has no bfloat16, so bfloat16 arrays are numpy arrays of
``BFLOAT16``, a one-field 2-byte dtype holding the bits.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

BFLOAT16 = np.dtype([("bfloat16", "=u2")])

# Only plain numeric dtypes cross the wire; names are torch's own.
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPES}
_NAME_OF_NP = {v: k for k, v in WIRE_DTYPES.items()}
_NAME_OF_TORCH = {v: k for k, v in _TORCH_DTYPES.items()}

# Float bit patterns: a value is NaN or infinite exactly when its exponent bits are all ones.
# Read as signed integers, the positive ones are the largest values; read as unsigned, the
# negative ones are. So two max-reductions over integer views of the same bytes find any NaN
# or infinity, with no temporary array: an order of magnitude cheaper than an isfinite pass
# over half precision, which matters on the per-request path.
_FLOAT_BITS = {
    # dtype: (signed view, unsigned view, smallest positive non-finite, smallest negative non-finite as unsigned)
    np.dtype(np.float16): (np.int16, np.uint16, 0x7C00, 0xFC00),
    BFLOAT16: (np.int16, np.uint16, 0x7F80, 0xFF80),
    np.dtype(np.float32): (np.int32, np.uint32, 0x7F800000, 0xFF800000),
}

MAX_TENSOR_DIMS = 8


class TensorCodecError(ValueError):
    """A tensor spec or frame that cannot be decoded."""


def dtype_name(dtype: torch.dtype | np.dtype) -> str:
    """The wire name of a torch or numpy dtype; TypeError for one that cannot be sent."""
    name = _NAME_OF_TORCH.get(dtype) if isinstance(dtype, torch.dtype) else _NAME_OF_NP.get(dtype)
    if name is None:
        raise TypeError(f"dtype {dtype} cannot be sent; allowed: {sorted(WIRE_DTYPES)}")
    return name


def to_wire(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """``x`` as a C-contiguous numpy array of a wire dtype. A contiguous CPU tensor or array is
    viewed, not copied; anything else (on an accelerator, strided, needing grad) is copied."""
    if isinstance(x, np.ndarray):
        dtype_name(x.dtype)
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy array, got {type(x).__name__}")
    dtype_name(x.dtype)
    x = x.detach()
    if x.device.type != "cpu" or not x.is_contiguous():
        x = x.cpu().contiguous()
    if x.dtype is torch.bfloat16:
        return x.view(torch.int16).numpy().view(BFLOAT16)
    return x.numpy()


def as_torch(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A torch view of a wire array (a tensor passes through). Decoded arrays are read-only
    views of their frames: clone before writing."""
    if x.__class__ is not np.ndarray:
        return x
    if x.dtype == BFLOAT16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def encode_tensor(x: torch.Tensor | np.ndarray) -> tuple[dict, memoryview]:
    """Return (spec, buffer). The buffer aliases the array's memory when it is already
    contiguous on the CPU, so sending it with ``copy=False`` copies nothing."""
    a = x if x.__class__ is np.ndarray and x.flags.c_contiguous else to_wire(x)
    name = _NAME_OF_NP.get(a.dtype)
    if name is None:
        dtype_name(a.dtype)  # raises the TypeError naming the allowed dtypes
    return {"dtype": name, "shape": list(a.shape)}, memoryview(a).cast("B") if a.size else memoryview(b"")


def all_finite(x: np.ndarray | torch.Tensor) -> bool:
    """True when no element of a floating array or tensor is NaN or infinite."""
    if x.__class__ is not np.ndarray:
        if x.device.type != "cpu" or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return bool(torch.isfinite(x).all())
        x = to_wire(x)
    bits = _FLOAT_BITS.get(x.dtype)
    if bits is None:
        return bool(np.isfinite(x).all()) if x.dtype.kind == "f" else True
    signed, unsigned, pos_bad, neg_bad = bits
    raw = x.view(signed)  # same-width views, so any strides work
    return raw.size == 0 or (int(raw.max()) < pos_bad and int(raw.view(unsigned).max()) < neg_bad)


def brief(v: object, width: int = 80) -> str:
    """A short description of untrusted input for an error message: containers by type and
    size (a repr of hostile nesting could exhaust the stack), anything else by a clipped repr."""
    if isinstance(v, (list, tuple, dict, set)):
        return f"a {type(v).__name__} of {len(v)}"
    return f"{v!r:.{width}}"


def decode_tensor(spec: object, buf) -> np.ndarray:
    """Rebuild an array from its spec and a buffer-protocol object, validating both.

    The result is a view of ``buf`` (read-only for a frame or bytes); ``as_torch`` gives a torch
    view of it."""
    if spec.__class__ is not dict:
        raise TensorCodecError("tensor spec must be a map")
    name = spec.get("dtype")
    dtype = WIRE_DTYPES.get(name) if name.__class__ is str else None
    if dtype is None:
        raise TensorCodecError(f"unknown tensor dtype {brief(name)}")
    shape = spec.get("shape")
    if shape.__class__ is not list or len(shape) > MAX_TENSOR_DIMS:
        raise TensorCodecError(f"bad tensor shape {brief(shape)}")
    numel = 1
    for d in shape:
        if d.__class__ is not int or d < 0:
            raise TensorCodecError(f"bad tensor shape: dimension {brief(d)}")
        numel *= d
    nbytes = len(buf) if buf.__class__ is bytes else memoryview(buf).nbytes
    if nbytes != numel * dtype.itemsize:
        raise TensorCodecError(f"tensor frame holds {nbytes} bytes, spec {name}{shape} needs {numel * dtype.itemsize}")
    return np.ndarray(shape, dtype, buf)  # one call: the shaped view, no copy


def _accept_read_only_buffers() -> None:
    # zmq frames are read-only, and a decoded array is a read-only view of its frame by
    # contract. torch warns about that once per process, in as_torch; take the warning here,
    # quietly, rather than paying for a warnings filter on every conversion.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


_accept_read_only_buffers()
