"""The HTTP API's OpenAPI document is its true contract: Schemathesis (a schema-driven fuzzer)
generates valid and invalid requests from it, sends them to the app in process, and checks every
answer against the document (status codes declared, bodies matching their schemas, content types,
valid requests accepted, invalid ones refused) with no failures."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from common.models import load_causal_lm
from starsd_draftd.demo.byte_tokenizer import make_byte_tokenizer
from starsd_target.daemon import TargetConfig, TargetDaemon
from starsd_target.http_api import create_app
from tiny_models import make_tiny_checkpoint

CONTEXT = 128  # short generations: a valid request may ask for the whole context
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
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
    it as max_tokens' description tells it to; invalid requests are sent as generated."""
    daemon, app = served
    api = schemathesis.openapi.from_asgi("/openapi.json", app)

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
            case.body["max_tokens"] = min(case.body.get("max_tokens") or 16, left)
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


@pytest.fixture(scope="module")
def strategies(api):
    """Requests for every operation in the document, valid ones and invalid ones."""
    return {mode: api.as_strategy(generation_mode=mode) for mode in GenerationMode}


def test_schemathesis_finds_no_failures(strategies):
    """Every standard check on each answer; and enough answers of each kind to mean something."""
    seen: Counter = Counter()

    # Schemathesis' own pytest loader (schema.parametrize with a fixture) does not run under this
    # pytest, so its strategies are drawn here: the same cases, the same checks.
    @settings(max_examples=1200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def requests(data):
        mode = data.draw(st.sampled_from(list(GenerationMode)), label="mode")
        case = data.draw(strategies[mode], label="case")
        response = case.call_and_validate()
        seen[mode, case.path, response.status_code] += 1

    requests()
    for path in GENERATION_PATHS:
        assert seen[GenerationMode.POSITIVE, path, 200] > 50 and seen[GenerationMode.NEGATIVE, path, 400] > 50, seen
