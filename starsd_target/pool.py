"""A target's draft daemons: one link per endpoint, placement of new sessions, failover and drain.

``DraftPool`` holds a ``DraftClient`` per draft daemon. An endpoint whose host name resolves to
several addresses (a Kubernetes headless Service, a DNS round robin) gives one link per address,
and is resolved again every ``resolve_interval_s``: a new address gets a link, a link whose
address is gone stops taking sessions and is closed once none uses it.

A generation's draft session lives on one link (``RemoteDraftSession.client``). It asks the pool
where to go at each round (``place``): where it is while that link is healthy (up, answering,
not draining); otherwise the better of two healthy links chosen at random (by the wait each
daemon reports: its replies' queue time, its WELCOME and PONG), so a daemon that died, hung or
is draining loses its sessions at their next round, which re-open elsewhere with their verified
tokens, spread over the rest. A new session goes to the daemon its prompt's first tokens name
(rendezvous hashing: sessions that share a prefix share a daemon, and its caches) unless that
one is clearly busier than the better of two others chosen at random. A daemon that drains or
fails makes the pool look its names up again at once: its replacement may already answer.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import random
import re
import secrets
import socket
import threading
import time
from collections.abc import Sequence

import zmq

from common.security import CurveKeys
from starsd_target.client import (Backoff, DraftClient, HandshakeRefused, HandshakeTimeout, LinkState, Welcome)
from starsd_target.rtt import RTT_FLOOR_S

log = logging.getLogger("starsd.target.pool")

AFFINITY_TOKENS = 32  # the prompt tokens that name a session's preferred daemon
# The preferred daemon is passed over when its expected wait exceeds the other's by this factor
# plus this margin (seconds): a few milliseconds of difference are noise; a queue is not.
BUSIER_FACTOR = 2.0
BUSIER_MARGIN_S = 0.02
RESOLVE_INTERVAL_S = 30.0


def parse_endpoints(spec: str | Sequence[str] | None) -> list[str]:
    """The draft endpoints named by ``spec``: a string holding one or more, separated by commas or
    whitespace (as STARSD_TARGET_DRAFT may), or a sequence of such strings; duplicates dropped."""
    if spec is None:
        return []
    parts = [spec] if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for part in parts:
        for ep in re.split(r"[,\s]+", part.strip()):
            if ep and ep not in out:
                out.append(ep)
    return out


def _split_tcp(endpoint: str) -> tuple[str, str] | None:
    """(host, port) of a tcp:// endpoint whose host is a name, None for an address or another
    transport (those connect as they are)."""
    m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/]+):(\d+|\*)", endpoint)
    if m is None:
        return None
    host = m.group(1).strip("[]")
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        return host, m.group(2)


def resolve(endpoint: str) -> list[str] | None:
    """The addresses ``endpoint`` stands for: one tcp:// endpoint per address of its host name
    (sorted; its IPv4 addresses, or its IPv6 ones where it has none: a dual-stack name is one
    daemon, not two), or the endpoint itself (an address, ipc://). None: the name does not
    resolve now."""
    split = _split_tcp(endpoint)
    if split is None:
        return [endpoint]
    host, port = split
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        log.warning("cannot resolve draft endpoint %s now: %s", endpoint, exc)
        return None
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    addrs = v4 or sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
    return [f"tcp://[{a}]:{port}" if ":" in a else f"tcp://{a}:{port}" for a in addrs] or None


def healthy(link: DraftClient) -> bool:
    """A link new and moved sessions may go to: up, answering, not draining, not retired, and
    past its probation (a daemon that came back takes one session, the probe, until it drafts
    for it: a circuit breaker's half-open state)."""
    return (link.up and not link.suspect and not link.draining and not link.retired
            and not (link.probation and link.sessions > 0))


class DraftPool:
    """Several draft daemons behind the face the scheduler uses of one link (``poll``,
    ``heartbeat``, ``up``, ``welcome``, ``next_session``, ``place``); see the module's docstring."""

    def __init__(self, endpoints: str | Sequence[str], vocab_size: int, fingerprint: str, name: str = "",
                 ctx: zmq.Context | None = None, feature_size: int = 0, curve: CurveKeys | None = None,
                 num_layers: int = 0, backoff: Backoff = Backoff(), rtt_floor_s: float = RTT_FLOOR_S,
                 resolve_interval_s: float = RESOLVE_INTERVAL_S, rng: random.Random | None = None,
                 resolver=resolve, heartbeat_s: float = 5.0, patience: float = DraftClient.ETA_SLACK,
                 ack_floor_s: float | None = None):
        self.specs = parse_endpoints(endpoints)
        if not self.specs:
            raise ValueError("no draft endpoint given")
        self._make = dict(vocab_size=vocab_size, fingerprint=fingerprint, name=name, ctx=ctx or zmq.Context.instance(),
                          feature_size=feature_size, curve=curve, num_layers=num_layers, backoff=backoff,
                          rtt_floor_s=rtt_floor_s, patience=patience, ack_floor_s=ack_floor_s)
        self.backoff = backoff
        self.resolve_interval_s = resolve_interval_s
        self._resolver = resolver
        self._rng = rng or random.Random()
        self.links: dict[str, DraftClient] = {}  # endpoint (one address) -> its link, in the order found
        self.placements = 0  # sessions placed (new, and moved)
        self.failovers = 0  # sessions moved off a link that failed (down, not answering)
        self.drained = 0  # sessions moved off a draining or retired link
        # Session ids start at a random point: targets that share a CURVE key (replicas of one
        # Deployment given one Secret) are one principal to a draft daemon, and must not name the
        # same sessions (2**40 starting points: a collision is a one-in-a-trillion event).
        start = secrets.randbits(40) << 20
        self._session_ids = iter(range(start + 1, start + (1 << 20) * (1 << 20)))
        self.heartbeat_s = heartbeat_s
        self._pinged: dict[str, float] = {}  # endpoint -> when a keep-alive PING last went
        self._known: dict[str, list[str]] = {}  # spec -> its addresses as last resolved
        self._resolved: dict[str, list[str] | None] | None = None  # a background resolution's answer
        self._resolving: threading.Thread | None = None
        self._next_resolve = 0.0
        self._looked_up = time.monotonic()  # when the last lookup began
        self._poller = zmq.Poller()
        self._apply(self._lookup())

    # ------------------------------------------------------------ the links
    def _lookup(self) -> dict[str, list[str] | None]:
        """Each endpoint's addresses now (None: its name did not resolve)."""
        out = {}
        for spec in self.specs:
            try:
                out[spec] = self._resolver(spec)
            except Exception:  # a resolver's failure costs this lookup, never the caller's thread
                log.exception("resolving draft endpoint %s failed", spec)
                out[spec] = None
        return out

    def _resolve_in_background(self) -> None:
        """Look the names up again on a thread of its own (a lookup may take seconds: never on the
        scheduler's); ``poll`` applies the answer."""
        now = time.monotonic()
        self._next_resolve = now + self.resolve_interval_s
        if self._resolving is not None and self._resolving.is_alive():
            return
        self._looked_up = now

        def run() -> None:
            self._resolved = self._lookup()

        try:
            thread = threading.Thread(target=run, name="starsd-draft-resolve", daemon=True)
            thread.start()
        except RuntimeError as exc:  # no thread to be had now: the links stay as they are until the next try
            log.warning("cannot look draft endpoints up now: %s", exc)
            return
        self._resolving = thread

    RESOLVE_SOON_S = 1.0  # the shortest time between lookups that a failing daemon asks for

    def resolve_soon(self) -> None:
        """Look the names up again soon (at most once a RESOLVE_SOON_S): a daemon is draining or
        gone, and its replacement (a new pod) may already answer under the same name."""
        self._next_resolve = min(self._next_resolve, self._looked_up + self.RESOLVE_SOON_S)

    def resolve_now(self) -> None:
        """Resolve every endpoint again, here and now (``poll`` does it in the background)."""
        self._apply(self._lookup())

    def _apply(self, answers: dict[str, list[str] | None]) -> None:
        """Links for new addresses, and links whose address is gone retired (no new sessions;
        closed once none uses them). A name that does not resolve keeps its last addresses (a DNS
        hiccup moves nothing); one that never did is connected by name (ZeroMQ resolves it then)."""
        self._next_resolve = time.monotonic() + self.resolve_interval_s
        wanted: list[str] = []
        for spec in self.specs:
            addrs = answers.get(spec)
            if addrs:
                self._known[spec] = addrs
            for ep in self._known.get(spec) or [spec]:
                if ep not in wanted:
                    wanted.append(ep)
        for ep in wanted:
            link = self.links.get(ep)
            if link is None:
                try:
                    link = DraftClient(ep, **self._make)
                except zmq.ZMQError as exc:  # out of sockets, say: the other links serve meanwhile
                    log.error("cannot connect to draft endpoint %s: %s", ep, exc)
                    continue
                self.links = {**self.links, ep: link}  # a new dict: other threads read the links
                self._poller.register(link.sock, zmq.POLLIN)
                if len(self.links) > 1 or len(wanted) > 1:
                    log.info("draft endpoint %s joins the pool (%d link(s))", ep, len(self.links))
            elif link.retired:
                link.retired = False
                log.info("draft endpoint %s is back in the pool", ep)
        for ep, link in list(self.links.items()):
            if ep not in wanted and not link.retired:
                link.retired = True
                log.info("draft endpoint %s no longer resolves: it takes no new sessions", ep)
        self._close_retired()

    def _close_retired(self) -> None:
        gone = [ep for ep, link in list(self.links.items()) if link.retired and link.sessions <= 0]
        if not gone:
            return
        links = dict(self.links)  # a new dict: other threads read the links (counters)
        for ep in gone:
            link = links.pop(ep)
            self._pinged.pop(ep, None)
            self._poller.unregister(link.sock)
            link.close()
            log.info("draft endpoint %s left the pool", ep)
        self.links = links

    def close(self) -> None:
        for link in self.links.values():
            link.close()

    # ------------------------------------------------------------ the face of one link
    @property
    def up(self) -> bool:
        return any(link.up for link in list(self.links.values()))

    @property
    def state(self) -> LinkState:
        states = {link.state for link in list(self.links.values())}
        for s in (LinkState.UP, LinkState.CONNECTING):
            if s in states:
                return s
        return LinkState.DOWN

    @property
    def welcome(self) -> Welcome | None:
        """What the daemons said (the first up link's WELCOME; with none up, any taken): what a
        generation starting now prepares for (features, their layers)."""
        links = list(self.links.values())
        taken = [link.welcome for link in links if link.welcome is not None]
        ups = [link.welcome for link in links if link.up]
        return ups[0] if ups else (taken[0] if taken else None)

    @property
    def endpoint(self) -> str:
        return ",".join(self.specs)

    def next_session(self) -> int:
        """A session id not used before by this target on any link: a session that moves keeps it."""
        return next(self._session_ids)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Wait up to ``timeout_s`` for a message on any link, then read and route what every link
        has (each link also sends a HELLO that is due); names are looked up again when due (in
        the background), and a link not heard from in a heartbeat is pinged, so a daemon that
        holds none of this target's sessions keeps it as a peer and its load stays known."""
        now = time.monotonic()
        if self._resolved is not None:
            answers, self._resolved = self._resolved, None
            self._apply(answers)
        elif now >= self._next_resolve and any(_split_tcp(spec) for spec in self.specs):
            self._resolve_in_background()
        if timeout_s > 0:
            self._poller.poll(max(0, int(timeout_s * 1000)))
        n = sum(link.poll(0) for link in list(self.links.values()))
        if len(self.links) > 1:
            self._keep_alive(now)
        return n

    def _keep_alive(self, now: float) -> None:
        for ep, link in list(self.links.items()):
            if link.up and now - max(link.heard_at, self._pinged.get(ep, 0.0)) >= self.heartbeat_s:
                self._pinged[ep] = now
                link.heartbeat()

    def ready(self) -> bool:
        self.poll(0)
        return self.up

    def heartbeat(self) -> None:
        now = time.monotonic()
        for ep, link in list(self.links.items()):
            self._pinged[ep] = now
            link.heartbeat()

    def handshake(self, timeout_s: float) -> Welcome:
        """Wait up to ``timeout_s`` for a link to come up (start-up only). A daemon that refuses
        this target is logged and left out; HandshakeRefused when every one did, HandshakeTimeout
        when none answered."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll(0.01)
            if self.up:
                return self.welcome
            refused = [link.refusal for link in list(self.links.values())
                       if isinstance(link.refusal, HandshakeRefused)]
            if refused and len(refused) == len(self.links):
                raise HandshakeRefused("; ".join(str(r) for r in refused))
            if time.monotonic() >= deadline:
                raise HandshakeTimeout(f"no draft daemon of {self.endpoint} answered within {timeout_s:.1f}s")

    # ------------------------------------------------------------ placement
    def place(self, tokens: Sequence[int], current: DraftClient | None = None) -> DraftClient | None:
        """The link a session should ask its next drafts from: ``current`` while it is healthy;
        else a healthy one (a new session: prefix affinity, or the better of two at random; a
        moved one: the least expected wait); with none healthy, ``current`` if it is still up
        (draining, or not answering: its rounds go on as its link allows), or any up link; None
        when no link is up."""
        if current is not None and healthy(current):
            return current
        if current is not None or not any(healthy(link) for link in list(self.links.values())):
            self.resolve_soon()  # a daemon drains or failed: a replacement may answer under the same name
        ok = [link for link in list(self.links.values()) if healthy(link) and link is not current]
        if ok:
            choice = self._choose(ok, tokens) if current is None else self._better_of_two(ok)
            self.placements += 1
            if current is not None:
                if current.up and not current.suspect and (current.draining or current.retired):
                    self.drained += 1  # moved in good order
                else:
                    self.failovers += 1  # down, or not answering
                log.info("session moves from draft endpoint %s (%s) to %s", current.endpoint, _why(current),
                         choice.endpoint)
            return choice
        if current is not None and current.up:
            return current
        ups = [link for link in list(self.links.values()) if link.up]
        if not ups:
            return None
        if current is None:
            self.placements += 1
        return min(ups, key=_expected_wait)

    def _better_of_two(self, ok: list[DraftClient]) -> DraftClient:
        """Of two healthy links chosen at random, the one with less expected wait (fewer of this
        target's sessions among equals): sessions leaving a failed daemon spread over the rest
        rather than all landing, each with its prefill, on the one that looked least busy."""
        if len(ok) == 1:
            return ok[0]
        return min(self._rng.sample(ok, 2), key=lambda link: (_expected_wait(link), link.sessions))

    def _choose(self, ok: list[DraftClient], tokens: Sequence[int]) -> DraftClient:
        """A new session's link: its prompt's preferred link (rendezvous hashing over the healthy
        links) unless that one is clearly busier than the better of two others chosen at random."""
        if len(ok) == 1:
            return ok[0]
        name = preferred_endpoint(tokens, [link.endpoint for link in ok])
        preferred = next(link for link in ok if link.endpoint == name)
        other = self._better_of_two(ok)
        if other is not preferred and _expected_wait(preferred) > BUSIER_FACTOR * _expected_wait(other) + BUSIER_MARGIN_S:
            return other
        return preferred

    # ------------------------------------------------------------ visibility
    def counters(self) -> dict:
        """The pool's and each link's counts, for the target's STATS (plain numbers: read from
        another thread). The top level sums the links, as a single link's counters read."""
        per = {ep: {**link.counters(), "sessions": link.sessions, "wait_ms": round(1000 * _expected_wait(link), 3),
                    "draining": link.draining, "retired": link.retired, "probation": link.probation,
                    "rtt_ms": round(1000 * (link.ack_rtt.srtt or 0.0), 3)}
               for ep, link in list(self.links.items())}
        total: dict = {"state": self.state.value, "placements": self.placements, "failovers": self.failovers,
                       "drained": self.drained, "endpoints": per}
        for name in ("reconnects", "hellos", "missed", "unacked", "stale_replies", "unexpected", "open_refusals"):
            total[name] = sum(c[name] for c in per.values())
        total["suspect"] = any(c["suspect"] for c in per.values())
        errors: dict[str, int] = {}
        for c in per.values():
            for k, v in c["errors"].items():
                errors[k] = errors.get(k, 0) + v
        total["errors"] = errors
        return total


def preferred_endpoint(tokens: Sequence[int], endpoints: Sequence[str]) -> str:
    """Of ``endpoints``, the one a new session whose prompt is ``tokens`` prefers: rendezvous
    hashing over the prompt's first AFFINITY_TOKENS tokens and each endpoint's name."""
    key = repr(list(tokens[:AFFINITY_TOKENS])).encode()
    return max(endpoints, key=lambda ep: hashlib.blake2b(key + ep.encode(), digest_size=8).digest())


def _expected_wait(link: DraftClient) -> float:
    """What a request sent to ``link`` now should wait, as the daemon last reported it, with the
    sessions this target keeps there as a tie-break."""
    return link.wait_s + 1e-4 * link.sessions


def _why(link: DraftClient) -> str:
    if link.retired:
        return "its address is gone"
    if link.draining:
        return "draining"
    if not link.up:
        return link.state.value
    return "not answering"

