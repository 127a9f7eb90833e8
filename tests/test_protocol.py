"""Wire protocol: tensor codec round trips and typed errors for every kind of bad input."""

import msgpack
import numpy as np
import pytest
import torch

from common import protocol as P
from common.protocol import ErrorCode, Limits, Message, MsgType, ProtocolError
from common.tensors import BFLOAT16, all_finite, as_torch, decode_tensor, encode_tensor, to_wire
from fakes import nested


def roundtrip(msg: Message) -> Message:
    frames = P.encode(msg)
    return P.decode([bytes(f) for f in frames])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                                   torch.uint8, torch.bool])
def test_tensor_roundtrip_dtypes(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    out = roundtrip(Message(MsgType.DRAFTED, {"session": 1, "seq": 2, "tokens": [1, 2, 3]}, {"x": t}))
    a = out.tensors["x"]
    assert isinstance(a, np.ndarray) and not a.flags.writeable  # a read-only view of the frame
    assert as_torch(a).dtype == dtype
    assert torch.equal(as_torch(a), t)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.int16, np.uint8, np.bool_])
def test_numpy_arrays_travel_as_they_are(dtype):
    a = (np.arange(12).reshape(3, 4) % 5).astype(dtype)
    out = roundtrip(Message(MsgType.DRAFTED, {"session": 1, "seq": 2, "tokens": [1]}, {"x": a, "col": a[:, 1]}))
    assert out.tensors["x"].dtype == a.dtype and np.array_equal(out.tensors["x"], a)
    assert np.array_equal(out.tensors["col"], a[:, 1])  # strided: sent as a contiguous copy


def test_bfloat16_bits_survive():
    t = torch.tensor([1.5, -2.25, 3.0e30, float("inf")], dtype=torch.bfloat16)
    spec, buf = encode_tensor(t)
    assert spec["dtype"] == "bfloat16"
    a = decode_tensor(spec, bytes(buf))
    assert a.dtype == BFLOAT16 and a.shape == (4,)
    assert torch.equal(as_torch(a), t)
    # the wire view of a bfloat16 tensor shares its memory and encodes the same bytes
    w = to_wire(t)
    assert w.dtype == BFLOAT16
    t[0] = 7.0
    assert as_torch(w)[0].item() == 7.0
    assert bytes(encode_tensor(w)[1]) == bytes(encode_tensor(t)[1])


def test_arrays_of_other_dtypes_or_types_are_refused():
    for bad in (np.zeros(3, np.float64), np.zeros(2, np.complex64), [1.0, 2.0], torch.zeros(2, dtype=torch.float64)):
        with pytest.raises(TypeError):
            encode_tensor(bad)


def test_empty_and_noncontiguous_tensors():
    empty = torch.empty(0, 4, dtype=torch.float16)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    strided = base.t()[::2]  # non-contiguous view
    assert not strided.is_contiguous()
    out = roundtrip(Message(MsgType.DRAFTED, {"session": 0, "seq": 0, "tokens": []}, {"e": empty, "s": strided}))
    assert out.tensors["e"].shape == (0, 4) and as_torch(out.tensors["e"]).dtype == torch.float16
    assert torch.equal(as_torch(out.tensors["s"]), strided)


def test_contiguous_cpu_tensor_is_not_copied():
    t = torch.arange(16, dtype=torch.float32)
    _, buf = encode_tensor(t)
    t[0] = 42.0
    assert torch.frombuffer(bytearray(buf), dtype=torch.float32)[0] == 42.0
    a = np.arange(16, dtype=np.float32)
    _, buf = encode_tensor(a)
    a[0] = 42.0
    assert np.frombuffer(bytes(buf), dtype=np.float32)[0] == 42.0


def test_tensors_needing_grad_or_scalar_shapes_travel():
    t = torch.randn(2, 3, requires_grad=True)
    spec, buf = encode_tensor(t)
    assert torch.equal(as_torch(decode_tensor(spec, bytes(buf))), t.detach())
    spec, buf = encode_tensor(torch.tensor(2.5))
    out = decode_tensor(spec, bytes(buf))
    assert out.shape == () and out.item() == 2.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_all_finite_matches_isfinite(dtype, bad):
    t = torch.randn(3, 257).to(dtype)
    t[1, 7] = torch.finfo(dtype).max  # the largest finite values are finite
    t[2, 9] = -torch.finfo(dtype).max
    t[0, 3] = -0.0
    if bad is not None:
        t[2, 256] = bad
    expected = bool(torch.isfinite(t).all())
    assert expected is (bad is None)
    assert all_finite(t) is expected
    assert all_finite(t.t()) is expected  # non-contiguous: the general path
    assert all_finite(t[:0])
    if dtype is not torch.float64:  # the wire arrays, as decoded, contiguous or not
        a = to_wire(t)
        assert all_finite(a) is expected
        assert all_finite(a.T) is expected
        spec, frame = encode_tensor(t)
        assert all_finite(decode_tensor(spec, bytes(frame))) is expected
    else:
        assert all_finite(t.numpy()) is expected


def test_header_fields_roundtrip():
    msg = Message(MsgType.DRAFT, {"session": 7, "seq": 3, "accepted": 2, "new": [5, 6], "pos": 40, "depth": 4})
    assert roundtrip(msg).header == {**msg.header, "v": P.PROTOCOL_VERSION}


def test_unknown_type_fails_at_encode():
    with pytest.raises(TypeError):
        P.encode(Message(b"NOPE", {}))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        P.encode(Message(MsgType.DRAFTED, {}, {"x": torch.zeros(2, dtype=torch.complex64)}))


def hdr(**kw) -> bytes:
    return msgpack.packb({"v": P.PROTOCOL_VERSION, **kw})


GOOD_DRAFT = dict(session=1, seq=1, accepted=0, new=[1], pos=5, depth=3)


@pytest.mark.parametrize("frames, code", [
    ([b"DRAFT"], ErrorCode.MALFORMED),
    ([b"WHAT", hdr()], ErrorCode.UNKNOWN_TYPE),
    ([b"DRAFT", b"\xc1\xc1garbage"], ErrorCode.MALFORMED),
    ([b"DRAFT", msgpack.packb([1, 2, 3])], ErrorCode.MALFORMED),
    ([b"DRAFT", msgpack.packb({"v": 999, **GOOD_DRAFT})], ErrorCode.VERSION_MISMATCH),
    ([b"DRAFT", msgpack.packb(GOOD_DRAFT)], ErrorCode.VERSION_MISMATCH),
    ([b"DRAFT", hdr(**{**GOOD_DRAFT, "seq": "one"})], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**{**GOOD_DRAFT, "new": [1, -2]})], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**{**GOOD_DRAFT, "depth": True})], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_survival=1.5)], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_survival=-0.1)], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_survival=float("nan"))], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_survival="0.3")], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_survival=True)], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_chance=1.5)], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_chance=float("nan"))], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT, min_survival=float("inf"))], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(session=1)], ErrorCode.BAD_REQUEST),
    ([b"DRAFT", hdr(**GOOD_DRAFT), b"extra"], ErrorCode.MALFORMED),
    ([b"DRAFT", hdr(**GOOD_DRAFT, tensors={"x": {"dtype": "float32", "shape": [4], "frame": 0}}), b"abc"],
     ErrorCode.MALFORMED),
    ([b"DRAFT", hdr(**GOOD_DRAFT, tensors={"x": {"dtype": "pickle", "shape": [1], "frame": 0}}), b"abcd"],
     ErrorCode.MALFORMED),
    ([b"DRAFT", hdr(**GOOD_DRAFT, tensors={"x": {"dtype": "uint8", "shape": [1], "frame": 5}}), b"a"],
     ErrorCode.MALFORMED),
    ([b"DRAFT", hdr(**GOOD_DRAFT)] + [b""] * 20, ErrorCode.TOO_LARGE),
])
def test_decode_errors_are_typed(frames, code):
    with pytest.raises(ProtocolError) as info:
        P.decode(frames)
    assert info.value.code == code


def test_min_survival_and_min_chance_are_probabilities():
    for value in (0, 0.0, 0.25, 1.0):
        assert P.decode([b"DRAFT", hdr(**GOOD_DRAFT, min_survival=value)]).header["min_survival"] == value
        assert P.decode([b"DRAFT", hdr(**GOOD_DRAFT, min_chance=value)]).header["min_chance"] == value


def test_fields_outside_the_schema_are_dropped():
    msg = P.decode([b"DRAFT", hdr(**GOOD_DRAFT, later_field={"x": [1, 2]}, other=nested(500))])
    assert msg.header == {**GOOD_DRAFT, "v": P.PROTOCOL_VERSION}


def test_deep_nesting_is_refused_in_map_fields_and_described_briefly_elsewhere():
    with pytest.raises(ProtocolError) as info:
        P.decode([b"OPEN", hdr(session=1, prompt=[1], sampling={"temperature": 1.0, "x": nested(100)})])
    assert info.value.code == ErrorCode.MALFORMED and "nests deeper" in info.value.message
    # a nested value where a scalar belongs fails its check; the message names it without a repr
    for field in ("seq", "new"):
        with pytest.raises(ProtocolError) as info:
            P.decode([b"DRAFT", hdr(**{**GOOD_DRAFT, field: nested(900)})])
        assert info.value.code == ErrorCode.BAD_REQUEST and "a list of 1" in info.value.message
    for spec in ({"dtype": nested(900), "shape": [1], "frame": 0}, {"dtype": "uint8", "shape": [nested(900)], "frame": 0}):
        with pytest.raises(ProtocolError) as info:
            P.decode([b"DRAFT", hdr(**GOOD_DRAFT, tensors={"x": spec}), b"a"])
        assert info.value.code == ErrorCode.MALFORMED


def test_size_limits():
    small = Limits(max_message_bytes=100, max_array_len=10)
    with pytest.raises(ProtocolError) as info:
        P.decode([b"DRAFT", hdr(**GOOD_DRAFT), b"x" * 200], small)
    assert info.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError) as info:
        P.decode([b"OPEN", hdr(session=1, prompt=list(range(50)), sampling={})], small)
    # msgpack's own array bound refuses it, and the refusal still names the session
    assert info.value.code == ErrorCode.TOO_LARGE and info.value.session == 1
    with pytest.raises(ProtocolError) as info:
        P.decode([b"DRAFT", hdr(**{**GOOD_DRAFT, "session": 7, "seq": 3, "new": list(range(50))})],
                 Limits(max_array_len=10))
    assert (info.value.code, info.value.session, info.value.seq) == (ErrorCode.TOO_LARGE, 7, 3)
    with pytest.raises(ProtocolError) as info:  # not a map at all: malformed, however long
        P.decode([b"OPEN", msgpack.packb(list(range(50)))], small)
    assert info.value.code == ErrorCode.MALFORMED


def test_errors_keep_session_and_seq():
    with pytest.raises(ProtocolError) as info:
        P.decode([b"DRAFT", hdr(**{**GOOD_DRAFT, "session": 9, "seq": 4, "depth": "x"})])
    assert (info.value.session, info.value.seq) == (9, 4)


def test_remote_error_names_code():
    msg = roundtrip(P.error(ErrorCode.BUSY, "full", 3, 4))
    with pytest.raises(P.RemoteError) as info:
        P.raise_if_error(msg)
    assert info.value.name == "BUSY" and info.value.session == 3 and "full" in str(info.value)
