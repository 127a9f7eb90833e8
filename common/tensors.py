"""Tensor codec: torch tensors as zero-copy trailing frames described by a msgpack-able spec.

A tensor travels as one raw frame holding its bytes (C order) and a spec
``{"dtype": "bfloat16", "shape": [2, 3]}`` in the message header. The dtype is a
string so that bfloat16 and other types numpy lacks survive the trip.
"""

from __future__ import annotations

import warnings

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

# Float bit patterns: a value is NaN or infinite exactly when its magnitude bits reach the
# all-ones exponent. Testing the integer view is an order of magnitude cheaper than
# torch.isfinite on CPU half precision, which matters on the per-request path.
_FLOAT_BITS = {
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
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
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    spec = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    try:  # the common case, a contiguous CPU tensor numpy can view: three calls, no copy
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
    if bits is None or not t.is_cpu or not t.is_contiguous():
        return bool(torch.isfinite(t).all())
    if t.numel() == 0:
        return True
    as_int, magnitude, exponent = bits
    return int((t.view(as_int).numpy() & magnitude).max()) < exponent


def decode_tensor(spec: object, buf) -> torch.Tensor:
    """Rebuild a tensor from its spec and a buffer-protocol object, validating both.

    The result shares memory with ``buf`` (read-only); clone it before writing."""
    if not isinstance(spec, dict):
        raise TensorCodecError("tensor spec must be a map")
    name = spec.get("dtype")
    shape = spec.get("shape")
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise TensorCodecError(f"unknown tensor dtype {name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise TensorCodecError(f"bad tensor shape {shape!r}")
    dtype = WIRE_DTYPES[name]
    numel = 1
    for d in shape:
        numel *= d
    mv = memoryview(buf)
    if mv.nbytes != numel * dtype.itemsize:
        raise TensorCodecError(
            f"tensor frame holds {mv.nbytes} bytes, spec {name}{shape} needs {numel * dtype.itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(mv, dtype=dtype)
    return flat if len(shape) == 1 else flat.view(shape)


def _accept_read_only_buffers() -> None:
    # zmq frames are read-only, and a decoded tensor is a read-only view of its frame by
    # contract. torch warns about that once per process; take the warning here, quietly,
    # rather than paying for a warnings filter on every decode.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_accept_read_only_buffers()
