"""Huge pages for the weights: a daemon's process starts with transparent huge pages asked for.

A decoding step streams every weight once, and on a CPU it is bound by how fast memory is read.
In 4 KiB pages a 1.5B model's 3 GB of weights span 750,000 pages, and the TLB misses of walking
them cost up to a sixth of the step: on a 2-vCPU Xeon, one core, a Qwen2.5-1.5B-shaped target's
decoding step took 9-19% less in bfloat16 and 1-16% less in fp16-weights in 2 MiB pages.

Linux hands out huge pages to memory that asks for them (``madvise``), which is the default
setting of most distributions' kernels (``/sys/kernel/mm/transparent_hugepage/enabled``). The
weights are allocated by PyTorch (bfloat16 and float32 layers, caches) and by fbgemm
(fp16-weights), inside C++ code; two settings read at allocation make them ask:
``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator: large blocks 2 MiB-aligned, advised huge)
and the glibc tunable ``glibc.malloc.hugetlb=1`` (every malloc'd mapping advised huge). glibc
reads its tunables only when a process starts, so ``with_huge_pages`` runs first when a daemon
starts (``serve``) and, where they are missing, starts the same command again in the same
process (``exec``: same PID, same arguments) with both set. ``STARSD_HUGE_PAGES=0`` turns it
off; on other systems, or where the kernel's setting is ``never``, it does nothing.

What it costs: every allocation the process makes may take huge pages, not the weights alone.
Importing PyTorch and transformers took 4.0 s instead of 2.1 (measured on this Xeon), a 1.5B
bfloat16 target was ready in about 30 s instead of 6, and a page fault in a huge-page region can
wait while the kernel assembles a 2 MiB page. Daemons serving small models gain nothing
measurable (the demo's 135M pair ran at the same speed), so the tests' daemons run without.
Collapsing only the loaded weights into huge pages after start-up (``MADV_COLLAPSE``) was tried
instead: 3 GiB took 16 s to collapse and a bfloat16 step gained 1-3%, against 9-19% this way.
"""

from __future__ import annotations

import importlib
import os
import sys

from common.switches import switched_off

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
GLIBC_HUGE = "glibc.malloc.hugetlb=1"
TORCH_HUGE = "THP_MEM_ALLOC_ENABLE"
DONE = "STARSD_HUGE_PAGES_SET"  # set in the environment it starts again with: never twice


def kernel_setting(path: str = THP_SETTING) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), None where unknown."""
    try:
        text = open(path).read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1: end] if 0 <= start < end else None


def huge_page_env(env: dict[str, str], setting: str | None) -> dict[str, str] | None:
    """The environment a process must start with for its weights to sit in huge pages, or None
    where nothing is to change (already set, turned off, or a kernel that gives none)."""
    if switched_off("STARSD_HUGE_PAGES", env) or env.get(DONE) or setting in (None, "never"):
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if GLIBC_HUGE in tunables.split(":") and env.get(TORCH_HUGE) == "1":
        return None
    new = dict(env)
    if GLIBC_HUGE not in tunables.split(":"):
        new["GLIBC_TUNABLES"] = f"{tunables}:{GLIBC_HUGE}" if tunables else GLIBC_HUGE
    new[TORCH_HUGE] = "1"
    new[DONE] = "1"
    return new


def with_huge_pages() -> None:
    """Start this command again with huge pages asked for (``huge_page_env``), or return where
    nothing is to change. Called first in the daemons' entry points, before anything is loaded."""
    if not sys.platform.startswith("linux"):
        return
    env = huge_page_env(dict(os.environ), kernel_setting())
    if env is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:  # cannot start again: go on as we are, in small pages
        return


def run_cli(module: str) -> None:
    """A console script's entry: ``module``'s click group ``main``, a daemon (``serve``) asking
    for huge pages first; other commands start as they are."""
    if sys.argv[1:2] == ["serve"]:
        with_huge_pages()
    importlib.import_module(module).main()
