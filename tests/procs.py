"""Daemons as real OS processes for end-to-end tests, always cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import zmq

from common.control import ControlClient, ControlTimeout
from starsd_draftd.demo import stop_process


class Daemons:
    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = zmq.Context()

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=full_env)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def wait_ready(self, name: str, endpoint: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        with ControlClient(endpoint, self.ctx) as cc:
            while time.monotonic() < deadline:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} died:\n{self.log(name)[-3000:]}")
                try:
                    cc.stats(timeout_s=1.0)
                    return
                except ControlTimeout:
                    pass
        raise TimeoutError(f"{name} not ready after {timeout_s}s:\n{self.log(name)[-3000:]}")

    def stop(self, name: str, timeout_s: float = 15.0) -> int:
        proc = self.procs.pop(name)
        stop_process(proc, timeout_s)
        return proc.returncode

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        self.ctx.destroy(linger=0)
