"""Many generations on one target model, interleaved so the target never idles on the network.

One thread owns the model and the draft link. Each pass it sends draft requests for every
generation that needs one, collects whatever replies have arrived, and verifies one generation
whose drafts are in (or whose deadline passed: that round runs without drafts). While one
generation waits for its drafts, another is verified: work conservation at the target, the
mirror of the draft daemon's. Jobs are admitted first come, first served.

A generation whose drafts are still on their way, on a target with nothing else to run, may take
a step of its own meanwhile (a fill step, ``--fill-steps``, where its measured costs say it pays:
``starsd_target.depth``); the drafts then count only if they begin with the fill steps' tokens,
and those are not verified again.

A long prompt is prefilled one chunk per pass, between the other generations' rounds, so it
delays them by one chunk at most. Whatever one job brings (its parameters, its draft session,
its streaming callback) can fail that job only; should the loop itself fail, its jobs fail at
once and ``healthy()`` turns false, for the daemon to exit and be restarted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from common.verify import SamplingParams
from starsd_target.client import DraftClient, DraftReply
from starsd_target.drafts import RemoteDraftSession
from starsd_target.pool import DraftPool
from starsd_target.config import TargetConfig
from starsd_target.depth import AdaptiveDepth
from starsd_target.engine import BatchFailed, Generation, GenerationResult, TargetEngine
from starsd_target.metrics import TargetMetrics
from starsd_target.profile import RoundProfile, RoundTimes, split_round
from starsd_target.round_plan import crowded_round, keeps_cap, plan_round

log = logging.getLogger("starsd.target.scheduler")


class Overloaded(RuntimeError):
    """The job queue is full; try again later."""


class ShuttingDown(RuntimeError):
    """The target daemon is stopping and takes no new jobs."""


class SchedulerFailed(ShuttingDown):
    """The scheduler's loop died: its jobs fail with this, and the daemon exits to be restarted."""


class Cancelled(RuntimeError):
    """The job was cancelled (its client went away) and dropped before its end."""


ADMIT_WINDOWS_AT_MOST = 4  # a burst's gathering ends this many windows after it began, whatever comes


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stop: tuple[str, ...] = ()
    no_draft: bool = False
    max_draft: int | None = None  # the most draft tokens a round verifies (None: the target's; 0: as no_draft)
    logprobs: int | None = None  # record token log-probabilities with this many alternatives (None: none)
    on_progress: Callable[[Generation], None] | None = None  # streaming: called after each round that added tokens
    draft_params: SamplingParams | None = None  # how the drafter samples; None: as the target does
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    submitted: float = field(default_factory=time.monotonic)
    cancelled: bool = False

    def cancel(self) -> None:
        """Abandon the job (from any thread): a queued one never starts; a running one is dropped
        at the scheduler's next pass, its cache freed and its draft session closed."""
        self.cancelled = True
        self.future.cancel()  # takes effect only while the job waits in the queue


@dataclass
class _Active:
    job: Job
    gen: Generation
    drafts: RemoteDraftSession | None
    seq: int | None = None  # draft request in flight
    ready: bool = False
    proposal: object = None
    wanted: bool = False
    ready_at: float = 0.0
    sent_at: float = 0.0  # perf_counter: when the request in flight went out
    prefill_turn: int = 0  # the pass in which it last prefilled a chunk (turns go round)
    # The round profile's clocks (perf_counter): the round began when the last one (or the last
    # prefill chunk) ended; its drafts were taken or given up at resolved_at (None: no request).
    round_start: float = field(default_factory=time.perf_counter)
    resolved_at: float | None = None
    reported: tuple[float, float] | None = None  # the draft daemon's (queued, drafting) for that request
    depth: AdaptiveDepth | None = None  # its draft-length controller (None: the cap every round)
    asked: int = 0  # drafts the request in flight (or the last one) asked for
    budget: int = 0  # the tree tokens it asked for (0: a chain)
    plain: bool = False  # this round runs without drafts by choice (the target alone is expected to be faster)
    crowded: bool = False  # ...because more generations are active than draft_max_active
    # fill steps: tokens the target added on its own while the request in flight was drafted, the
    # seconds they took, and the drafts of the reply they confirmed (skipped in the verification)
    filled: list[int] = field(default_factory=list)
    fill_s: float = 0.0
    confirmed: int = 0
    key: int = field(default_factory=itertools.count().__next__)  # unique for the daemon's life (ids are reused)

    @property
    def verifiable(self) -> bool:
        """Its drafts are in (or given up) and its prompt is in the cache: a round can run."""
        return self.ready and not self.gen.prefilling


class Scheduler:
    def __init__(self, engine: TargetEngine, link: Callable[[], DraftPool | DraftClient | None], draft_timeout_s: float,
                 max_active: int = TargetConfig.max_active, max_queue: int = TargetConfig.max_queue,
                 heartbeat_s: float = TargetConfig.heartbeat_s, stall_s: float = TargetConfig.stall_timeout_s,
                 adaptive_depth: bool = TargetConfig.adaptive_depth,
                 pause_unpaid_drafts: bool = TargetConfig.pause_unpaid_drafts,
                 fill_steps: bool = TargetConfig.fill_steps,
                 draft_max_active: int = 0,
                 admit_window_s: float = TargetConfig.admit_window_s):
        if admit_window_s < 0:
            raise ValueError(f"admit_window_s must be >= 0, got {admit_window_s}")
        self.engine = engine
        # rounds draft only while at most this many generations are active (0: always); beyond, they
        # run on the target alone, batched, where verifying every generation's drafts costs more
        self.draft_max_active = draft_max_active
        self.crowded_rounds = 0  # rounds run without drafts because more generations were active
        self.adaptive_depth = adaptive_depth  # each generation's draft length follows its measured rounds
        self.pause_unpaid_drafts = pause_unpaid_drafts  # and it runs plain rounds while drafting does not pay
        self.fill_steps = fill_steps  # and steps on its own while its drafts are on their way, where that pays
        self.fill_forwards = 0  # fill steps run
        self.stall_s = stall_s  # a pass this late means the loop is stuck (healthy() turns false)
        self.link = link  # the draft client, created lazily in the scheduler thread; None: no draft daemon
        self.draft_timeout_s = draft_timeout_s
        self.max_active = max_active
        self.admit_window_s = admit_window_s  # from idle, jobs this close behind the one taken start with it
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # orders submit() against the refusal of new jobs
        self._accepting = True
        self.failure: BaseException | None = None  # what killed the loop, if it died
        self.active: list[_Active] = []
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.forwards = 0  # verification forwards run
        self.batched_rounds = 0  # rounds verified beside others in one forward
        self.prefill_forwards = 0  # prefill forwards that went through (one chunk each, or several batched)
        self.batched_prefills = 0  # prefill chunks run beside others in one forward
        self._chunks = 0  # prefill chunks run so far: the clock the turns are taken by
        self.last_pass = time.monotonic()  # liveness: the loop stamps every pass
        self.thread: threading.Thread | None = None
        self.on_round: Callable[[Generation, int | None, bool, float], None] | None = None  # observer hook
        self.metrics: TargetMetrics | None = None
        self.profile = RoundProfile()  # where every generation's rounds spent their time, daemon-wide
        self._next_beat = time.monotonic() + heartbeat_s  # when the idle link's next heartbeat is due

    # ------------------------------------------------------------ public
    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._lock:
            if not self._accepting:
                raise self._refusal()
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                raise Overloaded(f"{self.jobs.maxsize} jobs are already waiting") from None
        return job.future

    def start(self) -> None:
        self.last_pass = time.monotonic()
        self.thread = threading.Thread(target=self.run, name="starsd-scheduler", daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Take no new jobs, fail the queued ones, finish those in progress, then stop the thread."""
        self._stop.set()
        self._refuse_queued()
        if self.thread is not None:
            self.thread.join(timeout_s)

    def healthy(self) -> bool:
        """The loop is running and has made a pass within ``stall_s`` (a hung forward or thread fails this)."""
        return self.thread is not None and self.thread.is_alive() and time.monotonic() - self.last_pass < self.stall_s

    def abandon(self, exc: BaseException) -> None:
        """From another thread, when the loop is stuck: fail every job it holds with ``exc`` at
        once, so that no client waits on a loop that will not come back."""
        self._refuse_queued()
        for a in list(self.active):
            self._settle(a.job, exc=exc)

    def load(self) -> dict:
        return {"active": len(self.active), "queued": self.jobs.qsize(), "completed": self.completed,
                "failed": self.failed, "cancelled": self.cancelled, "verify_forwards": self.forwards,
                "batched_rounds": self.batched_rounds, "prefill_forwards": self.prefill_forwards,
                "batched_prefills": self.batched_prefills, "fill_steps": self.fill_forwards,
                "draft_max_active": self.draft_max_active, "crowded_rounds": self.crowded_rounds}

    def _refusal(self) -> ShuttingDown:
        if self.failure is not None:
            return SchedulerFailed(f"the target's scheduler failed ({self.failure!r}); the daemon is restarting")
        return ShuttingDown("the target daemon is shutting down")

    def _refuse_queued(self) -> None:
        """Take no new jobs; fail those still queued with the reason."""
        with self._lock:
            self._accepting = False
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(self._refusal())
            else:
                self._count("cancelled")  # cancelled while it waited, as _start counts it

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        """The round driver, in the scheduler's thread (``start()``). Should it fail outside any
        one job, every job it holds fails at once with SchedulerFailed and the thread ends
        (``healthy()`` then says so): never a loop that looks alive and serves nothing."""
        try:
            self._loop()
        except BaseException as exc:
            log.critical("the scheduler loop failed; failing its jobs", exc_info=True)
            self.failure = exc
            self._refuse_queued()
            for a in list(self.active):
                self._finish(a, self._refusal())

    def _loop(self) -> None:
        self._next_beat = time.monotonic() + self.heartbeat_s
        while True:
            self.last_pass = time.monotonic()
            self._admit()
            if not self.active:
                client = self.link()
                if client is not None and not self._beat(client):
                    client.poll(0)  # take a WELCOME, send a HELLO that is due: never a wait
                if self._stop.is_set():
                    return
                try:
                    job = self.jobs.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._start(job)
                self._gather()
                continue
            self._step()

    def run_one(self, job: Job) -> GenerationResult:
        """One job to its end in the calling thread: the same passes ``run`` makes, for the
        one-off CLI path. Not while the scheduler runs in its own thread."""
        if self.thread is not None:
            raise RuntimeError("the scheduler runs in its own thread; submit() the job instead")
        future = self.submit(job)
        while not future.done():
            self.last_pass = time.monotonic()
            self._admit()
            if self.active:
                self._step()
        return future.result()

    def _gather(self) -> None:
        """Right after an idle loop took a job: each job that follows the last one taken within
        ``admit_window_s`` starts with it (up to ``max_active``, for ``ADMIT_WINDOWS_AT_MOST``
        windows in all), so that requests sent together prefill in one forward and run their
        rounds together, rather than the first a pass ahead of the rest. Only from idle (a busy
        loop admits at every pass anyway) and only where generations share forwards."""
        if self.admit_window_s <= 0 or self.engine.max_batch <= 1:
            return  # nothing to gain where every generation runs its own forwards
        deadline = time.monotonic() + ADMIT_WINDOWS_AT_MOST * self.admit_window_s
        while len(self.active) < self.max_active and not self._stop.is_set():
            self.last_pass = time.monotonic()  # a slow trickle of requests is not a stalled loop
            wait = min(self.admit_window_s, deadline - self.last_pass)
            if wait <= 0:
                return
            try:
                job = self.jobs.get(timeout=wait)
            except queue.Empty:
                return
            self._start(job)

    def _step(self) -> None:
        """One pass over the active generations: cancelled ones dropped, requests out, replies
        in, one prefill chunk and one round verified."""
        for a in [a for a in self.active if a.job.cancelled]:
            self._finish(a, Cancelled("the request was cancelled"))
        self._request_drafts()
        self._collect()
        self._keep_link()
        if self._prefill_one():
            self._collect()  # replies that came during the chunk: their rounds run now, not a chunk later
        self._verify_one()

    @contextlib.contextmanager
    def _confined(self, a: _Active):
        """Whatever goes wrong in one job's work fails that job alone; the loop goes on."""
        try:
            yield
        except Exception as exc:
            log.exception("a generation failed")
            self._finish(a, exc)

    def _admit(self) -> None:
        while len(self.active) < self.max_active and not self._stop.is_set():
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            self._start(job)

    def _start(self, job: Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            self._count("cancelled")  # cancelled while it waited
            return
        try:
            client = None if job.no_draft or job.max_draft == 0 else self.link()
            drafts = None
            if client is not None:
                drafts = RemoteDraftSession(client, client.next_session(), job.draft_params or job.params,
                                            self.draft_timeout_s)
            # features are collected for a daemon whose head reads them (or that has not said yet)
            features = drafts is not None and (client.welcome is None or client.welcome.feature_size > 0)
            gen = self.engine.start(job.prompt, job.max_tokens, job.params, job.stop, features=features,
                                    max_draft=job.max_draft if drafts is not None else 0, logprobs=job.logprobs,
                                    feature_layers=drafts.feature_layers if features else None)
        except Exception as exc:  # a bad job fails alone
            self._settle(job, exc=exc)
            return
        # A seeded sampled generation keeps its draft length (round_plan.keeps_cap): the target's
        # random draws follow its rounds, so a length that followed measured times would make the
        # same seed give other tokens at another speed. Greedy output does not depend on the length.
        adapt = self.adaptive_depth and drafts is not None and not keeps_cap(job.params)
        depth = AdaptiveDepth(pause_unpaid=self.pause_unpaid_drafts) if adapt else None
        self.active.append(_Active(job, gen, drafts, depth=depth))

    def _request_drafts(self) -> None:
        """Draft requests for the generations that want one. One whose drafter needs features
        waits for its prefill (the features come from it); the others ask at once, so the draft
        daemon prefills its side while the target prefills its own."""
        now = time.monotonic()
        for a in list(self.active):
            if a.ready or a.seq is not None or (a.gen.prefilling and a.gen.feats is not None):
                continue
            with self._confined(a):
                self._request(a, now)

    def _crowded(self, a: _Active) -> bool:
        """Whether ``a``'s next round runs without drafts because the target is crowded
        (``round_plan.crowded_round``)."""
        return crowded_round(self.draft_max_active, self.engine.max_batch, a.gen.batchable, a.job.params,
                             sum(o.gen.batchable for o in self.active))

    def _request(self, a: _Active, now: float) -> None:
        """Plan ``a``'s next round (``round_plan.plan_round``) and carry the plan out: a draft
        request sent, or the round readied to run without drafts."""
        d = a.drafts
        trees = d is not None and d.trees
        plan = plan_round(a.gen.draft_depth(), session=d is not None, crowded=d is not None and self._crowded(a),
                          trees=trees, budget=a.gen.draft_budget() if trees else 0,
                          stops_drafts=d is not None and d.stops_drafts,
                          greedy_drafts=d is not None and d.params.greedy, depth=a.depth)
        a.wanted = plan.wanted
        a.resolved_at, a.reported, a.plain, a.crowded = None, None, False, False
        a.filled, a.fill_s, a.confirmed = [], 0.0, 0
        if plan.wanted:
            a.asked, a.budget = plan.depth, plan.budget
            if plan.plain:  # the target alone, batched, is faster; no request, and no fallback
                a.wanted, a.plain, a.crowded = False, True, plan.crowded
                a.ready, a.proposal, a.ready_at = True, None, now
                return
            a.seq = d.send(a.gen.tokens, plan.depth, a.gen.features(), tree_tokens=plan.budget,
                           feature_layers=a.gen.feature_layers, min_survival=plan.min_survival,
                           min_chance=plan.min_chance)
            if a.seq is not None:
                a.gen.stats.asked_tokens += max(plan.depth, plan.budget)
                a.sent_at = time.perf_counter()
                return
        a.ready, a.proposal, a.ready_at = True, None, now

    def _keep_link(self) -> None:
        """Generations busy but none asking for drafts (a crowded target running them on the
        target alone): the link still gets its heartbeat, or the draft daemon
        would drop this peer as silent and the next drafted round would find no session."""
        plain = any(a.plain for a in self.active)
        if not plain or any(a.seq is not None for a in self.active):
            return
        client = self.link()
        if client is not None:
            self._beat(client)

    def _beat(self, client: DraftPool | DraftClient) -> bool:
        """The link's heartbeat, if one is due; whether it went."""
        if time.monotonic() < self._next_beat:
            return False
        client.heartbeat()
        self._next_beat = time.monotonic() + self.heartbeat_s
        return True

    def _busy(self) -> bool:
        """The target has work besides waiting for drafts: a round to verify or a chunk to prefill."""
        return any(a.verifiable or a.gen.prefilling for a in self.active)

    def _collect(self) -> None:
        """Take the replies that have come. A request the link says is lost is given up (its
        round runs without drafts) once the target has nothing else to do, or past the cap
        in any case: while the target has other work, waiting costs nothing."""
        waiting = [a for a in self.active if a.seq is not None]
        if not waiting:
            return
        busy = self._busy()
        if not busy and self.fill_steps:
            self.link().poll(0)  # a reply already here is verified, not stepped past
            if self._fill(waiting):
                busy = True  # a step's time has passed: take what came meanwhile, without waiting
                waiting = [a for a in waiting if a in self.active]  # the step may have ended its generation
                if not waiting:
                    return
        now = time.monotonic()
        timeout = 0.0 if busy else max(0.0, min(min(a.drafts.wake_at for a in waiting) - now, 0.05))
        self.link().poll(timeout)  # every draft daemon's link: replies are routed to each request's
        left = []
        for a in waiting:
            with self._confined(a):
                reply = a.drafts.client.take(a.drafts.session, a.seq)
                if reply is None:
                    left.append(a)
                    continue
                if isinstance(reply, DraftReply):
                    a.reported = reply.reported
                if self.metrics is not None:
                    self.metrics.round_trip.observe(time.perf_counter() - a.sent_at)
                self._resolved(a, a.drafts.resolve(reply))
        idle = not self._busy()
        for a in left:
            with self._confined(a):
                if not a.drafts.client.up or a.drafts.expired(idle):
                    self._resolved(a, a.drafts.resolve(None))  # link down, or no reply in time

    def _fill(self, waiting: list[_Active]) -> bool:
        """Fill steps for the waiting generations whose controllers say one pays now
        (``AdaptiveDepth.fill_pays``): one token each of the target's own, in one forward where
        their caches are pool rows (up to the engine's ``max_batch``, longest waiting first), so
        that one generation's step does not hold up another's. Only chains (a tree's drafts are
        not a line a step can follow) and generations with a controller (seeded sampled ones have
        none: their random draws must not follow timing). Whether any ran."""
        now, clock = time.perf_counter(), time.monotonic()
        due = []
        for a in sorted(waiting, key=lambda w: w.sent_at):
            d = a.depth
            if d is None or a.budget or a.gen.prefilling or a.gen.done:
                continue
            client, key = a.drafts.client, (a.drafts.session, a.seq)
            if client.replied(*key):
                continue  # its drafts are here
            expected, answer_due = d.expected_wait(), client.answer_due(key)
            if expected is None or answer_due is None:
                continue  # not measured yet, or not acknowledged yet (it comes within a round trip)
            # the sooner of what the last replies took and what the daemon said of this one: a
            # request served at once is not stepped past for a slow one earlier
            left = min(expected - (now - a.sent_at), answer_due - clock)
            if d.fill_pays(left, a.asked, len(a.filled)):
                log.debug("fill step: %.1f ms of the wait expected left (%.1f measured, %.1f acknowledged), a step "
                          "%.1f ms, %d of %d drafts asked stepped past, %.1f drafts a reply, acceptance %.2f",
                          1e3 * left, 1e3 * (expected - (now - a.sent_at)), 1e3 * (answer_due - clock),
                          1e3 * (d.fill_step_s or 0.0), len(a.filled), a.asked, d.drafts_sent or 0.0, d.acceptance)
                due.append(a)
        if not due:
            return False
        batch = self._sharing(due)
        before, t0 = [len(a.gen.tokens) for a in batch], time.perf_counter()
        if len(batch) == 1:
            with self._confined(batch[0]):
                batch[0].gen.verify(None, wanted=False)
        else:
            try:
                outcomes = self.engine.verify_batch([(a.gen, None, False) for a in batch])
            except BatchFailed:  # every generation is as it was; the step is given up this once
                log.warning("a batched fill step failed", exc_info=True)
                return False
            for a, outcome in zip(batch, outcomes):
                if isinstance(outcome, BaseException):
                    with self._confined(a):
                        raise outcome  # its own outcome failed: that job alone
        step_s = time.perf_counter() - t0
        self.forwards += 1
        self.fill_forwards += 1
        if self.metrics is not None:
            self.metrics.on_forward(len(batch), step_s)
        for a, n in zip(batch, before):
            if a not in self.active:
                continue  # it failed, alone
            added = a.gen.tokens[n:]
            a.filled += added
            a.fill_s += step_s
            a.gen.stats.fill_steps += 1
            a.depth.observe_fill_step(step_s, a.gen.last_forward_s)
            if self.metrics is not None:
                self.metrics.on_fill_step(len(added))
            if a.job.on_progress is not None and added:
                with self._confined(a):
                    a.job.on_progress(a.gen)
            if a in self.active and a.gen.done:  # the steps made its last tokens: their round ends here,
                a.resolved_at = time.perf_counter()  # its request given up, waited for until now
                self._profile(a, a.resolved_at, verified=False)
                self._finish(a, None)  # its request in flight is abandoned with its session
        return True

    def _resolved(self, a: _Active, proposal: DraftReply | None) -> None:
        """What came for ``a``'s request (None: nothing usable): after fill steps, the drafts
        count only if they begin with the fill steps' tokens; those are skipped and the rest
        verified. Drafts that part from them, or that the fill steps used up, end the round
        without a verification: its tokens are the fill steps'."""
        if a.depth is not None and proposal is not None:
            a.depth.observe_reply(proposal.reported, len(proposal.tokens))
        if not a.filled:
            self._ready(a, proposal)
            return
        m, drafts = len(a.filled), list(proposal.tokens) if proposal is not None else []
        j = 0
        while j < min(m, len(drafts)) and drafts[j] == a.filled[j]:
            j += 1
        s = a.gen.stats
        s.fill_confirmed += j
        s.drafted += min(j + 1, len(drafts), m)  # drafts the fill steps checked
        s.accepted += j
        if j == m and len(drafts) > m:
            a.confirmed = m
            self._ready(a, _after_fills(proposal, m))
            return
        a.seq, a.resolved_at = None, time.perf_counter()
        if proposal is not None:
            a.drafts.kept(j)  # the next request says how many of these drafts stand
        times = self._profile(a, a.resolved_at, verified=False)
        a.depth.observe(a.asked, len(drafts), j, times, tokens=m, rows=0)

    @staticmethod
    def _ready(a: _Active, proposal) -> None:
        a.seq, a.ready, a.proposal, a.ready_at = None, True, proposal, time.monotonic()
        a.resolved_at = time.perf_counter()

    def _prefill_one(self) -> bool:
        """One pass's prefill, taking turns: the generation whose last chunk is the oldest goes
        (among equals, the first to arrive), so a short prompt waits one chunk of each long one
        at most, and a long one still advances every few passes. The next in turn join its
        forward (``TargetEngine.prefill_batch``, pool rows only, up to ``max_batch``) while the
        padded chunks stay within one chunk's positions: prompts that arrive together prefill
        together, and no pass runs a longer forward than one chunk. A chunk that goes wide
        (``ModelRunner.wide_prefill_rows``) runs alone. Whether one ran."""
        prefilling = sorted((a for a in self.active if a.gen.prefilling), key=lambda p: p.prefill_turn)
        if not prefilling:
            return False
        batch = [prefilling[0]]
        if prefilling[0].gen.batchable and not prefilling[0].gen.chunk_goes_wide:
            longest = prefilling[0].gen.next_chunk_end() - prefilling[0].gen.prefilled
            for a in prefilling[1:]:
                if len(batch) == self.engine.max_batch:
                    break
                size = a.gen.next_chunk_end() - a.gen.prefilled
                if (a.gen.batchable and not a.gen.chunk_goes_wide
                        and (len(batch) + 1) * max(longest, size) <= self.engine.prefill_chunk):
                    batch.append(a)
                    longest = max(longest, size)
        for a in batch:
            self._chunks += 1
            a.prefill_turn = self._chunks
        gens, outcomes = [a.gen for a in batch], None
        if len(batch) > 1:
            try:
                outcomes = self.engine.prefill_batch(gens)
            except BatchFailed:
                # every generation is as it was: one at a time, so a fault fails its own job only
                log.warning("prefilling them one at a time", exc_info=True)
            else:
                self.prefill_forwards += 1
                self.batched_prefills += len(batch)
        if outcomes is None:
            outcomes = [self.engine.prefill_batch([g])[0] for g in gens]
            self.prefill_forwards += sum(o is None for o in outcomes)  # went through, as verify_forwards counts
        for a, outcome in zip(batch, outcomes):
            if outcome is not None:
                with self._confined(a):
                    raise outcome  # its own part failed: that job alone
        now = time.perf_counter()
        for a in batch:
            if a in self.active:
                a.round_start = now  # prefill is counted apart (prefill_s): the first round starts after it
        return True

    def _verify_one(self) -> None:
        """Verify the longest-waiting generation whose round can run, and with it (one forward,
        ``TargetEngine.verify_batch``) the next longest-waiting ones up to the engine's
        ``max_batch``."""
        ready = sorted((a for a in self.active if a.verifiable), key=lambda r: r.ready_at)
        if not ready:
            return
        self._rounds(self._sharing(ready))

    def _sharing(self, ordered: list[_Active]) -> list[_Active]:
        """The first of ``ordered`` and, where its cache is a pool row, the next ones whose caches
        are too, up to the engine's ``max_batch``: the generations that share its forward."""
        batch = [a for a in ordered if a.gen.batchable][: self.engine.max_batch]
        return batch if len(batch) > 1 and batch[0] is ordered[0] else ordered[:1]

    def _rounds(self, batch: list[_Active]) -> None:
        before = [(len(a.gen.out), a.gen.stats.drafted, a.gen.stats.accepted, a.gen.stats.fallback_rounds,
                   len(a.gen.tokens)) for a in batch]
        t0 = time.perf_counter()
        if len(batch) == 1:
            with self._confined(batch[0]):
                kept = [batch[0].gen.verify(batch[0].proposal, wanted=batch[0].wanted)]
            if batch[0] not in self.active:
                return  # it failed, alone
        else:
            try:
                kept = self.engine.verify_batch([(a.gen, a.proposal, a.wanted) for a in batch])
            except BatchFailed:
                # caches and generators are as they were: one at a time, so a fault fails its own job only
                log.warning("verifying them one at a time", exc_info=True)
                for a in batch:
                    self._rounds([a])
                return
        end = time.perf_counter()
        verify_s = end - t0
        self.forwards += 1
        self.batched_rounds += len(batch) if len(batch) > 1 else 0
        if self.metrics is not None:
            self.metrics.on_forward(len(batch), verify_s)
        for a, n, counts in zip(batch, kept, before):
            with self._confined(a):
                if isinstance(n, BaseException):
                    raise n  # its own outcome failed (in a batch): that job alone
                self._after_round(a, n, counts, verify_s, end)

    def _after_round(self, a: _Active, n: int | None, counts: tuple, verify_s: float, end: float) -> None:
        s = a.gen.stats
        if a.proposal is not None and n is not None:
            a.drafts.kept(a.confirmed + n)
        times = self._profile(a, end)
        if a.depth is not None and a.proposal is not None and n is not None:
            # the drafts the fill steps confirmed count as kept; the verification ran over the rest
            # (a tree's rows are its nodes: its rounds measure what a row costs for its floor)
            a.depth.observe(a.asked, a.confirmed + len(a.proposal.tokens), a.confirmed + n, times,
                            rows=len(a.proposal.tokens) + 1)
        if a.plain:
            s.plain_rounds += 1
            self.crowded_rounds += a.crowded
            if a.depth is not None and a.crowded:  # batched: not the target alone's rate
                a.depth.catching_up = True  # the next drafted round pays a catch-up
            elif a.depth is not None:  # the target alone's rate, and a catch-up next
                a.depth.observe_plain(times)
        elif a.depth is not None and a.wanted and a.proposal is None:
            a.depth.observe_fallback(times)  # drafts that did not come cost their round too
        if self.on_round is not None:
            self.on_round(a.gen, n, a.wanted, verify_s)
        if self.metrics is not None:
            self.metrics.on_round(s.drafted - counts[1], s.accepted - counts[2], len(a.gen.tokens) - counts[4],
                                  s.fallback_rounds > counts[3], a.budget, plain=a.plain, crowded=a.crowded)
            self.metrics.active.set(len(self.active))
            self.metrics.queued.set(self.jobs.qsize())
        a.ready, a.proposal = False, None
        if a.job.on_progress is not None and len(a.gen.out) != counts[0]:
            a.job.on_progress(a.gen)
        if a.gen.done:
            self._finish(a, None)

    def _profile(self, a: _Active, end: float, verified: bool = True) -> RoundTimes:
        """Split the round that just ended into its parts (starsd_target.profile), for the
        generation and daemon-wide. The draft wait counts from the request's send or the round's
        start, whichever is later (a request sent during the prefill waited beside it), less the
        fill steps taken meanwhile. ``verified``: the round ended in a verification (not so where
        its fill steps made its tokens)."""
        wait = 0.0
        if a.resolved_at is not None:
            wait = max(0.0, a.resolved_at - max(a.sent_at, a.round_start) - a.fill_s)
        forward, math = (a.gen.last_forward_s, a.gen.last_math_s) if verified else (0.0, 0.0)
        times = split_round(end - a.round_start, wait, a.reported, forward, math,
                            waited=a.resolved_at is not None, fill=a.fill_s)
        a.gen.stats.profile.add(times)
        self.profile.add(times)
        a.round_start, a.resolved_at, a.reported = end, None, None
        return times

    def _finish(self, a: _Active, exc: BaseException | None) -> None:
        """Take ``a`` off the model (its cache goes with it), close its draft session, settle its job."""
        self.active.remove(a)
        if self.metrics is not None:
            self.metrics.active.set(len(self.active))
        if a.drafts is not None:
            try:
                a.drafts.close()
            except Exception:
                log.exception("closing a draft session failed")
        result = None
        if exc is None:
            try:
                result = a.gen.result()
            except Exception as err:
                log.exception("a generation failed at its end")
                exc = err
        # freed now (a pool row back in the pool, scrubbed after a failure), whatever still holds the generation
        try:
            a.gen.release(scrub=exc is not None and not isinstance(exc, Cancelled))
        except Exception:
            log.exception("freeing a generation's cache failed")
        self._settle(a.job, result, exc)

    def _settle(self, job: Job, result: GenerationResult | None = None, exc: BaseException | None = None) -> None:
        """Give a started job its outcome, and count it (once: a job abandoned meanwhile keeps its first)."""
        try:
            if exc is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(exc)
        except concurrent.futures.InvalidStateError:
            return
        if exc is None:
            self._count("ok")
        else:
            self._count("cancelled" if isinstance(exc, Cancelled) else "error")

    def _count(self, outcome: str) -> None:
        if outcome == "ok":
            self.completed += 1
        elif outcome == "cancelled":
            self.cancelled += 1
        else:
            self.failed += 1
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome).inc()


def _after_fills(reply: DraftReply, m: int) -> DraftReply:
    """``reply``'s chain without its first ``m`` drafts (those fill steps confirmed): what the
    verification checks after them, with their q rows."""
    return dataclasses.replace(reply, tokens=list(reply.tokens[m:]),
                               q_ids=None if reply.q_ids is None else reply.q_ids[m:],
                               q_probs=None if reply.q_probs is None else reply.q_probs[m:])
