"""OpenAI-compatible HTTP API of a target daemon (FastAPI): completions, chat completions, models,
health. Requests become scheduler jobs (first come, first served, each its own draft session);
bad requests get 400 in OpenAI's error shape; a full queue 429, a stopping daemon 503."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from common.verify import SamplingParams
from starsd_target.engine import Generation, GenerationResult
from starsd_target.scheduler import Overloaded, ShuttingDown

MAX_TOKENS_DEFAULT = 16


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": None}})


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # an extension many servers accept
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    n: int = 1

    def checked(self) -> None:
        if self.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")

    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop takes up to 4 non-empty strings", param="stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def _usage(prompt_tokens: int, result: GenerationResult) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt_tokens + len(result.token_ids)}


class _Stream:
    """Text deltas of a generation as it grows, safe to send: held back are a trailing partial
    character (byte-level tokens) and the tail a stop string might still claim."""

    def __init__(self, decode, stops: tuple[str, ...]):
        self.decode = decode
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def delta(self, gen: Generation) -> str:
        text = self.decode(gen.out).rstrip("\ufffd")
        safe = text[: len(text) - self.hold] if self.hold else text
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        out, self.sent = safe[len(self.sent):], safe
        return out

    def final(self, text: str) -> str:
        return text[len(self.sent):] if text.startswith(self.sent) else ""


def create_app(daemon, model_name: str) -> FastAPI:
    """The HTTP front end of ``daemon`` (a TargetDaemon whose scheduler runs)."""
    app = FastAPI(title="StarSD target", version="1")
    tokenizer = daemon.loaded.tokenizer
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else "invalid request body",
                      "invalid_request_error", loc or None)

    @app.get("/health")
    async def health():
        status = daemon.status()
        return {"status": "ok", **status}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "starsd"}]}

    def _submit(prompt_ids: list[int], req: _Sampling, on_progress=None):
        req.checked()
        if req.model is not None and req.model != model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model")
        try:
            job = daemon.job(prompt_ids, req.max_tokens or MAX_TOKENS_DEFAULT, req.params(), req.stops(),
                             on_progress=on_progress)
            return daemon.submit(job)
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

    async def _run(prompt_ids: list[int], req: _Sampling, kind: str):
        """A finished response, or a streaming one; ``kind`` is "text" or "chat"."""
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        now = int(time.time())
        if not req.stream:
            future = _submit(prompt_ids, req)
            result = await _await(future)
            choice = {"index": 0, "finish_reason": result.finish_reason}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice.update(text=result.text, logprobs=None)
            return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": now, "model": model_name, "choices": [choice],
                    "usage": _usage(len(prompt_ids), result), "starsd": result.stats.to_dict()}
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        stream = _Stream(daemon.engine.decode, req.stops())

        def on_progress(gen: Generation) -> None:  # scheduler thread
            text = stream.delta(gen)
            if text:
                loop.call_soon_threadsafe(deltas.put_nowait, text)

        future = _submit(prompt_ids, req, on_progress)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            yield chunk("", None, first=True)
            wrapped = asyncio.wrap_future(future)
            while True:
                getter = asyncio.ensure_future(deltas.get())
                done, _ = await asyncio.wait({getter, wrapped}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield chunk(getter.result(), None)
                    continue
                getter.cancel()
                break
            while not deltas.empty():
                yield chunk(deltas.get_nowait(), None)
            try:
                result = wrapped.result()
            except Exception as exc:  # the generation failed after streaming began
                err = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(err)}\n\n"
                return
            yield chunk(stream.final(result.text), result.finish_reason)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _await(future) -> GenerationResult:
        try:
            return await asyncio.wrap_future(future)
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), "server_error") from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.logprobs is not None or req.echo:
            raise ApiError(400, "logprobs and echo are not supported", param="logprobs" if req.logprobs else "echo")
        return await _run(_encode_prompt(req.prompt), req, "text")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"model {model_name!r} has no chat template; use /v1/completions", param="messages")
        text = tokenizer.apply_chat_template([m.model_dump() for m in req.messages], tokenize=False,
                                             add_generation_prompt=True)
        return await _run(_encode_prompt(text), req, "chat")

    return app
