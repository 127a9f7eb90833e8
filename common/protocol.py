"""The StarSD wire protocol: every message type, field, error code and the version live here.

A message is a list of frames::

    [type][msgpack header][tensor frame 0][tensor frame 1]...

(the draft daemon's ROUTER socket sees the peer identity in front). The header is a
msgpack map; it always carries ``v`` (the protocol version) and, when tensors
follow, ``tensors``: ``{name: {"dtype": str, "shape": [...], "frame": i}}``.

Conversation between a target (DEALER) and the draft daemon (ROUTER)::

    HELLO   -> WELCOME | ERROR      handshake: version, vocabulary size, tokenizer fingerprint
    OPEN    -> (nothing) | ERROR    new session: prompt ids and sampling parameters
    DRAFT   -> ACK, then DRAFTED | ERROR
                                     "n of your last drafts survived, then these tokens were
                                     verified; the verified sequence is now `pos` long;
                                     draft `depth` more". For a backend that drafts from the
                                     target's features (WELCOME.feature_size > 0) a tensor
                                     `features` [m, feature_size] (float16/bfloat16/float32)
                                     carries the features of the m positions after those
                                     already sent, so that the session holds features for all
                                     but the last verified token. A feature is the target's
                                     final hidden state, or, where WELCOME names
                                     `feature_layers`, the hidden states entering those layers
                                     concatenated in that order (``common.features``). DRAFTED may say where the request's time
                                     went in the daemon (optional, microseconds): `queued_us`
                                     waiting for its batch, `draft_us` in the backend's call.
                                     A DRAFT may ask for a tree: `tree_tokens` > `depth` is the
                                     most draft tokens the target verifies in one forward, and
                                     the DRAFTED reply may then carry a tensor `parents` [n]
                                     (int16): each token's parent index, -1 for a child of the
                                     last verified token, every parent before its children
                                     (``common.tree``); without it the tokens are a chain. A tree
                                     reply's q rows are per node: the parent's distribution.
                                     ACK comes at once, when the request is queued (a refusal
                                     comes as ERROR instead): `ahead`, the requests queued before
                                     it, and `eta_us`, the daemon's estimate of when its DRAFTED
                                     will leave, from its measured costs. No ACK within a round
                                     trip means the daemon is not answering; an ACK means the
                                     reply is worth waiting for, about `eta_us`.
    CLOSE   -> (nothing)
                                     An ERROR names the request it answers (``re``: "OPEN",
                                     "DRAFT", ...) and echoes its session and seq where it had
                                     them, so a refused OPEN reaches the session that sent it.
    STATS   -> STATS_REPLY          counters of the draft daemon
    PING    -> PONG                 application-level lease: keeps the peer known, tells
                                     the target whether the daemon is alive and draining
    GOODBYE <-                      the daemon is stopping: with `draining`, it serves the
                                     sessions it holds until their targets move them to another
                                     daemon; without, it is gone: draft without it until it is back

A target daemon also takes generation jobs on a local control socket:

    GENERATE -> RESULT | ERROR

Any change to this module's messages or meanings bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

from common.tensors import TensorCodecError, brief, decode_tensor, encode_tensor

PROTOCOL_VERSION = 5  # 2: ERROR names the request it answers (re); WELCOME says max_len
# 3: draft trees (DRAFT.tree_tokens, DRAFTED's parents tensor, WELCOME.tree_topk and max_tree_tokens).
# A bump, not optional fields: after a tree, DRAFT's `accepted` no longer counts a prefix of the
# last drafts (the kept path comes back as new tokens) and a reply's q rows are per node, the
# parent's; a peer that read a tree reply as a chain would verify the wrong proposal.
# 4: fused features (WELCOME.feature_layers, HELLO.num_layers) for EAGLE-3 heads. A bump: a
# version-3 target would ignore feature_layers and send final hidden states where fused ones are
# read.
# 5: DRAFT is acknowledged (ACK) on arrival. A bump: a version-4 daemon never acknowledges, and a
# version-5 target would take its silence for a hung daemon.
# Optional fields added to a message without a version bump, because a peer of the same version
# that predates them interoperates unchanged: decode() drops fields outside the schema, and a
# message without them is valid. (The version is compared for equality: a bump would cut every
# older peer off.) DRAFTED: queued_us, draft_us. DRAFT: min_survival, with WELCOME: stops_drafts
# (a daemon that predates them drafts `depth`; a target that predates them never asks it to stop);
# DRAFT: min_chance (a daemon that predates it stops suffix drafts at min_survival too).
# WELCOME and PONG: queue, wait_us, sessions (its load). GOODBYE: draining (a target that
# predates it stops drafting there at once, as it did). ErrorCode NOT_ALLOWED (a target's job
# socket only; the draft link never sends it).


class MsgType(bytes, enum.Enum):
    HELLO = b"HELLO"
    WELCOME = b"WELCOME"
    OPEN = b"OPEN"
    DRAFT = b"DRAFT"
    DRAFTED = b"DRAFTED"
    CLOSE = b"CLOSE"
    ERROR = b"ERROR"
    STATS = b"STATS"
    STATS_REPLY = b"STATS_REPLY"
    GENERATE = b"GENERATE"
    RESULT = b"RESULT"
    PING = b"PING"
    PONG = b"PONG"
    GOODBYE = b"GOODBYE"
    ACK = b"ACK"


class ErrorCode(enum.IntEnum):
    MALFORMED = 1  # not valid frames / msgpack / tensor data
    UNKNOWN_TYPE = 2
    VERSION_MISMATCH = 3
    INCOMPATIBLE_MODEL = 4  # vocabulary or tokenizer differ
    NO_HANDSHAKE = 5  # a request before HELLO
    UNKNOWN_SESSION = 6
    BAD_REQUEST = 7  # well-formed but violates the schema or the session's state
    TOO_LARGE = 8
    BUSY = 9  # a session or queue limit was reached
    DESYNC = 10  # the verified length the target states differs from the session's
    INTERNAL = 11
    GENERATION_FAILED = 12
    SHUTTING_DOWN = 13
    NOT_ALLOWED = 14  # the request needs credentials this connection does not have (a job socket's GENERATE)


@dataclass(frozen=True)
class Limits:
    """Bounds applied to untrusted bytes before anything else looks at them."""

    max_frames: int = 8
    max_message_bytes: int = 64 << 20
    max_header_bytes: int = 4 << 20
    max_array_len: int = 1 << 18  # longest token list (prompt) accepted
    max_map_len: int = 64
    max_str_len: int = 1 << 20
    max_depth: int = 64


DEFAULT_LIMITS = Limits()


@dataclass
class Message:
    type: MsgType
    header: dict = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)  # numpy arrays or torch tensors to send; decoded: numpy


class ProtocolError(Exception):
    """Input that violates the protocol; carries what an ERROR reply needs."""

    def __init__(self, code: ErrorCode, message: str, session: int | None = None, seq: int | None = None,
                 re: MsgType | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.session = session
        self.seq = seq
        self.re = re  # the request refused, when known (the handler fills it in)


class RemoteError(Exception):
    """An ERROR message received from the other side."""

    def __init__(self, code: int, message: str, session: int | None = None, seq: int | None = None,
                 re: str | None = None):
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"code {code}"
        super().__init__(f"{name}: {message}")
        self.name = name
        self.code = code
        self.message = message
        self.session = session
        self.seq = seq
        self.re = re  # the type name of the request it answers ("OPEN", "DRAFT", ...), if the daemon said


# ---------------------------------------------------------------- schema
# Field kinds: "int" (not bool), "uint", "float" (int accepted), "prob" (a float in [0, 1]), "str", "bool",
# "ids" (list of uints < 2**31), "strs", "map", "opt_int", "opt_uint", "us", "any".
_U31 = (1 << 31) - 1
# "us": a duration a daemon reports, in whole microseconds, at most an hour (no request's time
# in a daemon can be longer: a target gives up waiting long before).
MAX_REPORTED_US = 3600 * 1_000_000

# What a draft daemon reports of its load in WELCOME and PONG (optional): targets with several
# draft daemons place new sessions by it.
LOAD_FIELDS = {
    "queue": ("uint", False),  # draft requests queued
    "wait_us": ("us", False),  # when a request sent now would begin to be drafted, by its estimate
    "sessions": ("uint", False),  # sessions it holds
}

SCHEMA: dict[MsgType, dict[str, tuple[str, bool]]] = {
    # name: (kind, required)
    MsgType.HELLO: {
        "vocab_size": ("uint", True),
        "tokenizer": ("str", True),
        "feature_size": ("uint", False),  # the target's hidden size (features it can send)
        "num_layers": ("uint", False),  # the target's decoder layers (the fused features it can send)
        "name": ("str", False),
    },
    MsgType.WELCOME: {
        "vocab_size": ("uint", True),
        "tokenizer": ("str", True),
        "backend": ("str", True),
        "max_depth": ("uint", True),
        "q_topk": ("uint", True),
        "feature_size": ("uint", True),  # >0: send target features of this width with each DRAFT
        "feature_layers": ("ids", False),  # the hidden states fused into a feature (absent: the final one)
        "instance": ("str", True),  # changes when the daemon restarts: sessions must be re-opened
        "server": ("str", False),
        "max_len": ("uint", False),  # longest sequence (verified + drafts) it drafts for; 0: no bound
        "tree_topk": ("uint", False),  # branching of the trees it drafts (absent or 1: chains only)
        "max_tree_tokens": ("uint", False),  # the most tree_tokens a DRAFT may ask for (absent: no trees)
        "stops_drafts": ("bool", False),  # greedy chains stop early on DRAFT.min_survival (absent: never)
        **LOAD_FIELDS,
    },
    MsgType.OPEN: {"session": ("uint", True), "prompt": ("ids", True), "sampling": ("map", True)},
    MsgType.DRAFT: {
        "session": ("uint", True),
        "seq": ("uint", True),
        "accepted": ("uint", True),
        "new": ("ids", True),
        "pos": ("uint", True),
        "depth": ("uint", True),
        "tree_tokens": ("uint", False),  # > depth: a tree of at most this many tokens may answer
        # a greedy chain may stop before `depth` once the chance that all its drafts are kept
        # falls below this (WELCOME.stops_drafts; absent or 0: `depth` drafts); a greedy tree
        # keeps no node below its threshold (min_chance, else this)
        "min_survival": ("prob", False),
        # the same for a chain the daemon copies from text already seen (its suffix index), which
        # costs it no drafting, and a greedy tree's threshold (absent: min_survival)
        "min_chance": ("prob", False),
    },
    MsgType.DRAFTED: {
        "session": ("uint", True),
        "seq": ("uint", True),
        "tokens": ("ids", True),
        "queued_us": ("us", False),  # in the request queue: from being queued to the start of its batch
        "draft_us": ("us", False),  # its batch's backend call (the draft forwards)
    },
    MsgType.ACK: {
        "session": ("uint", True),
        "seq": ("uint", True),
        "ahead": ("uint", True),  # requests queued before this one
        "eta_us": ("us", True),  # the daemon's estimate: from now until its DRAFTED leaves
    },
    MsgType.CLOSE: {"session": ("uint", True)},
    MsgType.ERROR: {
        "code": ("uint", True),
        "message": ("str", True),
        "session": ("opt_uint", False),
        "seq": ("opt_uint", False),
        "re": ("str", False),  # the request type this error answers
    },
    MsgType.STATS: {},
    MsgType.STATS_REPLY: {"stats": ("map", True)},
    MsgType.GENERATE: {
        "id": ("uint", True),
        "prompt": ("str", False),
        "prompt_ids": ("ids", False),
        "max_tokens": ("uint", True),
        "temperature": ("float", False),
        "top_p": ("float", False),
        "top_k": ("uint", False),
        "seed": ("opt_uint", False),
        "stop": ("strs", False),
        "no_draft": ("bool", False),
        "max_draft_tokens": ("uint", False),  # drafts per round at most, within the target's depth (0: none)
    },
    MsgType.RESULT: {"id": ("uint", True), "text": ("str", True), "token_ids": ("ids", True), "stats": ("map", True)},
    MsgType.PING: {},
    MsgType.PONG: {"instance": ("str", True), "draining": ("bool", True), **LOAD_FIELDS},
    # draining: the daemon serves the sessions it holds until their targets move them (absent or
    # false: it is gone now)
    MsgType.GOODBYE: {"instance": ("str", True), "draining": ("bool", False)},
}

SAMPLING_SCHEMA: dict[str, tuple[str, bool]] = {
    "temperature": ("float", True),
    "top_k": ("uint", False),
    "top_p": ("float", False),
    "seed": ("opt_uint", False),
}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and x.__class__ is not bool


_U63 = (1 << 63) - 1


def _ids(v: Any) -> bool:
    # map(type, ...) runs at C speed over long prompts; exact int excludes bool
    return v.__class__ is list and (not v or (set(map(type, v)) == {int} and min(v) >= 0 and max(v) <= _U31))


# One check per field kind (a table rather than an if-chain: this runs for every field of
# every message).
_CHECKS: dict[str, Any] = {
    "int": _is_int,
    "uint": lambda v: _is_int(v) and 0 <= v <= _U63,
    "opt_uint": lambda v: v is None or (_is_int(v) and 0 <= v <= _U63),
    "us": lambda v: _is_int(v) and 0 <= v <= MAX_REPORTED_US,
    "float": lambda v: (isinstance(v, float) or _is_int(v)) and v == v,  # rejects NaN
    "prob": lambda v: (isinstance(v, float) or _is_int(v)) and 0.0 <= v <= 1.0,  # rejects NaN too
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "ids": _ids,
    "strs": lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
    "map": lambda v: isinstance(v, dict),
    "any": lambda v: True,
}
# Kinds whose values may hold nested maps and lists: only these are measured against
# Limits.max_depth (every other kind is a scalar or a flat list by its check).
_NESTED_KINDS = frozenset({"map", "any"})

_MISSING = object()


def _compile(schema: dict[str, tuple[str, bool]]) -> tuple:
    return tuple((name, kind, required, _CHECKS[kind]) for name, (kind, required) in schema.items())


_COMPILED = {mtype: _compile(fields) for mtype, fields in SCHEMA.items()}
_NESTED = {mtype: tuple(n for n, (kind, _) in fields.items() if kind in _NESTED_KINDS)
           for mtype, fields in SCHEMA.items()}


def _check(compiled: tuple, header: dict, what: str, session, seq) -> int:
    """Validate ``header`` against a compiled schema; the number of schema fields present."""
    present = 0
    for name, kind, required, check in compiled:
        v = header.get(name, _MISSING)
        if v is _MISSING:
            if required:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what}: missing field {name!r}", session, seq)
            continue
        present += 1
        if not check(v):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what}: field {name!r} must be {kind}, got {brief(v)}",
                                session, seq)
    return present


def validate_fields(schema: dict[str, tuple[str, bool]], header: dict, what: str,
                    session: int | None = None, seq: int | None = None) -> None:
    _check(_compile(schema), header, what, session, seq)


# ---------------------------------------------------------------- encode / decode
_TYPE_OF = {t.value: t for t in MsgType}
_FRAME_OF = {t: t.value for t in MsgType}  # Enum.value is a descriptor call; a dict is cheaper


def encode(msg: Message) -> list:
    """Frames for ``msg`` (tensors as zero-copy buffers). Unknown types fail here, loudly."""
    frame = _FRAME_OF.get(msg.type) if isinstance(msg.type, MsgType) else None
    if frame is None:
        raise TypeError(f"not a protocol message type: {msg.type!r}")
    header = dict(msg.header)
    header["v"] = PROTOCOL_VERSION
    if not msg.tensors:
        return [frame, msgpack.packb(header)]
    frames: list = [frame, None]
    specs = {}
    for name, t in msg.tensors.items():
        spec, buf = encode_tensor(t)
        spec["frame"] = len(frames) - 2
        specs[name] = spec
        frames.append(buf)
    header["tensors"] = specs
    frames[1] = msgpack.packb(header)
    return frames


# Below this size a frame is cheaper to copy than to hand to ZeroMQ without copying (pyzmq's own
# zero-copy threshold): pass ``copy=needs_copy(frames)`` when sending.
ZERO_COPY_MIN_BYTES = 1 << 16


def needs_copy(frames: list) -> bool:
    """True when every frame is small: sending with ``copy=True`` is then the cheaper path."""
    for f in frames:
        if (len(f) if f.__class__ is bytes else memoryview(f).nbytes) >= ZERO_COPY_MIN_BYTES:
            return False
    return True


def _view(frame) -> memoryview:
    """A flat byte view of a zmq.Frame (its .buffer) or any other buffer."""
    v = getattr(frame, "buffer", frame)
    if v.__class__ is not memoryview:
        v = memoryview(v)
    if v.ndim != 1 or v.format != "B":
        try:
            v = v.cast("B")
        except TypeError:  # not C-contiguous: copy it
            v = memoryview(v.tobytes())
    return v


def decode(frames: Sequence, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse frames from an untrusted peer; every failure is a ProtocolError.

    The header keeps only the fields of the type's schema (others are ignored, for forward
    compatibility), each checked against its kind."""
    if len(frames) < 2:
        raise ProtocolError(ErrorCode.MALFORMED, f"a message needs at least 2 frames, got {len(frames)}")
    if len(frames) > limits.max_frames:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(frames)} frames exceed the limit of {limits.max_frames}")
    # zmq.Frame exposes .buffer; bytes are taken as they are, other buffers through a memoryview
    bufs = [f if f.__class__ is bytes else _view(f) for f in frames]
    raw_type = bytes(bufs[0])
    mtype = _TYPE_OF.get(raw_type)
    if mtype is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {raw_type[:32]!r}")
    try:
        return _decode_body(mtype, bufs, limits)
    except ProtocolError as exc:
        exc.re = exc.re or mtype  # a refusal names the request it answers
        raise


def _is_map(buf) -> bool:
    first = buf[0] if len(buf) else 0
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _decode_body(mtype: MsgType, bufs: list, limits: Limits) -> Message:
    total = sum(map(len, bufs))
    too_large = None
    if total > limits.max_message_bytes:
        too_large = f"message of {total} bytes exceeds {limits.max_message_bytes}"
    elif len(bufs[1]) > limits.max_header_bytes:
        too_large = f"header of {len(bufs[1])} bytes exceeds {limits.max_header_bytes}"
    if too_large is not None:  # say which session it was, if the header tells (read without decoding)
        ids = peek_ids(bufs[1], limits) if _is_map(bufs[1]) else (None, None)
        raise ProtocolError(ErrorCode.TOO_LARGE, too_large, *ids)
    try:
        header = msgpack.unpackb(bufs[1], raw=False, strict_map_key=True, max_str_len=limits.max_str_len,
                                 max_bin_len=0, max_ext_len=0, max_array_len=limits.max_array_len,
                                 max_map_len=limits.max_map_len)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        if _is_map(bufs[1]) and any(f"exceeds max_{k}_len" in str(exc) for k in ("array", "map", "str")):
            # a map holding something beyond the limits: the refusal says which session it was
            raise ProtocolError(ErrorCode.TOO_LARGE, f"header: {exc}", *peek_ids(bufs[1], limits)) from None
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not valid msgpack: {exc}") from None
    if header.__class__ is not dict:
        raise ProtocolError(ErrorCode.MALFORMED, "header must be a msgpack map")
    session = header.get("session")
    session = session if _is_int(session) else None
    seq = header.get("seq")
    seq = seq if _is_int(seq) else None
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"protocol version {brief(version)} is not supported; this side speaks version {PROTOCOL_VERSION}",
            session,
            seq,
        )
    specs = header.pop("tensors", None)
    present = _check(_COMPILED[mtype], header, mtype.name, session, seq)
    for name in _NESTED[mtype]:
        v = header.get(name)
        if (v.__class__ is dict or v.__class__ is list) and _nesting(v) > limits.max_depth:
            raise ProtocolError(ErrorCode.MALFORMED, f"{mtype.name}: field {name!r} nests deeper than "
                                                     f"{limits.max_depth} levels", session, seq)
    if present + 1 != len(header):  # drop fields outside the schema: nothing downstream reads them
        header = {name: header[name] for name, *_ in _COMPILED[mtype] if name in header}
        header["v"] = version
    tensors = _decode_tensors(specs, bufs, session, seq) if specs is not None or len(bufs) > 2 else {}
    return Message(mtype, header, tensors)


def peek_ids(buf, limits: Limits) -> tuple[int | None, int | None]:
    """The session and seq of a header too large to decode, read without building the rest
    (msgpack skips values without materialising them), so a refusal still reaches its session."""
    found: dict[str, Any] = {}
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(buf) + 1, max_str_len=limits.max_str_len)
        unpacker.feed(buf)
        for _ in range(min(unpacker.read_map_header(), limits.max_map_len)):
            key = unpacker.unpack()
            if key in ("session", "seq"):
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # garbage after the part that could be read: keep what was found
        pass
    session, seq = found.get("session"), found.get("seq")
    return (session if _CHECKS["uint"](session) else None), (seq if _CHECKS["uint"](seq) else None)


def _nesting(obj: Any) -> int:
    """How deep lists and maps nest in ``obj``; iterative, so hostile input cannot exhaust the stack.
    (msgpack builds exact lists and dicts, so exact type tests suffice.)"""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > deepest:
            deepest = d
        for v in (o.values() if o.__class__ is dict else o):
            if v.__class__ is list or v.__class__ is dict:
                stack.append((v, d + 1))
    return deepest


def _decode_tensors(specs: Any, frames: list, session, seq) -> dict[str, np.ndarray]:
    """The tensors described by ``specs`` in ``frames[2:]`` (the frames after type and header)."""
    n = len(frames) - 2
    if specs is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"{n} tensor frames but no tensor specs", session, seq)
    if specs.__class__ is not dict or len(specs) != n:
        raise ProtocolError(ErrorCode.MALFORMED, "tensor specs do not match the trailing frames", session, seq)
    out: dict[str, np.ndarray] = {}
    used = 0  # bit mask of the frames taken
    for name, spec in specs.items():
        idx = spec.get("frame") if spec.__class__ is dict else None
        if not _is_int(idx) or not 0 <= idx < n or used >> idx & 1:
            raise ProtocolError(ErrorCode.MALFORMED, f"tensor {brief(name)} has a bad frame index", session, seq)
        used |= 1 << idx
        try:
            out[name] = decode_tensor(spec, frames[idx + 2])
        except TensorCodecError as exc:
            raise ProtocolError(ErrorCode.MALFORMED, f"tensor {brief(name)}: {exc}", session, seq) from None
    return out


# ---------------------------------------------------------------- constructors
def error(code: ErrorCode, message: str, session: int | None = None, seq: int | None = None,
          re: MsgType | None = None) -> Message:
    # echo the request's session and seq only when they are valid: the reply must pass the schema
    session = session if _CHECKS["uint"](session) else None
    seq = seq if _CHECKS["uint"](seq) else None
    header = {"code": int(code), "message": message, "session": session, "seq": seq}
    if re is not None:
        header["re"] = re.name
    return Message(MsgType.ERROR, header)


def error_from(exc: ProtocolError) -> Message:
    return error(exc.code, exc.message, exc.session, exc.seq, exc.re)


def remote_error(header: dict) -> RemoteError:
    """The RemoteError an ERROR message's (validated) header describes."""
    h = header
    return RemoteError(h["code"], h["message"], h.get("session"), h.get("seq"), h.get("re"))


def raise_if_error(msg: Message) -> Message:
    if msg.type is MsgType.ERROR:
        raise remote_error(msg.header)
    return msg
