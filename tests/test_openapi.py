"""The HTTP API's OpenAPI document is its true contract: Schemathesis (a schema-driven fuzzer)
runs its coverage phase (each keyword's boundary values and each way to break it) and its fuzzing
phase against the app in process, and checks every answer against the document (no server error,
status codes declared, bodies matching their schemas, content types, valid requests accepted,
invalid ones refused) with no failures."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema_rs
import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events, from_schema
from schemathesis.engine.run import PhaseName
from schemathesis.generation import GenerationMode

from common.models import load_causal_lm
from starsd_draftd.demo.byte_tokenizer import make_byte_tokenizer
from starsd_target.daemon import TargetConfig, TargetDaemon
from starsd_target.http_api import create_app
from tiny_models import make_tiny_checkpoint

CONTEXT = 128  # short generations: a valid request may ask for the whole context
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Schemathesis' run: the coverage phase (every case the schema defines; no example count) and a
# bounded fuzzing phase, valid and invalid requests, derandomized with a fixed seed
RUN = {"seed": 1,
       "generation": {"mode": "all", "deterministic": True, "max-examples": 150, "database": "none"},
       "phases": {"examples": {"enabled": False}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
                  "stateful": {"enabled": False}}}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A target daemon (no draft link) on a tiny model with a chat template, and its HTTP app."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("openapi"), "llama", seed=1, hidden=32, layers=1,
                                context=CONTEXT)
    tok = make_byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    daemon = TargetDaemon(TargetConfig(model=str(path), draft=None), loaded=load_causal_lm(str(path)))
    sched = daemon.scheduler()
    sched.start()
    yield daemon, create_app(daemon, "tiny")
    sched.stop()


@pytest.fixture(scope="module")
def api(served):
    """The app's document, with the one bound no schema can carry applied to the valid requests
    generated from it: the prompt's tokens plus max_tokens within the context. A client keeps to
    it as max_tokens' description tells it to; invalid requests are sent as generated. Valid
    requests generate at most 4 tokens (what is checked is the answer's shape, not its length)."""
    daemon, app = served
    api = schemathesis.openapi.from_asgi("/openapi.json", app, config=SchemathesisConfig.from_dict(RUN))

    def room(case) -> int | None:
        """Tokens the context leaves for a valid generation request (None: not one)."""
        if not (case.meta and case.meta.generation.mode == GenerationMode.POSITIVE and isinstance(case.body, dict)
                and case.path in GENERATION_PATHS):
            return None
        return CONTEXT - _prompt_tokens(daemon, case.body, chat=case.path == "/v1/chat/completions")

    @api.hook("filter_case")
    def prompt_fits(ctx, case) -> bool:
        left = room(case)
        return left is None or left >= 1

    @api.hook("map_case")
    def max_tokens_fit(ctx, case):
        left = room(case)
        if left is not None:
            case.body["max_tokens"] = min(case.body.get("max_tokens") or 4, left, 4)
        return case

    return api


def test_the_document_declares_the_errors_the_server_answers(served):
    with TestClient(served[1]) as c:
        doc = c.get("/openapi.json").json()
        for path in ("/v1/completions", "/v1/chat/completions"):
            responses = doc["paths"][path]["post"]["responses"]
            assert "422" not in responses
            for status in ("400", "404", "429", "503"):
                assert responses[status]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"}
        error = doc["components"]["schemas"]["ErrorObject"]
        assert set(error["required"]) == {"message", "type", "param", "code"}
        assert "HTTPValidationError" not in doc["components"]["schemas"]
        request = doc["components"]["schemas"]["CompletionRequest"]["properties"]
        assert {"type": "integer", "minimum": 1, "maximum": CONTEXT - 1} in request["max_tokens"]["anyOf"]
        ids = next(b for b in request["prompt"]["anyOf"] if b.get("items", {}).get("type") == "integer")
        assert ids["items"]["maximum"] == served[0].loaded.logits_size - 1 and ids["maxItems"] == CONTEXT - 1
        # what the document says the server refuses, it refuses with a 400 in OpenAI's shape
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": CONTEXT})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = c.post("/v1/completions", json={"prompt": "x", "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"


@pytest.fixture(scope="module")
def client(served):
    with TestClient(served[1]) as c:
        yield c


def _document_takes(client, path: str, body: dict) -> bool:
    """Whether the published document's request schema for ``path`` takes ``body`` (JSON Schema
    2020-12, as OpenAPI 3.1 reads it, with the validator Schemathesis uses)."""
    doc = client.get("/openapi.json").json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return jsonschema_rs.Draft202012Validator({"$ref": ref, "components": doc["components"]}).is_valid(body)


# A value of another JSON type than the document's is refused, not coerced: a number or a string
# for a boolean, a boolean or a string for a number, a fraction for an integer
REFUSED = [
    ("/v1/completions", {"echo": 0}, "echo"),
    ("/v1/completions", {"echo": 0.0}, "echo"),
    ("/v1/completions", {"echo": "false"}, "echo"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"n": "1"}, "n"),
    ("/v1/completions", {"n": 1.5}, "n"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/completions", {"top_p": "1"}, "top_p"),
    ("/v1/completions", {"top_k": False}, "top_k"),
    ("/v1/completions", {"seed": "3"}, "seed"),
    ("/v1/completions", {"stream": 0}, "stream"),
    ("/v1/completions", {"stream": "true"}, "stream"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"stop": [True]}, "stop"),
    ("/v1/completions", {"model": 5}, "model"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/completions", {"starsd": {"speculate": 0}}, "starsd.speculate"),
    ("/v1/completions", {"starsd": {"max_draft_tokens": "1"}}, "starsd.max_draft_tokens"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
]

# What the document allows in another spelling is taken: an integer for a number, an integer
# written with a zero fraction (JSON Schema's integers include 5.0)
TAKEN = [
    ("/v1/completions", {"temperature": 1}),
    ("/v1/completions", {"temperature": 0.7, "top_p": 0.9, "seed": 3}),
    ("/v1/completions", {"top_p": 1}),
    ("/v1/completions", {"max_tokens": 2.0}),
    ("/v1/completions", {"n": 1.0}),
    ("/v1/completions", {"n": 1, "echo": False, "stream": False}),
    ("/v1/completions", {"prompt": [1.0, 2], "logprobs": 1.0}),
    ("/v1/completions", {"stop": "x"}),
    ("/v1/completions", {"stop": ["x", "yz"], "starsd": {"speculate": False, "max_draft_tokens": 0}}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.0}),
    ("/v1/chat/completions", {"logprobs": None, "top_k": 5.0}),
]


def _request(path: str, fields: dict) -> dict:
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    return {**base, "max_tokens": 2, **fields}


@pytest.mark.parametrize("path, fields, param", REFUSED, ids=[f"{p} {json.dumps(f)}" for p, f, _ in REFUSED])
def test_a_value_of_another_json_type_is_refused(client, path, fields, param):
    body = _request(path, fields)
    assert not _document_takes(client, path, body)
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": param, "code": None}}
    # the message names the value at fault by its path in the body
    where, _ = r.json()["error"]["message"].split(": ", 1)
    assert where.startswith(param.split(".")[0])
    value = body
    for part in where.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]


@pytest.mark.parametrize("path, fields", TAKEN, ids=[f"{p} {json.dumps(f)}" for p, f in TAKEN])
def test_what_the_document_allows_is_taken(client, path, fields):
    body = _request(path, fields)
    assert _document_takes(client, path, body)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _prompt_tokens(daemon, body: dict, chat: bool) -> int | None:
    """The prompt's length in tokens, as the server will count it (None: not a valid prompt)."""
    tok = daemon.loaded.tokenizer
    if chat:
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        return len(daemon.engine.encode(text))
    prompt = body["prompt"]
    if isinstance(prompt, list) and not isinstance(prompt[0], str):
        return len(prompt)  # token ids (JSON Schema's integers include 0.0, which the server takes too)
    return len(daemon.engine.encode(prompt if isinstance(prompt, str) else prompt[0]))


def test_schemathesis_finds_no_failures(api):
    """Both phases, every standard check on each answer (not_a_server_error, response_schema_conformance,
    negative_data_rejection and the rest); and enough answers of each kind to mean something."""
    seen: Counter = Counter()  # (phase, mode, path, status code) -> answers
    checked: Counter = Counter()  # check name -> answers it passed
    failures, errors = [], []
    # through Schemathesis' engine, as `schemathesis run` goes: its pytest loader for an app built in
    # a fixture (schemathesis.pytest.from_fixture) does not run under pytest 9
    for event in from_schema(api).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(event)
        if not isinstance(event, events.ScenarioFinished):
            continue
        recorder = event.recorder
        if event.status not in (Status.SUCCESS, Status.FAILURE):
            errors.append(f"{recorder.label} [{event.phase}]: {event.status} {event.skip_reason or ''}")
        for case_id, checks in recorder.checks.items():
            case = recorder.cases[case_id].value
            response = recorder.interactions[case_id].response
            seen[event.phase, case.meta.generation.mode, case.path, response and response.status_code] += 1
            for check in checks:
                if check.status == Status.SUCCESS:
                    checked[check.name] += 1
                else:
                    failure = check.failure_info and check.failure_info.failure
                    failures.append(f"{check.name} [{event.phase}] {case.method} {case.path} {case.body!r}: "
                                    f"{check.status} {failure and failure.title}: {failure and failure.message}")
    assert not errors, errors
    assert not failures, "\n".join(failures[:20])
    for name in ("not_a_server_error", "response_schema_conformance", "negative_data_rejection",
                 "positive_data_acceptance"):
        assert checked[name] > 100, checked
    for phase in (PhaseName.COVERAGE, PhaseName.FUZZING):
        for path in GENERATION_PATHS:
            assert seen[phase, GenerationMode.POSITIVE, path, 200] > 10, seen
            assert seen[phase, GenerationMode.NEGATIVE, path, 400] > 10, seen
