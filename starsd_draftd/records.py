"""The typed records a DRAFT request travels as through the draft daemon's loop: queued on Q_in
when it arrives, admitted to a batch when its pass serves it; and what each peer has queued."""

from __future__ import annotations

from dataclasses import dataclass

from common.protocol import Message
from starsd_draftd.backends.base import DraftRequest


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
