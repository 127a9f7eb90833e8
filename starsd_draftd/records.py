"""The typed records a DRAFT request travels as through the draft daemon's loop: queued on Q_in
when it arrives, admitted to a batch when its pass serves it; and what each peer has queued."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common import protocol as P
from common.protocol import Message, MsgType
from starsd_draftd.backends.base import Draft, DraftRequest


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A DRAFT request waiting on Q_in, checked as far as it can be on arrival."""

    identity: bytes  # the connection that sent it, which the reply goes to
    principal: bytes  # whose sessions it names: the CURVE key, or the connection's identity
    msg: Message
    cost: int  # what it holds in memory (queue_cost), charged to the queue's budgets
    share: bytes | str  # what fair service is counted by: the CURVE key, or the remote address
    read_at: float  # perf_counter when it was read off the socket
    queued_at: float  # perf_counter when it was queued
    fed: int = 0  # prompt tokens the draft model feeds for it beyond one (its ACK's estimate)

    @property
    def key(self) -> tuple[bytes, int]:
        """Its session's key in the session table."""
        return self.principal, self.msg.header["session"]


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """A request of this pass's batch, validated against its session, whose cache memory it reserved."""

    identity: bytes  # the connection the reply goes to
    header: dict  # the DRAFT's header (session, seq, depth, ...)
    key: tuple[bytes, int]  # its session's key
    request: DraftRequest  # what the backend drafts from
    read_at: float  # perf_counter when it was read off the socket
    queued_at: float  # perf_counter when it was queued
    fed: int = 0  # prompt tokens the draft model feeds for it beyond one


@dataclass(slots=True)
class PeerBacklog:
    """What one principal has waiting on Q_in, held to the per-peer queue budgets."""

    requests: int = 0  # requests queued
    nbytes: int = 0  # their cost (queue_cost) in all


@dataclass(frozen=True, slots=True)
class LastReply:
    """A session's last chain of drafts and what it was asked for: a DRAFT that brings nothing
    new (no verified tokens, nothing accepted) and asks the same again is answered with it by the
    socket's thread, without a batch slot."""

    seq: int  # the request it answered (or, once repeated, the last repeat)
    ask: tuple  # what it was drafted for (``ask_of`` its DRAFT's header)
    draft: Draft


def ask_of(header: dict) -> tuple:
    """What a DRAFT asks for, beyond its session's text: a repeat with the same gets the same."""
    return (header["depth"], header.get("tree_tokens", 0), header.get("min_survival", 0.0),
            header.get("min_chance", 0.0))


def drafted(session: int, seq: int, draft: Draft, queued_s: float, draft_s: float) -> Message:
    """A DRAFTED reply: the drafts (with their q where sampled, their parents where a tree), the
    request's wait in the queue and the drafting time it reports."""
    header = {"session": session, "seq": seq, "tokens": draft.tokens,
              "queued_us": min(P.MAX_REPORTED_US, round(1e6 * max(0.0, queued_s))),
              "draft_us": min(P.MAX_REPORTED_US, round(1e6 * draft_s))}
    tensors = {} if draft.q_ids is None else {"q_ids": draft.q_ids, "q_probs": draft.q_probs}
    if draft.parents is not None:
        tensors["parents"] = np.asarray(draft.parents, dtype=np.int16)
    return Message(MsgType.DRAFTED, header, tensors)
