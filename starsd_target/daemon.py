"""The target daemon: a loaded target model, its link to the draft daemon, and a local control socket."""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from common import protocol as P
from common.models import LoadedModel, load_causal_lm, set_torch_threads
from common.protocol import ErrorCode, Message, MsgType, ProtocolError
from common.sockets import SocketOptions, make_socket
from common.verify import SamplingParams
from common.security import client_keys
from starsd_target.client import DraftClient, HandshakeTimeout, RemoteDraftSession
from starsd_target.engine import GenerationResult, TargetEngine

log = logging.getLogger("starsd.target")


@dataclass
class TargetConfig:
    model: str = "demo"
    draft: str | None = "tcp://127.0.0.1:5555"  # None: generate with the target alone
    device: str = "cpu"
    dtype: str = "auto"
    depth: int = 5
    draft_timeout_s: float = 2.0
    connect_timeout_s: float = 10.0
    threads: int = 1
    name: str = ""
    listen: str = "tcp://127.0.0.1:5600"
    heartbeat_s: float = 5.0
    curve_secret: Path | None = None  # this target's .key_secret file
    curve_server_key: Path | None = None  # the draft daemon's public .key file


class TargetDaemon:
    def __init__(self, config: TargetConfig, loaded: LoadedModel | None = None, ctx: zmq.Context | None = None):
        set_torch_threads(config.threads)
        if (config.curve_secret is None) != (config.curve_server_key is None):
            raise ValueError("CURVE needs both --curve-secret and --curve-server-key")
        self.curve = client_keys(config.curve_secret, config.curve_server_key) if config.curve_secret else None
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        self.loaded = loaded or load_causal_lm(config.model, config.device, config.dtype)
        self.engine = TargetEngine(self.loaded, depth=config.depth)
        self.client: DraftClient | None = None
        self._sessions = itertools.count(1)
        self._stop = threading.Event()
        self.served = 0

    # ------------------------------------------------------------ draft link
    def _link(self) -> DraftClient:
        if self.client is None:
            self.client = DraftClient(self.config.draft, self.loaded.vocab_size, self.loaded.fingerprint,
                                      self.config.name, self.ctx, feature_size=self.loaded.feature_size,
                                      curve=self.curve)
        return self.client

    def connect(self) -> bool:
        """Handshake with the draft daemon at start-up. A refusal (mismatch) raises
        HandshakeRefused; silence only logs: generation proceeds with the target alone and the
        link keeps being retried."""
        if self.config.draft is None:
            return False
        link = self._link()
        try:
            link.handshake(self.config.connect_timeout_s)
            return True
        except HandshakeTimeout as exc:
            log.warning("%s; generating with the target model alone until it answers", exc)
            return False

    def _draft_source(self, params: SamplingParams, no_draft: bool):
        if no_draft or self.config.draft is None:
            return None
        return RemoteDraftSession(self._link(), next(self._sessions), params, self.config.draft_timeout_s)

    # ------------------------------------------------------------ generation
    def generate(self, prompt: str | list[int], max_tokens: int, params: SamplingParams,
                 stop: list[str] | tuple[str, ...] = (), no_draft: bool = False) -> GenerationResult:
        ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            bos = getattr(self.loaded.tokenizer, "bos_token_id", None)
            if bos is None:
                raise ValueError("the prompt is empty")
            ids = [bos]
        return self.engine.generate(ids, max_tokens, params, self._draft_source(params, no_draft), stop)

    # ------------------------------------------------------------ control socket
    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def serve_forever(self, ready: threading.Event | None = None) -> None:
        """Take GENERATE jobs on a local ROUTER socket, one at a time, until stopped. On stop the
        job in progress finishes; jobs already received but not started get SHUTTING_DOWN."""
        sock = make_socket(self.ctx, zmq.ROUTER, SocketOptions())
        sock.bind(self.config.listen)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("target daemon taking jobs on %s", self.endpoint)
        if ready is not None:
            ready.set()
        next_beat = time.monotonic() + self.config.heartbeat_s
        try:
            while not self._stop.is_set():
                if self.client is not None and time.monotonic() >= next_beat:
                    self.client.heartbeat()
                    next_beat = time.monotonic() + self.config.heartbeat_s
                if not sock.poll(100, zmq.POLLIN):
                    continue
                self._answer(sock, sock.recv_multipart(copy=False), self._handle)
            refused = 0
            while sock.poll(0, zmq.POLLIN):
                self._answer(sock, sock.recv_multipart(copy=False), _refuse_shutting_down)
                refused += 1
            log.info("target daemon stopped (%d queued job(s) refused)", refused)
        finally:
            # give the last replies (results, refusals) a moment to leave
            sock.close(linger=1000 if self._stop.is_set() else 0)
            if self.client is not None:
                self.client.close()

    @staticmethod
    def _answer(sock: zmq.Socket, frames: list, handler) -> None:
        identity = frames[0].bytes
        try:
            reply = handler(P.decode(frames[1:]))
        except ProtocolError as exc:
            reply = P.error_from(exc)
        try:
            sock.send_multipart([identity, *P.encode(reply)], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("could not return a reply to its client: %s", exc)

    def _handle(self, msg: Message) -> Message:
        h = msg.header
        if msg.type is MsgType.STATS:
            return Message(MsgType.STATS_REPLY, {"stats": {
                "served": self.served, "model": str(self.loaded.path),
                "draft_connected": self.client is not None and self.client.up}})
        if msg.type is not MsgType.GENERATE:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{msg.type.name} is not a target request")
        rid = h["id"]
        prompt = h.get("prompt_ids") if "prompt_ids" in h else h.get("prompt")
        if prompt is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "GENERATE needs prompt or prompt_ids", rid)
        try:
            params = SamplingParams(float(h.get("temperature", 0.0)), int(h.get("top_k", 0)),
                                    float(h.get("top_p", 1.0)), h.get("seed"))
            result = self.generate(prompt, h["max_tokens"], params, h.get("stop", ()), h.get("no_draft", False))
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc), rid) from None
        except Exception as exc:  # one failed job must not take the daemon down
            log.exception("generation %d failed", rid)
            raise ProtocolError(ErrorCode.GENERATION_FAILED, f"generation failed: {exc}", rid) from None
        self.served += 1
        return Message(MsgType.RESULT, {"id": rid, "text": result.text, "token_ids": result.token_ids,
                                        "stats": {**result.stats.to_dict(), "finish_reason": result.finish_reason}})


def _refuse_shutting_down(msg: Message) -> Message:
    raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the target daemon is shutting down", msg.header.get("id"))
