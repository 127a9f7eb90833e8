"""The draft daemon's Prometheus series, read from its counters at scrape time."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from starsd_draftd.metrics import Buckets, DraftMetrics


def samples(metrics: DraftMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_buckets_count_values_at_or_below_each_bound():
    b = Buckets((1, 2, 4))
    for v in (0.5, 1, 1.5, 2, 3, 4, 9):
        b.observe(v)
    family = b.family("h", "doc")
    got = {s.labels["le"]: s.value for s in family.samples if s.name == "h_bucket"}
    assert got == {"1.0": 2, "2.0": 4, "4.0": 6, "+Inf": 7}
    assert {s.name: s.value for s in family.samples if s.name != "h_bucket"} == {"h_count": 7, "h_sum": 21.0}


def test_series_follow_the_daemons_counters():
    stats = {"live_sessions": 3, "queue_depth": 1, "peers": 2, "requests": 10, "drafted_tokens": 50,
             "errors": {"BAD_REQUEST": 2, "DESYNC": 1}, "queue_bytes": 4096, "kv_bytes": 8192,
             "limits": {"max_queue_bytes": 1 << 20, "max_sessions": 8},
             "request_profile": {"requests": 10, "seconds": {"queue": 0.0, "draft_forward": 0.5, "rest": 0.01}},
             "lookahead": {"started": 9, "hits": 4, "late_hits": 1, "misses": 3, "dropped": 1, "steps": 40,
                           "idle_s": 0.25}}
    m = DraftMetrics(lambda: stats)
    m.busy_fraction = 0.75
    m.on_batch(2, 0.003)
    m.on_batch(1, 0.0004)
    got = samples(m)
    assert got[("starsd_draftd_live_sessions", ())] == 3
    assert got[("starsd_draftd_queue_depth", ())] == 1
    assert got[("starsd_draftd_peers", ())] == 2
    assert got[("starsd_draftd_queue_bytes", ())] == 4096
    assert got[("starsd_draftd_kv_bytes", ())] == 8192
    assert got[("starsd_draftd_limit", (("name", "max_queue_bytes"),))] == 1 << 20
    assert got[("starsd_draftd_limit", (("name", "max_sessions"),))] == 8
    assert got[("starsd_draftd_busy_fraction", ())] == 0.75
    assert got[("starsd_draftd_requests_total", ())] == 10
    assert got[("starsd_draftd_drafted_tokens_total", ())] == 50
    assert got[("starsd_draftd_errors_total", (("code", "BAD_REQUEST"),))] == 2
    assert got[("starsd_draftd_errors_total", (("code", "DESYNC"),))] == 1
    assert got[("starsd_draftd_lookahead_total", (("outcome", "hit"),))] == 4
    assert got[("starsd_draftd_lookahead_total", (("outcome", "late_hit"),))] == 1
    assert got[("starsd_draftd_lookahead_total", (("outcome", "miss"),))] == 3
    assert got[("starsd_draftd_lookahead_total", (("outcome", "dropped"),))] == 1
    assert got[("starsd_draftd_lookahead_idle_seconds_total", ())] == 0.25
    assert got[("starsd_draftd_service_seconds_count", ())] == 2
    assert got[("starsd_draftd_service_seconds_bucket", (("le", "0.0005"),))] == 1
    assert got[("starsd_draftd_batch_size_sum", ())] == 3
    stats["requests"] = 11  # read at scrape time, not copied at start
    assert samples(m)[("starsd_draftd_requests_total", ())] == 11
