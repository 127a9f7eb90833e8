"""The target daemon's Prometheus series: requests and tokens (starsd_target_*), speculative
decoding (starsd_spec_decode_*, per accepted position as well) and where rounds spend their time
(starsd_target_round_seconds_total{part}, starsd_target_rounds_total: see starsd_target.profile)."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from starsd_target.profile import RoundProfile


class _ProfileCollector:
    """The scheduler's round profile, read at scrape time (the loop never takes a metrics lock for it)."""

    def __init__(self) -> None:
        self.profile: RoundProfile | None = None

    def collect(self) -> Iterator[Metric]:
        p = (self.profile or RoundProfile()).to_dict()
        parts = CounterMetricFamily("starsd_target_round_seconds",
                                    "Rounds' wall time by part: draft_wait + verify_forward + verify_math + fill + "
                                    "rest is the rounds' time; draft_queue + draft_forward + wire is draft_wait",
                                    labels=["part"])
        for part, seconds in p["seconds"].items():
            parts.add_metric([part], seconds)
        yield parts
        yield CounterMetricFamily("starsd_target_rounds", "Rounds verified (the round profile's count)",
                                  value=p["rounds"])


class _LinkCollector:
    """The draft daemons' links as the pool counts them (``DraftPool.counters``), read at scrape time."""

    def __init__(self) -> None:
        self.counters = None  # () -> the pool's counters, or None (no draft daemon)

    def collect(self) -> Iterator[Metric]:
        c = self.counters() if self.counters is not None else None
        if c is None:
            return
        for name, key, text in (("starsd_target_draft_placements", "placements", "Draft sessions placed on a draft "
                                 "daemon (new ones, and those moved)"),
                                ("starsd_target_draft_failovers", "failovers", "Draft sessions moved off a draft "
                                 "daemon that failed (down, not answering)"),
                                ("starsd_target_draft_drained", "drained", "Draft sessions moved off a draft daemon "
                                 "that drained or whose address went away")):
            yield CounterMetricFamily(name, text, value=c.get(key, 0))
        per = c.get("endpoints", {})
        for name, text, value in (
                ("starsd_target_draft_endpoint_up", "1 while the link to this draft daemon is up",
                 lambda e: float(e["state"] == "up")),
                ("starsd_target_draft_endpoint_draining", "1 while this draft daemon drains", lambda e: float(e["draining"])),
                ("starsd_target_draft_endpoint_sessions", "This target's draft sessions on this draft daemon",
                 lambda e: e["sessions"]),
                ("starsd_target_draft_endpoint_round_trip_seconds", "Smoothed round trip of an acknowledgement",
                 lambda e: e["rtt_ms"] / 1000),
                ("starsd_target_draft_endpoint_wait_seconds", "The wait before drafting this draft daemon reports, "
                 "smoothed", lambda e: e["wait_ms"] / 1000)):
            g = GaugeMetricFamily(name, text, labels=["endpoint"])
            for ep, e in per.items():
                g.add_metric([ep], value(e))
            yield g
        missed = CounterMetricFamily("starsd_target_draft_endpoint_missed", "Draft requests not answered in time",
                                     labels=["endpoint"])
        for ep, e in per.items():
            missed.add_metric([ep], e["missed"])
        yield missed


class TargetMetrics:
    def __init__(self, depth: int) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("starsd_target_requests", "Generation requests by outcome", ["outcome"], registry=r)
        self.generated_tokens = Counter("starsd_target_generated_tokens", "Tokens generated", registry=r)
        self.active = Gauge("starsd_target_active_generations", "Generations in progress", registry=r)
        self.queued = Gauge("starsd_target_queued_requests", "Requests waiting to start", registry=r)
        self.num_drafts = Counter("starsd_spec_decode_num_drafts", "Rounds verified with drafts", registry=r)
        self.num_draft_tokens = Counter("starsd_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter("starsd_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("starsd_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.budget_rounds = Counter("starsd_target_draft_rounds", "Rounds verified with drafts, by the tree budget "
                                     "they asked for (draft_tokens; 0: a chain)", ["draft_tokens"], registry=r)
        self.budget_kept = Counter("starsd_target_draft_round_tokens", "Tokens those rounds produced (kept drafts "
                                   "and the target's own), by tree budget: over the rounds, tokens kept per round",
                                   ["draft_tokens"], registry=r)
        self.fallback_rounds = Counter("starsd_spec_decode_fallback_rounds",
                                       "Rounds that wanted drafts and were verified without them", registry=r)
        self.plain_rounds = Counter("starsd_target_plain_rounds", "Rounds verified without drafts by choice: "
                                    "more generations were active than --draft-max-active, or drafts did not pay "
                                    "(--pause-unpaid-drafts)", registry=r)
        self.fill_steps = Counter("starsd_target_fill_steps", "Steps the target took on its own while a "
                                  "generation's drafts were on their way (--fill-steps); their tokens are counted "
                                  "in the generated tokens", registry=r)
        self.crowded_rounds = Counter("starsd_target_crowded_rounds", "Of the plain rounds, those run without "
                                      "drafts because more generations were active than --draft-max-active",
                                      registry=r)
        self.mean_accepted_length = Gauge("starsd_spec_decode_mean_accepted_length",
                                          "Tokens produced per target forward, since start", registry=r)
        self.round_trip = Histogram("starsd_target_draft_round_trip_seconds", "Draft request to reply",
                                    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
                                    registry=r)
        self.verify_seconds = Histogram("starsd_target_verify_seconds", "One verification forward",
                                        buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1),
                                        registry=r)
        self.verify_batch = Histogram("starsd_target_verify_batch_size", "Generations one verification forward took",
                                      buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        for i in range(depth):
            self.accepted_per_pos.labels(position=str(i))
        self._profile = _ProfileCollector()
        r.register(self._profile)
        self._links = _LinkCollector()
        r.register(self._links)
        self._rounds = 0
        self._tokens = 0

    def watch(self, profile: RoundProfile) -> None:
        """Expose ``profile`` (the scheduler's) as starsd_target_round_seconds_total and _rounds_total."""
        self._profile.profile = profile

    def watch_links(self, counters) -> None:
        """Expose the draft daemons' links: ``counters()`` gives ``DraftPool.counters()`` or None."""
        self._links.counters = counters

    def on_forward(self, generations: int, verify_s: float) -> None:
        """One verification forward (over one generation's round, or several batched)."""
        self.verify_batch.observe(generations)
        self.verify_seconds.observe(verify_s)

    def on_fill_step(self, produced: int) -> None:
        """A fill step: one forward of the target alone, ``produced`` tokens."""
        self.fill_steps.inc()
        self.generated_tokens.inc(produced)
        self._rounds += 1
        self._tokens += produced
        self.mean_accepted_length.set(self._tokens / self._rounds)

    def on_round(self, drafted: int, accepted: int, produced: int, fallback: bool, tree_tokens: int = 0,
                 plain: bool = False, crowded: bool = False) -> None:
        if drafted:
            self.budget_rounds.labels(draft_tokens=str(tree_tokens)).inc()
            self.budget_kept.labels(draft_tokens=str(tree_tokens)).inc(produced)
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for i in range(accepted):
                self.accepted_per_pos.labels(position=str(i)).inc()
        if fallback:
            self.fallback_rounds.inc()
        if plain:
            self.plain_rounds.inc()
        if crowded:
            self.crowded_rounds.inc()
        self.generated_tokens.inc(produced)
        self._rounds += 1
        self._tokens += produced
        self.mean_accepted_length.set(self._tokens / self._rounds)
