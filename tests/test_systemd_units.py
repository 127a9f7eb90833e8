"""The systemd units: `systemd-analyze verify` has nothing to say about them, their sandbox keeps
the exposure score low, and the options and variables they and the env examples name are real.

verify needs every Exec*= binary to exist. The units name the installed CLI (/opt/starsd/venv),
which a checkout does not have, so the units are checked unchanged inside a scratch root
(--root): the host's own system units and binaries (/bin/kill) copied in, and a stand-in for the
CLI at the path the unit names, which execs this checkout's entry point."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from starsd_draftd.cli import main as draftd_main
from starsd_target.cli import main as target_main

UNITS_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNITS = {"starsd-draftd.service": "starsd-draftd.service", "starsd-target@.service": "starsd-target@gpu0.service"}
MAX_EXPOSURE = 5.0
SYSTEM_UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
EXEC_KEYS = ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload", "ExecStop", "ExecStopPost")


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd; `make test` installs it)")
    return path


def exec_binaries(unit_text: str) -> list[str]:
    """The binary of every Exec*= line, its prefixes (-@:+!) removed."""
    out = []
    for line in unit_text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in EXEC_KEYS and value.strip():
            out.append(shlex.split(value)[0].lstrip("-@:+!"))
    return out


def make_root(base: Path, units: dict[str, str]) -> Path:
    """A scratch root holding the host's system units, ``units`` (file name -> text) in
    /etc/systemd/system, and each Exec*= binary: the host's own, or for the StarSD CLI a stand-in."""
    root = base / "root"
    host_units = next((d for d in SYSTEM_UNIT_DIRS if (d / "sysinit.target").is_file()), None)
    assert host_units is not None, f"systemd-analyze is installed but no system unit directory among {SYSTEM_UNIT_DIRS}"
    shutil.copytree(host_units, root / "usr/lib/systemd/system", symlinks=True)
    for merged in ("bin", "sbin", "lib"):  # a merged-/usr layout, as on Debian 12
        (root / "usr" / merged).mkdir(parents=True, exist_ok=True)
        (root / merged).symlink_to(f"usr/{merged}")
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for name, text in units.items():
        (etc / name).write_text(text)
        for binary in exec_binaries(text):
            dest = root / binary.lstrip("/")
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            if binary.startswith("/opt/starsd/"):
                dest.write_text(f"#!/bin/sh\nexec {shlex.quote(str(Path(sys.executable).parent / Path(binary).name))} \"$@\"\n")
                dest.chmod(0o755)
            else:
                assert Path(binary).is_file(), f"{binary} named by an Exec*= line does not exist on this host"
                shutil.copy2(Path(binary).resolve(), dest)
    return root


@pytest.fixture(scope="module")
def unit_texts() -> dict[str, str]:
    return {name: (UNITS_DIR / name).read_text() for name in UNITS}


@pytest.fixture(scope="module")
def root(tmp_path_factory, unit_texts) -> Path:
    systemd_analyze()
    return make_root(tmp_path_factory.mktemp("systemd"), unit_texts)


def run_analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([systemd_analyze(), *args], capture_output=True, text=True, timeout=120)


def test_units_in_root_are_the_repository_files(root, unit_texts):
    for name in UNITS:
        assert (root / "etc/systemd/system" / name).read_text() == unit_texts[name]


@pytest.mark.parametrize("unit", UNITS.values())
def test_verify_prints_nothing(root, unit):
    res = run_analyze("verify", "--man=no", f"--root={root}", unit)
    assert (res.returncode, res.stdout + res.stderr) == (0, "")


@pytest.mark.parametrize("fault", ["unknown key", "missing binary"])
def test_verify_would_report_a_fault(tmp_path, unit_texts, fault):
    """The harness can fail: the same root with a faulty unit makes verify speak."""
    text = unit_texts["starsd-draftd.service"]
    if fault == "unknown key":
        text = text.replace("ProtectClock=yes", "ProtectClok=yes")
    else:
        text = text.replace("/opt/starsd/venv/bin/starsd-draftd", "/opt/starsd/nowhere/starsd-draftd")
    root = make_root(tmp_path, {"starsd-draftd.service": text})
    if fault == "missing binary":
        (root / "opt/starsd/nowhere/starsd-draftd").unlink()
    res = run_analyze("verify", "--man=no", f"--root={root}", "starsd-draftd.service")
    expected = "Unknown key 'ProtectClok'" if fault == "unknown key" else "is not executable"
    assert expected in res.stdout + res.stderr, res.stdout + res.stderr


def exposure(root: Path, unit: str) -> float:
    res = run_analyze("security", "--offline=yes", f"--root={root}", "--no-pager", unit)
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout + res.stderr)
    assert match, f"no exposure level in:\n{res.stdout}\n{res.stderr}"
    return float(match.group(1))


@pytest.mark.parametrize("unit", UNITS.values())
def test_exposure(root, unit):
    level = exposure(root, unit)
    assert level <= MAX_EXPOSURE, f"{unit}: exposure {level} > {MAX_EXPOSURE}"


# ------------------------------------------------------------------ what the units say is real

def unit_settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def serve_command(unit_name: str):
    return (draftd_main if "draftd" in unit_name else target_main).commands["serve"]


@pytest.mark.parametrize("name", UNITS)
def test_required_settings(unit_texts, name):
    s = unit_settings(unit_texts[name])
    for key, value in {"Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "KillSignal": "SIGTERM",
                       "DynamicUser": "yes", "ProtectSystem": "strict", "NoNewPrivileges": "yes",
                       "CapabilityBoundingSet": ""}.items():
        assert s.get(key) == [value], key
    for key in ("WatchdogSec", "RestartSec", "TimeoutStopSec", "CacheDirectory", "LoadCredential"):
        assert key in s, key
    # GPU access and torch's run-time code generation need these off
    assert "PrivateDevices" not in s and "MemoryDenyWriteExecute" not in s


@pytest.mark.parametrize("name", UNITS)
def test_execstart_is_the_serve_command_with_real_options(unit_texts, name):
    s = unit_settings(unit_texts[name])
    (execstart,) = s["ExecStart"]
    argv = shlex.split(execstart)
    assert argv[0] == f"/opt/starsd/venv/bin/{'starsd-draftd' if 'draftd' in name else 'starsd-target'}"
    assert argv[1] == "serve"
    known = {opt for p in serve_command(name).params for opt in p.opts}
    for arg in argv[2:]:
        if arg.startswith("--"):
            assert arg in known, f"{name}: {arg} is not an option of serve"
    credentials = {v.split(":", 1)[0] for v in s["LoadCredential"]}
    used = set(re.findall(r"%d/([\w.@-]+)", execstart))
    assert used and used == credentials, (used, credentials)


@pytest.mark.parametrize("example,unit_name", [("draftd.env.example", "starsd-draftd.service"),
                                               ("target.env.example", "starsd-target@.service")])
def test_env_examples_name_real_variables(example, unit_name):
    text = (UNITS_DIR / example).read_text()
    envvars = {p.envvar for p in serve_command(unit_name).params if p.envvar}
    named = set(re.findall(r"^#?(STARSD_\w+)=", text, flags=re.M))
    assert named, example
    assert named <= envvars, f"{example} names variables serve does not read: {sorted(named - envvars)}"
    # every option that makes sense in a file is documented; the CURVE paths come from the unit
    assert envvars - named <= {v for v in envvars if "CURVE" in v or v.endswith("INSECURE")}, sorted(envvars - named)
