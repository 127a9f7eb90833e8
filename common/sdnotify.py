"""systemd's sd_notify protocol without libsystemd: READY=1, STOPPING=1, WATCHDOG=1, STATUS=...,
and EXTEND_TIMEOUT_USEC while a long start-up step makes progress (``Heartbeat``).

Everything here is a no-op without $NOTIFY_SOCKET and never raises: a lost notification must not
take a daemon down (systemd then acts on its own timeouts)."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
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


class Heartbeat:
    """While a long step of a daemon's start-up runs (compiling its model on a CPU takes 8-12
    minutes for the demo target, longer for larger ones), every ``interval_s``: log that it is
    still running and for how long, update STATUS, and ask systemd for ``extend_s`` more of
    start-up time (EXTEND_TIMEOUT_USEC, systemd 236 and later), so that TimeoutStartSec does not
    kill a start that is making progress. The beats run on a thread of their own: a step that
    hangs while holding the GIL stops them, and systemd's timeout then ends the start within
    ``extend_s``; one that hangs without it (waiting on a compile worker) keeps them going, so
    they stop extending after ``limit_s`` in all. Use as a context manager around the step."""

    def __init__(self, what: str, interval_s: float = 60.0, extend_s: float | None = None,
                 limit_s: float = 2 * 3600.0):
        self.what = what
        self.interval_s = interval_s
        self.extend_s = 3 * interval_s if extend_s is None else extend_s
        self.limit_s = limit_s
        self.beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def __enter__(self) -> "Heartbeat":
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="starsd-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beats += 1
            elapsed = time.monotonic() - self._t0
            log.info("still %s: %.0f s so far", self.what, elapsed)
            status = f"STATUS={self.what} ({elapsed / 60:.0f} min so far)"
            if elapsed < self.limit_s:
                notify(f"EXTEND_TIMEOUT_USEC={int(self.extend_s * 1e6)}", status)
            else:  # no more start-up time: systemd's timeout applies again
                notify(status)
