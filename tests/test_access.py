"""Who may submit work. The HTTP API's key: requests without it, or with another, get 401 in
OpenAI's error shape; the paths named open are served without it; the key comes from the
environment as a Secret gives it. The job socket: GENERATE over CURVE or an ipc file of the
service's user alone; over plaintext TCP only with --insecure-listen (STATS is answered there)."""

import os
import stat

import httpx
import openai
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

import zmq

from common.control import ControlClient
from common.protocol import ErrorCode, Message, MsgType, RemoteError
from common.sockets import free_tcp_endpoint, free_tcp_port
from fakes import serving, wait_http_health
from starsd_draftd.bench.procs import ProcessSet
from starsd_target.config import TargetConfig
from starsd_target.daemon import TargetDaemon
from starsd_target.http_api import ApiKey, parse_paths
from tiny_models import reference_greedy


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"served"})


def test_only_requests_bearing_the_key_are_served_and_open_paths_need_none():
    app = TestClient(ApiKey(_ok, "s3cret-key", parse_paths("/health")))
    missing = app.get("/v1/models")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    err = missing.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and "Bearer" in err["message"]
    wrong = app.post("/v1/completions", headers={"Authorization": "Bearer s3cret-kez"})
    assert wrong.status_code == 401 and "s3cret" not in wrong.text  # never echoed
    assert app.get("/v1/models", headers={"Authorization": "Basic s3cret-key"}).status_code == 401
    assert app.get("/v1/models", headers={"Authorization": "Bearer s3cret-key"}).text == "served"
    assert app.get("/v1/models", headers={"Authorization": "bearer s3cret-key"}).text == "served"  # any case
    assert TestClient(ApiKey(_ok, "s3cret-key\n")).get("/", headers={"Authorization": "Bearer s3cret-key"}).text \
        == "served"  # a key read from a file: its newline is not part of it
    assert app.get("/health").text == "served"  # open
    assert app.get("/health/x").status_code == 401  # only the path named


def test_open_paths_are_checked():
    assert parse_paths("/health, /metrics") == {"/health", "/metrics"}
    assert parse_paths("") == frozenset()
    with pytest.raises(ValueError, match="start with '/'"):
        parse_paths("health")


def test_a_key_without_http_is_refused_before_the_model_loads():
    from starsd_target import cli

    r = CliRunner().invoke(cli.main, ["serve", "--model", "/nonexistent", "--no-draft"],
                           env={"STARSD_TARGET_API_KEY": "k"})
    assert r.exit_code == 1 and "--api-key guards the HTTP API" in r.output


@pytest.mark.slow
def test_the_served_api_takes_its_key_from_the_environment(tiny_target, loaded_target, tmp_path):
    port = free_tcp_port()
    with ProcessSet(tmp_path) as d:
        listen = free_tcp_endpoint()
        d.start("target", "starsd_target", "serve", "--model", str(tiny_target), "--no-draft", "--listen", listen,
                "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny", "--api-open-paths", "/health",
                env={"STARSD_TARGET_API_KEY": "a-key-from-a-secret"})
        d.wait_ready("target", listen)
        base = f"http://127.0.0.1:{port}"
        wait_http_health(base, lambda: d.log("target")[-3000:])  # /health is open: no key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(base + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=base + "/v1", api_key="a-key-from-a-secret", max_retries=0, timeout=120)
        prompt = "def parse(line):\n    "
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        ids = loaded_target.tokenizer(prompt)["input_ids"]
        ref = reference_greedy(tiny_target, ids, 12)
        assert done.choices[0].text == loaded_target.tokenizer.decode(ref)
        assert "a-key-from-a-secret" not in d.log("target")


@pytest.mark.parametrize("where,insecure,takes_jobs", [("tcp", False, False), ("tcp", True, True),
                                                      ("ipc", False, True)])
def test_the_job_socket_takes_jobs_only_where_it_can_tell_who_sends_them(where, insecure, takes_jobs, tiny_target,
                                                                          loaded_target, tmp_path):
    listen = free_tcp_endpoint() if where == "tcp" else f"ipc://{tmp_path}/jobs.sock"
    ctx = zmq.Context()
    d = TargetDaemon(TargetConfig(model=str(tiny_target), draft=None, listen=listen, insecure_listen=insecure),
                     loaded=loaded_target, ctx=ctx)
    try:
        with serving(d):
            if where == "ipc":  # the socket file: this user's alone
                assert stat.S_IMODE(os.stat(tmp_path / "jobs.sock").st_mode) == 0o600
            with ControlClient(listen, ctx) as cc:
                assert cc.stats(10)["model"] == str(loaded_target.path)  # status works everywhere
                job = Message(MsgType.GENERATE, {"id": 7, "prompt": "x", "max_tokens": 3})
                if takes_jobs:
                    assert len(cc.call(job, 60).header["token_ids"]) == 3
                else:
                    with pytest.raises(RemoteError) as info:
                        cc.call(job, 60)
                    assert info.value.code == ErrorCode.NOT_ALLOWED and "--insecure-listen" in info.value.message
                    assert d.jobs.refused_jobs == 1 and d.served == 0
    finally:
        ctx.destroy(linger=0)
