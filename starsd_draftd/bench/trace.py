"""The service trace: when each draft service starts and ends, on CLOCK_MONOTONIC (one clock for
every process on a host), and the timing accounting the bench reads from it."""

from __future__ import annotations

import bisect
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from common.verify import SamplingParams
from starsd_draftd.backends.base import Draft, DraftBackend, DraftRequest

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- the trace
@dataclass
class Trace:
    """What the draft daemon's backend did, on CLOCK_MONOTONIC (seconds).

    services: (start, end, requests served together) per backend call.
    requests: (session serial, start, end, verified length) per request.
    sessions: session serial -> the seed its target opened it with (names the session)."""

    services: list[tuple[float, float, int]] = field(default_factory=list)
    requests: list[tuple[int, float, float, int]] = field(default_factory=list)
    sessions: dict[int, int | None] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"clock": "CLOCK_MONOTONIC", "services": self.services, "requests": self.requests,
                "sessions": {str(k): v for k, v in self.sessions.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Trace":
        return cls([tuple(s) for s in d["services"]], [tuple(r) for r in d["requests"]],
                   {int(k): v for k, v in d["sessions"].items()})

    def dump(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> "Trace":
        return cls.from_json(json.loads(Path(path).read_text()))

    def serial_for_seed(self, seed: int) -> int | None:
        found = [k for k, v in self.sessions.items() if v == seed]
        return found[-1] if found else None


@dataclass
class _Traced:
    serial: int
    inner: object


class TracingBackend(DraftBackend):
    """Any backend, with the start and end of every service recorded (two clock reads each)."""

    def __init__(self, inner: DraftBackend, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.name = inner.name
        self.vocab_size = inner.vocab_size
        self.fingerprint = inner.fingerprint
        self.feature_size = inner.feature_size
        self.q_topk = getattr(inner, "q_topk", 0)  # the server reads it the same way
        self.trace = Trace()
        self._clock = clock
        self._serials = 0

    def new_state(self, params: SamplingParams) -> _Traced:
        self._serials += 1
        self.trace.sessions[self._serials] = params.seed
        return _Traced(self._serials, self.inner.new_state(params))

    def draft(self, state: object, verified: list[int], depth: int,
              new_features: np.ndarray | torch.Tensor | None = None) -> Draft:
        st: _Traced = state  # type: ignore[assignment]
        t0 = self._clock()
        try:
            return self.inner.draft(st.inner, verified, depth, new_features)
        finally:
            t1 = self._clock()
            self.trace.services.append((t0, t1, 1))
            self.trace.requests.append((st.serial, t0, t1, len(verified)))

    def draft_many(self, requests: list) -> list[Draft]:
        inner_requests = [DraftRequest(r.state.inner, r.verified, r.depth, r.new_features) for r in requests]
        t0 = self._clock()
        try:
            return self.inner.draft_many(inner_requests)
        finally:
            t1 = self._clock()
            self.trace.services.append((t0, t1, len(requests)))
            for r in requests:
                self.trace.requests.append((r.state.serial, t0, t1, len(r.verified)))

    def release(self, state: object) -> None:
        self.inner.release(state.inner)  # type: ignore[attr-defined]

    def attach_suffix(self, index: object) -> None:
        self.inner.attach_suffix(index)

    def bind_text(self, state: object, text: object) -> None:
        self.inner.bind_text(state.inner, text)  # type: ignore[attr-defined]

    def counters(self) -> dict:
        return self.inner.counters()


# ---------------------------------------------------------------- timing accounting
def services_between(services: list[tuple[float, float, int]], t0: float, t1: float) -> list[tuple[float, float, int]]:
    """Services that started and ended inside [t0, t1], in order."""
    return sorted(s for s in services if s[0] >= t0 and s[1] <= t1)


def idle_gaps(services: list[tuple[float, float, int]]) -> list[float]:
    """Seconds from the end of each service to the start of the next (the draft side's idle
    gaps; they include the server loop's own per-request work, which is not drafting)."""
    s = sorted(services)
    return [max(0.0, b[0] - a[1]) for a, b in zip(s, s[1:])]


class BusyIndex:
    """Busy time of a serial server within any interval, in O(log n) per query."""

    def __init__(self, services: list[tuple[float, float, int]]):
        merged: list[list[float]] = []
        for start, end, _ in sorted(services):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [m[0] for m in merged]
        self.ends = [m[1] for m in merged]
        self.prefix = [0.0]
        for s, e in merged:
            self.prefix.append(self.prefix[-1] + (e - s))

    def _upto(self, t: float) -> float:
        """Busy time in (-inf, t]."""
        i = bisect.bisect_right(self.starts, t)  # intervals starting at or before t
        if i == 0:
            return 0.0
        return self.prefix[i - 1] + (min(t, self.ends[i - 1]) - self.starts[i - 1])

    def busy(self, t0: float, t1: float) -> float:
        return max(0.0, self._upto(t1) - self._upto(t0)) if t1 > t0 else 0.0


