"""The HTTP API's published contract: response and error models, and the OpenAPI document that
declares what the server really answers (400 in OpenAI's error shape, never FastAPI's 422) and the
bounds of the model it serves (vocabulary, context) where the request models cannot know them."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field


class ErrorObject(BaseModel):
    message: str
    type: str  # invalid_request_error, rate_limit_error, server_error
    param: str | None  # the request field at fault, when one is
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object, the body of every 4xx and 5xx answer."""

    error: ErrorObject


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """The ``responses`` of a route for the error statuses it can answer."""
    return {status: {"model": ErrorResponse, "description": ERROR_MEANINGS[status]} for status in statuses}


ERROR_MEANINGS = {
    400: "The request is invalid: a field out of bounds, malformed JSON, a prompt beyond the context",
    404: "The model named is not the one this server serves",
    413: "The request body exceeds the server's limit",
    429: "The server's job queue is full; try again later",
    500: "The generation failed in the server (the request's own job only; the server goes on)",
    503: "The server is shutting down, or its scheduler failed and it is restarting",
}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens taken from a recent prompt's kept keys and values "
                                           "(--prefix-cache-mib), not prefilled")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Per generated token: its string, log-probability, the most likely alternatives (token
    string to log-probability, the chosen token included) and where its text starts."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    starsd: dict[str, Any]  # the generation's speculation statistics (GenerationStats)


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    starsd: dict[str, Any]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")  # and the daemon's load and link counters

    status: Literal["ok", "unhealthy"]


# One server-sent event of a stream: a chunk as JSON, an error object if the generation fails
# after streaming began, then "[DONE]".
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict]:
    """A generation route's answers: ``model`` as JSON, or (``stream``) server-sent events."""
    return {200: {"model": model, "description": "The generation; with stream, server-sent events of its chunks",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **error_responses(400, 404, 413, 429, 500, 503)}


def install_openapi(app: FastAPI, vocab: int, context: int | None, max_new_tokens: int, depth: int) -> None:
    """Make ``app.openapi()`` the server's true contract: FastAPI's 422 and its validation-error
    models dropped (the server answers 400), and the served model's bounds as JSON-schema
    constraints: token ids and top_k within the vocabulary, max_tokens within the context,
    ``starsd.max_draft_tokens`` within the draft tokens the target verifies per round."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in doc["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            _bound(schemas, vocab, context, max_new_tokens, depth)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def _bound(schemas: dict, vocab: int, context: int | None, max_new_tokens: int, depth: int) -> None:
    most_tokens = context - 1 if context is not None else max_new_tokens  # a prompt holds one token at least
    for branch in _branches(schemas.get("SpeculationOptions", {}).get("properties", {}).get("max_draft_tokens", {})):
        if branch.get("type") == "integer":
            branch["maximum"] = depth
    for name in ("CompletionRequest", "ChatRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for branch in _branches(props.get("max_tokens", {})):
            if branch.get("type") == "integer":
                branch["maximum"] = most_tokens
        for branch in _branches(props.get("top_k", {})):
            branch["maximum"] = min(branch.get("maximum", vocab), vocab)
        for branch in _branches(props.get("prompt", {})):
            if branch.get("type") == "array" and branch.get("items", {}).get("type") == "integer":
                branch["items"]["maximum"] = vocab - 1
                if context is not None:
                    branch["maxItems"] = context - 1


def _branches(prop: dict) -> list[dict]:
    """A property's schema, or each branch of its anyOf."""
    return prop.get("anyOf", [prop])
