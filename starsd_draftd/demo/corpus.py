"""Training text every Python install has: the standard library's own ``.py`` sources, read in a
deterministic order, optionally without docstrings and comments."""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
_MAX_FILE_BYTES = 200_000


def _stdlib_sources() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def _strip_docs(source: str) -> str | None:
    """``source`` without docstrings and full-line comments, or None if it does not parse.

    English prose is the hardest part of the stdlib to model and the least
    useful for a code demo; removing it lets the small models learn code
    structure within the time budget.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    drop: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if len(body) < 2:  # removing the only statement would leave an empty block
            continue
        first = body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
            and first.end_lineno is not None
            and first.end_lineno < body[1].lineno
            and (isinstance(node, ast.Module) or first.lineno > node.lineno)
        ):
            drop.update(range(first.lineno, first.end_lineno + 1))
    kept: list[str] = []
    blank_run = 0
    for lineno, line in enumerate(source.splitlines(), start=1):
        if lineno in drop or line.lstrip().startswith("#"):
            continue
        if not line.strip():
            blank_run += 1
            if blank_run > 2:
                continue
            line = ""
        else:
            blank_run = 0
        kept.append(line.rstrip())
    return "\n".join(kept).strip("\n")


def load_corpus(
    byte_budget: int = 4_000_000, heldout_bytes: int = 120_000, seed: int = 0, code_only: bool = True
) -> tuple[bytes, bytes, dict]:
    """Deterministic ``(train, heldout, info)`` byte strings from the stdlib sources.

    Files are listed in sorted order, shuffled with ``seed`` and taken whole
    until ``heldout_bytes`` (first) and then ``byte_budget`` are reached, so
    the held-out text comes from files never seen in training.  With
    ``code_only`` docstrings and full-line comments are removed.
    """
    files = _stdlib_sources()
    random.Random(seed).shuffle(files)
    heldout_parts: list[bytes] = []
    train_parts: list[bytes] = []
    n_held = n_train = 0
    for path in files:
        if n_train >= byte_budget:
            break
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if not raw or len(raw) > _MAX_FILE_BYTES:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if code_only:
            stripped = _strip_docs(text)
            if stripped is None:
                continue
            text = stripped
        data = text.rstrip("\n").encode("utf-8") + b"\n\n\n"
        if len(data) < 200:
            continue
        if n_held < heldout_bytes:
            heldout_parts.append(data)
            n_held += len(data)
        else:
            remaining = byte_budget - n_train
            train_parts.append(data[:remaining])
            n_train += min(len(data), remaining)
    train, heldout = b"".join(train_parts), b"".join(heldout_parts)
    if len(train) < 10_000 or len(heldout) < 2_000:
        raise RuntimeError(
            f"not enough Python sources found under {sysconfig.get_paths()['stdlib']} to train the demo models"
        )
    info = {
        "stdlib": sysconfig.get_paths()["stdlib"],
        "python": sys.version.split()[0],
        "code_only": code_only,
        "train_files": len(train_parts),
        "heldout_files": len(heldout_parts),
        "train_bytes": len(train),
        "heldout_bytes": len(heldout),
    }
    return train, heldout, info


