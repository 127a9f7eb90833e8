"""The draft daemon's Prometheus series (starsd_draftd_*)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class DraftMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.live_sessions = Gauge("starsd_draftd_live_sessions", "Draft sessions held", registry=r)
        self.queue_depth = Gauge("starsd_draftd_queue_depth", "Draft requests waiting (Q_in)", registry=r)
        self.peers = Gauge("starsd_draftd_peers", "Targets that completed the handshake", registry=r)
        self.busy_fraction = Gauge("starsd_draftd_busy_fraction",
                                   "Share of the last interval spent drafting (1.0 = never idle)", registry=r)
        self.requests = Counter("starsd_draftd_requests", "Draft requests served", registry=r)
        self.drafted_tokens = Counter("starsd_draftd_drafted_tokens", "Draft tokens sent", registry=r)
        self.errors = Counter("starsd_draftd_errors", "Errors answered, by code", ["code"], registry=r)
        self.service_seconds = Histogram(
            "starsd_draftd_service_seconds", "Time to serve one batch of draft requests",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=r)
        self.batch_size = Histogram("starsd_draftd_batch_size", "Sessions drafted together",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)

    def on_batch(self, requests: int, tokens: int, seconds: float) -> None:
        self.requests.inc(requests)
        self.drafted_tokens.inc(tokens)
        self.service_seconds.observe(seconds)
        self.batch_size.observe(requests)

    def sample(self, live_sessions: int, queue_depth: int, peers: int, busy_fraction: float) -> None:
        self.live_sessions.set(live_sessions)
        self.queue_depth.set(queue_depth)
        self.peers.set(peers)
        self.busy_fraction.set(busy_fraction)
