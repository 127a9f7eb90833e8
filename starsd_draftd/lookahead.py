"""The draft daemon's lookahead: drafting a served session's next round ahead of its request.

``DraftServer`` (``starsd_draftd.server``) owns one ``LookaheadServing``: after its replies it
queues the work ahead (``start``), runs one forward of it per loop pass while nothing is queued
(``step``), has the requests that bring a guessed sequence answered from it (``answered``) and
drops it when it frees the session (``drop``). The backend drafts the guesses
(``DraftBackend.lookahead``; docs/architecture.md, "Lookahead and adaptive draft length").

Idle passes also feed the draft model what it missed while the suffix index answered a session
(``note_behind``, ``idle_step``): those rounds' verified tokens, which its next drafting would
otherwise feed in one forward on the target's critical path.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from common.protocol import ProtocolError
from starsd_draftd.backends.base import Draft, DraftBackend, Lookahead
from starsd_draftd.eta import ServiceEstimate
from starsd_draftd.records import AdmittedRequest
from starsd_draftd.sessions import Session, SessionTable
from starsd_draftd.stats import Stats

log = logging.getLogger("starsd.draftd")

# Lookahead's gate: a session's share of requests answered from work ahead is smoothed with this
# weight per request; below the minimum it is drafted ahead only every PROBE_EVERY rounds (enough
# to notice when its text gets predictable).
LOOKAHEAD_SMOOTHING = 0.25
LOOKAHEAD_MIN_SCORE = 0.25
LOOKAHEAD_PROBE_EVERY = 8
FRESH_SMOOTHING = 0.2  # weight of each new measure of a fresh draft forward's seconds
# verified tokens a session's draft model lags by (suffix-answered rounds) before idle passes feed
# them: fewer cost its next drafting about nothing more, a forward being a pass over the weights
CATCH_UP_MIN = 8


def ahead_depth(max_depth: int, asked: int) -> int:
    """Drafts made ahead for a session whose request asked for ``asked``: one more (a target that
    picks its own length may ask for it after a round answered from work ahead), within the
    daemon's ``max_depth``."""
    return min(max_depth, asked + 1)


class LookaheadServing:
    """Lookahead's part of the draft daemon's loop: the sessions with work ahead, and what is done
    with it. It drafts with the server's backend, reserves memory in its session table and counts
    in its ``stats.lookahead``."""

    def __init__(self, backend: DraftBackend, sessions: SessionTable, stats: Stats):
        self.backend = backend
        self.sessions = sessions
        self.stats = stats
        # sessions whose lookahead has steps left, the one replied to longest ago (back soonest) first
        self.pending: collections.OrderedDict[tuple[bytes, int], Session] = collections.OrderedDict()
        self.fresh_step_s: float | None = None  # smoothed seconds of a forward drafting on request (``note_fresh``)
        # sessions whose draft model lags behind their verified tokens, the one noted first first
        self.behind: collections.OrderedDict[tuple[bytes, int], Session] = collections.OrderedDict()

    @property
    def has_work(self) -> bool:
        """Whether an idle pass has anything to do (``idle_step``)."""
        return bool(self.pending or self.behind)

    def answered(self, admitted: list[AdmittedRequest], superseded=()) -> dict[int, tuple[Draft, float]]:
        """The admitted requests lookahead answers, as (drafts, seconds it took now): those whose
        session drafted ahead for exactly the sequence the request brings, done, or nearly done
        (a late hit: finished now, when what is left costs less than drafting it afresh:
        ``finishing_pays``); at most the depth asked. Any other work ahead is dropped, and its
        request drafted as without lookahead; so is the work of the requests ``superseded``
        (indices already answered otherwise: by a suffix draft)."""
        out: dict[int, tuple[Draft, float]] = {}
        st = self.stats.lookahead
        for i, item in enumerate(admitted):
            key, req = item.key, item.request
            session = self.sessions.sessions.get(key)
            task = session.ahead if session is not None else None
            if task is None:
                continue
            session.ahead = None
            self.pending.pop(key, None)
            if i in superseded:  # answered without it: for the gate, work that did not answer
                session.ahead_score += LOOKAHEAD_SMOOTHING * (0.0 - session.ahead_score)
                task.close()
                st["superseded"] += 1
                continue
            guess = task.match(req.verified)
            late = not task.done
            if guess is not None and late and not self.finishing_pays(task, req.depth):
                guess = None  # too far from done: drafting afresh is quicker
            session.ahead_score += LOOKAHEAD_SMOOTHING * ((guess is not None) - session.ahead_score)
            if guess is None:
                task.close()
                st["misses"] += 1
                continue
            t0 = time.perf_counter()
            try:
                # a late hit's remaining steps are drafting, on the request's time
                draft = self.backend.finish_ahead(session.state, req, task.take(guess))
            except Exception:  # work ahead is optional: drafted afresh instead
                log.exception("finishing the work ahead failed for session %d", key[1])
                task.close()
                st["failed"] += 1
                continue
            st["late_hits" if late else "hits"] += 1
            out[i] = (draft, time.perf_counter() - t0)
        return out

    def note_fresh(self, seconds: float, tokens: int) -> None:
        """A request drafted on arrival, alone in its batch and after an earlier draft of its
        session (so no prompt prefill in its time): ``seconds`` for ``tokens`` drafts, about one
        forward each (its new tokens go in one), which ``finishing_pays`` weighs a late hit's
        remaining steps against."""
        if tokens > 0 and seconds > 0:
            per_step = seconds / tokens
            prev = self.fresh_step_s
            self.fresh_step_s = per_step if prev is None else prev + FRESH_SMOOTHING * (per_step - prev)

    def finishing_pays(self, task: Lookahead, depth: int) -> bool:
        """Whether a request that brings a guessed sequence before its work ahead is done is
        answered by finishing that work rather than by drafting ``depth`` tokens afresh: the
        steps left at the seconds its steps have taken (every guess's row, the first step's cache
        copies included) against ``depth`` forwards at the measured seconds of a fresh one. Where
        a draft step costs a third of a verification, a request arrives with two or three of the
        work's ``depth`` + 1 steps left, and at real sizes a batched step costs about one row's:
        finishing saves one to two forwards. Until both are measured, at most half the depth
        left (on a small model, a step over four rows costs up to twice one row's)."""
        left = task.steps_left
        if left is None:
            return True  # a backend that does not say how long its work takes: finished, as always
        if self.fresh_step_s is None or task.steps == 0:
            return 2 * left <= depth
        return left * (task.seconds / task.steps) < depth * self.fresh_step_s

    def start(self, session: Session, draft: Draft, depth: int, seq: int) -> None:
        """Queue the drafting of ``session``'s next round ahead of its request, when its cache
        memory fits in what is free without evicting anyone. A session whose requests work
        ahead rarely answers (score below LOOKAHEAD_MIN_SCORE) is drafted ahead only every
        LOOKAHEAD_PROBE_EVERY rounds: a request that comes during a step waits for it, and on
        shared hardware the steps compete with the target's verification for memory bandwidth;
        a few hits would not repay that (measured on the demo pair: 14% hits, no gain)."""
        if session.ahead_score < LOOKAHEAD_MIN_SCORE and session.ahead_skipped + 1 < LOOKAHEAD_PROBE_EVERY:
            session.ahead_skipped += 1
            self.stats.lookahead["skipped"] += 1
            return
        session.ahead_skipped = 0
        if not self.backend.drafts_ahead or session.params.seeded:
            return  # a seeded sampled session's drafts come from one kind of forward: its output stays put
        length = len(session.verified) + len(draft.tokens) + 2 + depth  # the furthest position a guess drafts
        if self.backend.max_len is not None and length > self.backend.max_len:
            return  # near the end of the drafter's context: drafted on request, within its bounds
        try:  # every guess is a copy of the session's cache: its memory is the session's too
            self.sessions.reserve(session, length * self.backend.lookahead_rows(draft), seq,
                                  keep=set(self.sessions.sessions))
        except ProtocolError:
            return  # no room: the next request is drafted on arrival
        task = self.backend.lookahead(session.state, session.verified, draft, depth)
        if task is None:
            return
        session.ahead = task
        self.pending[session.key] = session
        self.stats.lookahead["started"] += 1

    def idle_step(self, estimate: ServiceEstimate, lock: threading.Lock, chunk_max: int) -> None:
        """One forward while nothing is queued: of work ahead where any is pending, else of a
        lagging session's verified tokens (``catch_up``). ``estimate`` learns that a request
        arriving now waits for it."""
        if self.pending:
            estimate.started(1, 0)
            self.step()
            estimate.finished(0.0, 0, 0)
        else:
            self.catch_up(estimate, lock, chunk_max)

    def note_behind(self, session: Session) -> None:
        """A suffix draft answered ``session``'s request (call with the server's lock held): its
        draft model has not taken in the tokens verified since it last drafted. Where they are
        CATCH_UP_MIN or more, idle passes feed them. Not for a seeded sampled session: how its
        prompt is split into forwards changes its drafts' last bits, and so its output."""
        if not self.backend.prefills or session.state is None or session.params.seeded:
            return
        held = self.backend.held(session.state, session.verified)  # the kept drafts of its last chain too
        if held is not None:
            session.backend_held = max(session.backend_held, min(held, len(session.verified) - 1))
        if len(session.verified) - 1 - session.backend_held >= CATCH_UP_MIN:
            self.behind[session.key] = session

    def catch_up(self, estimate: ServiceEstimate, lock: threading.Lock, chunk_max: int) -> None:
        """Feed the lagging session noted first at most a chunk of its verified tokens: about as
        many as cost one draft step (at least CATCH_UP_MIN, at most ``chunk_max`` when > 0), so
        that a request arriving meanwhile waits about what it would wait for a step of work
        ahead. The session is noted again while CATCH_UP_MIN or more are left."""
        key, session = self.behind.popitem(last=False)
        with lock:
            if (self.sessions.sessions.get(key) is not session or session.state is None
                    or session.ahead is not None):
                return  # gone, or drafting ahead for it (which feeds what it drafts from)
            state, verified = session.state, list(session.verified)
            if len(verified) - 1 - session.backend_held < CATCH_UP_MIN:
                return  # its request came meanwhile and the model drafted for it
        chunk = max(CATCH_UP_MIN, int(estimate.cost_s(1, 0) / max(estimate.cost_s(0, 1), 1e-9)))
        chunk = min(chunk, chunk_max) if chunk_max > 0 else chunk
        estimate.started(0, chunk)
        t0 = time.perf_counter()
        try:
            fed, left = self.backend.prefill(state, verified, chunk)
        except Exception:  # optional work: its next drafting feeds them instead
            log.exception("feeding verified tokens while idle failed for session %d", key[1])
            return
        finally:  # not learnt from: a short chunk's fixed cost would read as a dearer token
            estimate.finished(0.0, 0, 0)
        seconds = time.perf_counter() - t0
        if fed > 0:
            st = self.stats.catch_up
            st["feeds"] += 1
            st["tokens"] += fed
            st["seconds"] += seconds
        with lock:
            if self.sessions.sessions.get(key) is session and session.state is state:
                session.backend_held = max(session.backend_held, len(verified) - left)
                if left - 1 >= CATCH_UP_MIN and fed > 0:
                    self.behind[key] = session

    def step(self) -> None:
        """One forward of the lookahead of the session replied to longest ago."""
        key, session = next(iter(self.pending.items()))
        task = session.ahead
        t0 = time.perf_counter()
        try:
            done = task.step()
        except Exception:  # work ahead is optional: a failure costs it, not the session
            log.exception("drafting ahead failed for session %d", key[1])
            self.stats.lookahead["failed"] += 1
            session.ahead = None
            self.pending.pop(key, None)
            task.close()
            return
        finally:
            spent = time.perf_counter() - t0
            self.stats.lookahead["steps"] += 1
            self.stats.lookahead["idle_s"] += spent  # not busy_s: that is drafting for requests
        if done:
            self.pending.pop(key, None)

    def drop(self, session: Session) -> None:
        """Drop any work done ahead for ``session`` (which is going: its state is freed next)."""
        if self.behind.get(session.key) is session:
            del self.behind[session.key]
        task = session.ahead
        if task is not None:
            session.ahead = None
            self.pending.pop(session.key, None)
            task.close()
            self.stats.lookahead["dropped"] += 1
