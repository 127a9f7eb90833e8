"""sd_notify: datagrams reach a real AF_UNIX socket (path and abstract), nothing happens without
NOTIFY_SOCKET, nothing raises on a dead socket, the watchdog's half-interval timing, and the
heartbeat that asks for more start-up time while a compiling warm-up runs."""

import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from common import sdnotify
from common.sdnotify import Watchdog, notify


class Receiver:
    def __init__(self, sock: socket.socket, address: str):
        self.sock, self.address = sock, address
        sock.settimeout(5.0)

    def recv(self) -> list[str]:
        return self.sock.recv(4096).decode().split("\n")


@pytest.fixture
def short_dir():
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer
    d = Path(tempfile.mkdtemp(prefix="sdn", dir="/tmp"))
    yield d
    shutil.rmtree(d)


@pytest.fixture(params=["path", "abstract"])
def receiver(request, short_dir, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(short_dir / "notify")
        sock.bind(address)
    else:
        name = f"starsd-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        address = "@" + name
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    yield Receiver(sock, address)
    sock.close()


@pytest.mark.parametrize("state", ["READY=1", "STOPPING=1", "WATCHDOG=1", "STATUS=serving 3 targets"])
def test_each_state_arrives(receiver, state):
    assert notify(state) is True
    assert receiver.recv() == [state]


def test_several_states_in_one_datagram(receiver):
    assert notify("READY=1", "STATUS=bound tcp://127.0.0.1:5555")
    assert receiver.recv() == ["READY=1", "STATUS=bound tcp://127.0.0.1:5555"]


def test_newline_in_status_cannot_inject_an_assignment(receiver):
    assert notify("STATUS=ok\nREADY=1")
    assert receiver.recv() == ["STATUS=ok READY=1"]


def test_unencodable_text_is_replaced_not_raised(receiver):
    assert notify("STATUS=bad \udcff byte")
    assert receiver.recv() == ["STATUS=bad ? byte"]


def test_noop_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify("READY=1") is False


def test_nothing_to_send_sends_nothing(receiver):
    assert notify() is False
    receiver.sock.settimeout(0.2)
    with pytest.raises(socket.timeout):
        receiver.sock.recv(4096)


@pytest.mark.parametrize("kind", ["missing", "closed", "abstract", "relative", "directory"])
def test_dead_socket_never_raises(kind, short_dir, monkeypatch, caplog):
    if kind == "missing":
        address = str(short_dir / "nobody-here")
    elif kind == "closed":  # the file is there, nobody reads it: ECONNREFUSED
        address = str(short_dir / "closed")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(address)
        s.close()
    elif kind == "abstract":
        address = f"@starsd-test-nobody-{uuid.uuid4().hex}"
    elif kind == "relative":
        address = "relative/notify"
    else:
        address = str(short_dir)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    with caplog.at_level("DEBUG", logger="starsd.sdnotify"):
        assert notify("READY=1") is False
    assert any("NOTIFY_SOCKET" in r.getMessage() or "failed" in r.getMessage() for r in caplog.records)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_watchdog_pings_at_half_the_interval(receiver, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")  # 10 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    clock = FakeClock()
    wd = Watchdog(clock=clock)
    assert wd.enabled and wd.interval_s == 10.0
    assert wd.due()  # the first ping goes out at once
    assert wd.tick() is True
    assert receiver.recv() == ["WATCHDOG=1"]
    clock.t += 4.999
    assert not wd.due()
    clock.t += 0.001
    assert wd.due()
    wd.tick()
    assert receiver.recv() == ["WATCHDOG=1"]
    clock.t += 2.5
    assert not wd.due()


def test_watchdog_for_our_pid(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Watchdog(clock=FakeClock()).interval_s == 2.0


@pytest.mark.parametrize("env", [
    {},
    {"WATCHDOG_USEC": "0"},
    {"WATCHDOG_USEC": "soon"},
    {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"},  # meant for another process
    {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "x"},
])
def test_watchdog_inert(env, receiver):
    clock = FakeClock()
    wd = Watchdog(environ=env, clock=clock)
    assert not wd.enabled
    for _ in range(3):
        assert not wd.due()
        clock.t += 1e6
    assert wd.tick() is False
    receiver.sock.settimeout(0.2)
    with pytest.raises(socket.timeout):
        receiver.sock.recv(4096)


def test_watchdog_tick_without_notify_socket_does_not_raise(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    clock = FakeClock()
    wd = Watchdog(environ={"WATCHDOG_USEC": "1000000"}, clock=clock)
    assert wd.due()
    assert wd.tick() is False
    assert not wd.due()  # a failed send still waits half an interval before trying again
    clock.t += 0.5
    assert wd.due()


def test_default_clock_is_monotonic(monkeypatch):
    clock = FakeClock(5.0)
    monkeypatch.setattr(sdnotify.time, "monotonic", clock)
    wd = Watchdog(environ={"WATCHDOG_USEC": "4000000"})
    wd.tick()
    clock.t += 1.9
    assert not wd.due()
    clock.t += 0.1
    assert wd.due()


def _drain(receiver: Receiver) -> list[list[str]]:
    """The datagrams waiting at the receiver, without waiting for more."""
    receiver.sock.settimeout(0.2)
    out = []
    try:
        while True:
            out.append(receiver.recv())
    except (socket.timeout, BlockingIOError):
        return out


def _beats(hb: sdnotify.Heartbeat, n: int) -> None:
    deadline = time.monotonic() + 10
    while hb.beats < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hb.beats >= n


def test_a_heartbeat_extends_the_start_up_while_its_step_runs_and_stops_after(receiver, caplog):
    caplog.set_level(logging.INFO, logger="starsd.sdnotify")
    with sdnotify.Heartbeat("compiling the target model's forwards", interval_s=0.05, extend_s=2.5) as hb:
        _beats(hb, 2)
    got = _drain(receiver)
    assert len(got) == hb.beats >= 2  # one datagram a beat, none after the step
    for states in got:
        assert states[0] == "EXTEND_TIMEOUT_USEC=2500000"
        assert states[1].startswith("STATUS=compiling the target model's forwards (") and len(states) == 2
    assert "still compiling the target model's forwards" in caplog.text
    time.sleep(0.15)
    assert _drain(receiver) == []


def test_a_heartbeat_stops_extending_past_its_limit(receiver):
    with sdnotify.Heartbeat("compiling", interval_s=0.05, limit_s=0.0) as hb:
        _beats(hb, 1)
    got = _drain(receiver)
    assert got and all(len(states) == 1 and states[0].startswith("STATUS=compiling") for states in got)


def test_a_heartbeat_without_notify_socket_only_logs(monkeypatch, caplog):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    caplog.set_level(logging.INFO, logger="starsd.sdnotify")
    with sdnotify.Heartbeat("loading", interval_s=0.02) as hb:
        _beats(hb, 1)
    assert "still loading" in caplog.text


def test_a_compiling_warm_up_beats(receiver, loaded_target, monkeypatch, caplog):
    """The runner's warm-up runs its compilation inside a heartbeat (here a made-up slow one:
    compiling for real takes minutes)."""
    from common.runner import ModelRunner

    caplog.set_level(logging.INFO, logger="starsd.sdnotify")
    runner = ModelRunner(loaded_target)
    runner.compiled = True  # what a compiled runner's warm-up does, around an exercise that only waits
    monkeypatch.setattr(ModelRunner, "HEARTBEAT_S", 0.05)
    assert runner.warm_up(lambda: time.sleep(0.3), "test model") >= 0.3 and runner.warm
    sent = _drain(receiver)
    assert ["STATUS=compiling the test model's forwards"] in sent
    assert any(s[0].startswith("EXTEND_TIMEOUT_USEC=") for s in sent)
    assert "still compiling the test model's forwards" in caplog.text
