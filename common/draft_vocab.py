"""A draft model's output layer cut to the tokens text actually uses (``--draft-vocab``).

A small draft model spends most of a step in its output layer: the demo's one-layer draft has
3.5 M parameters in its transformer layer and 28 M in its LM head (576 x 49152), and on one CPU
core a step took 2.6 ms with the full head and 0.5 ms without it. Text uses few of a
tokenizer's ids: the 8192 of 49152 most frequent in the demo's corpus covered 97.7% of the
tokens the demo target wrote for the demo's prompts. With ``--draft-vocab`` the draft model's
head computes logits for those ids only; every other id gets -inf, so the draft never proposes it.

This changes what the draft proposes. Greedy output stays the target's own: verification keeps
exactly the target's tokens. In sampling mode the draft's distribution q is the model's softmax
over the kept ids, which is the distribution its drafts are drawn from and the one sent for the
target's acceptance test, so sampled output keeps the target's distribution (a seed's tokens
depend on the drafts, so they change with the vocabulary).

A vocabulary file is JSON (``starsd-draftd vocab`` writes one from text files)::

    {"starsd_draft_vocab": 1, "logits_size": 49152, "fingerprint": "<tokenizer's>",
     "ids": [...], "source": "...", "tokens_counted": N, "coverage": 0.99}

The daemon reads ``<draft model dir>/starsd_draft_vocab.json`` when it is there (``auto``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_FILE = "starsd_draft_vocab.json"
FORMAT_VERSION = 1
MIN_IDS = 64  # at least sampling's default top-k of q (32), with room for trees' branches
DEFAULT_SIZE = 8192
DRAFT_VOCAB_HELP = ("--backend model: the token ids the draft model's output layer computes (a file from "
                    "`starsd-draftd vocab`). auto: the draft model directory's " + VOCAB_FILE + " if it has "
                    "one, else the full vocabulary; off: the full vocabulary. A cut head drafts faster (most "
                    "of a small draft's step is its output layer). Greedy outputs stay the target's own and "
                    "sampled ones its distribution; a seed's sampled tokens depend on the drafts, so they "
                    "change with the vocabulary.")


class DraftVocabError(ValueError):
    """A vocabulary file that cannot be used with this model, with a message saying why."""


@dataclass(frozen=True)
class DraftVocab:
    ids: tuple[int, ...]  # ascending, unique
    logits_size: int
    fingerprint: str | None
    path: Path | None = None
    coverage: float | None = None

    def check(self, logits_size: int, fingerprint: str, vocab_size: int | None = None) -> None:
        """Raise DraftVocabError unless this vocabulary belongs to a model of this output width and
        tokenizer, and keeps enough ids the tokenizer knows (``vocab_size``: drafts come from those
        only; the rest of a padded output layer is never proposed)."""
        where = f" ({self.path})" if self.path else ""
        if self.logits_size != logits_size:
            raise DraftVocabError(f"the draft vocabulary{where} is for an output layer of {self.logits_size} "
                                  f"logits; this model has {logits_size}: rebuild it with `starsd-draftd vocab`")
        if self.fingerprint is not None and self.fingerprint != fingerprint:
            raise DraftVocabError(f"the draft vocabulary{where} was built with another tokenizer (fingerprint "
                                  f"{self.fingerprint}, this model's {fingerprint}): rebuild it with "
                                  "`starsd-draftd vocab`")
        if vocab_size is not None:
            known = sum(1 for i in self.ids if i < vocab_size)
            if known < min(MIN_IDS, vocab_size):
                raise DraftVocabError(f"the draft vocabulary{where} keeps {known} ids the tokenizer knows (below "
                                      f"{vocab_size}); at least {MIN_IDS} are needed")


def load_vocab(path: Path) -> DraftVocab:
    """Read and validate a vocabulary file (DraftVocabError says what is wrong)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DraftVocabError(f"cannot read the draft vocabulary {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DraftVocabError(f"the draft vocabulary {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("starsd_draft_vocab") != FORMAT_VERSION:
        raise DraftVocabError(f"{path} is not a StarSD draft vocabulary (version {FORMAT_VERSION}); write one "
                              "with `starsd-draftd vocab`")
    size, ids, fp = data.get("logits_size"), data.get("ids"), data.get("fingerprint")
    if type(size) is not int or size < 1:
        raise DraftVocabError(f"{path}: logits_size must be a positive integer")
    if not isinstance(ids, list) or any(type(i) is not int for i in ids):
        raise DraftVocabError(f"{path}: ids must be a list of integers")
    if len(set(ids)) != len(ids) or any(i < 0 or i >= size for i in ids):
        raise DraftVocabError(f"{path}: ids must be distinct, each in 0..{size - 1}")
    if len(ids) < min(MIN_IDS, size):
        raise DraftVocabError(f"{path}: {len(ids)} ids; at least {MIN_IDS} are needed")
    if fp is not None and not isinstance(fp, str):
        raise DraftVocabError(f"{path}: fingerprint must be a string")
    cov = data.get("coverage")
    return DraftVocab(tuple(sorted(ids)), size, fp, path, float(cov) if isinstance(cov, (int, float)) else None)


def resolve_vocab(choice: str | None, model_dir: Path) -> DraftVocab | None:
    """``--draft-vocab``: ``auto`` (the model directory's file, if any), ``off``/None, or a path."""
    if choice is None or choice == "off":
        return None
    if choice == "auto":
        own = Path(model_dir) / VOCAB_FILE
        return load_vocab(own) if own.is_file() else None
    return load_vocab(Path(choice))


def count_tokens(tokenizer, texts: Iterable[str], logits_size: int) -> torch.Tensor:
    """How often each id occurs when ``texts`` are tokenized (int64 [logits_size])."""
    counts = torch.zeros(logits_size, dtype=torch.long)
    for text in texts:
        ids = [i for i in tokenizer(text, add_special_tokens=False)["input_ids"] if 0 <= i < logits_size]
        if ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=logits_size)
    return counts


def choose_ids(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` ids to keep: ``always`` (special tokens: a draft must be able to end a text),
    then the most frequent, ties broken by the lower id (a deterministic file)."""
    n = int(counts.numel())
    keep = {i for i in always if 0 <= i < n}
    order = sorted(range(n), key=lambda i: (-int(counts[i]), i))
    for i in order:
        if len(keep) >= size:
            break
        keep.add(i)
    return sorted(keep)


def write_vocab(path: Path, ids: list[int], logits_size: int, fingerprint: str | None, counts: torch.Tensor,
                source: str) -> dict:
    """Write a vocabulary file atomically; returns what was written."""
    total = int(counts.sum())
    covered = int(counts[torch.tensor(ids, dtype=torch.long)].sum()) if ids else 0
    data = {"starsd_draft_vocab": FORMAT_VERSION, "logits_size": int(logits_size), "fingerprint": fingerprint,
            "size": len(ids), "source": source, "tokens_counted": total,
            "coverage": round(covered / total, 6) if total else None, "ids": [int(i) for i in ids]}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return data


class SubsetHead(torch.nn.Module):
    """An output layer over ``ids`` only, returning full-width logits: -inf at every other id, so
    everything downstream (argmax, softmax, top-k) works unchanged and never picks them."""

    def __init__(self, head: torch.nn.Linear, ids: list[int] | tuple[int, ...], logits_size: int):
        super().__init__()
        idx = torch.tensor(list(ids), dtype=torch.long, device=head.weight.device)
        self.inner = torch.nn.Linear(head.in_features, len(ids), bias=head.bias is not None,
                                     device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            self.inner.weight.copy_(head.weight.index_select(0, idx))
            if head.bias is not None:
                self.inner.bias.copy_(head.bias.index_select(0, idx))
        self.register_buffer("ids", idx, persistent=False)
        self.logits_size = int(logits_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.inner(x)
        out = sub.new_full((*sub.shape[:-1], self.logits_size), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)

    def extra_repr(self) -> str:
        return f"{len(self.ids)} of {self.logits_size} ids"


def restrict_head(model: torch.nn.Module, vocab: DraftVocab) -> None:
    """Replace ``model``'s output layer by a SubsetHead over ``vocab.ids``, in place (before any
    weight packing: the subset's rows are copied out of the full layer)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise DraftVocabError(f"cannot cut an output layer of type {type(head).__name__}")
    model.set_output_embeddings(SubsetHead(head, vocab.ids, vocab.logits_size))


def _text_files(paths: list[Path], pattern: str) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():  # hidden files and directories (.git, .venv) are not sample text
            files.extend(sorted(f for f in p.rglob(pattern)
                                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)))
        else:
            files.append(p)
    return files


def _chunks(path: Path, size: int = 1 << 20) -> Iterable[str]:
    """A file's text in pieces of about ``size`` bytes, cut at line ends (undecodable bytes replaced)."""
    with open(path, "rb") as fh:
        rest = b""
        while block := fh.read(size):
            block = rest + block
            cut = block.rfind(b"\n") + 1 or len(block)
            rest = block[cut:]
            yield block[:cut].decode("utf-8", "replace")
        if rest:
            yield rest.decode("utf-8", "replace")


def vocab_for_texts(model_dir: Path, texts: Iterable[str], size: int = DEFAULT_SIZE, out: Path | None = None,
                    source: str = "") -> dict:
    """Count the tokens of ``texts`` with the model's own tokenizer, keep its special tokens and the
    most frequent ids up to ``size``, and write the vocabulary file (default: in the model
    directory). Reads the tokenizer and config only, not the weights. Returns what was written."""
    from transformers import AutoConfig

    from common.models import ModelLoadError, load_tokenizer, tokenizer_fingerprint, vocab_size

    model_dir = Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ModelLoadError(f"{model_dir} has no tokenizer: a vocabulary is counted with the draft's own tokenizer")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {exc}") from None
    logits_size = int(getattr(config, "vocab_size", 0) or len(tokenizer))
    if size > logits_size:
        raise DraftVocabError(f"a vocabulary of {size} ids is more than the model's {logits_size}")
    counts = count_tokens(tokenizer, texts, logits_size)
    if not int(counts.sum()):
        raise DraftVocabError("the texts hold no tokens to count")
    eos = getattr(config, "eos_token_id", None)
    always = set(getattr(tokenizer, "all_special_ids", None) or [])
    always.update([eos] if isinstance(eos, int) else list(eos or []))
    target = Path(out) if out is not None else model_dir / VOCAB_FILE
    fingerprint = tokenizer_fingerprint(tokenizer, vocab_size(tokenizer, logits_size))
    written = write_vocab(target, choose_ids(counts, size, always), logits_size, fingerprint, counts, source)
    return {**written, "path": target}


def build_vocab_file(model: str, texts: list[Path], size: int = DEFAULT_SIZE, out: Path | None = None,
                     pattern: str = "*", progress: bool = True) -> dict:
    """``starsd-draftd vocab``: ``vocab_for_texts`` over files, or directories read recursively for
    ``pattern``, with a progress bar."""
    from tqdm import tqdm

    from common.models import resolve_model_path

    files = _text_files(texts, pattern)
    if not files:
        raise DraftVocabError("no text files found in " + ", ".join(map(str, texts)))
    bar = tqdm(files, desc="counting tokens", unit="file", disable=not progress or len(files) < 2)
    pieces = (piece for f in bar for piece in _chunks(f))
    written = vocab_for_texts(resolve_model_path(model), pieces, size, out,
                              f"{len(files)} files under {', '.join(map(str, texts))}")
    return {**written, "files": len(files)}
