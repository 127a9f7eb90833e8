"""The target's OpenAI-compatible HTTP API, driven by the official openai client against a real
`starsd-target serve --http` process with a real draft daemon; and both daemons' metrics."""

import httpx
import openai
import pytest

from common.sockets import free_tcp_endpoint, free_tcp_port
from fakes import wait_http_health
from starsd_draftd.bench.procs import ProcessSet as Daemons
from tiny_models import make_near_copy, reference_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_target, tmp_path_factory):
    d = Daemons(tmp_path_factory.mktemp("http"))
    draft_ep, listen, port = free_tcp_endpoint(), free_tcp_endpoint(), free_tcp_port()
    draft_metrics, target_metrics = free_tcp_port(), free_tcp_port()
    near = make_near_copy(tiny_target, tmp_path_factory.mktemp("near"), noise=0.02)
    try:
        d.start("draftd", "starsd_draftd", "serve", "--model", str(near), "--bind", draft_ep,
                "--metrics-port", str(draft_metrics))
        d.start("target", "starsd_target", "serve", "--model", str(tiny_target), "--draft", draft_ep, "--listen",
                listen, "--http", f"127.0.0.1:{port}", "--served-model-name", "tiny", "--connect-timeout", "120",
                "--draft-timeout", "30", "--metrics-port", str(target_metrics))
        d.wait_ready("draftd", draft_ep)
        d.wait_ready("target", listen)
        base = f"http://127.0.0.1:{port}"
        wait_http_health(base, lambda: d.log("target")[-3000:])
        d.metrics = {"draftd": f"http://127.0.0.1:{draft_metrics}/metrics",
                     "target": f"http://127.0.0.1:{target_metrics}/metrics"}
        yield base, d
    finally:
        d.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["draft_connected"] is True


def test_completion_is_the_targets_own_greedy_output(client, loaded_target, tiny_target):
    from starsd_target.engine import TargetEngine

    prompt = "def parse(line):\n    "
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    ids = reference_greedy(tiny_target, TargetEngine(loaded_target).encode(prompt), 24)
    assert r.choices[0].text == loaded_target.tokenizer.decode(ids, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ids) and r.choices[0].finish_reason in ("length", "stop")
    assert r.model_extra["starsd"]["accepted"] > 0  # drafts were used


def test_logprobs_and_per_request_speculation(client, tiny_target, loaded_target):
    """Through `serve --http` and a real draft daemon: logprobs are the target's own
    log-softmax; the starsd object turns speculation off or caps it, output unchanged."""
    import torch
    from transformers import AutoModelForCausalLM

    from starsd_target.engine import TargetEngine

    prompt = "def parse(line):\n    "
    kw = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    r = client.completions.create(logprobs=2, **kw)
    ids = TargetEngine(loaded_target).encode(prompt)
    out = reference_greedy(tiny_target, ids, 24)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([ids + out])).logits[0, len(ids) - 1: -1].float(), dim=-1)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([float(want[i, t]) for i, t in enumerate(out)],
                                                                 abs=1e-4)
    assert r.model_extra["starsd"]["accepted"] > 0
    alone = client.completions.create(extra_body={"starsd": {"speculate": False}}, **kw)
    s = alone.model_extra["starsd"]
    assert s["drafted"] == 0 and s["fallback_rounds"] == 0 and s["speculate"] is False
    capped = client.completions.create(extra_body={"starsd": {"max_draft_tokens": 1}}, **kw)
    c = capped.model_extra["starsd"]
    assert c["max_draft_tokens"] == 1 and 0 < c["drafted"] <= c["rounds"]
    assert not any(c["accepted_by_position"][1:])
    assert alone.choices[0].text == capped.choices[0].text == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(extra_body={"starsd": {"max_draft_tokens": 99}}, **kw)
    assert info.value.body["param"] == "starsd.max_draft_tokens"



def test_a_prompt_that_begins_as_an_earlier_one_reuses_its_prefill_exactly(client, loaded_target, tiny_target):
    """A conversation's next turn: its prompt begins with the whole first one (over one 256-token
    prefill chunk), so the target takes that chunk's keys and values from the earlier prompt
    (usage's cached_tokens) and answers exactly as the target alone, speculating."""
    from starsd_target.engine import TargetEngine

    first = "".join(f"# step {i}: read the {i}th record, check it, store it\n" for i in range(6))
    second = first + "def run(records):\n    "
    engine = TargetEngine(loaded_target)
    kw = dict(model="tiny", max_tokens=24, temperature=0)
    a = client.completions.create(prompt=first, **kw)
    b = client.completions.create(prompt=second, **kw)
    assert len(engine.encode(first)) > 256 and len(engine.encode(second)) < 512 - 24
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == 256
    assert b.model_extra["starsd"]["cached_prompt_tokens"] == 256
    ids = reference_greedy(tiny_target, engine.encode(second), 24)
    assert b.choices[0].text == loaded_target.tokenizer.decode(ids, skip_special_tokens=True)
    s = b.model_extra["starsd"]
    assert s["accepted"] > 0 and s["fallback_rounds"] == 0

def test_streamed_completion_adds_up_to_the_whole(client):
    kwargs = dict(model="tiny", prompt="import os\n", max_tokens=30, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason is not None


def test_chat_completion_and_stream(client):
    msgs = [{"role": "user", "content": "write a loop"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, seed=3)
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    streamed = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content


def test_sampling_with_seed_repeats(client):
    kw = dict(model="tiny", prompt="x = ", max_tokens=20, temperature=0.9, top_p=0.9, seed=11)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string(client):
    whole = client.completions.create(model="tiny", prompt="import os\n", max_tokens=30, temperature=0)
    text = whole.choices[0].text
    stop = text[5:7]
    r = client.completions.create(model="tiny", prompt="import os\n", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", temperature=-1), "temperature"),
    (dict(prompt="x", n=2), "n"),
    (dict(prompt="", max_tokens=5), "prompt"),
    (dict(prompt="x", stop=[""]), "stop"),
])
def test_invalid_requests_get_400_error_objects(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", **kwargs)
    body = info.value.body
    assert info.value.status_code == 400 and body["type"] == "invalid_request_error"
    assert body["param"] == param and body["message"]


def test_malformed_json_and_unknown_model(server):
    r = httpx.post(server[0] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server[0] + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and "tiny" in r.json()["error"]["message"]


@pytest.mark.parametrize("fields, param", [
    ({"echo": 0}, "echo"),
    ({"n": True}, "n"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
])
def test_a_value_of_another_json_type_is_refused(server, fields, param):
    """Through uvicorn's own JSON parsing: a value the published schema does not allow is refused,
    not coerced (the full table is in test_openapi.py, in process)."""
    r = httpx.post(server[0] + "/v1/completions", json={"model": "tiny", "prompt": "x", **fields})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == param


def _scrape(url: str) -> dict[str, float]:
    """Sample name (with labels) -> value, from the Prometheus text format."""
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


DRAFTD_SERIES = ["starsd_draftd_live_sessions", "starsd_draftd_queue_depth", "starsd_draftd_busy_fraction",
                 "starsd_draftd_requests_total", "starsd_draftd_drafted_tokens_total",
                 "starsd_draftd_service_seconds_count", "starsd_draftd_batch_size_count"]
TARGET_SERIES = ["starsd_target_generated_tokens_total", "starsd_spec_decode_num_drafts_total",
                 "starsd_spec_decode_num_draft_tokens_total", "starsd_spec_decode_num_accepted_tokens_total",
                 'starsd_spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "starsd_spec_decode_mean_accepted_length", "starsd_spec_decode_fallback_rounds_total",
                 "starsd_target_draft_round_trip_seconds_count", "starsd_target_verify_seconds_count",
                 "starsd_target_active_generations"]


def test_metrics_expose_the_named_series_and_move(server, client):
    d = server[1]
    before = {k: _scrape(u) for k, u in d.metrics.items()}
    for name in DRAFTD_SERIES:
        assert name in before["draftd"], name
    for name in TARGET_SERIES:
        assert name in before["target"], name
    client.completions.create(model="tiny", prompt="for i in range(3):", max_tokens=40, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    after = {k: _scrape(u) for k, u in d.metrics.items()}
    for name in ("starsd_draftd_requests_total", "starsd_draftd_drafted_tokens_total",
                 "starsd_draftd_service_seconds_count"):
        assert after["draftd"][name] > before["draftd"][name], name
    t0, t1 = before["target"], after["target"]
    for name in ("starsd_target_generated_tokens_total", "starsd_spec_decode_num_draft_tokens_total",
                 "starsd_spec_decode_num_accepted_tokens_total", "starsd_target_draft_round_trip_seconds_count",
                 'starsd_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'):
        assert t1[name] > t0[name], name
    assert t1['starsd_target_requests_total{outcome="ok"}'] >= 1
    assert t1["starsd_spec_decode_mean_accepted_length"] > 1.0
