"""The draft daemon's counters: what STATS answers and the metrics are read from."""

from __future__ import annotations

import collections
import time

REQUEST_PARTS = ("queue", "draft_forward", "rest")  # where a served draft request's time goes (Stats.request_s)


class Stats:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.busy_s = 0.0
        self.requests = 0
        self.drafted_tokens = 0
        self.sessions_opened = 0
        self.sessions_expired = 0
        self.sessions_evicted = 0
        self.sessions_disconnected = 0  # dropped with their connection (gone, or its identity reused)
        self.disconnects = 0
        self.unroutable = 0
        self.dropped_replies = 0
        self.key_reloads = 0
        self.batches = 0
        self.batched_requests = 0
        self.batch_waits = 0  # passes that waited for a batch to fill (batch window)
        self.batch_wait_s = 0.0
        self.queue_bytes_peak = 0
        self.loop_errors = 0
        self.acks = 0  # DRAFT requests acknowledged on arrival (ACK: queued, with an estimate)
        self.repeats = 0  # DRAFT requests that brought and asked nothing new, answered with the last drafts
        self.prefill_chunks = 0  # chunks of long prompts fed apart from their requests (batch_prefill_tokens)
        # Where the draft requests served went, summed over them (seconds): "queue" from being
        # queued to the start of its batch, "draft_forward" its batch's backend call, "rest" the
        # remainder of its time from its reading off the socket to its reply's send (decode and
        # checks on arrival, admission, encode, send). The parts add up to the requests' time here.
        self.request_s = {part: 0.0 for part in REQUEST_PARTS}
        # Lookahead: requests answered from work done ahead (hit: it was done; late_hit: it was
        # finished on arrival), requests whose sequence it had not guessed (miss), work dropped
        # unused with its session (dropped), rounds not drafted ahead for a session it rarely
        # answers (skipped), work a suffix draft made unneeded (superseded: the suffix draft answered
        # its request); the forward steps it ran and their seconds (idle time
        # used: steps run only with nothing queued; finishing a late hit counts as drafting)
        self.lookahead = {"started": 0, "hits": 0, "late_hits": 0, "misses": 0, "dropped": 0, "skipped": 0,
                          "superseded": 0, "failed": 0, "steps": 0, "idle_s": 0.0}
        # Draft trees: replies that were trees, their tokens, and trees drafted smaller than
        # asked because requests were queued behind their batch
        self.trees = {"requests": 0, "tokens": 0, "shrunk": 0}
        # Adaptive draft length on this side: chain requests that asked it to stop early
        # (min_survival), those answered with fewer drafts than their depth, and the drafts not made
        self.stopping = {"requests": 0, "stopped": 0, "drafts_saved": 0}
        # Suffix drafts (starsd_draftd.suffix): requests they answered, their tokens, and the
        # drafts of theirs kept (learnt at each session's next request)
        self.suffix = {"requests": 0, "tokens": 0, "kept": 0}
        # Idle passes' feeds of verified tokens the draft model missed while suffix drafts
        # answered (starsd_draftd.lookahead.LookaheadServing.catch_up): forwards, tokens, seconds
        self.catch_up = {"feeds": 0, "tokens": 0, "seconds": 0.0}
        self.profiled = 0  # the requests those sums are over (each served one, once its reply went out)
        self.errors: collections.Counter[str] = collections.Counter()

    def snapshot(self, live_sessions: int, queue_depth: int, peers: int) -> dict:
        return {
            "uptime_s": time.monotonic() - self.started,
            "busy_s": self.busy_s,
            "requests": self.requests,
            "drafted_tokens": self.drafted_tokens,
            "sessions_opened": self.sessions_opened,
            "sessions_expired": self.sessions_expired,
            "sessions_evicted": self.sessions_evicted,
            "sessions_disconnected": self.sessions_disconnected,
            "disconnects": self.disconnects,
            "live_sessions": live_sessions,
            "queue_depth": queue_depth,
            "peers": peers,
            "unroutable": self.unroutable,
            "dropped_replies": self.dropped_replies,
            "key_reloads": self.key_reloads,
            "batches": self.batches,
            "batched_requests": self.batched_requests,
            "batch_waits": self.batch_waits,
            "batch_wait_s": self.batch_wait_s,
            "queue_bytes_peak": self.queue_bytes_peak,
            "loop_errors": self.loop_errors,
            "acks": self.acks,
            "repeats": self.repeats,
            "prefill_chunks": self.prefill_chunks,
            "errors": dict(self.errors),
            "request_profile": {"requests": self.profiled, "seconds": dict(self.request_s)},
            "lookahead": dict(self.lookahead),
            "trees": dict(self.trees),
            "stopping": dict(self.stopping),
            "suffix": dict(self.suffix),
            "catch_up": dict(self.catch_up),
        }
