"""OpenAI-compatible HTTP API of a target daemon (FastAPI): completions, chat completions, models,
health. Requests become scheduler jobs (first come, first served, each its own draft session);
bad requests get 400 in OpenAI's error shape; a full queue 429, a stopping daemon 503. Every
field is bounded here or by ``TargetEngine.check`` (the bounds the job socket applies too), and a
client that hangs up cancels its job."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from common.token_bytes import token_bytes
from common.verify import MAX_SEED, MAX_TOP_K, MIN_TEMPERATURE, SamplingParams
from starsd_target.api_schema import (ChatResponse, CompletionResponse, Health, ModelList, generation_responses,
                                      install_openapi)
from starsd_target.engine import (MAX_NEW_TOKENS, MAX_STOP_CHARS, MAX_STOP_STRINGS, Generation, GenerationResult,
                                  InvalidRequest, TokenLogprob)
from starsd_target.scheduler import Job, Overloaded, ShuttingDown

MAX_TOKENS_DEFAULT = 16
# The largest seed taken over HTTP: the largest integer a double holds exactly, as many JSON
# parsers and validators read numbers (JavaScript's MAX_SAFE_INTEGER). Near the wire's MAX_SEED a
# double cannot tell neighbouring integers apart, so a bound there is not the same bound for all.
MAX_HTTP_SEED = min(MAX_SEED, (1 << 53) - 1)
DISCONNECT_POLL_S = 0.25  # how often a waiting request looks whether its client is still there
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI bounds it
MAX_CHAT_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI bounds it
LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf is sent as (JSON has no infinity), as OpenAI does


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; its job was cancelled."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": type_, "param": param, "code": None}})


def _integral(value):
    """A float with no fraction as the integer it is: JSON Schema's integers include 5.0."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """An integer field's type, within ``bounds`` (Field's ge, le...), 5.0 taken as 5."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def only(value: bool | int):
    """A field's type that takes ``value`` alone, of its JSON type. A Literal is matched by
    Python's equality, under which 0 is false and true is 1: the type is checked first (a float
    with no fraction counting as an integer, as for ``integer``)."""

    def same_type(given):
        given = _integral(given) if type(value) is int else given
        if type(given) is not type(value):
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": json.dumps(value)})
        return given

    return Annotated[Literal[value], BeforeValidator(same_type)]


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class SpeculationOptions(BaseModel):
    """The request body's ``starsd`` object: how this request is speculated. Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)  # as the request: no coercion between JSON types

    speculate: bool = Field(default=True,
                            description="false: the target alone generates this request (no draft session)")
    max_draft_tokens: integer(ge=0) | None = Field(
        default=None, description="the most draft tokens a round verifies, 0..the target's --draft-tokens "
                                  "(0: none; at most --depth deep; above it, a tree); default: --draft-tokens")


class _Sampling(BaseModel):
    # strict: a value of another JSON type (false or "5" for a number, 1 for a boolean) is refused
    # with a 400, not coerced, so that the server takes exactly what its published schema says
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    # at most the model's context (the published schema says so), less the prompt (TargetEngine.check)
    max_tokens: integer(ge=1) | None = Field(
        default=None, description="at most the model's context less the prompt's tokens")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False,
                               description=f"0 (or below {MIN_TEMPERATURE}) is greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: integer(ge=0, le=MAX_TOP_K) = Field(default=0, description="0: off; at most the vocabulary size")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: integer(ge=0, le=MAX_HTTP_SEED) | None = None
    stream: bool = False
    n: only(1) = Field(default=1, description="one choice per request")
    starsd: SpeculationOptions | None = None

    def speculation(self) -> tuple[bool, int | None]:
        """(no_draft, max_draft) for the job, from the ``starsd`` object."""
        opts = self.starsd or SpeculationOptions()
        return not opts.speculate, opts.max_draft_tokens

    def logprob_count(self) -> int | None:
        """Alternatives per token whose log-probabilities the response carries (None: no logprobs)."""
        return None

    def params(self) -> SamplingParams:
        """The sampling parameters; a temperature too small to divide logits by is greedy."""
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        return SamplingParams(temperature, self.top_k, self.top_p, self.seed)

    def stops(self) -> tuple[str, ...]:
        """The stop strings as a tuple (their bounds are checked with the rest of the job's)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    # text, one text in a list, or token ids (within the vocabulary); one prompt per request
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                             Field(min_length=1, max_length=1)]
             | Annotated[list[integer(ge=0)], Field(min_length=1)])
    logprobs: integer(ge=0, le=MAX_COMPLETION_LOGPROBS) | None = Field(
        default=None, description="the log-probabilities of each token and of this many most likely alternatives")
    echo: only(False) = Field(default=False, description="not supported: false or absent")

    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None  # null or false: none
    top_logprobs: integer(ge=0, le=MAX_CHAT_TOP_LOGPROBS) | None = Field(
        default=None, description="with logprobs true: this many most likely alternatives per token "
                                  "(without it, no log-probabilities are returned)")

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _usage(prompt_tokens: int, result: GenerationResult) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt_tokens + len(result.token_ids),
            "prompt_tokens_details": {"cached_tokens": result.stats.cached_prompt_tokens}}


class _Stream:
    """Text deltas of a generation as it grows, safe to send: the generation's own final text so
    far (``Generation.text_so_far``: no trailing partial character), less the tail a stop string
    might still claim."""

    def __init__(self, stops: tuple[str, ...]):
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def delta(self, gen: Generation) -> str:
        text = gen.text_so_far()
        safe = text[: len(text) - self.hold] if self.hold else text
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        out, self.sent = safe[len(self.sent):], safe
        return out

    def final(self, text: str) -> str:
        return text[len(self.sent):] if text.startswith(self.sent) else ""


class _Logprobs:
    """A generation's token log-probabilities in OpenAI's shapes: completions' ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (the alternatives and the chosen token, by token
    string) and ``text_offset``; chat's ``content`` list of ``token``, ``logprob``, ``bytes``
    and ``top_logprobs``. One per response: it renders each token once, in order, and keeps
    the text offset across a stream's chunks. A token that is part of a character is named
    ``bytes:\\xNN...``, as OpenAI names it, and its offset is where that character starts
    (an undecodable byte's replacement character is counted from the next token on)."""

    WINDOW = 6  # tokens decoded before each one to find the text it adds

    def __init__(self, tokenizer, kind: str):
        self.tokenizer, self.kind = tokenizer, kind
        self.ids: list[int] = []  # the tokens rendered so far
        self.offset = 0  # characters of text before the next token
        self._names: dict[int, tuple[str, list[int]]] = {}

    def _name(self, tok: int) -> tuple[str, list[int]]:
        """The token's string and its bytes."""
        if tok not in self._names:
            if self.tokenizer is None:
                self._names[tok] = (f"token_id:{tok}", [])
            else:
                raw = token_bytes(self.tokenizer, tok)
                try:
                    name = raw.decode("utf-8")
                except UnicodeDecodeError:
                    name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                self._names[tok] = (name, list(raw))
        return self._names[tok]

    def _added_text(self, tok: int) -> str:
        """The characters ``tok`` adds to the text decoded so far (none while it ends inside a
        character), from a few preceding tokens rather than the whole output."""
        if self.tokenizer is None:
            return ""
        window = self.ids[-self.WINDOW:]
        before = self.tokenizer.decode(window, skip_special_tokens=True).rstrip("\ufffd")
        after = self.tokenizer.decode([*window, tok], skip_special_tokens=True).rstrip("\ufffd")
        return after[len(before):] if after.startswith(before) else ""

    def take(self, entries: list[TokenLogprob] | None, chars: int | None = None) -> dict | None:
        """The entries not rendered yet, rendered; with ``chars``, only those whose text ends
        within the first ``chars`` characters (what a stream has sent). None when there are none."""
        rendered = []
        for e in (entries or [])[len(self.ids):]:
            added = self._added_text(e.token)
            if chars is not None and self.offset + len(added) > chars:
                break
            rendered.append((e, self.offset))
            self.ids.append(e.token)
            self.offset += len(added)
        if not rendered:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e, _ in rendered], "refusal": None}
        return {"tokens": [self._name(e.token)[0] for e, _ in rendered],
                "token_logprobs": [_finite(e.logprob) for e, _ in rendered],
                "top_logprobs": [{**{self._name(t)[0]: _finite(v) for t, v in e.top},
                                  self._name(e.token)[0]: _finite(e.logprob)} for e, _ in rendered],
                "text_offset": [offset for _, offset in rendered]}

    def _chat_entry(self, e: TokenLogprob) -> dict:
        name, raw = self._name(e.token)
        top = []
        for t, v in e.top:
            alt, alt_raw = self._name(t)
            top.append({"token": alt, "logprob": _finite(v), "bytes": alt_raw})
        return {"token": name, "logprob": _finite(e.logprob), "bytes": raw, "top_logprobs": top}


def _request_param(engine_param: str | None) -> str | None:
    """The request field an engine bound names (``InvalidRequest.param``): the same name, but for
    the speculation cap, which the request carries inside its ``starsd`` object."""
    return "starsd.max_draft_tokens" if engine_param == "max_draft_tokens" else engine_param


def _body_path(error: dict, body: Any) -> list[str]:
    """Where a validation error lies in the request body, as field names and list indices. Pydantic's
    ``loc`` also names the member of a union it tried (``constrained-str``...), which is no part of
    the body; a field that is missing is named although the body has no such key."""
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    path, value = [], body
    for i, part in enumerate(loc):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif not (error.get("type") == "missing" and i == len(loc) - 1):
            continue
        path.append(str(part))
    return path


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _outcome(job: Job) -> asyncio.Future:
    """The job's future on the event loop. A request that stops waiting for it (its client hung
    up) leaves the outcome unread: it is marked read, so asyncio does not log it as lost."""
    wrapped = asyncio.wrap_future(job.future)
    wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())
    return wrapped


def create_app(daemon, model_name: str) -> "BodyLimit":
    """The HTTP front end of ``daemon`` (a TargetDaemon whose scheduler runs): the FastAPI app
    (``.app``) behind the request-body limit."""
    app = FastAPI(title="StarSD target", version="1")
    tokenizer = daemon.loaded.tokenizer
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = _body_path(first, exc.body)
        # param: the top-level field, as OpenAI's; inside the starsd object, its key too
        param = loc[0] if loc else None
        if param == "starsd" and len(loc) > 1:
            param = f"starsd.{loc[1]}"
        where = ".".join(loc) if loc else "invalid request body"
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        """Unknown paths (404) and methods (405, with Allow) in the same error shape."""
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers)

    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": Health}})
    async def health():
        """200 while the scheduler runs; 503 once it died or stalled (the daemon then exits)."""
        status = daemon.status()
        if not daemon.healthy():
            return JSONResponse(status_code=503, content={"status": "unhealthy", **status})
        return {"status": "ok", **status}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "starsd"}]}

    def _submit(prompt_ids: list[int], req: _Sampling, on_progress=None) -> Job:
        if req.model is not None and req.model != model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model")
        no_draft, max_draft = req.speculation()
        try:
            job = daemon.job(prompt_ids, req.max_tokens or MAX_TOKENS_DEFAULT, req.params(), req.stops(),
                             no_draft=no_draft, on_progress=on_progress, max_draft=max_draft,
                             logprobs=req.logprob_count())
            daemon.submit(job)
            return job
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param=_request_param(exc.param)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        except Overloaded as exc:
            raise ApiError(429, f"server busy: {exc}", "rate_limit_error") from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), "server_error") from None

    def _encode_prompt(prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
        ids = daemon.engine.encode(prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    async def _run(request: Request, prompt_ids: list[int], req: _Sampling, kind: str):
        """A finished response, or a streaming one; ``kind`` is "text" or "chat"."""
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        now = int(time.time())
        logprobs = _Logprobs(tokenizer, kind) if req.logprob_count() is not None else None
        if not req.stream:
            result = await _await(request, _submit(prompt_ids, req))
            choice = {"index": 0, "finish_reason": result.finish_reason,
                      "logprobs": logprobs.take(result.logprobs) if logprobs is not None else None}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": now, "model": model_name, "choices": [choice],
                    "usage": _usage(len(prompt_ids), result), "starsd": result.stats.to_dict()}
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        stream = _Stream(req.stops())

        def on_progress(gen: Generation) -> None:  # scheduler thread
            text = stream.delta(gen)
            if text:
                lp = logprobs.take(gen.token_logprobs(), len(stream.sent)) if logprobs is not None else None
                loop.call_soon_threadsafe(deltas.put_nowait, (text, lp))

        job = _submit(prompt_ids, req, on_progress)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False, lp: dict | None = None) -> str:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            """The chunks as the generation grows. However the stream ends early (the client
            hung up, the server closed the response), the job is cancelled with it."""
            wrapped = _outcome(job)
            try:
                yield chunk("", None, first=True)
                while True:
                    getter = asyncio.ensure_future(deltas.get())
                    try:
                        done = await _wait(request, job, getter, wrapped)
                    finally:
                        getter.cancel()
                    if getter in done:
                        text, lp = getter.result()
                        yield chunk(text, None, lp=lp)
                        continue
                    break
                while not deltas.empty():
                    text, lp = deltas.get_nowait()
                    yield chunk(text, None, lp=lp)
                try:
                    result = wrapped.result()
                except Exception as exc:  # the generation failed after streaming began
                    err = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                rest = logprobs.take(result.logprobs) if logprobs is not None else None
                yield chunk(stream.final(result.text), result.finish_reason, lp=rest)
                yield "data: [DONE]\n\n"
            except ClientGone:
                return
            finally:
                if not job.future.done():
                    job.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _wait(request: Request, job: Job, *waitables) -> set:
        """Those of ``waitables`` done first; ClientGone, with the job cancelled, if the client
        disconnects meanwhile (looked at every DISCONNECT_POLL_S)."""
        while True:
            done, _ = await asyncio.wait(waitables, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if done:
                return done
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone()

    async def _await(request: Request, job: Job) -> GenerationResult:
        wrapped = _outcome(job)
        try:
            await _wait(request, job, wrapped)
            return wrapped.result()
        except ClientGone:
            raise ApiError(499, "the client closed the request", "cancelled") from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), "server_error") from None
        except InvalidRequest as exc:  # the request, checked as its job started: the client's to fix
            raise ApiError(400, str(exc), param=_request_param(exc.param)) from None
        except Exception as exc:  # the generation failed in the server (NaN logits, a tokenizer error...)
            raise ApiError(500, f"generation failed: {exc}", "server_error") from None

    @app.post("/v1/completions", response_model=None, responses=generation_responses(CompletionResponse))
    async def completions(req: CompletionRequest, request: Request):
        # tokenizing a long prompt takes a while: off the event loop, which serves everyone
        return await _run(request, await run_in_threadpool(_encode_prompt, req.prompt), req, "text")

    # listed in the API's document only where it can succeed: with a chat template
    @app.post("/v1/chat/completions", response_model=None, responses=generation_responses(ChatResponse),
              include_in_schema=bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)))
    async def chat(req: ChatRequest, request: Request):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"model {model_name!r} has no chat template; use /v1/completions", param="messages")

        def encode() -> list[int]:
            text = tokenizer.apply_chat_template([m.model_dump() for m in req.messages], tokenize=False,
                                                 add_generation_prompt=True)
            return _encode_prompt(text)

        return await _run(request, await run_in_threadpool(encode), req, "chat")

    install_openapi(app, daemon.loaded.logits_size, daemon.engine.context, MAX_NEW_TOKENS, daemon.engine.round_tokens)
    limited = BodyLimit(app, max_body_bytes(daemon.engine.context))
    key = getattr(daemon.config, "api_key", None)
    if not key:
        return limited
    return ApiKey(limited, key, parse_paths(getattr(daemon.config, "api_open_paths", None)))


def max_body_bytes(context: int | None) -> int:
    """The largest request body taken: room for a prompt filling the context (as text or as ids,
    64 bytes a token), at least 1 MiB; 16 MiB for a model that declares no context."""
    return 16 << 20 if context is None else max(1 << 20, 64 * context)


class BodyLimit:
    """ASGI middleware: a request body larger than ``max_bytes`` is answered 413 before any of it
    is parsed (uvicorn sets no limit of its own); a smaller one is read, then handed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                body = json.dumps({"error": {"message": f"the request body exceeds {self.max_bytes} bytes",
                                             "type": "invalid_request_error", "param": None, "code": None}})
                await send({"type": "http.response.start", "status": 413,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body.encode()})
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what comes after the body: a disconnect, say
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def parse_paths(spec: str | None) -> frozenset[str]:
    """The paths named in ``spec``, separated by commas or spaces (each starting with /)."""
    paths = frozenset(p for p in re.split(r"[,\s]+", spec or "") if p)
    bad = [p for p in paths if not p.startswith("/")]
    if bad:
        raise ValueError(f"API paths start with '/': {', '.join(sorted(bad))}")
    return paths


class ApiKey:
    """ASGI middleware: every request but those to ``open_paths`` carries ``Authorization: Bearer
    <key>``, as OpenAI's clients send it; without it, or with another key (compared in constant
    time), 401 in OpenAI's error shape. The key itself is never logged or echoed."""

    def __init__(self, app, key: str, open_paths: frozenset[str] = frozenset()):
        self.app = app
        self._key = key.strip().encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)  # lifespan events, and the open paths
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        message = ("You didn't provide an API key: send it as 'Authorization: Bearer <key>'" if not given
                   else "Incorrect API key provided")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
