"""A fork server for the daemons the suite starts: one process per pytest worker imports torch,
transformers and both daemons' modules once, then forks a child for each daemon instead of
starting a new interpreter, which would spend 2-3 s of CPU on the same imports. A suite that
starts about 110 daemons on two cores spends that time many times over.

Each child is forked twice (the server forks a short-lived middle process, which forks the
daemon and exits), so that the daemon is re-parented to the pytest worker, which marked itself a
child subreaper: the worker waits for it as for its own child (``ForkedChild``), with the exit
status a ``subprocess.Popen`` would give. The child then takes the environment, the log file and
the cores it was asked for, and runs ``python -m <module> <args>`` in place (``runpy``).

Used through ``ProcessSet.launcher`` (conftest.py); tests that check what a fresh interpreter
imports start theirs with subprocess directly.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
# imported once in the server: what `python -m starsd_target serve` and `python -m starsd_draftd
# serve` import before they read their arguments, and the model classes the tests' checkpoints use
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.gpt2.modeling_gpt2",
           "starsd_target.cli", "starsd_target.daemon", "starsd_draftd.cli", "starsd_draftd.server",
           "starsd_draftd.backends.model")


class ForkedChild:
    """A daemon forked by the server and re-parented to this process: what ``ProcessSet`` and the
    tests use of a ``subprocess.Popen``."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:  # one waitpid at a time: a second one for a reaped child would fail
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server process and the socket to it; ``spawn`` has the signature of
    ``ProcessSet.launcher``; threads may share it (a spawn holds its lock)."""

    def __init__(self, log: Path | None = None):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        # its own failures (an import that fails, a crash) go to this log
        self.log = log or Path(tempfile.mkstemp(prefix="starsd-forkserver-", suffix=".log")[1])
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=err,
                                         stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
        theirs.close()
        self.sock = ours
        self.file = ours.makefile("rwb")
        self.lock = threading.Lock()
        self._next_id = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, args: list[str], env: dict, log: Path, cpus) -> ForkedChild:
        """Fork ``python -m *args``. Each request carries an id that its reply echoes: a reply
        left unread by a spawn that was interrupted (a test's timeout) is its daemon, killed,
        not taken for the next one's."""
        with self.lock:
            self._next_id += 1
            req = {"id": self._next_id, "args": list(args), "env": dict(env), "log": str(log), "cwd": os.getcwd(),
                   "cpus": sorted(cpus) if cpus is not None else None}
            try:
                self.file.write(json.dumps(req).encode() + b"\n")
                self.file.flush()
                while True:
                    line = self.file.readline()
                    if not line:
                        break
                    reply = json.loads(line)
                    if reply.get("id") == req["id"]:
                        break
                    if "pid" in reply:  # an interrupted spawn's daemon: nobody holds it
                        orphan = ForkedChild(reply["pid"], args)
                        orphan.kill()
                        orphan.wait()
            except OSError as exc:
                line = b""
                err = exc
            else:
                err = None
        if not line:
            raise RuntimeError(f"the fork server is gone (status {self.proc.poll()}, {err}); its log "
                               f"{self.log} ends: {self.log.read_text(errors='replace')[-2000:]}")
        if "error" in reply:
            raise RuntimeError(f"the fork server could not start {args}: {reply['error']}")
        return ForkedChild(reply["pid"], [sys.executable, "-m", *args])

    def close(self) -> None:
        self.file.close()
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.returncode == 0 and not self.log.stat().st_size:  # nothing to tell: no file left behind
            self.log.unlink()


# ---------------------------------------------------------------- in the server process
def _become(req: dict, server_fd: int) -> None:
    """In the forked daemon: its stdio, environment and cores, then its module as ``__main__``.
    Never returns."""
    code = 1
    try:
        os.close(server_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        if req["cpus"] is not None:
            os.sched_setaffinity(0, req["cpus"])
        import runpy

        sys.argv = list(req["args"])
        # what the interpreter was started with, as `python -m` gives it: a daemon that re-executes
        # itself (common.hugepages) must start itself again, not this server
        sys.orig_argv = [sys.executable, "-m", *req["args"]]
        sys.path[0] = req["cwd"]  # as `python -m` has it (the server's is this file's folder)
        try:
            runpy.run_module(req["args"][0], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                sys.stderr.write(f"{exc.code}\n")  # as the interpreter reports a message exit
                code = 1
    except BaseException:  # noqa: BLE001 - a daemon's crash, as a new interpreter would print it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(fd: int) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    reader = sock.makefile("rb")
    for line in reader:
        req = json.loads(line)
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:  # the middle process: forks the daemon, says its pid, exits
            try:
                os.close(r)
                pid = os.fork()
                if pid == 0:
                    os.close(w)
                    _become(req, fd)
                os.write(w, str(pid).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as got:
            said = got.read()
        os.waitpid(middle, 0)  # the daemon is the subreaper's now
        reply = {"id": req["id"], **({"pid": int(said)} if said else {"error": "the middle process forked nothing"})}
        sock.sendall(json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
