"""A daemon's resident memory, against the weights it serves: what start-up logs, what STATS
reports and what the bench records, so that a user sizing a board sees the real footprint."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

GIB = float(1 << 30)
WEIGHT_FILES = ("*.safetensors", "*.bin")


def resident_bytes() -> tuple[int, int]:
    """(resident set size now, its peak so far) of this process in bytes: Linux's VmRSS and
    VmHWM, else the peak from getrusage for both."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
                      if line.startswith(("VmRSS:", "VmHWM:")))
        now, peak = (int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
        return now, peak
    except (OSError, KeyError, ValueError):
        import resource  # POSIX only: imported where /proc is missing, not at start-up

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
        return peak, peak


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the weight files in a checkpoint directory (safetensors, else PyTorch bins)."""
    for pattern in WEIGHT_FILES:
        files = list(Path(path).glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    return 0


def memory_report(weights: int) -> dict:
    """Resident memory now and at its peak, with their ratio to ``weights`` (0: unknown)."""
    now, peak = resident_bytes()
    return {"rss_bytes": now, "peak_rss_bytes": peak, "weights_bytes": weights,
            "rss_over_weights": round(now / weights, 3) if weights else None,
            "peak_over_weights": round(peak / weights, 3) if weights else None}


def describe(report: dict) -> str:
    """One line for a log: 'resident 3.61 GiB (1.17x the checkpoint's 3.09 GiB), peak 4.20 GiB (1.36x)'."""
    text = f"resident {report['rss_bytes'] / GIB:.2f} GiB"
    if report["weights_bytes"]:
        text += (f" ({report['rss_over_weights']:.2f}x the checkpoint's {report['weights_bytes'] / GIB:.2f} GiB "
                 f"of weights), peak {report['peak_rss_bytes'] / GIB:.2f} GiB ({report['peak_over_weights']:.2f}x)")
    else:
        text += f", peak {report['peak_rss_bytes'] / GIB:.2f} GiB"
    return text


MADV_DONTNEED = 4  # Linux's values on every architecture PyTorch ships for
MADV_POPULATE_READ = 22


def _weight_file_maps(suffix: str = ".safetensors") -> list[tuple[int, int, int, int, str]]:
    """This process's mappings of weight files, as (start, end, file offset, inode, path), from
    Linux's /proc/self/maps (elsewhere none)."""
    maps = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].endswith(suffix):
                lo, hi = parts[0].split("-")
                maps.append((int(lo, 16), int(hi, 16), int(parts[2], 16), int(parts[4]), parts[5]))
    except OSError:
        return []
    return maps


def weight_file_ranges(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of weight files (Linux; else none): where a
    checkpoint loaded in its own dtype keeps its tensors, read straight from the page cache."""
    return [(lo, hi) for lo, hi, *_ in _weight_file_maps(suffix)]


def file_location(tensor) -> tuple[str, int, int] | None:
    """(path, byte offset, inode) of the file a tensor's bytes are mapped from, where all of them
    lie in one mapping of a weight file that is still the file at that path (the same inode: a
    file renamed over it since is not what the mapping holds). None elsewhere (not Linux, not a
    file mapping, or the file was replaced)."""
    import os

    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for lo, hi, offset, inode, path in _weight_file_maps():
        if lo <= start < end <= hi:
            try:
                same = os.stat(path).st_ino == inode
            except OSError:
                return None
            return (path, offset + (start - lo), inode) if same else None
    return None


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, loaded once: a wide prefill advises every weight twice (about 200 calls at
    1.5B), and loading the library costs about 40 us a time."""
    import ctypes

    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


def _file_advice(tensor, ranges: list[tuple[int, int]], advice: int) -> int:
    """madvise(``advice``) on the whole pages of ``tensor`` where it lies in a mapped weight file
    (``weight_file_ranges``); memory that is not such a mapping is never touched. Returns the
    bytes advised (0: none, or the kernel refused the advice)."""
    import mmap

    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo or not any(a <= lo and hi <= b for a, b in ranges):
        return 0
    return hi - lo if _madvise()(lo, hi - lo, advice) == 0 else 0


def release_file_pages(tensor, ranges: list[tuple[int, int]]) -> int:
    """Tell the kernel this process no longer needs the pages of ``tensor`` where it lies in a
    mapped weight file (``weight_file_ranges``): they leave resident memory, and a later read
    pages them in again from the file. That holds for pages never written, as a loaded
    checkpoint's are (safetensors maps its file private, so a page written in place would be
    dropped and read back as the file holds it): call it only on weights nothing has modified.
    Memory that is not a file mapping is never touched. Returns the bytes released."""
    return _file_advice(tensor, ranges, MADV_DONTNEED)


def populate_file_pages(tensor, ranges: list[tuple[int, int]]) -> int:
    """Map the pages of ``tensor`` where it lies in a mapped weight file, all in one call
    (MADV_POPULATE_READ, Linux 5.14 and later), rather than a page fault for every 64 KiB read:
    a wide prefill reads the whole checkpoint, and at 1.5B faulting its 3 GiB in (and giving
    them back) took a third of a 24-token prefill. Returns the bytes mapped (0 on an older
    kernel, where reading faults them in as before)."""
    return _file_advice(tensor, ranges, MADV_POPULATE_READ)


def give_back_freed_memory() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; elsewhere nothing).
    Replacing weights frees blocks in the middle of the heap, which glibc otherwise keeps: after
    the fp16-weights fusion of a 1.5B model, 2 GiB of them."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)


def status_line(stats: dict) -> list[str]:
    """The memory line of a daemon's ``status`` (none from a daemon that reports none)."""
    report = stats.get("memory")
    return [f"  memory: {describe(report)}"] if report else []
