"""The draft daemon's batcher: a work-conserving loop over one request queue and one backend.

Its front door, ``starsd_draftd.ingress.Ingress``, owns the ROUTER socket on a thread of its own:
it reads and checks what arrives, answers the handshake and operators while a batch computes, and
queues DRAFT requests. Each pass here
takes a batch of the waiting requests (oldest first, one per address in turn before any address
gets a second), admits each against its session, drafts them in one backend call and queues
the replies, which the ingress's thread sends. The loop blocks only when no work is waiting, so the draft
model is busy whenever any target is waiting for drafts; with nothing queued it drafts ahead and
feeds what suffix-answered sessions' draft models missed (``starsd_draftd.lookahead``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq

from common.protocol import ErrorCode, Message, MsgType, ProtocolError
from common.memory import memory_report
from common.metrics import serve_metrics
from common.sdnotify import Watchdog, notify
from common.tensors import as_torch
from common.sockets import check_server_endpoint
from starsd_draftd.backends.base import Draft, DraftBackend, DraftRequest
from starsd_draftd.eta import ServiceEstimate
from starsd_draftd.ingress import Ingress
from starsd_draftd.lookahead import LookaheadServing, ahead_depth
from starsd_draftd.metrics import DraftMetrics
from starsd_draftd.records import AdmittedRequest, LastReply, QueuedRequest, ask_of, drafted
from starsd_draftd.sessions import Session, SessionTable, TableLimits
from starsd_draftd.suffix import SuffixDraft, SuffixIndex, SuffixText, partition
from starsd_draftd.stats import REQUEST_PARTS, Stats  # noqa: F401 (REQUEST_PARTS: part of this module's face)

log = logging.getLogger("starsd.draftd")

_TABLE = TableLimits()  # the session table's defaults, which the daemon's are
# Target features a session may hold back while suffix drafts answer its rounds (feature backends):
# beyond them its next round goes to the backend, which takes them all
MAX_PENDING_FEATURES = 256
SWITCH_INTERVAL_S = 0.0005


@dataclass
class ServerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    max_depth: int = 5
    batch_max: int = 8  # requests of different sessions drafted together; 1 serves one at a time
    # Longest wait, with requests queued, for sessions predicted to send their next request within
    # it (each session's reply-to-request turnaround is tracked). 0 keeps the loop strictly
    # work-conserving; a few ms fills batches when targets answer fast (many targets, short V).
    batch_window_s: float = 0.0
    # Prompt tokens a batch feeds at most beyond one a request (a new session's prompt, a round's
    # newly verified tokens): a request over what is left waits for a later batch, and the first of
    # them gets a chunk of its prompt fed after the batch's replies (backends that feed prompts in
    # chunks), so a short request is never drafted behind several long prefills. 0: no budget.
    batch_prefill_tokens: int = 128
    # With nothing queued, draft each served session's next round ahead for the outcomes the
    # draft can guess (its drafts all kept then its next token; kept up to a position then its
    # second choice there), one batched forward per loop pass; a request that brings one of
    # those sequences is answered from it at once.
    lookahead: bool = True
    # The most tokens a target may ask a draft tree to hold (DRAFT.tree_tokens); trees are
    # drafted by backends with a tree_topk above 1, and with requests still queued after a batch
    # is taken, at half the size asked (at least the depth).
    max_tree_tokens: int = 64
    # Drafts from text already seen (``starsd_draftd.suffix``): each session's own text and the
    # outputs of recent sessions, bounded in bytes and shared per CURVE key ("key"), by all
    # ("all") or not at all ("off"); without CURVE, "key" shares one index among all targets.
    # Per request, a suffix draft goes where its score beats the backend's measured drafts kept.
    suffix: bool = True
    suffix_cache_bytes: int = 256 << 20
    suffix_share: str = "key"
    # Finished sessions' keys and values kept for later sessions whose text begins alike, in the
    # suffix index's partitions (backends that support it: the model backend)
    prefix_cache_bytes: int = 64 << 20
    # The session table's bounds (TableLimits, fields of the same names)
    max_sessions: int = _TABLE.max_sessions
    max_sessions_per_peer: int = _TABLE.max_sessions_per_peer
    max_peers: int = _TABLE.max_peers  # connections that completed the handshake
    # Without CURVE every connection is its own principal: bound what one remote address may hold.
    max_peers_per_address: int = _TABLE.max_peers_per_address
    max_sessions_per_address: int = _TABLE.max_sessions_per_address
    # Cache memory, estimated per position from the drafter's config: in all, per target, per session
    max_kv_bytes: int = _TABLE.max_kv_bytes
    max_peer_kv_bytes: int = _TABLE.max_peer_kv_bytes
    max_session_kv_bytes: int = _TABLE.max_session_kv_bytes
    session_ttl_s: float = _TABLE.session_ttl_s
    peer_ttl_s: float = _TABLE.peer_ttl_s
    evict_idle_s: float = _TABLE.evict_idle_s  # a full table gives way to its least recently used entry idle this long
    max_queue: int = 4096
    # Queued draft requests are charged what they hold in memory, estimated from their frame sizes
    # (queue_cost); beyond a budget a request gets BUSY. Per peer too, so no one target's backlog
    # crowds out the others.
    max_queue_bytes: int = 256 << 20
    max_peer_queue: int = 64  # requests of one peer waiting at once (one per session is the norm)
    max_peer_queue_bytes: int = 64 << 20
    # SIGTERM drains: targets are told (GOODBYE, draining) and move their sessions to another
    # draft daemon at their next round, or go on here; the daemon exits once it holds no session
    # and no request, or after this many seconds.
    drain_s: float = 5.0
    curve_secret: Path | None = None  # this daemon's .key_secret file
    curve_allow: Path | None = None  # directory of allowed target public keys (.key files)
    insecure: bool = False
    metrics_port: int | None = None
    name: str = "starsd-draftd"


class LoopFailed(RuntimeError):
    """The serving loop kept failing outside any one request: the daemon exits non-zero (and
    systemd restarts it) rather than look alive and serve nothing."""


class DraftServer:
    def __init__(self, backend: DraftBackend, config: ServerConfig, ctx: zmq.Context | None = None):
        check_server_endpoint(config.bind, config.curve_secret, config.curve_allow, config.insecure)
        self.backend = backend
        self.config = config
        self.ctx = ctx or zmq.Context.instance()
        bounds = {f.name: getattr(config, f.name) for f in dataclasses.fields(TableLimits)
                  if f.name != "kv_bytes_per_token"}  # the one bound that comes from the model
        self.sessions = SessionTable(TableLimits(**bounds, kv_bytes_per_token=backend.kv_bytes_per_token),
                                     durable=config.curve_secret is not None)
        self._served_turn: dict[bytes | str, int] = {}  # share -> the batch that last served it
        self._conn_turn: dict[bytes, int] = {}  # principal -> the batch that last served it (turns inside a share)
        self._turn = 0
        self._awaited: dict[tuple[bytes, int], Session] = {}  # replied to, not back yet (batch window)
        self.stats = Stats()
        self.suffix = SuffixIndex(config.suffix_cache_bytes, config.suffix_share) if config.suffix else None
        if self.suffix is not None:
            backend.attach_suffix(self.suffix)
            if config.suffix_share != "off" and config.curve_secret is None:
                log.info("suffix drafts: without CURVE every target's outputs may draft for every other's sessions "
                         "(--suffix-share off keeps each session to its own text)")
        backend.keep_prompts(config.prefix_cache_bytes)
        self.lookahead = LookaheadServing(backend, self.sessions, self.stats)
        self.metrics = DraftMetrics(self.snapshot)
        self._busy_mark = (time.monotonic(), 0.0)
        self.instance = secrets.token_hex(8)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._http = None  # the metrics port's server, when one is asked for
        self.last_pass = time.monotonic()  # when the batcher last began a pass (health)
        self._serving = False
        # the socket, what arrives on it and the queue's budgets; this class takes the queue's requests
        self.estimate = ServiceEstimate(config.batch_max)  # what a batch costs: the ACKs' estimates
        self.ingress = Ingress(backend, config, self.sessions, self.stats, self.ctx, self.instance, self.snapshot,
                               self._returned, self.estimate)
        self.lock = self.ingress.lock  # held while the session table or the queue is read or changed

    # the ingress's state, as this loop and its callers see it
    @property
    def q_in(self) -> collections.deque[QueuedRequest]:
        return self.ingress.q_in

    @property
    def endpoint(self) -> str:
        return self.ingress.endpoint

    @property
    def draining(self) -> bool:
        return self.ingress.draining

    def _returned(self, session: Session) -> None:
        """A DRAFT of ``session`` was queued (the ingress's thread, with the lock held): with a batch
        window, its turnaround is measured and it is no longer awaited."""
        if self.config.batch_window_s > 0:
            session.returned(time.monotonic())
            self._awaited.pop(session.key, None)

    # ------------------------------------------------------------ life cycle
    def stop(self) -> None:
        """Safe from signal handlers and other threads: only sets a flag."""
        self._stop.set()

    def reload_keys(self) -> None:
        """Safe from signal handlers: the loop re-reads the allowed keys on its next pass."""
        self._reload.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        signal.signal(signal.SIGHUP, lambda *_: self.reload_keys())

    def bind(self) -> str:
        endpoint = self.ingress.bind()
        if self.config.metrics_port is not None:
            self._http = serve_metrics(self.metrics.registry, self.config.metrics_port,
                                       probes={"/health": self.health, "/ready": self.readiness})
        log.info("draft daemon listening on %s (backend %s, max depth %d, %s)", endpoint, self.backend.name,
                 self.config.max_depth, "CURVE" if self.ingress.allow else "plaintext")
        return endpoint

    def serve_forever(self, ready: threading.Event | None = None) -> None:
        if self.ingress.sock is None:
            self.bind()
        # The socket's thread needs the GIL to read, acknowledge and send; a short switch interval
        # bounds how long the batcher's Python keeps it waiting (it costs nothing while the thread
        # sleeps in its poll).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.ingress.start()
        if ready is not None:
            ready.set()
        self._next_sweep = time.monotonic() + 1.0
        drain_deadline = None
        failures = 0
        watchdog = Watchdog()
        notify("READY=1", f"STATUS=serving drafts on {self.endpoint}")
        self._serving = True
        try:
            while True:
                if watchdog.due():
                    watchdog.tick()
                self.last_pass = time.monotonic()
                if self._stop.is_set() and not self.draining:
                    drain_deadline = time.monotonic() + self.config.drain_s
                    self._start_draining()
                if self.draining and (self._drained() or time.monotonic() >= drain_deadline):
                    break
                if self.ingress.failure is not None:
                    raise LoopFailed("the socket thread failed") from self.ingress.failure
                try:
                    self._pass()
                    failures = 0
                except Exception as exc:  # outside any one request: count it, and give up only if it persists
                    failures += 1
                    self.stats.loop_errors += 1
                    log.exception("the serving loop failed (%d pass(es) in a row)", failures)
                    if failures >= self.MAX_FAILED_PASSES:
                        raise LoopFailed(f"the serving loop failed {failures} passes in a row") from exc
                    time.sleep(0.01)
        finally:
            self._serving = False
            if self.q_in:
                log.warning("stopping with %d draft requests unanswered", len(self.q_in))
            with self.lock:
                held = len(self.sessions.sessions)
            if held:
                log.warning("stopping with %d session(s) still open: their targets draft elsewhere or alone", held)
            if self.ingress.sock is not None and self.ingress.failure is None:
                self.ingress.say_goodbye(final=True)
            self.ingress.stop()
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()
            log.info("draft daemon stopped")

    def _drained(self) -> bool:
        """Draining is done: no request queued and no session open (its targets moved them)."""
        with self.lock:
            return not self.q_in and not self.sessions.sessions

    STALL_S = 120.0  # a batcher pass this late: /health fails (a hung loop; systemd's watchdog covers it too)

    def health(self) -> tuple[int, dict]:
        """Liveness, for the metrics port's /health: the batcher makes passes and the socket's
        thread runs. Draining is alive (its sessions are still served)."""
        behind = time.monotonic() - self.last_pass
        ok = self._serving and self.ingress.failure is None and behind < self.STALL_S
        return (200 if ok else 503), {"status": ("draining" if self.draining else "ok") if ok else "unhealthy",
                                      "instance": self.instance, "last_pass_s": round(behind, 3)}

    def readiness(self) -> tuple[int, dict]:
        """Readiness, for /ready: alive and taking new targets and sessions (not draining)."""
        code, body = self.health()
        if code == 200 and self.draining:
            code = 503
        return code, body

    MAX_FAILED_PASSES = 50  # passes in a row that fail outside any request: then the daemon exits non-zero

    def _pass(self) -> None:
        """One pass: wait (at most 100 ms) while nothing is queued and no work ahead is pending,
        free the sessions the ingress let go, serve the oldest waiting batch (the ingress's
        thread sends its replies), and once a second expire silent peers and sample the metrics."""
        if self._reload.is_set():
            self._reload.clear()
            with self.lock:
                self.ingress.reload_keys()
        arrived = self.ingress.arrived
        arrived.clear()  # before looking: what arrives after the look sets it again
        self._free_dropped()
        if not self.q_in and not (self.lookahead.has_work and not self.draining):
            arrived.wait(0.1)
            self._free_dropped()
        if self.q_in:
            self._fill_batch()
            self._serve_batch()
        elif self.lookahead.has_work and not self.draining:  # one forward, then the queue is looked at again
            self.lookahead.idle_step(self.estimate, self.lock, self.config.batch_prefill_tokens)
        now = time.monotonic()
        if now >= self._next_sweep:
            with self.lock:
                self.sessions.expire(now)
            self._free_dropped()
            self._sample_metrics(now)
            self._next_sweep = now + 1.0

    def _free_dropped(self) -> None:
        """Free the backend state of the sessions the ingress closed or re-opened and of those the
        table dropped on its own (between batches: no forward is using any)."""
        with self.lock:
            gone = self._take_dropped()
        for s in gone:
            self._release(s)

    def _take_dropped(self) -> list[Session]:
        """The sessions let go since the last call, to free; those the table dropped counted by
        why (call with the lock held)."""
        gone = self.ingress.take_released()
        for s, why in self.sessions.take_dropped():
            gone.append(s)
            if why == "expired":
                self.stats.sessions_expired += 1
                log.info("expired silent session %d of peer %s", s.key[1], s.key[0].hex())
            elif why == "evicted":
                self.stats.sessions_evicted += 1
            else:
                self.stats.sessions_disconnected += 1
        return gone

    def _start_draining(self) -> None:
        """Stop taking sessions, tell every peer we are leaving, answer what is already queued."""
        notify("STOPPING=1", "STATUS=draining")
        self.ingress.say_goodbye()

    def _fill_batch(self) -> None:
        """With a batch window, wait (at most the window) while the batch has room and some
        session is predicted to send its next request within the window; otherwise return at
        once. Replies to a batch go out together, so targets that answer fast come back
        together: a short wait turns their trickle of arrivals into one full batch."""
        window = self.config.batch_window_s
        if window <= 0 or self.config.batch_max <= 1:
            return
        start = time.monotonic()
        deadline = start + window
        waited = False
        arrived = self.ingress.arrived
        while True:
            arrived.clear()
            with self.lock:
                waiting = {item.key for item in self.q_in}
                if len(waiting) >= self.config.batch_max:
                    break
                now = time.monotonic()
                # sessions replied to and not back yet, due (by their usual turnaround) within the window
                due = False
                for key, s in list(self._awaited.items()):
                    t = None if s.replied_at is None or s.turnaround_s is None else s.replied_at + s.turnaround_s
                    if t is None or t < now - window or self.sessions.sessions.get(key) is not s:
                        del self._awaited[key]  # unpredictable, long overdue, or gone: never waited for again
                    elif t <= deadline and key not in waiting:
                        due = True
            if not due or now >= deadline:
                break
            waited = True
            if not arrived.wait(deadline - now):
                break
        if waited:
            self.stats.batch_waits += 1
            self.stats.batch_wait_s += time.monotonic() - start

    def _take_batch(self) -> tuple[list[QueuedRequest], QueuedRequest | None]:
        """At most batch_max waiting requests, one per session (a session's later request waits
        for the next pass, so each session's requests stay in order), shared fairly: each share
        (an address, or a CURVE key) gets one request in turn, the share served longest ago
        first, before any gets a second; inside a share its connections take turns the same way,
        each one's oldest first; in the batch, oldest first. So one host's backlog delays another's
        request by one batch at most, not by the backlog, and one process on a host with many
        sessions delays another on that host by one turn, not by its sessions.
        Then the prefill budget (``_within_budget``): the requests it leaves queued, and the one
        whose prompt gets a chunk fed this pass (or None)."""
        items = self.q_in
        by_share: dict = {}
        seen = set()
        rank: dict[int, int] = {}  # an item's place among its principal's waiting sessions
        per_principal: dict[bytes, int] = {}
        for i, item in enumerate(items):
            if item.key not in seen:
                seen.add(item.key)
                by_share.setdefault(item.share, []).append(i)
                rank[i] = per_principal.get(item.principal, 0)
                per_principal[item.principal] = rank[i] + 1
        for sh, idx in by_share.items():  # each connection's first, the one served longest ago first; then seconds
            idx.sort(key=lambda i: (rank[i], self._conn_turn.get(items[i].principal, 0), i))
        shares = sorted(by_share, key=lambda sh: (self._served_turn.get(sh, 0), min(by_share[sh])))
        taken: list[int] = []
        limit, depth = self.config.batch_max, 0
        while len(taken) < limit:
            row = [by_share[sh][depth] for sh in shares if depth < len(by_share[sh])]
            if not row:
                break
            taken.extend(row[: limit - len(taken)])
            depth += 1
        self._turn += 1
        for i in taken:
            self._served_turn[items[i].share] = self._turn
            self._conn_turn[items[i].principal] = self._turn
        self._served_turn = {sh: t for sh, t in self._served_turn.items() if sh in by_share}
        self._conn_turn = {p: t for p, t in self._conn_turn.items() if p in per_principal}
        chosen, chunk = self._within_budget(items, sorted(taken))
        batch = [items[i] for i in chosen]
        chosen = set(chosen)
        self.ingress.q_in = collections.deque(item for i, item in enumerate(items) if i not in chosen)
        for item in batch:
            self.ingress.dequeued(item)
        return batch, chunk

    def _within_budget(self, items, taken: list[int]) -> tuple[list[int], QueuedRequest | None]:
        """Of a fair batch (indices into ``items``, oldest first), those whose prompt tokens
        (``fed``) fit ``batch_prefill_tokens``, and the first that does not, for a chunk of its
        prompt (where the backend feeds prompts in chunks; one whose backend does not is drafted
        whole in a batch of its own, when it is oldest). A batch is never empty for the budget's
        sake: one request always goes, or a chunk is fed. A seeded session's prompt that fits a whole
        budget waits for one, never split where others left room (its output must not follow them)."""
        budget = self.config.batch_prefill_tokens
        if budget <= 0:
            return taken, None
        left, keep, chunk = budget, [], None
        for i in taken:
            fed = items[i].fed
            if fed <= left:
                keep.append(i)
                left -= fed
            elif chunk is None and self.backend.prefills and not (fed <= budget and self.sessions.seeded(items[i].key)):
                chunk = items[i]
            elif not keep and chunk is None:
                keep.append(i)  # drafted whole (no chunks), alone
                break
        return keep, chunk

    def _feed_chunk(self, item: QueuedRequest) -> None:
        """Feed a chunk of a long queued request's prompt (at most ``batch_prefill_tokens``)
        after this pass's replies; the request stays queued, costing what is left to feed. A
        chunk that can feed nothing (what is left comes with the request) lets it go whole next."""
        with self.lock:
            session = self.sessions.sessions.get(item.key)
            if session is None:  # closed meanwhile: its request goes to admission (UNKNOWN_SESSION) next
                self._requeue(item, 0)
                return
            if session.state is None:
                session.state = self._new_state(session)
            state, verified = session.state, list(session.verified)
        t0 = time.perf_counter()
        try:
            fed_now, left = self.backend.prefill(state, verified, self.config.batch_prefill_tokens)
        except Exception:  # the request is drafted whole instead
            log.exception("feeding a prompt chunk failed for session %d", item.key[1])
            fed_now, left = 0, 1
        seconds = time.perf_counter() - t0
        self.stats.busy_s += seconds
        self.stats.prefill_chunks += 1
        self.estimate.finished(seconds, 0, fed_now)
        # what the request still feeds: the rest of the prompt (its last token is drafting's) and its
        # new tokens; a chunk that fed nothing (what is left comes with the request) lets it go whole
        with self.lock:
            if self.sessions.sessions.get(item.key) is session and session.state is state:
                # what the backend holds now, so that the session's next requests are charged only
                # what it has not taken in (a request the suffix index answers feeds none of it)
                session.backend_held = max(session.backend_held, len(verified) - left)
            self._requeue(item, 0 if fed_now == 0 else left - 1 + len(item.msg.header["new"]))

    def _requeue(self, item: QueuedRequest, fed: int) -> None:
        """Charge a queued request ``fed`` prompt tokens from now on (with the lock held)."""
        q = self.ingress.q_in
        for j, queued in enumerate(q):
            if queued is item:
                q[j] = dataclasses.replace(item, fed=fed)
                self.ingress.queued_fed += fed - item.fed
                return

    def _new_state(self, session: Session) -> object:
        """A session's backend state, bound to the partition of kept prompts its text may come
        from: the suffix index's (its CURVE key's with --suffix-share key, everyone's with all);
        a seeded sampled session (its drafts follow its own requests alone) and --suffix-share off keep none."""
        state = self.backend.new_state(session.params)
        part = partition(self.config.suffix_share, self._text_principal(session.key[0]))
        if part is not None and not session.params.seeded:
            self.backend.bind_share(state, part)
        return state

    def _text_principal(self, principal: bytes) -> bytes:
        """Whose text a peer's sessions are: its key with CURVE; without, one principal for all
        (a connection is no tenant)."""
        return principal if self.sessions.durable else b""

    def _admit(self, principal: bytes, msg: Message, keep: set) -> DraftRequest:
        """Validate a DRAFT request against its session, reserve its cache memory and apply what
        it reports; refused (BUSY, TOO_LARGE), the session is as it was. ``keep``: the sessions
        admitted to this batch so far (never evicted to make room)."""
        h = msg.header
        sid, seq = h["session"], h["seq"]
        session = self.sessions.get(principal, sid, seq)
        if session.state is None:  # opened since its last request: its backend state is made here
            session.state = self._new_state(session)
        features = msg.tensors.get("features") if self.backend.feature_size else None
        if features is not None and session.features + features.shape[0] != h["pos"] - 1:
            raise ProtocolError(
                ErrorCode.DESYNC,
                f"the session holds {session.features} features; {features.shape[0]} more make "
                f"{session.features + features.shape[0]}, but {h['pos'] - 1} are needed; re-open the session",
                sid, seq)
        session.check(h["accepted"], h["new"], h["pos"], seq)
        if features is not None:
            held = features.shape[0]
            if session.pending_features:  # those of rounds a suffix draft answered, not fed yet
                features = torch.cat([*session.pending_features, as_torch(features).float()])
        tree = self._tree_budget(session, h)
        try:
            room = self.backend.tree_room(h["depth"], tree, session.params.greedy)
            self.sessions.reserve(session, h["pos"] + room, seq, keep)
        except ProtocolError:
            if not tree:
                raise
            tree = 0  # no memory for the tree's drafting: a chain, if that fits
            self.sessions.reserve(session, h["pos"] + h["depth"], seq, keep)
        before = len(session.verified)
        session.advance(h["accepted"], h["new"], h["pos"], seq)
        if features is not None:
            session.features += held
            session.pending_features = []
        self._note_text(session, principal, before, h)
        return DraftRequest(session.state, session.verified, h["depth"], features, tree, h.get("min_survival", 0.0),
                            h.get("min_chance", 0.0))

    def _note_text(self, session: Session, principal: bytes, before: int, h: dict) -> None:
        """The session's text in the suffix index takes its newly verified tokens (from
        ``before``), and the outcome of its last round (the DRAFT header ``h`` reports) is learnt."""
        index = self.suffix
        if index is None:
            return
        text: SuffixText | None = session.suffix
        if text is None:
            seeded = session.params.seeded
            # a seeded sampled session's drafts must follow its own requests alone: no shared text
            text = session.suffix = index.open(self._text_principal(principal), session.verified[:before],
                                               shared=not seeded)
            self.backend.bind_text(session.state, text)
        else:
            kept = text.kept_of(h["accepted"], h["new"])
            if text.last_source == "suffix":
                self.stats.suffix["kept"] += kept
            text.learn(kept)
        index.extend(text, session.verified[before:])

    def _suffix_drafts(self, admitted: list[AdmittedRequest], todo: list[int]) -> dict[int, tuple[Draft, float]]:
        """The requests a suffix draft answers, with the seconds each took: where one scores at
        least what the backend's drafts keep for that session. A sampled session gets a chain,
        each token's q one-hot."""
        index = self.suffix
        if index is None or not todo:
            return {}
        with self.lock:
            sessions = [self.sessions.sessions.get(admitted[i].key) for i in todo]
        won: dict[int, tuple[Draft, float]] = {}
        for i, session in zip(todo, sessions):
            item = admitted[i]
            if session is None or session.state is not item.request.state or session.suffix is None:
                continue
            features = item.request.new_features
            if features is not None and features.shape[0] > MAX_PENDING_FEATURES:
                continue  # the backend's turn: what it has not taken in is bounded
            text: SuffixText = session.suffix
            h = item.header
            greedy = session.params.greedy
            t0 = time.perf_counter()
            found = index.propose(text, h["depth"], h.get("tree_tokens", 0) if greedy else 0,
                                  h.get("min_chance") or h.get("min_survival", 0.0))
            if found is None or not text.choose(found.score):
                continue
            text.drafted(found)
            if features is not None and features.shape[0]:  # the backend takes them with the next request's
                session.pending_features = [as_torch(features).to(torch.float32, copy=True)]
            won[i] = (_suffix_draft(found, greedy), time.perf_counter() - t0)
            self.stats.suffix["requests"] += 1
            self.stats.suffix["tokens"] += len(found.tokens)
        return won

    def _tree_budget(self, session: Session, h: dict) -> int:
        """The tree tokens a DRAFT is drafted with (0: a chain): what it asks, where the backend
        drafts trees; halved while requests wait behind this batch (smaller trees, sooner),
        except for seeded sampled sessions, whose tokens follow the tree's shape."""
        tree = h.get("tree_tokens", 0)
        if self.backend.tree_topk <= 1 or tree <= h["depth"]:
            return 0
        if self.q_in and not session.params.seeded:
            tree = max(h["depth"], tree // 2)
            self.stats.trees["shrunk"] += 1
        return tree if tree > h["depth"] else 0

    def _serve_batch(self) -> None:
        admitted: list[AdmittedRequest] = []
        keys: set = set()
        start = time.perf_counter()  # the batch begins: its requests' wait in the queue ends
        with self.lock:
            batch, chunk = self._take_batch()
            for item in batch:
                try:
                    request = self._admit(item.principal, item.msg, keys)
                except ProtocolError as exc:
                    exc.re = MsgType.DRAFT
                    self.ingress.error(item.identity, exc)
                    continue
                admitted.append(AdmittedRequest(item.identity, item.msg.header, item.key, request, item.read_at,
                                                item.queued_at, item.fed))
                keys.add(item.key)
            gone = self._take_dropped()  # evicted to make room for these (none of them), counted now
        # They, and the sessions let go from here on (by the socket's thread, this batch's among
        # them), are freed once the batch is drafted, never under its forwards.
        try:
            self._draft_batch(admitted, start)
        finally:
            if chunk is not None:  # after the batch's replies are out
                self._feed_chunk(chunk)
            for s in gone:
                self._release(s)
            self._free_dropped()

    def _draft_batch(self, admitted: list[AdmittedRequest], start: float) -> None:
        """Draft the admitted requests (those work ahead answers first) and queue their replies."""
        if not admitted:
            return
        stats = self.stats
        drafts: list[Draft | None] = [None] * len(admitted)
        spent = [0.0] * len(admitted)  # each request's drafting time (what its reply reports)
        # requests a suffix draft answers go out at once: they cost no forward, and each won
        # against what the backend's drafts keep for its session (SuffixText.choose), work the
        # backend did ahead included; those answered from work done ahead go out next, before
        # the others are drafted
        suffixed = self._suffix_drafts(admitted, list(range(len(admitted))))
        self._send_early(admitted, suffixed, drafts, spent, start)
        ahead = self.lookahead.answered(admitted, superseded=suffixed)
        self._send_early(admitted, ahead, drafts, spent, start)
        todo = [i for i in range(len(admitted)) if i not in ahead and i not in suffixed]
        steps = max((admitted[i].request.depth for i in todo), default=0)
        fed = sum(admitted[i].fed for i in todo)
        t0 = time.perf_counter()
        self.estimate.started(steps, fed, t0)
        try:
            if todo:
                for i, d in zip(todo, self.backend.draft_many([admitted[i].request for i in todo])):
                    drafts[i] = d
        except Exception:  # a failing draft costs these rounds (targets verify alone), not the daemon
            log.exception("drafting failed for %d session(s)", len(todo))
            for i in todo:
                h = admitted[i].header
                self.ingress.error(admitted[i].identity, ProtocolError(ErrorCode.INTERNAL, "drafting failed",
                                                                       h["session"], h["seq"], MsgType.DRAFT))
            todo = []  # answered (with an error); the hits above still need their bookkeeping
        finally:
            elapsed = time.perf_counter() - t0
            stats.busy_s += elapsed + sum(spent)
            self.estimate.finished(elapsed if todo else 0.0, steps, fed)
        served = [i for i in range(len(admitted)) if drafts[i] is not None]
        # counted before the replies leave, so a target that saw its reply sees it counted
        stats.requests += len(todo)
        stats.drafted_tokens += sum(len(drafts[i].tokens) for i in todo)
        if served:
            stats.batches += 1
            stats.batched_requests += len(served)
        for i in todo:
            spent[i] = elapsed
            self._reply(admitted[i], drafts[i], start, elapsed)
        self.ingress.flush()
        # the rest of the bookkeeping is off the targets' critical path
        if len(todo) == 1 and drafts[todo[0]].parents is None:  # a chain alone: what fresh forwards cost,
            one = self.sessions.sessions.get(admitted[todo[0]].key)  # once its session was drafted before
            if one is not None and one.last_draft:
                self.lookahead.note_fresh(elapsed, len(drafts[todo[0]].tokens))
        done = time.perf_counter()
        parts = stats.request_s
        for i in served:
            queued = start - admitted[i].queued_at
            parts["queue"] += queued
            parts["draft_forward"] += spent[i]
            parts["rest"] += (done - admitted[i].read_at) - queued - spent[i]
        stats.profiled += len(served)
        with self.lock:
            self._after_replies(admitted, drafts, served)
        if served:
            self.metrics.on_batch(len(served), elapsed + sum(spent[i] for i in ahead))

    def _send_early(self, admitted: list[AdmittedRequest], answered: dict[int, tuple[Draft, float]],
                    drafts: list[Draft | None], spent: list[float], start: float) -> None:
        """Send the replies of the requests ``answered`` before the batch's forwards (index ->
        (drafts, seconds they took)), counted before they leave, as the batch's are."""
        if not answered:
            return
        self.stats.requests += len(answered)
        self.stats.drafted_tokens += sum(len(d.tokens) for d, _ in answered.values())
        for i, (draft, seconds) in answered.items():
            drafts[i], spent[i] = draft, seconds
            self._reply(admitted[i], draft, start, seconds)
        self.ingress.flush()

    def _after_replies(self, admitted: list[AdmittedRequest], drafts: list[Draft | None], served: list[int]) -> None:
        """The served sessions' bookkeeping once their replies are out: tree and stopping counts,
        their last drafts and their next rounds drafted ahead."""
        for i in served:
            key, req = admitted[i].key, admitted[i].request
            draft = drafts[i]
            session = self.sessions.sessions.get(key)
            if session is not None and session.state is not req.state:
                session = None  # closed or re-opened while it was drafted: the new one starts afresh
            text = session.suffix if session is not None else None
            from_suffix = text is not None and text.last_source == "suffix"
            if text is not None:
                if not from_suffix:
                    text.last_source = "model"
                text.last_tree = (list(draft.tokens), list(draft.parents)) if draft.parents is not None else None
            if session is not None and not from_suffix:
                session.backend_held = len(req.verified)  # what the backend took in (ingress charges the rest)
            if draft.parents is not None:
                self.stats.trees["requests"] += 1
                self.stats.trees["tokens"] += len(draft.tokens)
            elif req.min_survival > 0.0 and self.backend.stops_drafts and not from_suffix:
                stop = self.stats.stopping
                stop["requests"] += 1
                stop["stopped"] += len(draft.tokens) < req.depth
                stop["drafts_saved"] += max(req.depth - len(draft.tokens), 0)
            if session is not None:
                # a tree's kept path is no prefix of its tokens: the target reports it as new tokens
                session.last_draft = list(draft.tokens) if draft.parents is None else []
                h = admitted[i].header
                session.last_reply = None if draft.parents is not None else LastReply(h["seq"], ask_of(h), draft)
                if self.config.lookahead and not self.draining and draft.parents is None and not from_suffix:
                    self.lookahead.start(session, draft, ahead_depth(self.config.max_depth, req.depth), h["seq"])
                elif self.config.lookahead and from_suffix:  # its draft model missed this round's tokens
                    self.lookahead.note_behind(session)

    def _reply(self, item: AdmittedRequest, draft: Draft, start: float, seconds: float) -> None:
        """Queue one DRAFTED reply: its drafts, its wait in the queue (to ``start``, when its
        batch began) and the drafting time it reports."""
        h = item.header
        reply = drafted(h["session"], h["seq"], draft, start - item.queued_at, seconds)
        if self.config.batch_window_s > 0:  # before it leaves: the session's next request may come at once
            with self.lock:
                session = self.sessions.sessions.get(item.key)
                if session is not None and session.state is item.request.state:
                    session.replied_at = time.monotonic()
                    self._awaited[item.key] = session
        self.ingress.send(item.identity, reply)

    def _release(self, session: Session) -> None:
        """Free a session's backend state, dropping any work done ahead for it first."""
        self.lookahead.drop(session)
        if session.state is not None:
            self.backend.release(session.state)

    def _sample_metrics(self, now: float) -> None:
        t0, busy0 = self._busy_mark
        busy = (self.stats.busy_s - busy0) / max(1e-9, now - t0)
        self._busy_mark = (now, self.stats.busy_s)
        self.metrics.busy_fraction = min(1.0, busy)

    def snapshot(self) -> dict:
        with self.lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        snap = self.stats.snapshot(len(self.sessions.sessions), len(self.q_in), len(self.sessions.conns))
        snap["addresses"] = len(self.sessions.address_conns)
        snap["kv_bytes"] = self.sessions.kv_bytes
        snap["backend"] = self.backend.counters()
        snap["queue_bytes"] = self.ingress.queue_bytes
        snap["estimate"] = {"step_s": self.estimate.step_s, "token_s": self.estimate.token_s}
        snap["limits"] = self.budgets()
        snap["memory"] = memory_report(self.backend.weights_bytes)
        if self.suffix is not None:
            snap["suffix"] = {**snap["suffix"], **self.suffix.snapshot()}
        return snap

    def budgets(self) -> dict:
        """The configured bounds a snapshot's usage figures are measured against: the session
        table's (TableLimits, kv_bytes_per_token included) and the queue's."""
        c = self.config
        return {**dataclasses.asdict(self.sessions.limits), "max_queue": c.max_queue,
                "max_queue_bytes": c.max_queue_bytes, "max_peer_queue": c.max_peer_queue,
                "max_peer_queue_bytes": c.max_peer_queue_bytes}


def _suffix_draft(found: SuffixDraft, greedy: bool) -> Draft:
    """A suffix draft as a reply's Draft: a sampled one with q one-hot at each drafted token
    (speculative sampling then keeps a token with the target's probability of it)."""
    if greedy:
        return Draft(list(found.tokens), parents=found.parents)
    k = len(found.tokens)
    return Draft(list(found.tokens), np.asarray(found.tokens, dtype=np.int32).reshape(k, 1),
                 np.ones((k, 1), dtype=np.float32))
