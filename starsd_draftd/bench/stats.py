"""Statistics the bench reports: percentiles, summaries, histograms, per-token latencies, trace accounting."""

from __future__ import annotations

import math
import statistics


from starsd_draftd.bench.trace import BusyIndex


# ---------------------------------------------------------------- statistics
def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default method)."""
    if not xs:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError("q must lie in [0, 100]")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(xs: list[float], scale: float = 1.0) -> dict:
    """n, mean, population std, p50, p99, min, max of ``xs`` times ``scale`` (e.g. 1e3 for s -> ms)."""
    if not xs:
        return {"n": 0, "mean": None, "std": None, "p50": None, "p99": None, "min": None, "max": None}
    v = [x * scale for x in xs]
    return {"n": len(v), "mean": statistics.fmean(v), "std": statistics.pstdev(v), "p50": percentile(v, 50),
            "p99": percentile(v, 99), "min": min(v), "max": max(v)}


def histogram(xs: list[float], edges: tuple[float, ...]) -> list[dict]:
    """Counts in [edges[i], edges[i+1]) and a last open bin [edges[-1], inf)."""
    counts = [0] * len(edges)
    for x in xs:
        i = 0
        while i + 1 < len(edges) and x >= edges[i + 1]:
            i += 1
        counts[i] += 1
    return [{"lo": lo, "hi": (edges[i + 1] if i + 1 < len(edges) else None), "count": c}
            for i, (lo, c) in enumerate(zip(edges, counts))]


def per_token_latencies(rounds: list[tuple[float, int]]) -> list[float]:
    """Time per output token: a round of duration t that produced k tokens gives each of its k
    tokens the latency t / k (so the mean over tokens is total time / total tokens)."""
    out: list[float] = []
    for duration, tokens in rounds:
        if tokens > 0:
            out.extend([duration / tokens] * tokens)
    return out


def relative_error_pct(measured: float, predicted: float) -> float:
    return 100.0 * (measured - predicted) / predicted if predicted else math.inf


def session_rounds(requests: list[tuple[int, float, float, int]]) -> list[tuple[float, int]]:
    """(duration, tokens) of each round, from a draft trace's requests: consecutive requests of one
    session are one target round apart, and the verified length grew by that round's tokens."""
    by_session: dict[int, list[tuple[float, int]]] = {}
    for serial, t0, _t1, n_verified in requests:
        by_session.setdefault(serial, []).append((t0, n_verified))
    out = []
    for reqs in by_session.values():
        reqs.sort()
        for (ta, na), (tb, nb) in zip(reqs, reqs[1:]):
            if nb > na:  # a re-opened session starts over; that step is not a round
                out.append((tb - ta, nb - na))
    return out


def framework_overheads(rounds, requests_by_pos: dict[int, tuple[float, float]], busy: BusyIndex) -> list[float]:
    """Per round trip: the client-observed wait for drafts minus the draft server's busy time
    inside it (this request's own service and other sessions' services before it): the time spent
    in the framework, the network and wake-ups rather than drafting."""
    out = []
    for r in rounds:
        svc = requests_by_pos.get(r.pos)
        if svc is None or r.fallback:
            continue
        s0, s1 = svc
        out.append((r.t_reply - r.t_send) - (s1 - s0) - busy.busy(r.t_send, s0))
    return out


