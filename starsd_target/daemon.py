"""The target daemon: a loaded target model, its link to the draft daemon, its scheduler, and
the jobs its front ends (the job socket in jobs.py, the HTTP API in http_api.py) bring."""

from __future__ import annotations

import logging
import platform
import signal
import threading

import zmq

from common.memory import memory_report
from common.models import LoadedModel, load_causal_lm, set_torch_threads
from common.runner import ModelRunner
from common.security import optional_client_keys
from common.sockets import check_server_endpoint
from common.verify import SamplingParams
from starsd_target.client import HandshakeTimeout
from starsd_target.config import TargetConfig
from starsd_target.engine import GenerationResult, TargetEngine
from starsd_target.jobs import JobSocket, ServiceFailed
from starsd_target.metrics import TargetMetrics
from starsd_target.pool import DraftPool
from starsd_target.profile import RoundProfile
from starsd_target.scheduler import Job, Overloaded, Scheduler, ShuttingDown

log = logging.getLogger("starsd.target")

# On a CPU, verifying every active generation's drafts in one forward costs more than a batched
# forward without drafts once several are active (each verified token is computed): with the
# demo pair on one core each, speculation gave 1.23x-1.54x the target alone with one generation,
# 0.80x-1.03x with two and 0.60x-0.77x with four (docs/bench.md). Two generations at once ran
# 1.18x faster without drafts than with them (median of 8 alternated bursts, faster in all 8).
CPU_DRAFT_MAX_ACTIVE = 1


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
                                   draft_tokens=config.draft_tokens,
                                   prefix_cache_bytes=config.prefix_cache_mib << 20)
        if config.pause_unpaid_drafts and not config.adaptive_depth:
            log.warning("--pause-unpaid-drafts does nothing with --no-adaptive-depth: every round drafts")
        elif config.pause_unpaid_drafts and self.engine.tree_tokens > self.engine.depth:
            log.warning("--pause-unpaid-drafts does not apply to tree rounds (--draft-tokens above --depth)")
        if config.fill_steps and not config.adaptive_depth:
            log.warning("--fill-steps does nothing with --no-adaptive-depth: the steps are judged by its measurements")
        elif config.fill_steps and self.engine.tree_tokens > self.engine.depth:
            log.warning("--fill-steps does not apply to tree rounds (--draft-tokens above --depth)")
        self.client: DraftPool | None = None  # the draft daemons' links
        self._scheduler: Scheduler | None = None
        self.metrics = TargetMetrics(config.depth)
        self.metrics.watch_links(lambda: self.client.counters() if self.client is not None else None)
        self.jobs = JobSocket(self)

    # ------------------------------------------------------------ draft link
    def _link(self) -> DraftPool:
        if self.client is None:
            self.client = DraftPool(self.config.draft, self.loaded.vocab_size, self.loaded.fingerprint,
                                    self.config.name, self.ctx, feature_size=self.loaded.feature_size,
                                    curve=self.curve, num_layers=self.loaded.num_layers,
                                    resolve_interval_s=self.config.draft_resolve_interval_s,
                                    heartbeat_s=self.config.heartbeat_s, patience=self.config.draft_patience,
                                    ack_floor_s=self.config.ack_timeout_s)
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
                                        pause_unpaid_drafts=self.config.pause_unpaid_drafts,
                                        fill_steps=self.config.fill_steps,
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

    def _scheduler_link(self) -> DraftPool | None:
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

    def close_link(self) -> None:
        """Close the draft link, unless the scheduler's thread still runs: it owns the link while
        it runs (ZeroMQ sockets are not thread-safe)."""
        sched = self._scheduler
        if self.client is not None and not (sched is not None and sched.thread is not None and sched.thread.is_alive()):
            self.client.close()

    # ------------------------------------------------------------ serving: the job socket (jobs.py)
    def serve_forever(self, ready: threading.Event | None = None, notify_ready: bool = True) -> None:
        """Serve the job socket until stopped (see JobSocket.serve)."""
        self.jobs.serve(ready, notify_ready)

    def stop(self) -> None:
        self.jobs.stop()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.jobs.stop())
        signal.signal(signal.SIGHUP, lambda *_: self.jobs.reload_keys())

    @property
    def endpoint(self) -> str | None:
        return self.jobs.endpoint

    @property
    def served(self) -> int:
        """Results the job socket has sent."""
        return self.jobs.served

    @property
    def failure(self) -> ServiceFailed | None:
        """Set when serving ended because the scheduler failed or stalled."""
        return self.jobs.failure

    def status(self) -> dict:
        sched = self._scheduler.load() if self._scheduler is not None else {}
        link = self.client.counters() if self.client is not None else {}
        runner = self.engine.runner
        profile = self._scheduler.profile.to_dict() if self._scheduler is not None else RoundProfile().to_dict()
        return {"served": self.served, "model": str(self.loaded.path), "dtype": self.loaded.dtype_name,
                "machine": platform.machine(),
                "memory": memory_report(self.loaded.weights_bytes), "compiled": runner.compiled, "compile_s": round(runner.compile_s, 3), "forward": runner.forward_kind,
                "max_batch": self.engine.max_batch, "batching_off": self.engine.batch_off,
                "draft_connected": self.client is not None and self.client.up, **sched, "draft_link": link,
                "round_profile": profile, "prefix_cache": self.engine.prefix.snapshot()}
