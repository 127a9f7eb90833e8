"""Huge pages for the weights (common.hugepages): the environment a daemon starts again with, and
the start again itself, in a real process."""

import os
import subprocess
import sys
from pathlib import Path

from common.hugepages import DONE, GLIBC_HUGE, TORCH_HUGE, huge_page_env, kernel_setting

ROOT = Path(__file__).resolve().parents[1]


def test_the_kernel_setting_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert kernel_setting(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert kernel_setting(str(f)) == "always"
    assert kernel_setting(str(tmp_path / "missing")) is None


def test_the_environment_asks_for_huge_pages_once_and_keeps_other_tunables():
    env = huge_page_env({"PATH": "/bin"}, "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": GLIBC_HUGE, TORCH_HUGE: "1", DONE: "1"}
    mine = huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "always")
    assert mine["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{GLIBC_HUGE}" and mine[TORCH_HUGE] == "1"
    assert huge_page_env(env, "madvise") is None  # started again already: never twice
    assert huge_page_env({"GLIBC_TUNABLES": GLIBC_HUGE, TORCH_HUGE: "1"}, "madvise") is None  # set by hand
    assert huge_page_env({}, "never") is None and huge_page_env({}, None) is None  # no huge pages to be had
    assert huge_page_env({"STARSD_HUGE_PAGES": "0"}, "madvise") is None  # turned off


def _run(code: str, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", TORCH_HUGE, DONE, "STARSD_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", code, "an-argument"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**clean, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_process_starts_again_with_huge_pages_asked_for_same_pid_same_arguments():
    code = ("import os, sys; from common.hugepages import with_huge_pages; print('start', os.getpid(), flush=True); "
            "with_huge_pages(); print(os.getpid(), sys.argv[1:], os.environ.get('GLIBC_TUNABLES'), "
            "os.environ.get('THP_MEM_ALLOC_ENABLE'))")
    lines = _run(code).splitlines()
    setting = kernel_setting() if sys.platform.startswith("linux") else None
    if setting in (None, "never"):
        assert len(lines) == 2 and lines[1].endswith("None None")  # nothing to ask for: it goes on
        return
    pid = lines[0].split()[1]
    assert lines == [f"start {pid}", f"start {pid}", f"{pid} ['an-argument'] {GLIBC_HUGE} 1"]
    off = _run(code, STARSD_HUGE_PAGES="0").splitlines()
    assert len(off) == 2 and off[1].endswith("None None")


def test_only_a_daemon_asks_for_huge_pages():
    """``serve`` starts again with huge pages asked for; any other command (``status``, ``--help``)
    starts as it is, without the second start."""
    code = ("import os, sys; sys.argv = ['starsd-target', sys.argv[1]]; print('start', flush=True); "
            "from starsd_target.__main__ import run\n"
            "try:\n    run()\nexcept SystemExit:\n    pass\n"
            "print('huge', os.environ.get('STARSD_HUGE_PAGES_SET'))")
    setting = kernel_setting() if sys.platform.startswith("linux") else None
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", TORCH_HUGE, DONE, "STARSD_HUGE_PAGES")}
    for command, restarts in (("--help", False), ("serve", setting not in (None, "never"))):
        out = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env={**clean, "STARSD_TARGET_MODEL": "/nonexistent"})
        starts = out.stdout.count("start")
        assert starts == (2 if restarts else 1), (command, out.stdout, out.stderr[-500:])
