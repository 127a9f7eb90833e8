"""A target's draft daemons: one link per endpoint, placement of new sessions, failover and drain.

``DraftPool`` holds a ``DraftClient`` per draft daemon. An endpoint whose host name resolves to
several addresses (a Kubernetes headless Service, a DNS round robin) gives one link per address,
and is resolved again every ``resolve_interval_s``: a new address gets a link, a link whose
address is gone stops taking sessions and is closed once none uses it.

A generation's draft session lives on one link (``RemoteDraftSession.client``). It asks the pool
where to go at each round (``place``): where it is while that link is healthy (up, answering,
not draining); otherwise the healthy link with the least expected wait, so a daemon that died,
hung or is draining loses its sessions at their next round, which re-open elsewhere with their
verified tokens. A new session goes to the better of two healthy links chosen at random, judged
by the wait each daemon reports (its acknowledgements' estimates, its WELCOME and PONG), except
that sessions whose prompts share their first tokens prefer one daemon (rendezvous hashing), so
its caches see their common prefix, unless that daemon is clearly busier.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import random
import re
import socket
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


def resolve(endpoint: str) -> list[str]:
    """The addresses ``endpoint`` stands for: one tcp:// endpoint per address of its host name
    (sorted), or the endpoint itself (an address, ipc://, a name that does not resolve now:
    ZeroMQ then retries it on its own)."""
    split = _split_tcp(endpoint)
    if split is None:
        return [endpoint]
    host, port = split
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        log.warning("cannot resolve draft endpoint %s now (%s); connecting by name", endpoint, exc)
        return [endpoint]
    addrs = sorted({info[4][0] for info in infos})
    return [f"tcp://[{a}]:{port}" if ":" in a else f"tcp://{a}:{port}" for a in addrs] or [endpoint]


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
                 resolver=resolve):
        self.specs = parse_endpoints(endpoints)
        if not self.specs:
            raise ValueError("no draft endpoint given")
        self._make = dict(vocab_size=vocab_size, fingerprint=fingerprint, name=name, ctx=ctx or zmq.Context.instance(),
                          feature_size=feature_size, curve=curve, num_layers=num_layers, backoff=backoff,
                          rtt_floor_s=rtt_floor_s)
        self.backoff = backoff
        self.resolve_interval_s = resolve_interval_s
        self._resolver = resolver
        self._rng = rng or random.Random()
        self.links: dict[str, DraftClient] = {}  # endpoint (one address) -> its link, in the order found
        self.placements = 0  # sessions placed (new, and moved)
        self.failovers = 0  # sessions moved off a link that failed (down, not answering)
        self.drained = 0  # sessions moved off a draining or retired link
        self._session_ids = iter(range(1, 1 << 62))
        self._next_resolve = 0.0
        self._poller = zmq.Poller()
        self.resolve_now()

    # ------------------------------------------------------------ the links
    def resolve_now(self) -> None:
        """Resolve every endpoint again: links for new addresses, and links whose address is gone
        retired (no new sessions; closed once none uses them)."""
        self._next_resolve = time.monotonic() + self.resolve_interval_s
        wanted: list[str] = []
        for spec in self.specs:
            for ep in self._resolver(spec):
                if ep not in wanted:
                    wanted.append(ep)
        for ep in wanted:
            link = self.links.get(ep)
            if link is None:
                link = DraftClient(ep, **self._make)
                self.links[ep] = link
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
        for ep, link in list(self.links.items()):
            if link.retired and link.sessions <= 0:
                self._poller.unregister(link.sock)
                link.close()
                del self.links[ep]
                log.info("draft endpoint %s left the pool", ep)

    def close(self) -> None:
        for link in self.links.values():
            link.close()

    # ------------------------------------------------------------ the face of one link
    @property
    def up(self) -> bool:
        return any(link.up for link in self.links.values())

    @property
    def state(self) -> LinkState:
        states = {link.state for link in self.links.values()}
        for s in (LinkState.UP, LinkState.CONNECTING):
            if s in states:
                return s
        return LinkState.DOWN

    @property
    def welcome(self) -> Welcome | None:
        """What the daemons said (the first up link's WELCOME; with none up, any taken): what a
        generation starting now prepares for (features, their layers)."""
        taken = [link.welcome for link in self.links.values() if link.welcome is not None]
        ups = [link.welcome for link in self.links.values() if link.up]
        return ups[0] if ups else (taken[0] if taken else None)

    @property
    def endpoint(self) -> str:
        return ",".join(self.specs)

    def next_session(self) -> int:
        """A session id not used before by this target on any link: a session that moves keeps it."""
        return next(self._session_ids)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Wait up to ``timeout_s`` for a message on any link, then read and route what every link
        has (each link also sends a HELLO that is due); names are resolved again when due."""
        if time.monotonic() >= self._next_resolve:
            self.resolve_now()
        if timeout_s > 0:
            self._poller.poll(max(0, int(timeout_s * 1000)))
        return sum(link.poll(0) for link in list(self.links.values()))

    def ready(self) -> bool:
        self.poll(0)
        return self.up

    def heartbeat(self) -> None:
        for link in list(self.links.values()):
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
            refused = [link.refusal for link in self.links.values() if isinstance(link.refusal, HandshakeRefused)]
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
        ok = [link for link in self.links.values() if healthy(link) and link is not current]
        if ok:
            choice = self._choose(ok, tokens) if current is None else min(ok, key=_expected_wait)
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
        ups = [link for link in self.links.values() if link.up]
        if not ups:
            return None
        if current is None:
            self.placements += 1
        return min(ups, key=_expected_wait)

    def _choose(self, ok: list[DraftClient], tokens: Sequence[int]) -> DraftClient:
        """A new session's link: its prompt's preferred link (rendezvous hashing over the healthy
        links) unless that one is clearly busier than the better of two others chosen at random."""
        if len(ok) == 1:
            return ok[0]
        key = repr(list(tokens[:AFFINITY_TOKENS])).encode()
        preferred = max(ok, key=lambda link: hashlib.blake2b(key + link.endpoint.encode(), digest_size=8).digest())
        two = self._rng.sample(ok, 2)
        other = min(two, key=_expected_wait)
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

