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
    child = server.spawn(["http.server", "--bind", "127.0.0.1", "0"], dict(os.environ), tmp_path / "srv.log",
                         [0])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.3)  # serving
    assert child.poll() is None
    assert os.sched_getaffinity(child.pid) == {0}  # the cores it was given
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
