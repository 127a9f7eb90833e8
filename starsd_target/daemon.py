"""The target daemon: a loaded target model, its link to the draft daemon, and a job socket.

The job socket (GENERATE, STATS) serves the demo, the bench, `starsd-target status` and scripts
that speak the wire protocol. It takes jobs from anyone who can reach it, so it binds loopback or
ipc only, unless CURVE admits just the listed client keys (or --insecure-listen says plaintext
on purpose), as the draft daemon refuses a routable bind without CURVE."""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time

import zmq

from common import protocol as P
from common.models import LoadedModel, load_causal_lm, set_torch_threads
from common.runner import ModelRunner
from common.protocol import ErrorCode, Message, MsgType, ProtocolError
from common.sockets import WakingQueue, bind_server, check_server_endpoint
from common.verify import SamplingParams
from common.metrics import serve_metrics
from common.sdnotify import Watchdog, notify
from common.security import AllowList, optional_client_keys
from starsd_target.client import DraftClient, HandshakeTimeout
from starsd_target.config import TargetConfig
from starsd_target.engine import GenerationResult, TargetEngine
from starsd_target.metrics import TargetMetrics
from starsd_target.profile import RoundProfile
from starsd_target.scheduler import Job, Overloaded, Scheduler, SchedulerFailed, ShuttingDown

log = logging.getLogger("starsd.target")

# On a CPU, verifying every active generation's drafts in one forward costs more than a batched
# forward without drafts once several are active (each verified token is computed): with the
# demo pair on one core each, speculation gave 1.23x-1.54x the target alone with one generation,
# 0.80x-1.03x with two and 0.60x-0.77x with four (docs/bench.md). Two generations at once ran
# 1.18x faster without drafts than with them (median of 8 alternated bursts, faster in all 8).
CPU_DRAFT_MAX_ACTIVE = 1
# the job socket's loop wakes at once for a request, a reply or a stop, and at least this often
# for its other duties: the scheduler's health, systemd's watchdog, a key reload
CONTROL_POLL_MS = 100


class ServiceFailed(RuntimeError):
    """The scheduler died or stalled: the daemon stops serving and exits non-zero to be restarted."""


def check_listen(config: TargetConfig) -> None:
    """ValueError unless the job socket is safe to bind: loopback or ipc, CURVE, or insecure on purpose."""
    check_server_endpoint(config.listen, config.listen_curve_secret, config.listen_curve_allow, config.insecure_listen,
                          ("--listen-curve-secret", "--listen-curve-allow", "--insecure-listen"), "take jobs on")


class TargetDaemon:
    def __init__(self, config: TargetConfig, loaded: LoadedModel | None = None, ctx: zmq.Context | None = None):
        set_torch_threads(config.threads)
        check_listen(config)
        self.curve = optional_client_keys(config.curve_secret, config.curve_server_key)
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        self.loaded = loaded or load_causal_lm(config.model, config.device, config.dtype)
        self.engine = TargetEngine(self.loaded, depth=config.depth, prefill_chunk=config.prefill_chunk,
                                   runner=ModelRunner(self.loaded, compile=config.compile, lean=config.lean),
                                   max_batch=min(config.max_batch, config.max_active), rows=config.max_active,
                                   draft_tokens=config.draft_tokens)
        self.client: DraftClient | None = None
        self._stop = threading.Event()
        self._reload_keys = threading.Event()  # SIGHUP: re-read --listen-curve-allow
        self.allow: AllowList | None = None
        self.failure: ServiceFailed | None = None  # set when serving ended because the scheduler failed
        self._scheduler: Scheduler | None = None
        self.metrics = TargetMetrics(config.depth)
        self.served = 0
        self._replies: WakingQueue | None = None  # the job socket's replies, while it serves

    # ------------------------------------------------------------ draft link
    def _link(self) -> DraftClient:
        if self.client is None:
            self.client = DraftClient(self.config.draft, self.loaded.vocab_size, self.loaded.fingerprint,
                                      self.config.name, self.ctx, feature_size=self.loaded.feature_size,
                                      curve=self.curve, num_layers=self.loaded.num_layers)
        return self.client

    def connect(self) -> bool:
        """Wait up to ``connect_timeout_s`` for the draft link to come up, at start-up (before
        serving: the round loop itself never waits on the link). A refusal (mismatch) raises
        HandshakeRefused; silence only logs: generation proceeds with the target alone and the
        link keeps being retried in the background."""
        if self.config.draft is None:
            return False
        link = self._link()
        try:
            link.handshake(self.config.connect_timeout_s)
            return True
        except HandshakeTimeout as exc:
            log.warning("%s; generating with the target model alone until it answers", exc)
            return False

    def warm_up(self) -> float:
        """With --compile, compile the forwards serving uses before taking jobs. Called before
        connect() (so the draft link is not left silent for minutes of compiling), and again
        after it, which compiles the feature path only when the draft daemon's head needs the
        target's features (the rest is then already compiled). That second compile does leave
        the link silent: one longer than the draft daemon's --peer-ttl makes the first rounds
        run without drafts until the link is re-established."""
        welcome = self.client.welcome if self.client is not None else None
        if self.engine.runner.warm and not (welcome is not None and welcome.feature_size):
            return 0.0
        return self.engine.warm_up(features=bool(welcome is not None and welcome.feature_size),
                                   feature_layers=welcome.feature_layers if welcome is not None else None)

    # ------------------------------------------------------------ generation
    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            bos = getattr(self.loaded.tokenizer, "bos_token_id", None)
            if bos is None:
                raise ValueError("the prompt is empty")
            ids = [bos]
        return ids

    def generate(self, prompt: str | list[int], max_tokens: int, params: SamplingParams,
                 stop: list[str] | tuple[str, ...] = (), no_draft: bool = False) -> GenerationResult:
        """One generation in the calling thread (the one-off CLI path): the scheduler, driven
        here with this one job, instead of in its own thread as `serve` runs it."""
        return self.scheduler().run_one(self.job(prompt, max_tokens, params, stop, no_draft))

    # ------------------------------------------------------------ serving
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._scheduler = Scheduler(self.engine, self._scheduler_link, self.config.draft_timeout_s,
                                        max_active=self.config.max_active, max_queue=self.config.max_queue,
                                        heartbeat_s=self.config.heartbeat_s, stall_s=self.config.stall_timeout_s,
                                        adaptive_depth=self.config.adaptive_depth,
                                        adaptive_speculation=self.config.adaptive_speculation,
                                        draft_max_active=self.draft_max_active,
                                        admit_window_s=self.config.admit_window_s)
            self._scheduler.metrics = self.metrics
            self.metrics.watch(self._scheduler.profile)
        return self._scheduler

    @property
    def draft_max_active(self) -> int:
        """The most active generations whose rounds draft (0: no limit): the configured number, or
        by default CPU_DRAFT_MAX_ACTIVE on a CPU and no limit on an accelerator; 0 where the engine
        verifies one generation per forward (rounds without drafts would share no forward)."""
        if self.engine.max_batch <= 1:
            return 0
        if self.config.draft_max_active is not None:
            return self.config.draft_max_active
        return CPU_DRAFT_MAX_ACTIVE if self.engine.runner.device.type == "cpu" else 0

    def submit(self, job: Job):
        """Queue a job; Overloaded or ShuttingDown (counted as refused) when it cannot be taken."""
        try:
            return self.scheduler().submit(job)
        except (Overloaded, ShuttingDown):
            self.metrics.requests.labels(outcome="refused").inc()
            raise

    def _scheduler_link(self) -> DraftClient | None:
        return None if self.config.draft is None else self._link()

    def job(self, prompt: str | list[int], max_tokens: int, params: SamplingParams, stop=(), no_draft: bool = False,
            on_progress=None, max_draft: int | None = None, logprobs: int | None = None) -> Job:
        """A job for the scheduler, checked against the target's bounds (``TargetEngine.check``)
        before it queues: ValueError (InvalidRequest) for bad input, the same for every front end.
        ``max_draft`` caps its draft tokens per round (0..--draft-tokens; None: all); ``logprobs``: record
        each token's log-probability and that many alternatives (None: none)."""
        ids = self._prompt_ids(prompt)
        stop = tuple(stop or ())
        self.engine.check(ids, max_tokens, params, stop, max_draft, logprobs)
        return Job(ids, max_tokens, params, stop, no_draft=no_draft, max_draft=max_draft, logprobs=logprobs,
                   on_progress=on_progress)

    def healthy(self) -> bool:
        """The scheduler runs and makes passes: what /health and the systemd watchdog report."""
        return self._scheduler is not None and self._scheduler.healthy()

    def stop(self) -> None:
        self._stop.set()
        replies = self._replies
        if replies is not None:
            replies.wake()  # the job socket's loop sees the stop now, not at its next timeout

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        signal.signal(signal.SIGHUP, lambda *_: self._reload_keys.set())

    def serve_forever(self, ready: threading.Event | None = None, notify_ready: bool = True) -> None:
        """Take GENERATE jobs on a local ROUTER socket until stopped; generations run concurrently
        in the scheduler. On stop, jobs in progress finish and queued ones get SHUTTING_DOWN."""
        replies = self._replies = WakingQueue()  # filled by job callbacks, sent by this thread
        sched = self.scheduler()
        sched.start()
        if self.config.metrics_port is not None:
            serve_metrics(self.metrics.registry, self.config.metrics_port)
        sock, self.allow = bind_server(self.ctx, self.config.listen, self.config.listen_curve_secret,
                                       self.config.listen_curve_allow)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("target daemon taking jobs on %s (%s)", self.endpoint, "CURVE" if self.allow else "plaintext")
        if ready is not None:
            ready.set()
        if notify_ready:
            notify("READY=1", f"STATUS=taking jobs on {self.endpoint}")
        watchdog = Watchdog()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(replies.fd, zmq.POLLIN)  # a reply is sent the moment it is put
        pending = 0
        try:
            while not self._stop.is_set():
                if not sched.healthy():
                    self._fail(sched)
                    break
                if watchdog.due():
                    watchdog.tick()
                if self._reload_keys.is_set() and self.allow is not None:
                    self._reload_keys.clear()
                    self.allow.reload()
                events = dict(poller.poll(CONTROL_POLL_MS))
                if events.get(sock):
                    frames = sock.recv_multipart(copy=False)
                    pending += self._on_control(frames, replies)
                replies.clear()  # before taking the replies: one put after this wakes the next poll
                pending -= self._send_replies(sock, replies)
            notify("STOPPING=1", "STATUS=finishing jobs in progress")
            sched.stop(0.0 if self.failure else 60.0)  # queued jobs fail with SHUTTING_DOWN, running ones finish
            while sock.poll(0, zmq.POLLIN):  # requests that arrived meanwhile are refused
                pending += self._on_control(sock.recv_multipart(copy=False), replies)
            deadline = time.monotonic() + 5.0
            while pending > 0 and time.monotonic() < deadline:
                pending -= self._send_replies(sock, replies, wait_s=0.05)
            log.info("target daemon stopped")
        finally:
            # give the last replies (results, refusals) a moment to leave
            sock.close(linger=1000 if self._stop.is_set() or self.failure else 0)
            replies.close()
            if self.allow is not None:
                self.allow.stop()
            if self.client is not None and not (sched.thread is not None and sched.thread.is_alive()):
                self.client.close()  # the scheduler thread owns the link while it runs (ZeroMQ sockets are not thread-safe)

    def _fail(self, sched: Scheduler) -> None:
        """The scheduler died or stalled: stop serving, for the process to exit non-zero (and
        systemd to restart it) rather than look alive and serve nothing."""
        why = f"failed: {sched.failure!r}" if sched.failure is not None else "stalled"
        self.failure = ServiceFailed(f"the target's scheduler {why}; exiting to be restarted")
        log.critical("%s", self.failure)
        sched.abandon(SchedulerFailed(f"the target's scheduler {why}; the daemon is restarting"))
        notify(f"STATUS=scheduler {why}")

    @staticmethod
    def _send_replies(sock: zmq.Socket, replies: WakingQueue, wait_s: float = 0.0) -> int:
        sent = 0
        while True:
            try:
                identity, msg = replies.get(timeout=wait_s) if wait_s and not sent else replies.get_nowait()
            except queue.Empty:
                return sent
            try:
                sock.send_multipart([identity, *P.encode(msg)], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:
                log.warning("could not return a reply to its client: %s", exc)
            sent += 1

    def _on_control(self, frames: list, replies: WakingQueue) -> int:
        """Handle one control message; returns 1 (a reply will be queued) in every case."""
        identity = frames[0].bytes
        try:
            msg = P.decode(frames[1:])
            if msg.type is MsgType.STATS:
                replies.put((identity, Message(MsgType.STATS_REPLY, {"stats": self.status()})))
                return 1
            if msg.type is not MsgType.GENERATE:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{msg.type.name} is not a target request")
            h = msg.header
            rid = h["id"]
            prompt = h.get("prompt_ids") if "prompt_ids" in h else h.get("prompt")
            if prompt is None:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "GENERATE needs prompt or prompt_ids", rid)
            try:
                params = SamplingParams(float(h.get("temperature", 0.0)), int(h.get("top_k", 0)),
                                        float(h.get("top_p", 1.0)), h.get("seed"))
                job = self.job(prompt, h["max_tokens"], params, h.get("stop", ()), h.get("no_draft", False),
                               max_draft=h.get("max_draft_tokens"))
                future = self.submit(job)
            except ValueError as exc:
                raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc), rid) from None
            except Overloaded as exc:
                raise ProtocolError(ErrorCode.BUSY, str(exc), rid) from None
            except ShuttingDown as exc:
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, str(exc), rid) from None
            future.add_done_callback(lambda f: replies.put((identity, self._result_message(rid, f))))
        except ProtocolError as exc:
            replies.put((identity, P.error_from(exc)))
        except Exception as exc:  # a request this code did not foresee costs that request only
            log.exception("a job request failed")
            replies.put((identity, P.error(ErrorCode.INTERNAL, f"internal error: {exc}")))
        return 1

    def _result_message(self, rid: int, future) -> Message:
        exc = future.exception()
        if isinstance(exc, ShuttingDown):
            return P.error(ErrorCode.SHUTTING_DOWN, str(exc), rid)
        if exc is not None:
            return P.error(ErrorCode.GENERATION_FAILED, f"generation failed: {exc}", rid)
        result = future.result()
        self.served += 1
        return Message(MsgType.RESULT, {"id": rid, "text": result.text, "token_ids": result.token_ids,
                                        "stats": {**result.stats.to_dict(), "finish_reason": result.finish_reason}})

    def status(self) -> dict:
        sched = self._scheduler.load() if self._scheduler is not None else {}
        link = self.client.counters() if self.client is not None else {}
        runner = self.engine.runner
        profile = self._scheduler.profile.to_dict() if self._scheduler is not None else RoundProfile().to_dict()
        return {"served": self.served, "model": str(self.loaded.path),
                "compiled": runner.compiled, "compile_s": round(runner.compile_s, 3), "forward": runner.forward_kind,
                "max_batch": self.engine.max_batch, "batching_off": self.engine.batch_off,
                "draft_connected": self.client is not None and self.client.up, **sched, "draft_link": link,
                "round_profile": profile}
