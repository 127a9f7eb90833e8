"""Hostile input never costs the target service (issue 14): every field a request carries is
bounded on every front end (HTTP and the job socket), one job's failure stays with that job, a
dead scheduler makes /health 503 and the daemon exit non-zero, long prompts prefill in chunks
between other generations' rounds, abandoned requests are cancelled, and the job socket admits
only what it should. Each attack found by hand is here scaled down to seconds."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
import torch
import zmq
from click.testing import CliRunner
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.control import ControlClient, ControlTimeout
from common.protocol import ErrorCode, Message, MsgType, RemoteError
from common.security import client_keys, keygen
from common.sockets import free_tcp_endpoint, free_tcp_port
from common.verify import SamplingParams
from fakes import CountingBackend, running_server, serving, wait_http_health
from starsd_target.client import DraftClient
from starsd_target.config import TargetConfig
from starsd_target.daemon import TargetDaemon
from starsd_target.engine import MAX_STOP_CHARS, MAX_STOP_STRINGS, InvalidRequest, TargetEngine
from starsd_target.http_api import create_app
from starsd_target.scheduler import Cancelled, Job, Scheduler, SchedulerFailed
from tiny_models import reference_greedy

CONTEXT = 512  # the tiny checkpoints' max_position_embeddings
PROMPT = "def parse(line):\n    "


# ---------------------------------------------------------------- SamplingParams and the engine's check
@pytest.mark.parametrize("kwargs", [dict(top_k=2**31), dict(top_k=2**80), dict(top_k=-1), dict(seed=-1),
                                    dict(seed=2**63), dict(temperature=math.nan), dict(temperature=math.inf),
                                    dict(temperature=1e-9), dict(top_p=math.nan), dict(top_p=0.0)])
def test_sampling_params_refuse_what_the_wire_and_math_cannot_carry(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**{"temperature": 0.5, **kwargs})


def test_sampling_params_take_the_extremes_the_wire_carries():
    assert SamplingParams(0.5, top_k=2**31 - 1, seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=0).seed == 0


@pytest.mark.parametrize("prompt_len, max_tokens, params, stop, param", [
    (CONTEXT, 1, SamplingParams(), (), "max_tokens"),
    (10, CONTEXT - 9, SamplingParams(), (), "max_tokens"),
    (10, 5, SamplingParams(0.5, top_k=10**6), (), "top_k"),
    (10, 5, SamplingParams(), ("a",) * (MAX_STOP_STRINGS + 1), "stop"),
    (10, 5, SamplingParams(), ("a" * (MAX_STOP_CHARS + 1),), "stop"),
    (10, 5, SamplingParams(), ("",), "stop"),
    (0, 5, SamplingParams(), (), "prompt"),
])
def test_engine_check_bounds_each_field(loaded_target, prompt_len, max_tokens, params, stop, param):
    engine = TargetEngine(loaded_target)
    assert engine.context == CONTEXT
    with pytest.raises(InvalidRequest) as info:
        engine.check([65] * prompt_len, max_tokens, params, stop)
    assert info.value.param == param
    engine.check([65] * 10, CONTEXT - 10, SamplingParams(0.5, top_k=loaded_target.logits_size),
                 ("a" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS)  # the bounds themselves are fine


# ---------------------------------------------------------------- chunked prefill
def _long_prompt(engine: TargetEngine, n: int) -> list[int]:
    text = "import os\nfor line in open(path):\n    print(line.strip())\n" * 20
    ids = engine.encode(text)[:n]
    assert len(ids) == n
    return ids


def test_a_prompt_prefilled_in_many_chunks_gives_the_targets_own_output(loaded_target, tiny_target):
    chunked = TargetEngine(loaded_target, depth=4, prefill_chunk=7)
    prompt = _long_prompt(chunked, 150)
    result = chunked.generate(prompt, 30, SamplingParams())
    assert result.token_ids == reference_greedy(tiny_target, prompt, 30)

    # the features an EAGLE drafter reads are there for every prompt position, as one forward gives them
    gen = chunked.start(prompt, 5, SamplingParams(), features=True)
    chunks = 0
    while gen.prefilling:
        gen.prefill()
        chunks += 1
    assert chunks == math.ceil((len(prompt) - 1) / 7)
    whole = TargetEngine(loaded_target, prefill_chunk=len(prompt)).start(prompt, 5, SamplingParams(), features=True)
    whole.prefill()
    assert not whole.prefilling and gen.features().shape == whole.features().shape == (len(prompt) - 1, 48)
    torch.testing.assert_close(torch.from_numpy(gen.features()).float(), torch.from_numpy(whole.features()).float(),
                               atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError):
        chunked.start(prompt, 5, SamplingParams()).verify(None)  # no round before the prefill


def test_a_long_prompt_holds_a_short_one_up_by_one_chunk_at_most(loaded_target, tiny_target):
    engine = TargetEngine(loaded_target, depth=4, prefill_chunk=4)
    long_prompt, short_prompt = _long_prompt(engine, 400), engine.encode("x = 1")
    sched = Scheduler(engine, lambda: None, draft_timeout_s=1, max_active=2)
    long_job, short_job = Job(long_prompt, 5, SamplingParams()), Job(short_prompt, 8, SamplingParams())
    seen = []  # for each of the short job's rounds: how far the long prompt's prefill had got

    def on_round(gen, n, wanted, verify_s):
        if gen.tokens[: len(short_prompt)] == short_prompt:
            long_gen = next(a.gen for a in sched.active if a.job is long_job)
            seen.append((long_gen.prefilling, long_gen.prefilled))

    sched.on_round = on_round
    sched.submit(long_job)
    sched.submit(short_job)  # both queued before the loop starts: admitted together, long first
    sched.start()
    try:
        short = short_job.future.result(60)
        assert not long_job.future.done()
        long = long_job.future.result(120)
    finally:
        sched.stop()
    assert short.token_ids == reference_greedy(tiny_target, short_prompt, 8)
    assert long.token_ids == reference_greedy(tiny_target, long_prompt, 5)
    # the short prompt's one chunk went second; then the short job ran all its rounds while the long
    # prompt was still prefilling, one chunk per pass
    assert len(seen) == len(short.token_ids) and all(prefilling for prefilling, _ in seen)
    assert [done for _, done in seen] == [4 * (i + 1) for i in range(len(seen))]


# ---------------------------------------------------------------- one job's failure stays with it
class OpenFails(DraftClient):
    """A real draft link whose session opening raises for one marked job (top_k 7), as msgpack
    raised OverflowError for a top_k of 2**80."""

    def open(self, session, prompt, params):
        if params.top_k == 7:
            raise OverflowError("int too big to convert")
        return super().open(session, prompt, params)


def test_a_job_whose_draft_session_fails_to_open_fails_alone(loaded_target, tiny_target):
    engine = TargetEngine(loaded_target, depth=4)
    backend = CountingBackend(loaded_target.vocab_size, loaded_target.fingerprint)
    with running_server(backend) as (server, ctx):
        client = OpenFails(server.endpoint, loaded_target.vocab_size, loaded_target.fingerprint, ctx=ctx)
        client.handshake(10)
        sched = Scheduler(engine, lambda: client, draft_timeout_s=10, max_active=4)
        sched.start()
        try:
            prompt = engine.encode(PROMPT)
            bad = sched.submit(Job(prompt, 10, SamplingParams(0.5, top_k=7, seed=1)))

            def explode(gen):
                raise RuntimeError("the stream's consumer broke")

            broken_stream = sched.submit(Job(prompt, 10, SamplingParams(), on_progress=explode))
            good = sched.submit(Job(prompt, 20, SamplingParams()))
            with pytest.raises(OverflowError):
                bad.result(30)
            with pytest.raises(RuntimeError, match="consumer broke"):
                broken_stream.result(30)
            result = good.result(60)
            later = sched.submit(Job(prompt, 12, SamplingParams())).result(60)
            assert sched.healthy()
        finally:
            sched.stop()
            client.close()
    assert result.token_ids == reference_greedy(tiny_target, prompt, 20)
    assert later.token_ids == result.token_ids[:12]
    assert result.stats.drafted > 0  # the good job did speculate over the same link
    assert sched.load()["failed"] == 2 and sched.load()["completed"] == 2


def test_a_dead_loop_fails_its_jobs_at_once_and_reports_unhealthy(loaded_target):
    engine = TargetEngine(loaded_target, depth=4)
    sched = Scheduler(engine, lambda: None, draft_timeout_s=1, max_active=1)

    def broken(*_):
        raise RuntimeError("a bug outside any one job")

    sched._verify_one = broken  # a defect in the loop itself, not in one job's work
    active = sched.submit(Job(engine.encode("a"), 50, SamplingParams()))
    queued = sched.submit(Job(engine.encode("b"), 50, SamplingParams()))
    sched.start()
    for f in (active, queued):
        with pytest.raises(SchedulerFailed, match="a bug outside any one job"):
            f.result(10)
    sched.thread.join(10)
    assert not sched.healthy() and not sched.active
    with pytest.raises(SchedulerFailed):
        sched.submit(Job(engine.encode("c"), 5, SamplingParams()))


def test_a_cancelled_job_is_dropped_at_the_next_pass(loaded_target):
    engine = TargetEngine(loaded_target, depth=4)
    sched = Scheduler(engine, lambda: None, draft_timeout_s=1, max_active=1)
    rounds, gens = [], []

    def progress(gen):
        rounds.append(len(gen.out))
        gens.append(gen)
        if len(rounds) == 3:
            job.cancel()  # as the HTTP front end does when its client hangs up

    job = Job(engine.encode(PROMPT), 400, SamplingParams(), on_progress=progress)
    waiting = Job(engine.encode("b"), 5, SamplingParams())
    sched.submit(job)
    sched.submit(waiting)
    waiting.cancel()  # still queued: it never starts
    sched.start()
    try:
        with pytest.raises(Cancelled):
            job.future.result(30)
    finally:
        sched.stop()
    assert rounds == [1, 2, 3] and not sched.active
    assert gens[-1].cache is None  # its KV cache went with it
    assert waiting.future.cancelled()
    assert sched.load()["cancelled"] == 2 and sched.load()["completed"] == 0


def test_a_streaming_callback_that_raises_fails_its_job_alone(loaded_target, tiny_target):
    engine = TargetEngine(loaded_target, depth=4)
    sched = Scheduler(engine, lambda: None, draft_timeout_s=1, max_active=2)
    calls, beside = [], []

    def broken(gen):
        calls.append(len(gen.out))
        if len(calls) == 2:
            beside.append(len(sched.active))
            raise RuntimeError("the stream's callback failed")

    bad = Job(engine.encode(PROMPT), 200, SamplingParams(), on_progress=broken)
    good = Job(engine.encode("x = 1"), 30, SamplingParams(), on_progress=lambda gen: None)
    sched.submit(bad)
    sched.submit(good)
    sched.start()
    try:
        with pytest.raises(RuntimeError, match="callback failed"):
            bad.future.result(30)
        assert good.future.result(60).token_ids == reference_greedy(tiny_target, engine.encode("x = 1"), 30)
        assert sched.healthy()
        after = sched.submit(Job(engine.encode("b"), 5, SamplingParams()))
        assert len(after.result(30).token_ids) == 5
    finally:
        sched.stop()
    assert calls == [1, 2] and beside == [2]  # raised while the other ran beside it, then never called again
    assert not sched.active and sched.load()["failed"] == 1 and sched.load()["completed"] == 2


# ---------------------------------------------------------------- both front ends, in process
@pytest.fixture(scope="module")
def daemon(tiny_target, loaded_target, tmp_path_factory):
    """A target daemon with no draft link, its job socket served in a thread; its HTTP app below."""
    ctx = zmq.Context()
    cfg = TargetConfig(model=str(tiny_target), draft=None, listen=f"ipc://{tmp_path_factory.mktemp('jobs')}/t.sock",
                       depth=4)
    d = TargetDaemon(cfg, loaded=loaded_target, ctx=ctx)
    with serving(d):
        yield d
    ctx.destroy(linger=0)


def test_a_reply_and_a_stop_wake_the_job_socket_at_once(tiny_target, loaded_target, monkeypatch, tmp_path):
    """The job socket's loop sends a job's reply when the job ends and sees a stop when it comes,
    not at its poll's timeout: with that timeout made 10 minutes, a GENERATE is still answered
    (exactly) and a stop still ends serving, each well within a minute."""
    import starsd_target.jobs as jobs_module

    monkeypatch.setattr(jobs_module, "CONTROL_POLL_MS", 600_000)
    ctx = zmq.Context()
    d = TargetDaemon(TargetConfig(model=str(tiny_target), draft=None, listen=f"ipc://{tmp_path}/t.sock", depth=4),
                     loaded=loaded_target, ctx=ctx)
    try:
        with serving(d, join_s=60):  # the stop ends serving within a minute, or this fails
            prompt = d.engine.encode(PROMPT)
            with ControlClient(d.endpoint, ctx) as cc:
                for i in range(2):  # the second after the first reply's wake-up was cleared
                    r = cc.call(Message(MsgType.GENERATE, {"id": i + 1, "prompt_ids": prompt, "max_tokens": 6,
                                                           "temperature": 0.0}), timeout_s=60)
                    assert r.header["token_ids"] == reference_greedy(tiny_target, prompt, 6)
    finally:
        ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def http(daemon):
    with TestClient(create_app(daemon, "tiny")) as c:
        yield c


def _exact(http, tiny_target, engine) -> None:
    """A real request after the attack: served, and exactly the target's own greedy output."""
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    ids = reference_greedy(tiny_target, engine.encode(PROMPT), 12)
    assert r.json()["choices"][0]["text"] == engine.decode(ids)
    assert http.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("fields, param", [
    (dict(top_k=2**80), "top_k"),
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=100_000), "top_k"),  # within int32 but beyond the vocabulary
    (dict(seed=2**64), "seed"),
    (dict(seed=-1), "seed"),
    (dict(temperature=1e300), "temperature"),
    (dict(max_tokens=2**70), "max_tokens"),
    (dict(max_tokens=CONTEXT), "max_tokens"),  # prompt plus max_tokens beyond the context
    (dict(prompt="x" * CONTEXT, max_tokens=1), "max_tokens"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=["a" * (MAX_STOP_CHARS + 1)]), "stop"),
])
def test_http_refuses_out_of_bounds_fields_with_400_and_keeps_serving(http, tiny_target, daemon, fields, param):
    r = http.post("/v1/completions", json={"prompt": "x", "temperature": 0.5, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    _exact(http, tiny_target, daemon.engine)


def test_http_refuses_non_finite_floats(http, tiny_target, daemon):
    for field in ("temperature", "top_p"):
        for value in ("NaN", "Infinity", "-Infinity"):
            body = f'{{"prompt": "x", "{field}": {value}}}'
            r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    _exact(http, tiny_target, daemon.engine)


def _generate(endpoint: str, **fields) -> Message:
    ctx = zmq.Context()
    try:
        with ControlClient(endpoint, ctx) as cc:
            return cc.call(Message(MsgType.GENERATE, {"id": 1, **fields}), 30)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("fields", [
    dict(top_k=2**63 - 1, temperature=0.5),  # the most the wire's schema lets through
    dict(top_k=100_000, temperature=0.5),
    dict(temperature=math.inf),
    dict(top_p=math.inf),
    dict(max_tokens=2**63 - 1),
    dict(prompt_ids=[65] * CONTEXT),
    dict(stop=["x"] * 20_000),  # the attack that stalled everyone, scaled down
    dict(stop=["x" * (MAX_STOP_CHARS + 1)]),
    dict(stop=[""]),
])
def test_job_socket_refuses_out_of_bounds_fields_with_bad_request(daemon, tiny_target, fields):
    with pytest.raises(RemoteError) as info:
        _generate(daemon.endpoint, **{"prompt": "x", "max_tokens": 5, **fields})
    assert info.value.code == ErrorCode.BAD_REQUEST, info.value
    reply = _generate(daemon.endpoint, prompt=PROMPT, max_tokens=12)
    assert reply.header["token_ids"] == reference_greedy(tiny_target, daemon.engine.encode(PROMPT), 12)
    assert daemon.healthy()


FUZZ = dict(max_examples=60, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck))
anything = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=3))


@settings(**FUZZ)
@given(top_k=anything, seed=anything, max_tokens=anything, temperature=anything, top_p=anything, n=anything)
def test_http_fields_never_cost_a_5xx(http, tiny_target, daemon, top_k, seed, max_tokens, temperature, top_p, n):
    fields = {k: v for k, v in dict(top_k=top_k, seed=seed, max_tokens=max_tokens, temperature=temperature,
                                     top_p=top_p, n=n).items() if v is not None}
    if isinstance(fields.get("max_tokens"), int) and not isinstance(fields["max_tokens"], bool):
        fields["max_tokens"] = fields["max_tokens"] % 64  # the valid ones generate: keep them short
    r = http.post("/v1/completions", json={"prompt": "x", **fields})
    assert r.status_code in (200, 400), r.text
    assert daemon.healthy()


def test_after_the_fuzzing_the_service_still_serves_exactly(http, tiny_target, daemon):
    _exact(http, tiny_target, daemon.engine)


def test_a_dead_scheduler_makes_health_503(loaded_target, tiny_target):
    d = TargetDaemon(TargetConfig(model=str(tiny_target), draft=None), loaded=loaded_target)
    sched = d.scheduler()

    def broken(*_):
        raise RuntimeError("a bug outside any one job")

    sched._verify_one = broken
    sched.start()
    with TestClient(create_app(d, "tiny")) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 503 and "scheduler failed" in r.json()["error"]["message"]
        sched.thread.join(10)
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}).status_code == 503


# ---------------------------------------------------------------- real processes: a crash exits, a hang-up cancels
CRASHING_TARGET = """
import sys
from starsd_target import scheduler

def broken(self):
    raise RuntimeError("a bug outside any one job")

scheduler.Scheduler._verify_one = broken
from starsd_target.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _wait_http(base: str, proc: subprocess.Popen, log) -> None:
    wait_http_health(base, log.read_text, alive=lambda: proc.poll() is None, timeout_s=120)


@pytest.mark.parametrize("mode", ["jobs", "http"])
def test_a_crashing_scheduler_makes_serve_exit_non_zero(tiny_target, tmp_path, mode):
    listen, port = f"ipc://{tmp_path}/jobs.sock", free_tcp_port()
    args = ["serve", "--model", str(tiny_target), "--draft", free_tcp_endpoint(), "--connect-timeout", "0",
            "--listen", listen]
    if mode == "http":
        args += ["--http", f"127.0.0.1:{port}"]
    log = tmp_path / "target.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", CRASHING_TARGET, *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        if mode == "http":
            base = f"http://127.0.0.1:{port}"
            _wait_http(base, proc, log)
            r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
            assert r.status_code == 503, r.text
        else:
            ctx = zmq.Context()
            try:
                with ControlClient(listen, ctx) as cc:
                    deadline = time.monotonic() + 120
                    while True:
                        try:
                            cc.stats(1.0)
                            break
                        except ControlTimeout:
                            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    with pytest.raises(RemoteError) as info:
                        cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": "x", "max_tokens": 5}), 30)
                    assert info.value.code == ErrorCode.SHUTTING_DOWN
            finally:
                ctx.destroy(linger=0)
        assert proc.wait(60) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "scheduler failed" in log.read_text()


class SlowCounting(CountingBackend):
    """Drafts that take 50 ms: a generation of hundreds of tokens then lasts many seconds, far
    longer than the client waits before it hangs up."""

    def draft(self, state, verified, depth, new_features=None):
        time.sleep(0.05)
        return super().draft(state, verified, depth, new_features)


@dataclass
class HttpServer:
    base: str  # the HTTP API
    metrics: str  # its Prometheus page
    drafts: SlowCounting  # the draft server's backend: it counts the sessions released


@pytest.fixture(scope="module")
def http_server(tiny_target, loaded_target, tmp_path_factory):
    """A real `starsd-target serve --http` process, drafting from a slow in-process draft server."""
    log = tmp_path_factory.mktemp("http-limits") / "target.log"
    port, metrics = free_tcp_port(), free_tcp_port()
    backend = SlowCounting(loaded_target.vocab_size, loaded_target.fingerprint)
    with running_server(backend) as (server, _):
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "starsd_target", "serve", "--model", str(tiny_target),
                                     "--draft", server.endpoint, "--connect-timeout", "60", "--listen",
                                     free_tcp_endpoint(), "--http", f"127.0.0.1:{port}",
                                     "--metrics-port", str(metrics)],
                                    stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_http(base, proc, log)
            yield HttpServer(base, f"http://127.0.0.1:{metrics}/metrics", backend)
        finally:
            proc.terminate()
            proc.wait(30)


def _health_until(base: str, cond, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = httpx.get(base + "/health", timeout=5).json()
        if cond(h) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def _sample(url: str, name: str) -> float:
    """One sample's value (0 when absent) from a Prometheus text page."""
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_cancels_its_generation(http_server, stream):
    """The generation leaves the scheduler (active drops to 0), far short of max_tokens; its draft
    session is closed and the metrics count it cancelled."""
    base, max_tokens = http_server.base, CONTEXT - 8
    tokens = "starsd_target_generated_tokens_total"
    cancelled = 'starsd_target_requests_total{outcome="cancelled"}'
    before = httpx.get(base + "/health").json()
    generated, counted = _sample(http_server.metrics, tokens), _sample(http_server.metrics, cancelled)
    released = http_server.drafts.released
    body = {"prompt": "x", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=30) as c:
        if stream:
            with c.stream("POST", base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                data = (line for line in r.iter_lines() if line.startswith("data:"))
                assert [next(data) for _ in range(3)]  # the first chunks came: leaving the block hangs up
                assert httpx.get(base + "/health").json()["active"] == 1
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post(base + "/v1/completions", json=body, timeout=0.5)
    after = _health_until(base, lambda h: h["cancelled"] > before["cancelled"] and h["active"] == 0)
    assert after["cancelled"] == before["cancelled"] + 1 and after["active"] == 0
    assert after["completed"] == before["completed"]  # it did not run to max_tokens
    assert after["draft_connected"]  # the rounds were paced by the (slow) drafts, as intended
    assert 0 < _sample(http_server.metrics, tokens) - generated < max_tokens / 5
    assert _sample(http_server.metrics, cancelled) == counted + 1
    deadline = time.monotonic() + 10
    while http_server.drafts.released == released and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http_server.drafts.released == released + 1  # the draft daemon dropped its session


# ---------------------------------------------------------------- the job socket's exposure
def test_a_routable_job_socket_without_curve_is_refused(tiny_target, loaded_target):
    cfg = TargetConfig(model=str(tiny_target), draft=None, listen="tcp://0.0.0.0:5999")
    with pytest.raises(ValueError, match="--listen-curve-secret.*--insecure-listen"):
        TargetDaemon(cfg, loaded=loaded_target)
    from starsd_target.cli import main

    r = CliRunner().invoke(main, ["serve", "--model", "no-such-model", "--listen", "tcp://0.0.0.0:5999"])
    assert r.exit_code == 1 and "--insecure-listen" in r.output  # refused before any model loads
    TargetDaemon(TargetConfig(model=str(tiny_target), draft=None, listen="tcp://0.0.0.0:5999", insecure_listen=True),
                 loaded=loaded_target)  # on purpose: allowed (not bound here)


def _stats_once_admitted(ep: str, ctx: zmq.Context, curve, timeout_s: float = 20.0) -> dict:
    """STATS from a fresh connection each try (a refused CURVE handshake is not retried), until admitted."""
    deadline = time.monotonic() + timeout_s
    while True:
        with ControlClient(ep, ctx, curve=curve) as cc:
            try:
                return cc.stats(0.5)
            except ControlTimeout:
                assert time.monotonic() < deadline, "the key was not admitted after SIGHUP"


def test_a_curve_job_socket_admits_an_allowed_key_and_refuses_another(tiny_target, loaded_target, tmp_path):
    keys, allow = tmp_path / "keys", tmp_path / "allow"
    allow.mkdir()
    server_pub, server_secret = keygen(keys, "target")
    good_pub, good_secret = keygen(keys, "good")
    _, bad_secret = keygen(keys, "bad")
    (allow / "good.key").write_bytes(good_pub.read_bytes())
    port = free_tcp_port()
    ctx = zmq.Context()
    cfg = TargetConfig(model=str(tiny_target), draft=None, listen=f"tcp://0.0.0.0:{port}",
                       listen_curve_secret=server_secret, listen_curve_allow=allow)
    d = TargetDaemon(cfg, loaded=loaded_target, ctx=ctx)
    try:
        with serving(d):
            ep = f"tcp://127.0.0.1:{port}"
            with ControlClient(ep, ctx, curve=client_keys(good_secret, server_pub)) as cc:
                assert cc.stats(10)["model"] == str(loaded_target.path)
                reply = cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": "x", "max_tokens": 3}), 30)
                assert len(reply.header["token_ids"]) == 3
            with ControlClient(ep, ctx, curve=client_keys(bad_secret, server_pub)) as cc, pytest.raises(ControlTimeout):
                cc.stats(1.5)
            with ControlClient(ep, ctx) as cc, pytest.raises(ControlTimeout):  # plaintext
                cc.stats(1.5)
            assert d.served == 1
            # what an operator runs: `status` with the client's key and the socket's public key
            from starsd_target.cli import main as target_cli

            status = CliRunner().invoke(target_cli, ["status", "--connect", ep, "--json", "--curve-secret",
                                                     str(good_secret), "--curve-server-key", str(server_pub)])
            assert status.exit_code == 0 and json.loads(status.stdout)["served"] == 1, status.output
            # SIGHUP re-reads the allow-list: the other key is admitted once it is listed
            (allow / "bad.key").write_bytes((keys / "bad.key").read_bytes())
            saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
            try:
                d.install_signal_handlers()
                os.kill(os.getpid(), signal.SIGHUP)
                assert _stats_once_admitted(ep, ctx, client_keys(bad_secret, server_pub))["served"] == 1
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)
    finally:
        ctx.destroy(linger=0)


def test_a_request_body_beyond_the_limit_is_refused_before_it_is_parsed(loaded_target):
    from starsd_target.http_api import max_body_bytes

    daemon = TargetDaemon(TargetConfig(model="unused", draft=None), loaded=loaded_target)
    daemon.scheduler().start()
    try:
        limit = max_body_bytes(daemon.engine.context)
        with TestClient(create_app(daemon, "tiny")) as c:
            r = c.post("/v1/completions", content=b'{"prompt": "' + b"x" * limit + b'"}',
                       headers={"content-type": "application/json"})
            assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        daemon.scheduler().stop()


def test_a_control_call_that_cannot_send_times_out(tmp_path):
    """A DEALER with no pipe to send on (its handshake refused, or nothing to connect to with
    immediate set) blocks in send without end; the control client gives up as it does on a reply."""
    from common.control import ControlClient, ControlTimeout

    ctx = zmq.Context()
    try:
        endpoint = f"ipc://{tmp_path}/nobody"
        cc = ControlClient(endpoint, ctx)
        cc.sock.close(linger=0)
        cc.sock = ctx.socket(zmq.DEALER)
        cc.sock.setsockopt(zmq.IMMEDIATE, 1)  # no completed connection: no pipe to queue the message on
        cc.sock.connect(endpoint)
        with pytest.raises(ControlTimeout, match="could not send"):
            cc.stats(0.3)  # before, this send never returned
        cc.close()
    finally:
        ctx.destroy(linger=0)
