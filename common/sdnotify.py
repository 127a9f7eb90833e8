"""systemd's sd_notify protocol without libsystemd: READY=1, STOPPING=1, WATCHDOG=1, STATUS=...

Everything here is a no-op without $NOTIFY_SOCKET and never raises: a lost notification must not
take a daemon down (systemd then acts on its own timeouts)."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("starsd.sdnotify")


def notify(*states: str) -> bool:
    """Send ``states`` ("READY=1", "STATUS=loading", ...) as one datagram to $NOTIFY_SOCKET.
    True if it was sent; False without $NOTIFY_SOCKET, for an address we cannot use, or on error."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not states or not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # Linux abstract namespace
    elif not address.startswith("/"):
        log.debug("NOTIFY_SOCKET=%r is neither a path nor an abstract address; not notifying", address)
        return False
    # one assignment per line: a newline inside a STATUS text would start a bogus assignment
    payload = "\n".join(s.replace("\n", " ") for s in states).encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.send(payload)
    except OSError as exc:
        log.debug("sd_notify %s failed: %s", states, exc)
        return False
    return True


class Watchdog:
    """When to send WATCHDOG=1: every half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

    Inert (never due) without $WATCHDOG_USEC, or when $WATCHDOG_PID names another process. A loop
    calls ``if watchdog.due(): watchdog.tick()``; the first call is due at once."""

    def __init__(self, environ: Mapping[str, str] | None = None, clock: Callable[[], float] | None = None):
        env = os.environ if environ is None else environ
        self._clock = clock or time.monotonic
        self.interval_s = _interval_s(env)  # None: inert
        self._next = self._clock() if self.interval_s is not None else math.inf

    @property
    def enabled(self) -> bool:
        return self.interval_s is not None

    def due(self) -> bool:
        return self._clock() >= self._next

    def tick(self) -> bool:
        """Send WATCHDOG=1 now and restart the half interval; False when inert or not sent."""
        if self.interval_s is None:
            return False
        self._next = self._clock() + self.interval_s / 2
        return notify("WATCHDOG=1")


def _interval_s(env: Mapping[str, str]) -> float | None:
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None  # the watchdog is meant for another process (e.g. our parent)
        value = int(usec)
    except ValueError:
        log.debug("ignoring malformed WATCHDOG_USEC=%r / WATCHDOG_PID=%r", usec, pid)
        return None
    return value / 1e6 if value > 0 else None
