"""The suite's fork server (tests/forkserver.py) gives its children what a new interpreter's
``subprocess.Popen`` would: their output in the log, their exit status, the status of a signal."""

import json
import os
import signal
import subprocess

import pytest

from forkserver import ForkServer


@pytest.fixture(scope="module")
def server():
    s = ForkServer()
    yield s
    s.close()


def test_a_child_runs_its_module_with_the_environment_it_was_given(server, tmp_path):
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text('{"b": 1, "a": [2]}')
    env = {**os.environ, "STARSD_FORK_PROBE": "1"}
    child = server.spawn(["json.tool", "--sort-keys", str(src), str(dst)], env, tmp_path / "ok.log", None)
    assert child.wait(60) == 0 and child.returncode == 0
    assert json.loads(dst.read_text()) == {"a": [2], "b": 1}


def test_a_failing_child_gives_its_status_and_its_error_in_the_log(server, tmp_path):
    log = tmp_path / "bad.log"
    child = server.spawn(["json.tool", str(tmp_path / "missing.json")], dict(os.environ), log, None)
    assert child.wait(60) == 2  # argparse's status for a file it cannot open
    assert "missing.json" in log.read_text()


def test_a_killed_child_reads_as_popen_reads_it(server, tmp_path):
    core = min(os.sched_getaffinity(0))
    child = server.spawn(["http.server", "--bind", "127.0.0.1", "0"], dict(os.environ), tmp_path / "srv.log",
                         [core])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.3)  # serving
    assert child.poll() is None
    assert os.sched_getaffinity(child.pid) == {core}  # the cores it was given
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_a_reply_left_unread_is_not_taken_for_the_next_spawns(server, tmp_path):
    """A spawn interrupted after its request went out (a test's timeout) leaves its reply unread:
    the next spawn skips it by its id and kills that orphan, and gets its own child."""
    with server.lock:
        server._next_id += 1
        req = {"id": server._next_id, "args": ["http.server", "--bind", "127.0.0.1", "0"], "env": dict(os.environ),
               "log": str(tmp_path / "orphan.log"), "cwd": os.getcwd(), "cpus": None}
        server.file.write(json.dumps(req).encode() + b"\n")
        server.file.flush()  # and never read: as if interrupted here
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text("[1]")
    child = server.spawn(["json.tool", str(src), str(dst)], dict(os.environ), tmp_path / "next.log", None)
    assert child.wait(60) == 0 and json.loads(dst.read_text()) == [1]


def test_a_child_sees_its_own_command_line_and_folder(server, tmp_path, monkeypatch):
    """``sys.orig_argv`` is the daemon's own command line (common.hugepages re-executes it), and
    its module is found in its working folder, as ``python -m`` finds it."""
    (tmp_path / "argv_probe.py").write_text(
        "import json, os, sys\n"
        "json.dump({'orig': sys.orig_argv, 'argv': sys.argv, 'cwd': os.getcwd()}, open('argv.json', 'w'))\n")
    monkeypatch.chdir(tmp_path)
    child = server.spawn(["argv_probe", "serve", "--x"], dict(os.environ), tmp_path / "probe.log", None)
    assert child.wait(60) == 0, (tmp_path / "probe.log").read_text()
    seen = json.loads((tmp_path / "argv.json").read_text())
    assert seen["orig"][1:] == ["-m", "argv_probe", "serve", "--x"]
    assert seen["argv"][1:] == ["serve", "--x"] and seen["argv"][0].endswith("argv_probe.py")
    assert seen["cwd"] == str(tmp_path)
