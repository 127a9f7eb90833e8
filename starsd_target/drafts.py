"""One generation's drafts from a draft daemon, as the scheduler drives them: what the daemon
holds of the session, the request in flight and when to stop waiting for it, and which daemon of
the target's pool (``starsd_target.pool``) the session lives on."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from common.protocol import ErrorCode, RemoteError
from common.verify import SamplingParams
from starsd_target.client import DraftClient, DraftReply, Welcome

log = logging.getLogger("starsd.target.client")


class RemoteDraftSession:
    """One generation's drafts from a draft daemon, as the scheduler drives them.

    Tracks what the daemon has verified, so each request carries only the tokens (and, for
    feature backends, the features) verified since the previous one. A round that got no drafts
    reports 0 accepted next time; an error about the session (unknown after a restart, out of
    sync), or a different daemon instance after a reconnect, re-opens it with the full verified
    prefix. ``pool`` (a ``starsd_target.pool.DraftPool``, or one ``DraftClient``) says at each
    round which link the session asks (``client``): where it lives while that daemon is healthy;
    another once it fails or drains, where the session re-opens with its verified tokens.

    ``send()`` puts a request in flight; ``expired()`` says when to stop waiting for it: an
    acknowledgement's round trip, then the daemon's estimate (``DraftClient.give_up_at``), capped
    by ``timeout_s`` (a seeded sampled generation's, on a link that answers, only by the cap).
    ``resolve()`` turns what came (None: nothing in time) into drafts, giving the request up when
    nothing came."""

    def __init__(self, pool, session: int, params: SamplingParams, timeout_s: float):
        self.pool = pool
        self.client: DraftClient | None = None  # the link it lives on (placed at its first request)
        self.moves = 0  # times it moved to another daemon
        self.session = session
        self.params = params
        self.timeout_s = timeout_s
        self.seq = 0
        self.synced = 0  # verified tokens the daemon held when it drafted the last proposal
        self.accepted = 0  # how many of that proposal the target kept
        self.features_sent = 0
        self.instance: str | None = None  # the daemon instance holding this session
        self.errors = 0
        self.disabled = False  # the sequence outgrew the drafter's context: no more drafts for it
        self.sent_at = 0.0  # the request in flight: when it went out,
        self.cap_at = 0.0  # and when waiting for it ends in any case
        self.open_refusals = 0  # OPENs of this session the daemon refused
        self._before = (0, 0, 0)  # (synced, accepted, features_sent) before the request in flight
        self.tree = False  # the last reply was a tree: what it kept is reported as new tokens
        self._retry_delay = pool.backoff.initial_s  # after a refusal (BUSY), the next request waits this
        self._retry_at = 0.0  # long, until then; doubling up to the backoff's cap

    @property
    def welcome(self) -> Welcome | None:
        """What its daemon said (before it is placed, what the pool's daemons said)."""
        return (self.client or self.pool).welcome

    @property
    def feature_size(self) -> int:
        w = self.welcome
        return w.feature_size if w is not None else 0

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The hidden states the daemon's head fuses per feature (None: the final one)."""
        w = self.welcome
        return w.feature_layers if w is not None else None

    @property
    def trees(self) -> bool:
        """The draft daemon drafts trees (a request's tree_tokens is then heeded)."""
        w = self.welcome
        return w is not None and w.trees

    @property
    def stops_drafts(self) -> bool:
        """The draft daemon stops greedy chains early (a request's min_survival is then heeded)."""
        w = self.welcome
        return w is not None and w.stops_drafts

    def _link(self, tokens: list[int]) -> DraftClient | None:
        """The link to ask this round (``pool.place``), moving the session when it changes: closed
        on the old daemon where that one still answers, re-opened on the new one with the verified
        tokens. None: no daemon is up."""
        link = self.pool.place(tokens, self.client)
        old = self.client
        if link is None or link is old:
            return link
        if old is not None:
            if old.up:  # what it holds of this session is let go (after an error too)
                old.close_session(self.session)
            old.take_open_refusal(self.session)
            old.sessions -= 1
            self.moves += 1
        link.sessions += 1
        self.client, self.instance = link, None
        self._retry_delay, self._retry_at = self.pool.backoff.initial_s, 0.0
        return link

    def send(self, tokens: list[int], depth: int, features: np.ndarray | torch.Tensor | None = None,
             tree_tokens: int = 0, feature_layers: tuple[int, ...] | None = None,
             min_survival: float = 0.0, min_chance: float = 0.0) -> int | None:
        """Ask for drafts following ``tokens``; the sequence number in flight, or None when no
        request could go out (link not up, no features): the round then runs without drafts.
        ``tree_tokens`` > ``depth``: a tree of up to that many tokens may answer, where the
        daemon drafts trees (within its ``max_tree_tokens``). ``feature_layers``: the hidden
        states ``features`` were fused from (None: the final one); features the daemon's head
        does not read (another head since the generation started) end its drafting, logged.
        ``min_survival``: where the daemon stops greedy chains early (``stops_drafts``), the
        chance of all drafts kept below which it stops; ``min_chance`` the same for drafts its
        suffix index copies (they cost no drafting)."""
        if self.disabled or not self.pool.ready():
            return None
        client = self._link(tokens)
        if client is None or time.monotonic() < self._retry_at:
            return None
        welcome = client.welcome
        if welcome.max_len and len(tokens) + min(depth, welcome.max_depth) > welcome.max_len:
            self._stop_drafting(f"it outgrew the drafter's {welcome.max_len} positions")
            return None
        opening = self.instance != welcome.instance
        if opening:
            if not self._may_open():
                return None
            try:
                sent = client.open(self.session, tokens, self.params)
            except ValueError as exc:  # parameters the wire cannot carry
                self._stop_drafting(f"it cannot be opened: {exc}")
                return None
            if not sent:
                client.mark_down("not connected")
                return None
            self.instance = welcome.instance
            self.synced, self.accepted, self.features_sent = len(tokens), 0, 0
        new_features = None
        if welcome.feature_size:
            why = self._feature_mismatch(features, feature_layers, welcome)
            if why:
                self._stop_drafting(why)
                return None
            if features.shape[0] != len(tokens) - 1:
                return None  # its prefill is still under way
            new_features = features[self.features_sent:]
        self.seq += 1
        self._before = (self.synced, self.accepted, self.features_sent)  # to undo a request refused BUSY
        new = tokens[self.synced + self.accepted:]
        depth = min(depth, welcome.max_depth)
        tree = min(tree_tokens, welcome.max_tree_tokens) if welcome.trees else 0
        if not client.request(self.session, self.seq, self.accepted, new, len(tokens), depth, new_features,
                              tree if tree > depth else 0, min_survival if welcome.stops_drafts else 0.0,
                              min_chance if welcome.stops_drafts else 0.0):
            client.mark_down("not connected")
            self.instance = None  # whatever the daemon holds is unknown now
            return None
        self.synced, self.accepted = len(tokens), 0
        if new_features is not None:
            self.features_sent = len(tokens) - 1
        self.sent_at = time.monotonic()
        self.cap_at = self.sent_at + self.timeout_s
        return self.seq

    @staticmethod
    def _feature_mismatch(features, layers: tuple[int, ...] | None, welcome) -> str | None:
        """Why this generation's features cannot feed the daemon's head (None: they can). A
        generation fuses the layers named when it started, for its whole length; a daemon that
        restarted with another head, or a link that came up after the start, leaves it without
        the features the head reads, and its rounds run on the target alone."""
        if features is None:
            return "it collected no target features (it started before the draft daemon's head was known)"
        # both are tuples (the WELCOME's as parsed, the generation's as it started) or None
        if layers != welcome.feature_layers or features.shape[1] != welcome.feature_size:
            named = (lambda ls: "the final hidden state" if ls is None else f"layers {list(ls)}")
            return (f"its features ({features.shape[1]} wide, {named(layers)}) are not what the draft daemon's "
                    f"head reads ({welcome.feature_size} wide, {named(welcome.feature_layers)})")
        return None

    def _may_open(self) -> bool:
        """Whether to (re-)open the session now. After the daemon refused an OPEN, the next one
        waits a backoff that doubles up to the link's cap (a busy daemon is not sent the whole
        prompt every round); a refusal no retry can cure (the prompt outgrows the drafter, or
        parameters it rejects) ends drafting for this generation."""
        refusal = self.client.take_open_refusal(self.session)
        if refusal is None:
            return True
        self.open_refusals += 1
        if refusal.code in (ErrorCode.TOO_LARGE, ErrorCode.BAD_REQUEST, ErrorCode.INCOMPATIBLE_MODEL):
            self._stop_drafting(f"the draft daemon refused it: {refusal}")
        else:
            self._back_off(refusal)
        return False

    def _stop_drafting(self, why: str) -> None:
        """This generation asks for no more drafts: the rest runs on the target alone."""
        log.info("session %d: %s; the rest runs on the target alone", self.session, why)
        self.disabled = True

    def _back_off(self, refusal: RemoteError) -> None:
        """The daemon is busy for this session: its next request waits, twice as long each time."""
        self._retry_at = time.monotonic() + self._retry_delay
        log.debug("the draft daemon refused session %d (%s); next OPEN in %.2fs", self.session, refusal,
                  self._retry_delay)
        self._retry_delay = min(self.client.backoff.cap_s, 2 * self._retry_delay)

    def expired(self, idle: bool = True) -> bool:
        """Whether to give the request in flight up now. Past the cap, always; before it, only
        while the target is ``idle`` (with other rounds to verify, waiting costs nothing): at once
        while the link is suspect and the request unacknowledged, else when the link says so
        (``DraftClient.expired``: no ACK in a round trip, or no reply by the daemon's estimate),
        but for a seeded sampled request on a link that has been answering (``_waits_to_cap``)."""
        if time.monotonic() >= self.cap_at:
            return True
        if not idle:
            return False
        client = self.client
        key = (self.session, self.seq)
        if client.suspect and not client.acked(key):
            return True
        return not self._waits_to_cap() and client.expired(key, self.sent_at, self.timeout_s)

    def _waits_to_cap(self) -> bool:
        """A seeded sampled generation's request is waited for up to the cap while its link is
        neither suspect nor missing replies: a round without drafts draws other random numbers
        than one with them, so a reply given up because a busy host answered late would change
        the tokens its seed gives. Once a request has gone unanswered, such requests are given
        up by the daemon's estimate as any other, so a daemon that stops answering costs them one
        cap's wait, not one a round."""
        client = self.client
        return self.params.seeded and not client.suspect and not client.misses

    @property
    def wake_at(self) -> float:
        """When ``expired()`` has something new to decide."""
        if self._waits_to_cap():
            return self.cap_at
        return self.client.give_up_at((self.session, self.seq), self.sent_at, self.timeout_s)

    def resolve(self, reply: DraftReply | RemoteError | None) -> DraftReply | None:
        """Turn what came back for the request in flight (None: nothing in time, or the link
        went down meanwhile) into drafts."""
        if reply is None:
            acked = self.client.acked((self.session, self.seq))
            self.client.abandon(self.session, self.seq)
            if self.client.up:
                self.client.miss(acked)
            return None
        if isinstance(reply, RemoteError):
            self.errors += 1
            if reply.code == ErrorCode.TOO_LARGE:
                self._stop_drafting(f"it outgrew the drafter ({reply.message})")
                return None
            if reply.code == ErrorCode.BUSY:
                # refused before the daemon applied it (a BUSY DRAFT means its session exists and
                # stands as it was): ask again after a backoff, reporting what this request did
                self.synced, self.accepted, self.features_sent = self._before
                self._back_off(reply)
                return None
            log.debug("draft request failed (%s); re-opening session %d", reply, self.session)
            self.instance = None
            return None
        self._retry_delay = self.client.backoff.initial_s  # the session is served: a later refusal starts afresh
        self.tree = reply.parents is not None
        return reply

    def kept(self, n: int) -> None:
        """``n`` tokens of the last proposal were kept. A tree's kept path is no prefix of its
        tokens: the next request reports none accepted and sends the path as new tokens."""
        self.accepted = 0 if self.tree else n

    def close(self) -> None:
        client = self.client
        if client is None:
            return
        client.abandon(self.session, self.seq)  # a reply still in flight is nobody's now
        client.take_open_refusal(self.session)
        if self.instance is not None:
            client.close_session(self.session)
        client.sessions -= 1
        self.client = None
