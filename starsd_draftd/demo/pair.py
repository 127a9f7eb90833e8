"""A toy byte-level Llama pair (a small target and a tiny draft), trained from scratch on this machine.

Nothing is downloaded.  The pair is trained locally, in a few minutes on a
laptop-class CPU, on the Python standard library's own ``.py`` sources, and
cached under ``common.models.cache_root()``.  The target is trained with cross-entropy;
the draft is then distilled toward the target so that speculative decoding
with the pair has a meaningful acceptance rate. The demo itself runs SmolLM2
(``starsd_draftd.demo.checkpoints``); this pair stays for tests and for
experiments with models trained from nothing.

Public entry points:

* :func:`ensure_demo_pair` builds the pair once (safe against concurrent
  callers and against a training run killed half way).
* :func:`train_demo_pair` does the actual training into a directory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from starsd_draftd.demo.byte_tokenizer import BOS_ID, BYTE_OFFSET, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, make_byte_tokenizer
from common.models import cache_root, torch_threads
from starsd_draftd.demo.checkpoints import exclusive_lock
from starsd_draftd.demo.corpus import load_corpus

logger = logging.getLogger("starsd.demo.pair")

RECIPE_VERSION = "v5"  # the cache directory names it: a new recipe is a new directory
DEMO_TARGET_NAME = "demo"
DEMO_DRAFT_NAME = "demo-draft"
REPORT_NAME = "train_report.json"

# Defaults used by ensure_demo_pair(); the time budget is what bounds the
# build on slow machines, the step counts bound it on fast ones.
DEFAULT_TARGET_STEPS = 1200
DEFAULT_DRAFT_STEPS = 400
DEFAULT_TIME_BUDGET_S = 165.0

__all__ = [
    "DEFAULT_DRAFT_STEPS",
    "DEFAULT_TARGET_STEPS",
    "DEFAULT_TIME_BUDGET_S",
    "DEMO_DRAFT_NAME",
    "DEMO_TARGET_NAME",
    "RECIPE_VERSION",
    "ModelShape",
    "byte_pair_dir",
    "draft_shape",
    "ensure_demo_pair",
    "load_corpus",
    "target_shape",
    "train_demo_pair",
]


# --------------------------------------------------------------------------
# Build-once logic
# --------------------------------------------------------------------------


def _pair_is_complete(root: Path) -> bool:
    if not (root / REPORT_NAME).is_file():
        return False
    for sub in ("target", "draft"):
        d = root / sub
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            if not (d / name).is_file():
                return False
    return True


def byte_pair_dir() -> Path:
    """Where :func:`ensure_demo_pair` caches the pair (apart from the demo's own checkpoints)."""
    return cache_root() / f"demo-{RECIPE_VERSION}"


def ensure_demo_pair(progress: bool = True) -> tuple[Path, Path]:
    """Return ``(target_dir, draft_dir)`` of the demo pair, training it if absent.

    Concurrent callers (several daemons started at once) serialise on a file
    lock, so training happens once.  Training writes into a temporary
    directory which is renamed into place only when complete, so an
    interrupted run is never mistaken for a finished one.
    """
    final = byte_pair_dir()
    target_dir, draft_dir = final / "target", final / "draft"
    if _pair_is_complete(final):
        return target_dir, draft_dir

    root = final.parent
    with exclusive_lock(root / f"demo-{RECIPE_VERSION}.lock"):
        if _pair_is_complete(final):
            logger.info("demo models were built by another process: %s", final)
            return target_dir, draft_dir
        # Holding the lock, any leftover temporary directory belongs to a run
        # that was killed; an incomplete final directory is equally stale.
        for stale in root.glob(f".demo-{RECIPE_VERSION}.tmp-*"):
            logger.info("removing stale partial build %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            logger.warning("removing incomplete demo model directory %s", final)
            shutil.rmtree(final)

        tmp = Path(tempfile.mkdtemp(prefix=f".demo-{RECIPE_VERSION}.tmp-", dir=root))
        tmp.chmod(0o755)
        try:
            logger.info("training the demo model pair (one-time, a few minutes) into %s", final)
            report = train_demo_pair(
                tmp,
                target_steps=DEFAULT_TARGET_STEPS,
                draft_steps=DEFAULT_DRAFT_STEPS,
                progress=progress,
                time_budget_s=DEFAULT_TIME_BUDGET_S,
            )
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _fsync_dir(root)
        logger.info(
            "demo models ready in %.0fs: target held-out loss %.3f, draft held-out loss %.3f, top-1 agreement %.1f%%",
            report["total_wall_s"],
            report["target"]["heldout_loss"],
            report["draft"]["heldout_loss"],
            100.0 * report["agreement"]["heldout_top1"],
        )
    return target_dir, draft_dir


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024

    def to_config(self) -> LlamaConfig:
        config = LlamaConfig(
            vocab_size=BYTE_VOCAB_SIZE,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            dtype="float32",
        )
        return config


def target_shape() -> ModelShape:
    return ModelShape(
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
    )


def draft_shape() -> ModelShape:
    return ModelShape(
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=344,
    )


# --------------------------------------------------------------------------
def _to_ids(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long) + BYTE_OFFSET


class _WindowSampler:
    """Random contiguous windows of ``seq_len + 1`` tokens.

    A ``line_aligned`` share of each batch starts right after a newline, so
    the models also learn to continue from almost no context at the start of
    a line, which is what a prompt such as ``"def "`` looks like.
    """

    def __init__(
        self, ids: torch.Tensor, seq_len: int, batch_size: int, seed: int, line_aligned: float = 0.5
    ) -> None:
        self.ids = ids
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1)
        self.hi = ids.numel() - seq_len - 1
        if self.hi <= 0:
            raise ValueError("training text is shorter than one window")
        line_starts = torch.nonzero(ids[: self.hi] == BYTE_OFFSET + ord("\n")).flatten() + 1
        self.line_starts = line_starts[line_starts < self.hi]
        self.n_aligned = round(batch_size * line_aligned) if self.line_starts.numel() else 0

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.hi, (self.batch_size,), generator=self.gen)
        if self.n_aligned:
            pick = torch.randint(0, self.line_starts.numel(), (self.n_aligned,), generator=self.gen)
            starts[: self.n_aligned] = self.line_starts[pick]
        return self.ids[starts[:, None] + self.offsets[None, :]]


def _fixed_windows(ids: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    hi = ids.numel() - seq_len - 1
    count = max(1, min(count, hi // (seq_len + 1) or 1))
    starts = torch.linspace(0, max(hi - 1, 0), count).long()
    return ids[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


@dataclass
class _Schedule:
    steps: int
    lr: float
    warmup: int
    min_lr_frac: float = 0.1

    def lr_at(self, step: int, frac_time: float) -> float:
        """Linear warmup, then cosine decay along steps or time, whichever is further."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        frac = min(max(frac, frac_time), 1.0)
        cos = 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.lr * (self.min_lr_frac + (1.0 - self.min_lr_frac) * cos)


class _Trainee:
    """A model with its AdamW optimiser."""

    def __init__(self, model: LlamaForCausalLM, weight_decay: float = 0.1) -> None:
        self.model = model
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            (decay if param.ndim >= 2 and "embed" not in name else no_decay).append(param)
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            betas=(0.9, 0.95),
            eps=1e-8,
        )

    def update(self, loss: torch.Tensor, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))


def _distill_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, ce_weight: float
) -> torch.Tensor:
    """KL(teacher || student) over next-token distributions, plus ``ce_weight`` * CE."""
    vocab = student_logits.size(-1)
    s_logp = F.log_softmax(student_logits.reshape(-1, vocab).float(), dim=-1)
    t_logp = F.log_softmax(teacher_logits.reshape(-1, vocab).float(), dim=-1)
    loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
    if ce_weight > 0.0:
        loss = loss + ce_weight * F.nll_loss(s_logp, labels.reshape(-1))
    return loss


def _bf16_speedup() -> float:
    """How much faster a typical training matmul runs under bf16 autocast on this CPU.

    Measured on one thread with the two variants interleaved and the best of
    several runs kept, so that other processes competing for the CPU do not
    skew the comparison.
    """
    a = torch.randn(2048, 192)
    w = torch.randn(512, 192)

    def run(enabled: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            for _ in range(4):
                F.linear(a, w)
        return time.perf_counter() - start

    with torch_threads(1):
        try:
            run(False)
            run(True)
            fp32, bf16 = math.inf, math.inf
            for _ in range(6):
                fp32 = min(fp32, run(False))
                bf16 = min(bf16, run(True))
        except RuntimeError:
            return 0.0
    return fp32 / bf16


class _ThreadGovernor:
    """Falls back to one intra-op thread while the CPU is oversubscribed.

    With several OpenMP threads every parallel region waits for the slowest
    thread, so when other processes compete for the cores a single preempted
    thread stalls the whole step: a few steps then take many times the usual
    time.  One thread is much faster in that situation, so the governor
    switches to it for a while (longer after each relapse) and then tries the
    full thread count again.
    """

    window = 10

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.times: list[float] = []
        self.best = math.inf
        self.strikes = 0
        self.seen = 0
        self.single_until = -1
        self.backoff = 50
        self.switches = 0
        if max_threads > 1 and self._cores_busy_elsewhere(own_load=0.0):
            logger.info("other processes are keeping the CPU busy; starting with 1 thread")
            torch.set_num_threads(1)
            self.single_until = self.backoff
            self.switches += 1

    def _cores_busy_elsewhere(self, own_load: float) -> bool:
        """True when the 1-minute load average leaves fewer free cores than our threads need."""
        try:
            load = os.getloadavg()[0]
            cores = len(os.sched_getaffinity(0))
        except (OSError, AttributeError):
            return False
        return load - own_load >= cores - self.max_threads + 1.0

    def after_step(self, step: int, seconds: float) -> None:
        if self.max_threads <= 1:
            return
        if torch.get_num_threads() == 1:
            if step >= self.single_until:
                if self._cores_busy_elsewhere(own_load=1.0):
                    self.single_until = step + self.backoff
                    return
                torch.set_num_threads(self.max_threads)
                self.times.clear()
                self.strikes = 0
            return
        self.seen += 1
        if self.seen > 2:  # the first steps include one-off allocation costs
            self.best = min(self.best, seconds)
        self.times.append(seconds)
        if seconds > 4.0 * self.best:
            self.strikes += 1
        median = sorted(self.times)[len(self.times) // 2]
        if self.strikes >= 2 or (
            len(self.times) >= self.window and sum(self.times) > 1.6 * len(self.times) * median
        ):
            torch.set_num_threads(1)
            self.single_until = step + self.backoff
            logger.info(
                "CPU looks oversubscribed (%.1fs for the last %d steps); using 1 thread for %d steps",
                sum(self.times),
                len(self.times),
                self.backoff,
            )
            self.backoff *= 2
            self.switches += 1
            self.times.clear()
            self.strikes = 0
        elif len(self.times) >= self.window:
            self.times.clear()
            self.strikes = 0


def _train_loop(name: str, steps: int, deadline: float | None, progress: bool, step_fn) -> dict:
    """Call ``step_fn(step, frac_time) -> {loss_name: value}`` until ``steps`` or ``deadline``."""
    start = time.monotonic()
    budget = None if deadline is None else max(deadline - start, 1e-6)
    governor = _ThreadGovernor(torch.get_num_threads())
    ema: dict[str, float] = {}
    step = 0
    stopped_by_time = False
    bar = tqdm(
        total=steps, desc=f"demo {name}", unit="step", file=sys.stderr, disable=not progress, dynamic_ncols=True
    )
    try:
        while step < steps:
            now = time.monotonic()
            if deadline is not None and now >= deadline and step > 0:
                stopped_by_time = True
                break
            frac_time = 0.0 if budget is None else (now - start) / budget
            for key, value in step_fn(step, frac_time).items():
                ema[key] = value if key not in ema else 0.95 * ema[key] + 0.05 * value
            governor.after_step(step, time.monotonic() - now)
            step += 1
            bar.update(1)
            if step % 5 == 0 or step == steps:
                bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()})
    finally:
        bar.close()
        torch.set_num_threads(governor.max_threads)
    wall = time.monotonic() - start
    logger.info(
        "demo %s phase: %d steps in %.1fs%s, %s",
        name,
        step,
        wall,
        " (time budget reached)" if stopped_by_time else "",
        ", ".join(f"{k} {v:.3f}" for k, v in ema.items()),
    )
    return {
        "steps": step,
        "planned_steps": steps,
        "stopped_by_time_budget": stopped_by_time,
        "wall_s": round(wall, 2),
        "single_thread_fallbacks": governor.switches,
        "loss_ema": {k: round(v, 4) for k, v in ema.items()},
    }


@torch.no_grad()
def _evaluate(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, windows: torch.Tensor, chunk: int = 16
) -> dict:
    t_loss = d_loss = 0.0
    agree = total = t_correct = d_correct = 0
    for i in range(0, windows.size(0), chunk):
        batch = windows[i : i + chunk]
        inputs, labels = batch[:, :-1], batch[:, 1:]
        t_logits = target(input_ids=inputs).logits.float()
        d_logits = draft(input_ids=inputs).logits.float()
        n = labels.numel()
        t_loss += float(_ce(t_logits, labels)) * n
        d_loss += float(_ce(d_logits, labels)) * n
        t_top, d_top = t_logits.argmax(-1), d_logits.argmax(-1)
        agree += int((t_top == d_top).sum())
        t_correct += int((t_top == labels).sum())
        d_correct += int((d_top == labels).sum())
        total += n
    return {
        "target_loss": t_loss / total,
        "draft_loss": d_loss / total,
        "top1_agreement": agree / total,
        "target_top1_acc": t_correct / total,
        "draft_top1_acc": d_correct / total,
        "tokens": total,
    }


@torch.no_grad()
def _greedy(model: LlamaForCausalLM, prompt_ids: list[int], new_tokens: int) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def _greedy_path_agreement(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    """Top-1 agreement of the draft along the target's own greedy continuations.

    This is what greedy speculative decoding sees: each drafted token is
    checked against the target's greedy choice on the target's own path.
    """
    agree = total = 0
    continuations = []
    for prompt in prompts:
        cont = _greedy(target, prompt, new_tokens)
        continuations.append(cont)
        if not cont:
            continue
        seq = torch.tensor([prompt + cont])
        d_top = draft(input_ids=seq[:, :-1]).logits[0, len(prompt) - 1 :].argmax(-1)
        agree += int((d_top == torch.tensor(cont)).sum())
        total += len(cont)
    return (agree / total if total else 0.0), continuations


def _expected_tokens_per_verify(agreement: float, k: int) -> float:
    """Mean tokens emitted per verify step with ``k`` drafted tokens, if matches were i.i.d."""
    if agreement >= 1.0:
        return float(k + 1)
    return (1.0 - agreement ** (k + 1)) / (1.0 - agreement)


def _save(model: LlamaForCausalLM, out: Path) -> None:
    model.to(torch.float32)
    model.config.pad_token_id = PAD_ID
    model.config.bos_token_id = BOS_ID
    model.config.eos_token_id = EOS_ID
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    make_byte_tokenizer().save_pretrained(out)


def _param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_demo_pair(
    out_dir: Path,
    *,
    target_steps: int,
    draft_steps: int,
    progress: bool,
    seed: int = 0,
    time_budget_s: float | None = None,
    target_share: float = 0.8,
    batch_size: int = 16,
    seq_len: int = 256,
    target_lr: float = 2e-3,
    draft_lr: float = 3e-3,
    polish_lr: float = 1e-3,
    distill_ce_weight: float = 0.1,
    cotrain_draft: bool = True,
    corpus_bytes: int = 4_000_000,
    eval_windows: int = 32,
    sample_tokens: int = 96,
    num_threads: int = 2,
    use_bf16: bool | None = None,
    target: ModelShape | None = None,
    draft: ModelShape | None = None,
) -> dict:
    """Train the demo target and draft into ``out_dir/target`` and ``out_dir/draft``.

    Phase 1 (``target_steps`` steps) trains the target on next-byte
    cross-entropy over stdlib Python sources.  With ``cotrain_draft`` the draft
    is distilled during this phase too, toward the target's (detached) logits
    of the same batch, which costs little since those logits are computed
    anyway.  Phase 2 (``draft_steps`` steps) distils the draft toward the
    final, frozen target.  The distillation loss is KL(target || draft) over
    the next-token distributions plus ``distill_ce_weight`` times
    cross-entropy on the data.

    With ``time_budget_s`` each phase also stops once its share of the budget
    is spent (phase 1 ends at ``target_share`` of it, phase 2 at the end,
    minus a reserve for evaluation and saving) and the learning rate decays
    along whichever of steps or time runs out first.  ``use_bf16=None``
    enables bf16 autocast for training only where it is clearly faster on
    this CPU; saved weights are always float32.

    Returns the report that is also written to ``out_dir/train_report.json``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_shape = target or target_shape()
    d_shape = draft or draft_shape()
    t0 = time.monotonic()
    if time_budget_s is None:
        target_deadline = draft_deadline = None
    else:
        reserve = min(10.0, 0.1 * time_budget_s)
        target_deadline = t0 + target_share * (time_budget_s - reserve)
        draft_deadline = t0 + time_budget_s - reserve

    with torch_threads(num_threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        train_bytes, heldout_bytes, corpus_info = load_corpus(byte_budget=corpus_bytes, seed=seed)
        train_ids, heldout_ids = _to_ids(train_bytes), _to_ids(heldout_bytes)
        speedup = None
        if use_bf16 is None:
            speedup = _bf16_speedup()
            use_bf16 = speedup >= 1.3
        data_wall = time.monotonic() - t0
        logger.info(
            "demo corpus: %d training bytes from %d files; bf16 autocast %s",
            len(train_bytes),
            corpus_info["train_files"],
            "on" if use_bf16 else "off",
        )

        def autocast():
            return torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)

        target_model = LlamaForCausalLM(t_shape.to_config())
        draft_model = LlamaForCausalLM(d_shape.to_config())
        target_model.train()
        draft_model.train()
        t_trainee, d_trainee = _Trainee(target_model), _Trainee(draft_model)

        # Phase 1: target (and, optionally, draft distilled on the fly).
        t_sched = _Schedule(target_steps, target_lr, warmup=max(1, min(30, target_steps // 10)))
        c_sched = _Schedule(target_steps, draft_lr, warmup=max(1, min(30, target_steps // 10)))
        sampler = _WindowSampler(train_ids, seq_len, batch_size, seed + 1)

        def target_step(step: int, frac_time: float) -> dict[str, float]:
            batch = sampler.next()
            inputs, labels = batch[:, :-1], batch[:, 1:]
            with autocast():
                t_logits = target_model(input_ids=inputs).logits
            losses = {"target": t_trainee.update(_ce(t_logits, labels), t_sched.lr_at(step, frac_time))}
            if cotrain_draft:
                with autocast():
                    d_logits = draft_model(input_ids=inputs).logits
                loss = _distill_loss(d_logits, t_logits.detach(), labels, distill_ce_weight)
                losses["draft_kl"] = d_trainee.update(loss, c_sched.lr_at(step, frac_time))
            return losses

        target_phase = _train_loop("target", target_steps, target_deadline, progress, target_step)
        target_model.eval()
        target_model.requires_grad_(False)

        # Phase 2: distil the draft toward the final target.
        d_sched = _Schedule(
            draft_steps,
            polish_lr if cotrain_draft else draft_lr,
            warmup=max(1, min(20, draft_steps // 10)),
        )
        d_sampler = _WindowSampler(train_ids, seq_len, batch_size, seed + 2)

        def draft_step(step: int, frac_time: float) -> dict[str, float]:
            batch = d_sampler.next()
            inputs, labels = batch[:, :-1], batch[:, 1:]
            with torch.no_grad(), autocast():
                t_logits = target_model(input_ids=inputs).logits
            with autocast():
                d_logits = draft_model(input_ids=inputs).logits
            loss = _distill_loss(d_logits, t_logits, labels, distill_ce_weight)
            return {"draft_kl": d_trainee.update(loss, d_sched.lr_at(step, frac_time))}

        draft_phase = _train_loop("draft", draft_steps, draft_deadline, progress, draft_step)
        draft_model.eval()
        draft_model.requires_grad_(False)
        del t_trainee, d_trainee

        # Evaluation (float32, one thread: small work that must not stall on a busy machine).
        eval_start = time.monotonic()
        torch.set_num_threads(1)
        heldout_eval = _evaluate(target_model, draft_model, _fixed_windows(heldout_ids, seq_len, eval_windows))
        train_eval = _evaluate(target_model, draft_model, _fixed_windows(train_ids, seq_len, eval_windows))
        tok = make_byte_tokenizer()
        prompts = ["def ", "import ", "class ", "    def __init__(self"]
        path_agreement, conts = _greedy_path_agreement(
            target_model,
            draft_model,
            [tok.encode(p, add_special_tokens=False) for p in prompts],
            new_tokens=sample_tokens,
        )
        samples = {p: tok.decode(c) for p, c in zip(prompts, conts)}
        eval_wall = time.monotonic() - eval_start

        save_start = time.monotonic()
        _save(target_model, out_dir / "target")
        _save(draft_model, out_dir / "draft")
        save_wall = time.monotonic() - save_start

    common = {"batch_size": batch_size, "seq_len": seq_len}
    report = {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "time_budget_s": time_budget_s,
        "num_threads": num_threads,
        "bf16_autocast": use_bf16,
        "bf16_matmul_speedup": None if speedup is None else round(speedup, 2),
        "corpus": corpus_info,
        "target": {
            "shape": asdict(t_shape),
            "params": _param_count(target_model),
            "train_loss": round(train_eval["target_loss"], 4),
            "heldout_loss": round(heldout_eval["target_loss"], 4),
            "heldout_top1_acc": round(heldout_eval["target_top1_acc"], 4),
        },
        "draft": {
            "shape": asdict(d_shape),
            "params": _param_count(draft_model),
            "train_loss": round(train_eval["draft_loss"], 4),
            "heldout_loss": round(heldout_eval["draft_loss"], 4),
            "heldout_top1_acc": round(heldout_eval["draft_top1_acc"], 4),
            "distill_ce_weight": distill_ce_weight,
            "cotrained_with_target": cotrain_draft,
        },
        "phases": {
            "target": {**target_phase, **common, "lr": target_lr, "draft_lr": draft_lr if cotrain_draft else None},
            "draft": {**draft_phase, **common, "lr": d_sched.lr},
        },
        "agreement": {
            "heldout_top1": round(heldout_eval["top1_agreement"], 4),
            "train_top1": round(train_eval["top1_agreement"], 4),
            "target_greedy_path_top1": round(path_agreement, 4),
            "expected_tokens_per_verify_k4": round(_expected_tokens_per_verify(path_agreement, 4), 3),
            "heldout_tokens": heldout_eval["tokens"],
        },
        "greedy_samples": samples,
        "wall_s": {
            "data": round(data_wall, 2),
            "target": target_phase["wall_s"],
            "draft": draft_phase["wall_s"],
            "eval": round(eval_wall, 2),
            "save": round(save_wall, 2),
        },
        "total_wall_s": round(time.monotonic() - t0, 2),
    }
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report
