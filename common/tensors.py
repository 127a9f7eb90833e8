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
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return spec, memoryview(b"")
    # A flat byte view works for every dtype, bfloat16 included (numpy has no bf16).
    raw = t.reshape(-1).view(torch.uint8)
    return spec, memoryview(raw.numpy()).cast("B")


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
    itemsize = torch.empty((), dtype=dtype).element_size()
    mv = memoryview(buf)
    if mv.nbytes != numel * itemsize:
        raise TensorCodecError(
            f"tensor frame holds {mv.nbytes} bytes, spec {name}{shape} needs {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # zmq frames are read-only; the tensor is a read-only view by contract.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mv.cast("B"), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
