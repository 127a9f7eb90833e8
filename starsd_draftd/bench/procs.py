"""A set of daemons as child processes (for the demo, the bench and the tests), always cleaned up.

Each child runs ``python -m <args>`` with its output in ``<logdir>/<name>.log``, optionally pinned
to a set of CPU cores (as separate machines would be), and is stopped with SIGTERM (the daemons
drain on it), then SIGKILL after a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import zmq

from common.control import ControlClient, ControlTimeout


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (the daemons drain on it), then SIGKILL if it is still running after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ProcessSet:
    """Named children that are always terminated, whatever happens to the parent."""

    # How a child starts: None, as a new interpreter (``python -m``). Else a callable
    # ``(args, env, log_path, cpus)`` returning what ``subprocess.Popen`` would (``pid``, ``poll``,
    # ``wait``, ``terminate``, ``kill``, ``returncode``): the test suite forks its daemons from a
    # process that imported torch once (tests/forkserver.py).
    launcher = None

    def __init__(self, logdir: Path, ctx: zmq.Context | None = None):
        self.logdir = Path(logdir)
        self.procs: dict[str, subprocess.Popen] = {}
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self._ipc_dir: str | None = None  # a private directory for job sockets (``job_endpoint``)

    def job_endpoint(self, name: str) -> str:
        """An ipc:// endpoint for the target daemon ``name``'s job socket, in a directory of this
        user's alone: a target takes GENERATE over ipc (or CURVE), not over plaintext TCP."""
        if self._ipc_dir is None:
            self._ipc_dir = tempfile.mkdtemp(prefix="starsd-jobs-")  # short: a socket path has ~100 bytes
        return f"ipc://{self._ipc_dir}/{name}.sock"

    def start(self, name: str, *args: str, env: dict | None = None,
              cpus: Iterable[int] | None = None) -> subprocess.Popen:
        """Start ``python -m *args`` as ``name``; ``cpus`` pins it (and its torch threads' cores)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        log_path = self.logdir / f"{name}.log"
        if self.launcher is not None:
            open(log_path, "wb").close()  # there, and empty, once this returns; the launcher pins the child
            proc = self.launcher(list(args), full_env, log_path, cpus)
        else:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                        env=full_env)
            if cpus is not None:  # before the child has imported anything (a fork-time hook is unsafe with threads)
                os.sched_setaffinity(proc.pid, frozenset(cpus))
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def check_alive(self, *names: str) -> None:
        """RuntimeError, with the end of its log, if one of the named children (all: none named) has exited."""
        for name in names or list(self.procs):
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode}; its log ends:\n"
                                   f"{self.log(name)[-3000:]}")

    def wait_ready(self, name: str, endpoint: str, timeout_s: float = 120.0) -> None:
        """Until the daemon ``name`` answers STATS on ``endpoint``; fails early if it died."""
        deadline = time.monotonic() + timeout_s
        with ControlClient(endpoint, self.ctx) as cc:
            while time.monotonic() < deadline:
                self.check_alive(name)
                try:
                    cc.stats(timeout_s=1.0)
                    return
                except ControlTimeout:
                    pass
        raise TimeoutError(f"{name} not ready on {endpoint} after {timeout_s:.0f}s; its log ends:\n"
                           f"{self.log(name)[-3000:]}")

    def wait_draft_link(self, endpoints: list[str], timeout_s: float) -> None:
        """Until every target daemon at ``endpoints`` reports its draft link up."""
        deadline = time.monotonic() + timeout_s
        for ep in endpoints:
            with ControlClient(ep, self.ctx) as cc:
                while not cc.stats()["draft_connected"]:
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"target at {ep} did not reach the draft daemon within {timeout_s:.0f}s")
                    time.sleep(0.1)

    def stop(self, name: str, timeout_s: float = 15.0) -> int:
        """Stop one child; its exit status."""
        proc = self.procs.pop(name)
        stop_process(proc, timeout_s)
        return proc.returncode

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop every child (SIGTERM to all at once, then SIGKILL to those still running at the deadline)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self._own_ctx and not self.ctx.closed:
            self.ctx.destroy(linger=0)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def __enter__(self) -> "ProcessSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
