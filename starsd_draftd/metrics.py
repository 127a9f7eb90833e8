"""The draft daemon's Prometheus series (starsd_draftd_*).

The serving loop never touches prometheus_client: it bumps the plain counters it keeps anyway
(``Stats``) and two lock-free histograms, and a scrape reads them (a custom collector). A
prometheus_client Counter or Histogram takes a lock per update, which cost the loop more per
request than the rest of its bookkeeping together.
"""

from __future__ import annotations

import bisect
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

SERVICE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


class Buckets:
    """A histogram updated by one thread and read by another without a lock: a scrape copies
    the counts, so it sees each observation in the buckets or not at all; the sum may lead or
    trail the counts by the observation being made."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last counts values above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le semantics: value <= bound
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip(self.bounds + (float("inf"),), counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class DraftMetrics:
    """A prometheus collector over the daemon's counters. ``snapshot`` returns the daemon's
    stats (``DraftServer.snapshot()``); it is called from the scrape thread and only reads."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot
        self.busy_fraction = 0.0  # of the last sampling interval, set by the serving loop
        self.service_seconds = Buckets(SERVICE_BUCKETS)
        self.batch_size = Buckets(BATCH_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def on_batch(self, requests: int, seconds: float) -> None:
        self.service_seconds.observe(seconds)
        self.batch_size.observe(requests)

    @staticmethod
    def _lookahead(la: dict | None) -> Iterator[Metric]:
        if la is None:
            return
        ahead = CounterMetricFamily("starsd_draftd_lookahead",
                                    "Rounds drafted ahead of their request, by outcome: hit (answered from it), "
                                    "late_hit (finished on the request's arrival), miss (another sequence came), "
                                    "dropped (its session went first), skipped (not drafted ahead: it rarely "
                                    "answers that session's requests), superseded (a suffix draft answered the "
                                    "request)", labels=["outcome"])
        for key, outcome in (("hits", "hit"), ("late_hits", "late_hit"), ("misses", "miss"), ("dropped", "dropped"),
                             ("skipped", "skipped"), ("superseded", "superseded")):
            ahead.add_metric([outcome], la.get(key, 0))
        yield ahead
        yield CounterMetricFamily("starsd_draftd_lookahead_idle_seconds",
                                  "Idle time spent drafting ahead (forwards run with no request queued)",
                                  value=la["idle_s"])

    @staticmethod
    def _suffix(sx: dict | None) -> Iterator[Metric]:
        if not sx or "bytes" not in sx:  # suffix drafts off
            return
        yield CounterMetricFamily("starsd_draftd_suffix_requests", "Draft requests answered with suffix drafts",
                                  value=sx["requests"])
        tokens = CounterMetricFamily("starsd_draftd_suffix_tokens",
                                     "Suffix draft tokens, by outcome: drafted, or kept (reported at the "
                                     "session's next request)", labels=["outcome"])
        tokens.add_metric(["drafted"], sx["tokens"])
        tokens.add_metric(["kept"], sx["kept"])
        yield tokens
        yield GaugeMetricFamily("starsd_draftd_suffix_index_bytes",
                                "Memory the shared suffix index charges itself (bounded by --suffix-cache-mib)",
                                value=sx["bytes"])
        yield GaugeMetricFamily("starsd_draftd_suffix_index_requests", "Requests' outputs the shared index holds",
                                value=sx["requests_held"])

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield GaugeMetricFamily("starsd_draftd_live_sessions", "Draft sessions held", value=s["live_sessions"])
        yield GaugeMetricFamily("starsd_draftd_queue_depth", "Draft requests waiting (Q_in)", value=s["queue_depth"])
        yield GaugeMetricFamily("starsd_draftd_peers", "Targets that completed the handshake", value=s["peers"])
        yield GaugeMetricFamily("starsd_draftd_queue_bytes", "Memory held by queued draft requests (estimated)",
                                value=s["queue_bytes"])
        yield GaugeMetricFamily("starsd_draftd_kv_bytes", "Cache memory reserved by sessions (estimated)",
                                value=s["kv_bytes"])
        limits = GaugeMetricFamily("starsd_draftd_limit", "Configured bounds, by name", labels=["name"])
        for name, value in sorted(s["limits"].items()):
            limits.add_metric([name], value)
        yield limits
        yield GaugeMetricFamily("starsd_draftd_busy_fraction",
                                "Share of the last interval spent drafting (1.0 = never idle)",
                                value=self.busy_fraction)
        yield CounterMetricFamily("starsd_draftd_requests", "Draft requests served", value=s["requests"])
        yield from self._lookahead(s.get("lookahead"))
        stop = s.get("stopping")
        if stop is not None:
            chains = CounterMetricFamily("starsd_draftd_stopping_requests",
                                         "Chain requests that let the daemon stop early (min_survival), by outcome: "
                                         "stopped (fewer drafts than asked) or full", labels=["outcome"])
            chains.add_metric(["stopped"], stop["stopped"])
            chains.add_metric(["full"], stop["requests"] - stop["stopped"])
            yield chains
            yield CounterMetricFamily("starsd_draftd_stopping_drafts_saved",
                                      "Drafts not made because a chain stopped early", value=stop["drafts_saved"])
        yield CounterMetricFamily("starsd_draftd_drafted_tokens", "Draft tokens sent", value=s["drafted_tokens"])
        yield from self._suffix(s.get("suffix"))
        cu = s.get("catch_up")
        if cu is not None:
            yield CounterMetricFamily("starsd_draftd_catch_up_tokens",
                                      "Verified tokens fed to the draft model while idle, which it missed while "
                                      "suffix drafts answered their sessions", value=cu["tokens"])
        parts = CounterMetricFamily("starsd_draftd_request_seconds",
                                    "Time of the draft requests served, by part: queue (waiting for its batch), "
                                    "draft_forward (its batch's backend call), rest (decode, checks, encode, send)",
                                    labels=["part"])
        for part, seconds in s["request_profile"]["seconds"].items():
            parts.add_metric([part], seconds)
        yield parts
        errors = CounterMetricFamily("starsd_draftd_errors", "Errors answered, by code", labels=["code"])
        for code, n in sorted(s["errors"].items()):
            errors.add_metric([code], n)
        yield errors
        yield self.service_seconds.family("starsd_draftd_service_seconds", "Time to serve one batch of draft requests")
        yield self.batch_size.family("starsd_draftd_batch_size", "Sessions drafted together")
