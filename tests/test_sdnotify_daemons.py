"""The real daemons speak sd_notify: READY=1 once loaded and bound, WATCHDOG=1 while serving when
systemd asks for it, STOPPING=1 when SIGTERM starts the drain, then a clean exit."""

import json
import re
import signal
import socket
import time
import urllib.request
import uuid

import pytest

from common.control import ControlClient
from common.sockets import free_tcp_endpoint
from starsd_draftd.bench.procs import ProcessSet

pytestmark = pytest.mark.slow

WATCHDOG_USEC = 2_000_000  # pings are expected every second


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET (abstract namespace)."""

    def __init__(self):
        self.name = f"starsd-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.states: list[str] = []

    @property
    def env(self) -> dict:
        return {"NOTIFY_SOCKET": "@" + self.name, "WATCHDOG_USEC": str(WATCHDOG_USEC)}

    def poll(self, timeout_s: float) -> list[str]:
        """The states of the next datagram, [] if none came within timeout_s."""
        self.sock.settimeout(timeout_s)
        try:
            lines = self.sock.recv(4096).decode().split("\n")
        except (socket.timeout, BlockingIOError):  # the latter for timeout 0
            return []
        self.states.extend(lines)
        return lines

    def wait_for(self, state: str, proc, timeout_s: float, describe) -> float:
        """Collect datagrams until ``state`` arrives; returns the monotonic time it did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self.poll(0.2)
            if state in lines:
                return time.monotonic()
            if proc.poll() is not None and not lines:
                raise AssertionError(f"exited ({proc.returncode}) before sending {state}; got {self.states}\n"
                                     f"{describe()}")
        raise AssertionError(f"no {state} within {timeout_s}s; got {self.states}\n{describe()}")

    def close(self):
        self.sock.close()


def wait_ready(d: ProcessSet, name: str, endpoint: str, listener: NotifyListener, timeout_s: float = 180) -> None:
    """READY=1 must come, and by then the endpoint must already answer. A daemon that serves but
    does not say READY=1 within a few seconds fails at once instead of after the whole timeout."""
    proc = d.procs[name]
    describe = lambda: d.log(name)[-3000:]  # noqa: E731
    deadline = time.monotonic() + timeout_s
    serving_since = None
    with ControlClient(endpoint, d.ctx) as cc:
        while "READY=1" not in listener.states:
            listener.poll(0.3)
            if "READY=1" in listener.states:
                break
            now = time.monotonic()
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}) before READY=1\n{describe()}")
            if serving_since is None:
                try:
                    cc.stats(timeout_s=0.3)
                    serving_since = now
                except TimeoutError:
                    pass
            elif now - serving_since > 3.0:
                raise AssertionError(f"{name} answers on {endpoint} but sent no READY=1; got {listener.states}")
            if now > deadline:
                raise AssertionError(f"{name}: no READY=1 within {timeout_s}s\n{describe()}")
        assert cc.stats(timeout_s=5.0) is not None  # READY=1 means loaded and bound


def free_port() -> int:
    return int(free_tcp_endpoint().rsplit(":", 1)[1])


def test_daemons_notify_ready_watchdog_stopping(tiny_target, tiny_draft, star):
    d = star
    draft_l, target_l = NotifyListener(), NotifyListener()
    draft_ep, target_ep = free_tcp_endpoint(), d.job_endpoint("target")
    try:
        d.start("draftd", "starsd_draftd", "serve", "--model", str(tiny_draft), "--bind", draft_ep,
                env=draft_l.env)
        d.start("target", "starsd_target", "serve", "--model", str(tiny_target), "--listen", target_ep,
                "--draft", draft_ep, "--connect-timeout", "0", env=target_l.env)  # loads beside the draft daemon
        wait_ready(d, "draftd", draft_ep, draft_l)
        wait_ready(d, "target", target_ep, target_l)

        for name, what in (("draftd", "draft daemon"), ("target", "target daemon")):
            # start-up's objects are out of the collector's reach before serving (common.heap)
            frozen = re.search(what + r": (\d+) start-up objects moved out", d.log(name))
            assert frozen and int(frozen.group(1)) > 10_000, d.log(name)[-3000:]

        for name, listener in (("draftd", draft_l), ("target", target_l)):
            proc, describe = d.procs[name], (lambda n=name: d.log(n)[-3000:])
            while listener.poll(0.0):  # pings sent while the other daemon started up
                pass
            for _ in range(2):  # they keep coming now, every half WATCHDOG_USEC
                listener.wait_for("WATCHDOG=1", proc, 5.0, describe)

        for name, listener in (("target", target_l), ("draftd", draft_l)):
            proc = d.procs[name]
            proc.send_signal(signal.SIGTERM)
            listener.wait_for("STOPPING=1", proc, 30.0, lambda n=name: d.log(n)[-3000:])
            assert proc.wait(30) == 0, d.log(name)[-3000:]
            assert listener.states.count("READY=1") == 1, listener.states
            assert "STOPPING=1" not in listener.states[:listener.states.index("READY=1")]
    finally:
        d.close()  # the daemons stop before their listeners go
        draft_l.close()
        target_l.close()


def test_target_with_http_api_notifies_once(tiny_target, tiny_draft, star):
    """With --http, uvicorn owns SIGTERM: READY=1 still comes once (when HTTP serves too),
    STOPPING=1 after SIGTERM, then a clean exit."""
    d = star
    draft_l, target_l = NotifyListener(), NotifyListener()
    draft_ep, target_ep, http_port = free_tcp_endpoint(), d.job_endpoint("target"), free_port()
    try:
        d.start("draftd", "starsd_draftd", "serve", "--model", str(tiny_draft), "--bind", draft_ep,
                env=draft_l.env)
        d.start("target", "starsd_target", "serve", "--model", str(tiny_target), "--listen", target_ep,
                "--draft", draft_ep, "--connect-timeout", "0", "--http", f"127.0.0.1:{http_port}", env=target_l.env)
        wait_ready(d, "draftd", draft_ep, draft_l)
        proc, describe = d.procs["target"], (lambda: d.log("target")[-3000:])
        target_l.wait_for("READY=1", proc, 180, describe)
        deadline = time.monotonic() + 5
        while True:  # READY=1 means the HTTP API answers (within the moment uvicorn takes to bind)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as r:
                    assert r.status == 200 and json.load(r)["status"] == "ok"
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "HTTP API not listening 5 s after READY=1"
                time.sleep(0.05)
            except urllib.error.URLError as exc:
                assert isinstance(exc.reason, ConnectionRefusedError), exc
                assert time.monotonic() < deadline, "HTTP API not listening 5 s after READY=1"
                time.sleep(0.05)
        target_l.wait_for("WATCHDOG=1", proc, 5.0, describe)
        assert re.search(r"target daemon: \d+ start-up objects moved out", d.log("target")), describe()
        proc.send_signal(signal.SIGTERM)
        target_l.wait_for("STOPPING=1", proc, 60.0, describe)
        assert proc.wait(60) == 0, describe()
        assert target_l.states.count("READY=1") == 1, target_l.states
    finally:
        d.close()  # the daemons stop before their listeners go
        draft_l.close()
        target_l.close()
