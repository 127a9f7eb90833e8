"""Tensor codec: torch tensors as zero-copy trailing frames described by a msgpack-able spec.

A tensor travels as one raw frame holding its bytes (C order) and a spec
``{"dtype": "bfloat16", "shape": [2, 3]}`` in the message header. The dtype is a
string so that bfloat16 and other types numpy lacks survive the trip.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

# Only plain numeric dtypes cross the wire; names are torch's own.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
_NP_DTYPES = {dtype: np.dtype(name) for name, dtype in WIRE_DTYPES.items() if name != "bfloat16"}

# Float bit patterns: a value is NaN or infinite exactly when its exponent bits are all ones.
# Read as signed integers, the positive ones are the largest values; read as unsigned, the
# negative ones are. So two max-reductions over integer views of the same bytes find any NaN
# or infinity, with no temporary array: an order of magnitude cheaper than torch.isfinite on
# CPU half precision, which matters on the per-request path.
_FLOAT_BITS = {
    # dtype: (signed view, unsigned view, smallest positive non-finite, smallest negative non-finite as unsigned)
    torch.float16: (np.int16, np.uint16, 0x7C00, 0xFC00),
    torch.bfloat16: (np.int16, np.uint16, 0x7F80, 0xFF80),
    torch.float32: (np.int32, np.uint32, 0x7F800000, 0xFF800000),
}

MAX_TENSOR_DIMS = 8


class TensorCodecError(ValueError):
    """A tensor spec or frame that cannot be decoded."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be sent; allowed: {sorted(WIRE_DTYPES)}") from None


def encode_tensor(t: torch.Tensor) -> tuple[dict, memoryview]:
    """Return (spec, buffer). The buffer aliases the tensor's memory when it is
    already contiguous on the CPU, so sending it with ``copy=False`` copies nothing."""
    name = _NAMES.get(getattr(t, "dtype", None))
    if name is None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        dtype_name(t.dtype)  # raises the TypeError naming the allowed dtypes
    spec = {"dtype": name, "shape": list(t.shape)}
    try:  # the common case, a contiguous CPU tensor numpy can view: no copy
        return spec, memoryview(t.numpy()).cast("B")
    except (TypeError, RuntimeError):  # needs grad, not on the CPU, not contiguous, or bfloat16
        pass
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return spec, memoryview(b"")
    # numpy lacks bfloat16: its bytes travel through a same-width integer view.
    if t.dtype is torch.bfloat16:
        t = t.view(torch.int16)
    return spec, memoryview(t.numpy()).cast("B")


def all_finite(t: torch.Tensor) -> bool:
    """True when no element of a floating tensor is NaN or infinite."""
    bits = _FLOAT_BITS.get(t.dtype)
    if bits is not None:
        signed, unsigned, pos_bad, neg_bad = bits
        try:  # a CPU tensor without grad: its bits through numpy, which has no bfloat16
            raw = t.view(torch.int16).numpy() if t.dtype is torch.bfloat16 else t.numpy().view(signed)
        except (TypeError, RuntimeError):
            raw = None
        if raw is not None:  # same-width views, so any strides work
            return raw.size == 0 or (int(raw.max()) < pos_bad and int(raw.view(unsigned).max()) < neg_bad)
    return bool(torch.isfinite(t).all())


def brief(v: object, width: int = 80) -> str:
    """A short description of untrusted input for an error message: containers by type and
    size (a repr of hostile nesting could exhaust the stack), anything else by a clipped repr."""
    if isinstance(v, (list, tuple, dict, set)):
        return f"a {type(v).__name__} of {len(v)}"
    return f"{v!r:.{width}}"


def decode_tensor(spec: object, buf) -> torch.Tensor:
    """Rebuild a tensor from its spec and a buffer-protocol object, validating both.

    The result shares memory with ``buf`` (read-only); clone it before writing."""
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
    np_dtype = _NP_DTYPES.get(dtype)
    if np_dtype is not None:  # one call into torch: numpy builds the shaped view
        return torch.from_numpy(np.frombuffer(buf, dtype=np_dtype).reshape(shape))
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=dtype)
    if len(shape) == 1:
        return flat
    return flat.view(*shape) if shape else flat.view(())  # view(*shape) parses faster than view(list)


def _accept_read_only_buffers() -> None:
    # zmq frames are read-only, and a decoded tensor is a read-only view of its frame by
    # contract. torch warns about that once per process; take the warning here, quietly,
    # rather than paying for a warnings filter on every decode.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)
        torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


_accept_read_only_buffers()
