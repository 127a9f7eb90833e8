"""Where a round's time goes: the target's parts add up to each round's wall time, the draft
daemon's split travels in DRAFTED (optional fields, checked; absent from an older daemon), and
STATS and the metrics expose both sides' parts. No assertion on a time beyond > 0 and sums."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common import protocol as P
from common.protocol import ErrorCode, Message, MsgType, ProtocolError
from common.verify import SamplingParams
from fakes import CountingBackend, running_server
from starsd_draftd.metrics import DraftMetrics
from starsd_draftd.server import REQUEST_PARTS
from starsd_target.client import DraftClient
from starsd_target.engine import TargetEngine
from starsd_target.metrics import TargetMetrics
from starsd_target.profile import DRAFT_WAIT_PARTS, PARTS, ROUND_PARTS, RoundProfile, merge, ms_per_round, split_round
from starsd_target.scheduler import Job, Scheduler

PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n"]


def assert_adds_up(p: dict) -> None:
    """The round parts add up to the rounds' wall time, the draft parts to the draft wait."""
    s = p["seconds"]
    assert sum(s[k] for k in ROUND_PARTS) == pytest.approx(p["wall_s"], rel=1e-9, abs=1e-9)
    assert sum(s[k] for k in DRAFT_WAIT_PARTS) == pytest.approx(s["draft_wait"], rel=1e-9, abs=1e-9)
    assert all(v >= -1e-9 for v in s.values()), s


# ---------------------------------------------------------------- the split itself
def test_split_round_adds_up_and_trusts_the_daemon_only_up_to_the_wait():
    t = split_round(1.0, 0.4, (0.1, 0.2), 0.3, 0.05)
    assert (t.draft_queue, t.draft_forward) == (0.1, 0.2) and t.wire == pytest.approx(0.1)
    assert t.rest == pytest.approx(0.25) and t.waited and t.reported
    # a daemon claiming more than the target waited: capped, so wire never goes negative
    t = split_round(1.0, 0.4, (5.0, 3.0), 0.3, 0.05)
    assert t.draft_forward == 0.4 and t.draft_queue == 0.0 and t.wire == 0.0
    t = split_round(1.0, 0.4, (-1.0, -1.0), 0.3, 0.05)
    assert (t.draft_queue, t.draft_forward, t.wire) == (0.0, 0.0, 0.4)
    # no report (an older daemon, a request given up): the whole wait is wire
    t = split_round(1.0, 0.4, None, 0.3, 0.05)
    assert t.wire == 0.4 and not t.reported
    p = RoundProfile()
    p.add(split_round(1.0, 0.4, (0.1, 0.2), 0.3, 0.05))
    p.add(split_round(0.5, 0.0, None, 0.3, 0.05))
    d = p.to_dict()
    assert_adds_up(d)
    assert d["rounds"] == 2 and d["counts"]["draft_wait"] == 1 and d["counts"]["draft_forward"] == 1
    assert d["counts"]["verify_forward"] == 2
    ms = ms_per_round(merge([d, d]))
    assert ms["round"] == pytest.approx(750.0) and ms["draft_forward"] == pytest.approx(100.0)
    # a reply taken during the prefill: no wait within the round, yet the round had its request
    t = split_round(0.5, 0.0, (0.01, 0.02), 0.3, 0.05, waited=True)
    assert t.waited and t.reported and (t.draft_queue, t.draft_forward, t.wire) == (0.0, 0.0, 0.0)
    p.add(t)
    assert p.counts["draft_wait"] == p.counts["draft_forward"] == 2


# ---------------------------------------------------------------- the wire fields
def roundtrip(header: dict) -> Message:
    return P.decode([bytes(f) for f in P.encode(Message(MsgType.DRAFTED, header))])


def test_drafted_carries_the_daemons_split():
    h = roundtrip({"session": 1, "seq": 2, "tokens": [3], "queued_us": 0, "draft_us": P.MAX_REPORTED_US}).header
    assert h["queued_us"] == 0 and h["draft_us"] == P.MAX_REPORTED_US
    old = roundtrip({"session": 1, "seq": 2, "tokens": [3]}).header  # an older daemon's reply is valid
    assert "queued_us" not in old and "draft_us" not in old
    newer = roundtrip({"session": 1, "seq": 2, "tokens": [3], "later_field_us": 5}).header  # and a newer one's
    assert "later_field_us" not in newer


@pytest.mark.parametrize("value", [-1, 1.5, True, "10", None, [1], P.MAX_REPORTED_US + 1, 1 << 64])
@pytest.mark.parametrize("name", ["queued_us", "draft_us"])
def test_bad_timing_fields_are_refused(name, value):
    header = {"session": 1, "seq": 2, "tokens": [3], "queued_us": 10, "draft_us": 10, name: value}
    try:
        frames = P.encode(Message(MsgType.DRAFTED, header))
    except OverflowError:  # beyond what msgpack holds: cannot even be sent
        assert value == 1 << 64
        return
    with pytest.raises(ProtocolError) as err:
        P.decode([bytes(f) for f in frames])
    assert err.value.code is ErrorCode.BAD_REQUEST and name in err.value.message
    assert (err.value.session, err.value.seq, err.value.re) == (1, 2, MsgType.DRAFTED)


# ---------------------------------------------------------------- through the scheduler, tiny model, fake drafter
def _run(engine, server, ctx, prompts, max_tokens=24, max_active=1):
    client = DraftClient(server.endpoint, engine.loaded.vocab_size, engine.loaded.fingerprint, ctx=ctx)
    client.handshake(10)
    sched = Scheduler(engine, lambda: client, draft_timeout_s=30, max_active=max_active)
    sched.start()
    try:
        futures = [sched.submit(Job(engine.encode(p), max_tokens, SamplingParams())) for p in prompts]
        results = [f.result(120) for f in futures]
    finally:
        sched.stop()
        client.close()
    return sched, results


@pytest.fixture
def fake_backend(loaded_target):
    return CountingBackend(vocab_size=loaded_target.vocab_size, fingerprint=loaded_target.fingerprint)


def test_round_parts_add_up_to_the_wall_time(loaded_target, fake_backend):
    engine = TargetEngine(loaded_target, depth=4)
    with running_server(fake_backend) as (server, ctx):
        sched, results = _run(engine, server, ctx, PROMPTS[:1])
        snap = server.snapshot()
    stats = results[0].stats
    p = stats.to_dict()["profile"]
    assert stats.fallback_rounds == 0 and p["rounds"] == stats.rounds > 1
    assert_adds_up(p)
    assert p["wall_s"] <= stats.wall_s  # rounds are part of the generation's time
    s, c = p["seconds"], p["counts"]
    assert s["verify_forward"] > 0 and s["verify_math"] > 0 and s["draft_wait"] > 0 and s["draft_forward"] > 0
    # every round asked for drafts but the last (one token left: nothing to draft), and the daemon reported on each
    assert c["draft_wait"] == c["draft_forward"] == c["draft_queue"] >= p["rounds"] - 1
    assert c["verify_forward"] == c["rest"] == p["rounds"]
    assert sched.profile.to_dict() == p  # one generation: the daemon-wide profile is its own
    # the draft daemon's own split: its parts add up to the requests' time there
    rp = snap["request_profile"]
    assert rp["requests"] == snap["requests"] >= c["draft_forward"]
    assert set(rp["seconds"]) == set(REQUEST_PARTS) and rp["seconds"]["draft_forward"] > 0
    assert all(v >= 0 for v in rp["seconds"].values())


def test_interleaved_generations_each_add_up(loaded_target, fake_backend):
    engine = TargetEngine(loaded_target, depth=4)
    with running_server(fake_backend) as (server, ctx):
        sched, results = _run(engine, server, ctx, PROMPTS, max_active=3)
    profiles = [r.stats.to_dict()["profile"] for r in results]
    for r, p in zip(results, profiles):
        assert_adds_up(p)
        assert p["rounds"] == r.stats.rounds and r.stats.fallback_rounds == 0
    whole = sched.profile.to_dict()
    assert_adds_up(whole)
    both = merge(profiles)
    assert whole["rounds"] == both["rounds"] and whole["counts"] == both["counts"]
    for part in PARTS:
        assert whole["seconds"][part] == pytest.approx(both["seconds"][part])


def test_an_older_daemon_without_the_fields_still_drafts(loaded_target, fake_backend):
    """A daemon that predates queued_us/draft_us: its drafts are used as before, and the target's
    draft wait is all wire (it cannot tell the daemon's share)."""
    engine = TargetEngine(loaded_target, depth=4)
    with running_server(fake_backend) as (server, ctx):
        def old_send(identity, msg, send=server.ingress.send):
            if msg.type is MsgType.DRAFTED:
                msg = Message(MsgType.DRAFTED, {k: v for k, v in msg.header.items()
                                                if k not in ("queued_us", "draft_us")}, msg.tensors)
            send(identity, msg)

        server.ingress.send = old_send
        _, results = _run(engine, server, ctx, PROMPTS[:1])
    stats = results[0].stats
    p = stats.to_dict()["profile"]
    assert stats.fallback_rounds == 0 and stats.drafted > 0
    assert_adds_up(p)
    assert p["counts"]["draft_forward"] == 0 and p["seconds"]["draft_forward"] == 0.0
    assert p["seconds"]["wire"] == pytest.approx(p["seconds"]["draft_wait"]) and p["seconds"]["wire"] > 0


# ---------------------------------------------------------------- metrics
def samples(registry) -> dict:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_target_metrics_expose_the_round_parts():
    m = TargetMetrics(depth=4)
    assert samples(m.registry)[("starsd_target_rounds_total", ())] == 0  # present before any round
    profile = RoundProfile()
    m.watch(profile)
    profile.add(split_round(1.0, 0.4, (0.1, 0.2), 0.3, 0.05))
    got = samples(m.registry)  # read at scrape time
    assert got[("starsd_target_rounds_total", ())] == 1
    for part in PARTS:
        assert got[("starsd_target_round_seconds_total", (("part", part),))] == pytest.approx(
            profile.seconds[part])
    assert got[("starsd_target_round_seconds_total", (("part", "draft_forward"),))] == pytest.approx(0.2)


def test_draft_metrics_expose_the_request_parts():
    stats = {"live_sessions": 0, "queue_depth": 0, "peers": 0, "requests": 2, "drafted_tokens": 8, "errors": {},
             "queue_bytes": 0, "kv_bytes": 0, "limits": {},
             "request_profile": {"requests": 2, "seconds": {"queue": 0.001, "draft_forward": 0.02, "rest": 0.002}}}
    got = samples(DraftMetrics(lambda: stats).registry)
    for part, v in stats["request_profile"]["seconds"].items():
        assert got[("starsd_draftd_request_seconds_total", (("part", part),))] == v
