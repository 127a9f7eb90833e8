"""Bench peer, never a product dependency: ArcticInference's suffix decoding cache (Snowflake), built from
the ``arctic-inference`` sdist on PyPI into a venv of its own, and a replay of given greedy outputs
through it (``arctic_replay.py``, run by that venv's python) that reports tokens per step at a fixed
draft budget.

Only the C++ suffix tree (``csrc/suffix_decoding``, bound with nanobind) is compiled, with cmake, and
installed with the sdist's thin Python wrapper (``arctic_inference/suffix_decoding``: SuffixDecodingCache,
which needs numpy); none of arctic-inference's heavy dependencies (vllm, torch) are installed. The
environment lives under ``<cache root>/bench-peers/arctic-suffix`` (``common.models.cache_root``:
``$STARSD_CACHE_DIR``, else ``$XDG_CACHE_HOME/starsd``, else ``~/.cache/starsd``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("starsd.bench.suffix_peer")

ARCTIC_VERSION = "0.3.0"  # the sdist this peer was written against and checked with
REPLAY_SCRIPT = Path(__file__).resolve().parent / "arctic_replay.py"
MARKER = "peer.json"
MIN_CMAKE = (3, 18)  # csrc/suffix_decoding/CMakeLists.txt: cmake_minimum_required(VERSION 3.18)
# What the peer needs from the sdist, relative to its top folder.
SDIST_MEMBERS = ("PKG-INFO", "LICENSE", "pyproject.toml", "arctic_inference/__init__.py",
                 "arctic_inference/suffix_decoding/__init__.py", "arctic_inference/suffix_decoding/cache.py",
                 "csrc/suffix_decoding/CMakeLists.txt", "csrc/suffix_decoding/bindings.cc",
                 "csrc/suffix_decoding/suffix_tree.cc", "csrc/suffix_decoding/suffix_tree.h",
                 "csrc/suffix_decoding/int32_map.h")
TORCH_STUB = ('"""Stub for the StarSD arctic-suffix bench peer: arctic-inference\'s setup.py imports torch at\n'
              'the top, and pip runs it to read the sdist\'s metadata while downloading. Nothing uses it."""\n')
SMOKE = ("from arctic_inference.suffix_decoding import SuffixDecodingCache\n"
         "c = SuffixDecodingCache(max_tree_depth=8)\n"
         "c.start_request(0, [1, 2, 3, 1, 2])\n"
         "d = c.speculate(0, [1, 2], max_spec_tokens=4)\n"
         "assert list(d.token_ids) == [3], d.token_ids\n"
         "c.add_active_response(0, [3]); c.stop_request(0)\n")


def default_cache_dir() -> Path:
    """``<cache root>/bench-peers/arctic-suffix`` (``common.models.cache_root``)."""
    from common.models import cache_root

    return cache_root() / "bench-peers" / "arctic-suffix"


class _Steps:
    """Numbered build steps: each is logged with its time; any failure becomes a RuntimeError naming it."""

    def __init__(self, total: int, logs: Path) -> None:
        self.total, self.n, self.logs = total, 0, logs

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[str]:
        self.n += 1
        log.info("arctic-suffix peer: step %d/%d: %s", self.n, self.total, name)
        t0 = time.monotonic()
        try:
            yield name
        except RuntimeError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the step's name
            raise RuntimeError(f"arctic-suffix peer build failed at step '{name}': "
                               f"{type(exc).__name__}: {exc}") from exc
        log.info("arctic-suffix peer: step %d/%d done in %.1f s", self.n, self.total, time.monotonic() - t0)

    def run(self, name: str, cmd: Sequence[str | os.PathLike], env: Mapping[str, str] | None = None,
            cwd: Path | None = None) -> str:
        """Run ``cmd`` for step ``name``, its output kept in ``logs/<n>-<slug>.log``; raise with its tail."""
        self.logs.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
        path = self.logs / f"{self.n:02d}-{slug}.log"
        argv = [str(c) for c in cmd]
        log.info("arctic-suffix peer:   $ %s", " ".join(argv))
        try:
            proc = subprocess.run(argv, env=dict(env) if env is not None else _clean_env(), cwd=cwd,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as exc:
            raise RuntimeError(f"arctic-suffix peer build failed at step '{name}': cannot run "
                               f"{argv[0]}: {exc}") from exc
        path.write_text(proc.stdout)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-25:])
            raise RuntimeError(f"arctic-suffix peer build failed at step '{name}' (exit {proc.returncode}; "
                               f"full log {path}):\n{tail}")
        return proc.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _venv_python(cache_dir: Path) -> Path:
    return cache_dir / "venv" / "bin" / "python"


def _is_ready(cache_dir: Path, version: str | None) -> bool:
    """The marker is there (for ``version``, when given) and the peer's python imports the cache."""
    marker, python = cache_dir / MARKER, _venv_python(cache_dir)
    if not (marker.is_file() and python.exists()):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if version is not None and info.get("version") != version:
        log.info("arctic-suffix peer: built from %s, %s asked for: rebuilding", info.get("version"), version)
        return False
    check = subprocess.run([str(python), "-I", "-c", "import arctic_inference.suffix_decoding"],
                           capture_output=True, text=True)
    return check.returncode == 0


def _cmake_version(cmake: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_env(cache_dir: Path | str | None = None, *, version: str | None = ARCTIC_VERSION,
               base_python: Path | str | None = None, sdist: Path | str | None = None) -> Path:
    """Build the peer environment unless it is already there; return the peer's python.

    ``version``: the arctic-inference release to build (None: the newest on PyPI); ``base_python``:
    the interpreter the venv is made from (default: this one); ``sdist``: a local sdist to build
    instead of downloading one. Idempotent and safe to call from several processes (a file lock).
    Raises RuntimeError naming the step that failed.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if _is_ready(cache_dir, version):
                log.info("arctic-suffix peer: ready at %s", cache_dir)
                return _venv_python(cache_dir)
            return _build(cache_dir, version, Path(base_python or sys.executable),
                          Path(sdist).resolve() if sdist else None)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _build(cache_dir: Path, version: str | None, base_python: Path, sdist: Path | None) -> Path:
    t_start = time.monotonic()
    steps = _Steps(total=10, logs=cache_dir / "logs")
    venv, src, build = cache_dir / "venv", cache_dir / "src", cache_dir / "build"
    python = _venv_python(cache_dir)
    pip = [python, "-m", "pip", "--no-input"]
    log.info("arctic-suffix peer: building in %s (arctic-inference %s)", cache_dir, version or "newest")

    with steps.step("check the C++ compiler") as name:
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if not cxx:
            raise RuntimeError(f"arctic-suffix peer build failed at step '{name}': no C++ compiler found "
                               "(C++20 needed; e.g. apt-get install g++)")
        cxx_version = steps.run(name, [cxx, "--version"]).splitlines()[0]
        log.info("arctic-suffix peer:   %s", cxx_version)

    with steps.step("create the venv") as name:
        for stale in (cache_dir / MARKER, venv, src, build):
            if stale.is_dir():
                shutil.rmtree(stale)
            elif stale.exists():
                stale.unlink()
        steps.run(name, [base_python, "-m", "venv", venv])

    with steps.step("install pip's sdist tools (setuptools, wheel)") as name:
        steps.run(name, [*pip, "install", "setuptools>=61", "wheel"])

    with steps.step("download the arctic-inference sdist") as name:
        if sdist is None:
            dl = cache_dir / "dl"
            stub = cache_dir / "stub"
            (stub / "torch").mkdir(parents=True, exist_ok=True)
            (stub / "torch" / "__init__.py").write_text(TORCH_STUB)
            req = f"arctic-inference=={version}" if version else "arctic-inference"
            # No build isolation: isolation would install the sdist's build requirements, torch among
            # them, only to read its metadata; the stub satisfies setup.py's top-level import instead.
            steps.run(name, [*pip, "download", "--no-deps", "--no-binary", "arctic-inference",
                             "--no-build-isolation", "-d", dl, req], env=_clean_env(PYTHONPATH=str(stub)))
            found = sorted(dl.glob(f"arctic_inference-{version or '*'}.tar.gz"), key=lambda p: p.stat().st_mtime)
            if not found:
                raise RuntimeError(f"no arctic_inference sdist in {dl} after pip download")
            sdist = found[-1]
        log.info("arctic-suffix peer:   %s", sdist)

    with steps.step("extract the suffix tree sources") as name:
        with tarfile.open(sdist) as tar:
            names = tar.getnames()
            top = names[0].split("/")[0]
            wanted = {f"{top}/{m}" for m in SDIST_MEMBERS}
            missing = wanted - set(names)
            if missing:
                raise RuntimeError(f"arctic-suffix peer build failed at step '{name}': the sdist lacks "
                                   f"{sorted(missing)}")
            for member in tar.getmembers():
                if member.name in wanted and member.isfile():
                    member.name = member.name[len(top) + 1:]
                    tar.extract(member, src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        pkg_info = (src / "PKG-INFO").read_text()
        built_version = re.search(r"^Version: (\S+)", pkg_info, re.M).group(1)
        pin = re.search(r'"nanobind([=<>!~][^"]*)"', (src / "pyproject.toml").read_text())
        nanobind_req = f"nanobind{pin.group(1)}" if pin else "nanobind"

    with steps.step(f"install build and run deps ({nanobind_req}, numpy, cmake if needed)") as name:
        cmake = shutil.which("cmake")
        need_cmake = cmake is None or (_cmake_version(cmake) or (0, 0)) < MIN_CMAKE
        extra = ["cmake>=%d.%d" % MIN_CMAKE] if need_cmake else []
        steps.run(name, [*pip, "install", nanobind_req, "numpy", *extra])
        if need_cmake:
            cmake = str(venv / "bin" / "cmake")
        log.info("arctic-suffix peer:   cmake %s", ".".join(map(str, _cmake_version(cmake) or ())))

    with steps.step("configure with cmake") as name:
        steps.run(name, [cmake, "-S", src / "csrc" / "suffix_decoding", "-B", build,
                         f"-DPython_EXECUTABLE={python}", "-DCMAKE_BUILD_TYPE=Release",
                         f"-DCMAKE_CXX_COMPILER={cxx}"])

    with steps.step("compile the suffix tree extension") as name:
        steps.run(name, [cmake, "--build", build, "--parallel", str(os.cpu_count() or 2)])
        built = sorted(build.glob("_C*.so"))
        if len(built) != 1:
            raise RuntimeError(f"arctic-suffix peer build failed at step '{name}': expected one _C*.so "
                               f"in {build}, found {[p.name for p in built]}")

    with steps.step("install the extension and its wrapper into the venv") as name:
        purelib = Path(steps.run(name, [python, "-I", "-c",
                                        "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
        pkg = purelib / "arctic_inference"
        if pkg.exists():
            shutil.rmtree(pkg)
        (pkg / "suffix_decoding").mkdir(parents=True)
        shutil.copy2(src / "arctic_inference" / "__init__.py", pkg / "__init__.py")
        shutil.copy2(src / "LICENSE", pkg / "LICENSE")
        for f in ("__init__.py", "cache.py"):
            shutil.copy2(src / "arctic_inference" / "suffix_decoding" / f, pkg / "suffix_decoding" / f)
        shutil.copy2(built[0], pkg / "suffix_decoding" / built[0].name)
        info = {"version": built_version, "sdist": sdist.name, "sdist_sha256": _sha256(sdist),
                "nanobind": nanobind_req, "cxx": cxx_version, "base_python": str(base_python),
                "extension": built[0].name}
        (pkg / "BUILD_INFO.json").write_text(json.dumps(info, indent=1) + "\n")

    with steps.step("smoke-test SuffixDecodingCache") as name:
        steps.run(name, [python, "-I", "-c", SMOKE])

    info.update(python=str(python), build_seconds=round(time.monotonic() - t_start, 1),
                built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (cache_dir / MARKER).write_text(json.dumps(info, indent=1) + "\n")
    log.info("arctic-suffix peer: arctic-inference %s built in %.1f s; python %s", built_version,
             info["build_seconds"], python)
    return python


def replay(requests: Sequence[Mapping[str, Any]], budget: int = 16, python: Path | str | None = None, *,
           params: Mapping[str, Any] | None = None, timeout: float = 600.0) -> dict:
    """Replay ``requests`` (``{"id", "prompt": [ints], "output": [ints]}`` each, in order) through the
    peer's suffix cache at ``budget`` draft tokens per step; return arctic_replay.py's JSON object.

    ``python``: the peer's interpreter (default: ``ensure_env()``); ``params``: arctic_replay.py's
    optional parameters (``tree``, ``max_tree_depth``, ``max_spec_factor``, ``max_spec_offset``,
    ``min_token_prob``, ``max_cached_requests``, ``ask_tokens``). Raises RuntimeError on failure.
    """
    py = Path(python) if python else ensure_env()
    payload = {"budget": int(budget), **dict(params or {}),
               "requests": [{"id": r.get("id", i), "prompt": [int(t) for t in r["prompt"]],
                             "output": [int(t) for t in r["output"]]} for i, r in enumerate(requests)]}
    try:
        proc = subprocess.run([str(py), "-I", str(REPLAY_SCRIPT)], input=json.dumps(payload),
                              capture_output=True, text=True, timeout=timeout, env=_clean_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"arctic replay could not run with {py}: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"arctic replay failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    try:
        return json.loads(proc.stdout)
    except ValueError as exc:
        raise RuntimeError(f"arctic replay printed no JSON: {proc.stdout[-500:]!r}") from exc
