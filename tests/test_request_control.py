"""Per-request control of speculation (off, or a cap on the draft length) and token
log-probabilities: on the engine, through the scheduler and the job socket, and through the
HTTP API (in-process, with a real draft model behind an in-process draft server).

Log-probabilities are checked against the target model run directly with transformers over
prompt and output: the log-softmax of its raw logits at each generated position."""

from __future__ import annotations

from dataclasses import dataclass, field

import openai
import pytest
import torch
import zmq
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from common.control import ControlClient
from common.models import load_causal_lm
from common.protocol import ErrorCode, Message, MsgType, RemoteError
from common.token_bytes import token_bytes
from common.verify import SamplingParams
from fakes import IN_PROCESS_ACK_FLOOR_S, LocalDrafts, running_server, serving
from starsd_draftd.backends.model import ModelBackend
from starsd_target.daemon import TargetConfig, TargetDaemon
from starsd_target.engine import MAX_LOGPROBS, InvalidRequest, TargetEngine
from starsd_target.http_api import create_app
from tiny_models import reference_greedy

PROMPT = "def parse(line):\n    "
DEPTH = 4


@pytest.fixture(scope="module")
def draft_backend(near_draft):
    return ModelBackend(load_causal_lm(str(near_draft)))


@pytest.fixture(scope="module")
def engine(loaded_target):
    return TargetEngine(loaded_target, depth=DEPTH)


@pytest.fixture(scope="module")
def reference(tiny_target):
    """log-softmax of the target's raw logits (float32) at the positions producing ``out``."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()

    def logprobs(prompt: list[int], out: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(out)], dim=-1)

    return logprobs


@dataclass
class Recording:
    """A DraftSource around LocalDrafts that records the depth each round asked for."""

    inner: LocalDrafts
    depths: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    feature_size: int = 0

    def propose(self, tokens, depth, features=None):
        self.depths.append(depth)
        prop = self.inner.propose(tokens, depth, features)
        self.lengths.append(len(prop.tokens))
        return prop

    def kept(self, n):
        self.inner.kept(n)

    def close(self):
        self.inner.close()


def assert_matches_reference(result, prompt, ref, top: int) -> None:
    want = ref(prompt, result.token_ids)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for i, (entry, tok) in enumerate(zip(result.logprobs, result.token_ids)):
        assert entry.token == tok
        assert entry.logprob == pytest.approx(float(want[i, tok]), abs=1e-4)
        assert len(entry.top) == top
        values, ids = torch.topk(want[i], top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


# ---------------------------------------------------------------- the engine
def test_greedy_logprobs_are_the_targets_log_softmax_with_drafts_kept(engine, draft_backend, reference, tiny_target):
    prompt = engine.encode(PROMPT)
    with_lp = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend), logprobs=5)
    without = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend))
    assert with_lp.stats.accepted > 0 and with_lp.stats.drafted > with_lp.stats.accepted  # kept and rejected drafts
    assert with_lp.token_ids == without.token_ids == reference_greedy(tiny_target, prompt, 40)
    assert without.logprobs is None
    assert_matches_reference(with_lp, prompt, reference, top=5)
    # greedy: the produced token is the most likely one
    assert all(e.top[0][0] == e.token for e in with_lp.logprobs)


def test_sampled_logprobs_are_of_the_raw_logits_and_change_nothing(engine, draft_backend, reference):
    prompt = engine.encode(PROMPT)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=4)
    runs = [engine.generate(prompt, 30, params, LocalDrafts(draft_backend, params), logprobs=lp)
            for lp in (None, 0, MAX_LOGPROBS)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert runs[2].stats.accepted > 0
    assert_matches_reference(runs[1], prompt, reference, top=0)
    assert_matches_reference(runs[2], prompt, reference, top=MAX_LOGPROBS)  # not tempered, not filtered


def test_logprobs_are_cut_with_the_output_at_a_stop_string(engine, draft_backend):
    prompt = engine.encode(PROMPT)
    whole = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend), logprobs=1)
    stop = whole.text[10:12]
    cut = engine.generate(prompt, 40, SamplingParams(), LocalDrafts(draft_backend), stop=[stop], logprobs=1)
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(whole.token_ids)
    assert len(cut.logprobs) == len(cut.token_ids)
    assert [e.token for e in cut.logprobs] == cut.token_ids
    assert [e.logprob for e in cut.logprobs] == pytest.approx([e.logprob for e in whole.logprobs[: len(cut.token_ids)]],
                                                              abs=1e-5)


def test_max_draft_caps_each_rounds_drafts(engine, draft_backend, tiny_target):
    prompt = engine.encode(PROMPT)
    rec = Recording(LocalDrafts(draft_backend))
    result = engine.generate(prompt, 40, SamplingParams(), rec, max_draft=1)
    assert result.token_ids == reference_greedy(tiny_target, prompt, 40)
    assert rec.depths and max(rec.depths) == 1 and max(rec.lengths) == 1
    assert result.stats.accepted > 0 and result.stats.drafted <= result.stats.rounds
    assert result.stats.accepted_by_position[1:] == [0] * (DEPTH - 1)
    assert result.stats.max_draft_tokens == 1 and result.stats.to_dict()["speculate"] is True
    full = Recording(LocalDrafts(draft_backend))
    engine.generate(prompt, 40, SamplingParams(), full)
    assert max(full.depths) == DEPTH  # without the cap, rounds ask for the target's depth


def test_max_draft_zero_asks_for_no_drafts_and_counts_no_fallback(engine, draft_backend, tiny_target):
    prompt = engine.encode(PROMPT)
    rec = Recording(LocalDrafts(draft_backend))
    result = engine.generate(prompt, 20, SamplingParams(), rec, max_draft=0)
    assert result.token_ids == reference_greedy(tiny_target, prompt, 20)
    assert rec.depths == [] and result.stats.drafted == 0 and result.stats.fallback_rounds == 0
    assert result.stats.rounds == 20 and result.stats.to_dict()["speculate"] is False


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_draft=DEPTH + 1), "max_draft_tokens"),
    (dict(max_draft=-1), "max_draft_tokens"),
    (dict(max_draft=True), "max_draft_tokens"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=1.5), "logprobs"),
])
def test_engine_check_bounds_the_speculation_and_logprob_options(engine, kwargs, param):
    with pytest.raises(InvalidRequest) as info:
        engine.check([65, 66], 5, SamplingParams(), (), **kwargs)
    assert info.value.param == param and str(info.value)
    engine.check([65, 66], 5, SamplingParams(), (), max_draft=DEPTH, logprobs=MAX_LOGPROBS)


# ---------------------------------------------------------------- the HTTP API and the job socket
class CountingModelBackend(ModelBackend):
    """A real draft model that counts the sessions opened and records the depth each request asked for."""

    def __init__(self, loaded):
        super().__init__(loaded)
        self.sessions = 0
        self.depths: list[int] = []

    def new_state(self, params):
        self.sessions += 1
        return super().new_state(params)

    def draft_many(self, requests):
        self.depths.extend(r.depth for r in requests)
        return super().draft_many(requests)


@dataclass
class Served:
    http: TestClient
    daemon: TargetDaemon
    backend: CountingModelBackend

    def post(self, path: str, **body) -> dict:
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def served(tiny_target, loaded_target, near_draft, tmp_path_factory):
    """A target daemon linked to an in-process draft server (a real draft model), its job socket
    served in a thread, and its HTTP app."""
    backend = CountingModelBackend(load_causal_lm(str(near_draft)))
    with running_server(backend) as (server, ctx):
        cfg = TargetConfig(model=str(tiny_target), draft=server.endpoint,
                           listen=f"ipc://{tmp_path_factory.mktemp('jobs')}/t.sock", depth=DEPTH,
                           draft_timeout_s=10, ack_timeout_s=IN_PROCESS_ACK_FLOOR_S)
        d = TargetDaemon(cfg, loaded=loaded_target, ctx=ctx)
        assert d.connect()
        with serving(d), TestClient(create_app(d, "tiny")) as http:
            yield Served(http, d, backend)


@pytest.fixture(scope="module")
def openai_client(served):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=served.http, max_retries=0)


def _chat_prompt(engine: TargetEngine, messages: list[dict]) -> list[int]:
    tok = engine.loaded.tokenizer
    return engine.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _offsets(engine: TargetEngine, ids: list[int]) -> list[int]:
    """Where each token's text starts in the output's text (a token inside a character: where that character starts)."""
    return [len(engine.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]


def test_completion_logprobs_are_the_targets_with_drafts_kept(served, reference):
    engine = served.daemon.engine
    prompt = engine.encode(PROMPT)
    plain = served.post("/v1/completions", prompt=PROMPT, max_tokens=30, temperature=0)
    r = served.post("/v1/completions", prompt=PROMPT, max_tokens=30, temperature=0, logprobs=3)
    assert r["starsd"]["accepted"] > 0 and r["starsd"]["speculate"] is True
    assert r["starsd"]["max_draft_tokens"] == DEPTH
    choice = r["choices"][0]
    assert choice["text"] == plain["choices"][0]["text"] and plain["choices"][0]["logprobs"] is None
    ids = reference_greedy(served.daemon.config.model, prompt, 30)
    want = reference(prompt, ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"] == pytest.approx([float(want[i, t]) for i, t in enumerate(ids)], abs=1e-4)
    for i, top in enumerate(lp["top_logprobs"]):
        values = torch.topk(want[i], 3).values.tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(values, abs=1e-4)
        assert top[lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i])  # the chosen token is there
    assert lp["text_offset"] == _offsets(engine, ids)
    for name, t in zip(lp["tokens"], ids):  # a token that is part of a character is named by its bytes
        raw = token_bytes(engine.loaded.tokenizer, t)
        try:
            assert name == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert name == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_chat_logprobs_through_the_openai_client(served, openai_client, reference):
    engine = served.daemon.engine
    msgs = [{"role": "user", "content": "write a loop"}]
    r = openai_client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0,
                                              logprobs=True, top_logprobs=2)
    plain = openai_client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content and plain.choices[0].logprobs is None
    assert r.model_extra["starsd"]["accepted"] > 0
    prompt = _chat_prompt(engine, msgs)
    ids = reference_greedy(served.daemon.config.model, prompt, 24)
    want = reference(prompt, ids)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) == r.usage.completion_tokens
    for i, (entry, t) in enumerate(zip(content, ids)):
        assert entry.logprob == pytest.approx(float(want[i, t]), abs=1e-4)
        assert bytes(entry.bytes) == token_bytes(engine.loaded.tokenizer, t)
        values, top_ids = torch.topk(want[i], 2)
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert [bytes(a.bytes) for a in entry.top_logprobs] == [token_bytes(engine.loaded.tokenizer, j)
                                                               for j in top_ids.tolist()]
    text_tokens = content[:-1] if r.choices[0].finish_reason == "stop" else content
    assert b"".join(bytes(e.bytes) for e in text_tokens).decode("utf-8", "replace") == r.choices[0].message.content


def test_streamed_logprobs_come_with_their_chunks_and_add_up_to_the_whole(served, openai_client):
    kw = dict(model="tiny", prompt="import os\n", max_tokens=40, temperature=0, logprobs=2)
    whole = openai_client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in openai_client.completions.create(stream=True, **kw)]
    assert "".join(c.text for c in chunks) == whole.text
    with_lp = [c for c in chunks if c.logprobs is not None]
    assert len(with_lp) > 2  # the log-probabilities arrive as the text does, not all at the end
    # the two runs' rounds may differ in length (adaptive depth follows measured times), so their
    # verification forwards round differently: log-probabilities agree to float rounding
    for field_name in ("tokens", "text_offset"):
        streamed = [x for c in with_lp for x in getattr(c.logprobs, field_name)]
        assert streamed == getattr(whole.logprobs, field_name), field_name
    streamed = [x for c in with_lp for x in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.logprobs.token_logprobs, abs=1e-4)
    streamed = [x for c in with_lp for x in c.logprobs.top_logprobs]
    assert [sorted(t) for t in streamed] == [sorted(t) for t in whole.logprobs.top_logprobs]
    assert [t[k] for t in streamed for k in sorted(t)] == pytest.approx(
        [t[k] for t in whole.logprobs.top_logprobs for k in sorted(t)], abs=1e-4)
    for c in with_lp:  # each chunk's tokens are those of its text
        if c.text:
            assert c.logprobs.tokens

    msgs = [{"role": "user", "content": "count to ten"}]
    ckw = dict(model="tiny", messages=msgs, max_tokens=30, temperature=0, logprobs=True, top_logprobs=1)
    chat_whole = openai_client.chat.completions.create(**ckw).choices[0]
    chat_chunks = [c.choices[0] for c in openai_client.chat.completions.create(stream=True, **ckw)]
    streamed = [e for c in chat_chunks if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in chat_whole.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in chat_whole.logprobs.content], abs=1e-4)
    assert "".join(c.delta.content or "" for c in chat_chunks) == chat_whole.message.content


def test_speculate_false_opens_no_draft_session_and_drafts_nothing(served, openai_client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0)
    spec = openai_client.completions.create(**kw)
    sessions = served.backend.sessions
    alone = openai_client.completions.create(extra_body={"starsd": {"speculate": False}}, **kw)
    assert served.backend.sessions == sessions  # no draft session was opened for it
    s = alone.model_extra["starsd"]
    assert s["drafted"] == 0 and s["fallback_rounds"] == 0 and s["rounds"] == 30
    assert s["speculate"] is False and s["max_draft_tokens"] == 0
    assert spec.model_extra["starsd"]["drafted"] > 0 and spec.model_extra["starsd"]["speculate"] is True
    assert alone.choices[0].text == spec.choices[0].text
    zero = served.post("/v1/completions", prompt=PROMPT, max_tokens=30, temperature=0,
                       starsd={"max_draft_tokens": 0})
    assert served.backend.sessions == sessions
    assert zero["starsd"]["drafted"] == 0 and zero["starsd"]["fallback_rounds"] == 0
    assert zero["choices"][0]["text"] == spec.choices[0].text


def test_max_draft_tokens_caps_every_round(served):
    before = len(served.backend.depths)
    r = served.post("/v1/chat/completions", messages=[{"role": "user", "content": "write a loop"}], max_tokens=30,
                    temperature=0, starsd={"max_draft_tokens": 1})
    asked = served.backend.depths[before:]
    s = r["starsd"]
    assert asked and max(asked) == 1
    assert s["max_draft_tokens"] == 1 and s["speculate"] is True
    assert 0 < s["accepted"] <= s["drafted"] <= s["rounds"]
    assert s["accepted_by_position"][1:] == [0] * (DEPTH - 1)
    before = len(served.backend.depths)
    served.post("/v1/chat/completions", messages=[{"role": "user", "content": "write a loop"}], max_tokens=30,
                temperature=0)
    assert max(served.backend.depths[before:]) == DEPTH  # without the cap, the target's depth


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", dict(starsd={"max_draft_tokens": DEPTH + 1}), "starsd.max_draft_tokens"),
    ("/v1/completions", dict(starsd={"max_draft_tokens": -1}), "starsd.max_draft_tokens"),
    ("/v1/completions", dict(starsd={"max_draft_tokens": "2"}), "starsd.max_draft_tokens"),
    ("/v1/completions", dict(starsd={"speculate": "no"}), "starsd.speculate"),
    ("/v1/completions", dict(starsd={"speculate": False, "depth": 3}), "starsd.depth"),
    ("/v1/completions", dict(starsd=5), "starsd"),
    ("/v1/completions", dict(logprobs=6), "logprobs"),
    ("/v1/completions", dict(logprobs=-1), "logprobs"),
    ("/v1/completions", dict(logprobs=2, echo=True), "echo"),
    ("/v1/chat/completions", dict(starsd={"max_draft_tokens": DEPTH + 1}), "starsd.max_draft_tokens"),
    ("/v1/chat/completions", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", dict(logprobs="sometimes"), "logprobs"),
])
def test_bad_speculation_and_logprob_values_get_400_naming_the_param(served, path, fields, param):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = served.http.post(path, json={**body, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_the_job_socket_takes_max_draft_tokens(served):
    def generate(**fields):
        with ControlClient(served.daemon.endpoint, zmq.Context.instance()) as cc:
            return cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": PROMPT, "max_tokens": 20, **fields}), 60)

    capped = generate(max_draft_tokens=1).header["stats"]
    assert capped["max_draft_tokens"] == 1 and 0 < capped["drafted"] <= capped["rounds"]
    assert generate().header["stats"]["max_draft_tokens"] == DEPTH  # the field is optional
    with pytest.raises(RemoteError) as info:
        generate(max_draft_tokens=DEPTH + 1)
    assert info.value.code == ErrorCode.BAD_REQUEST and "max_draft_tokens" in str(info.value)


def test_null_options_mean_their_defaults(served):
    r = served.post("/v1/chat/completions", messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0,
                    logprobs=None, top_logprobs=None, starsd=None)
    assert r["choices"][0]["logprobs"] is None and r["starsd"]["max_draft_tokens"] == DEPTH
    r = served.post("/v1/completions", prompt="x", max_tokens=4, temperature=0, logprobs=None,
                    starsd={"max_draft_tokens": None})
    assert r["choices"][0]["logprobs"] is None and r["starsd"]["speculate"] is True


def test_top_logprobs_without_logprobs_returns_none(served):
    """The published schema cannot tie top_logprobs to logprobs: alone it is accepted and ignored."""
    r = served.post("/v1/chat/completions", messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0,
                    top_logprobs=2)
    assert r["choices"][0]["logprobs"] is None and r["choices"][0]["message"]["content"] is not None
