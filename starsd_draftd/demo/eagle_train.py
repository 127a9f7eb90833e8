"""Training an EAGLE-1 head for a local target on text the target writes itself.

The target writes greedy continuations of prompts cut from the Python standard library's sources
(or the demo build has written them already), keeping per position its final hidden state f_i
(the feature, float16 as it travels) and its top-k next tokens. The head reads pairs
(f_i, embed(t_{i+1})) and is trained, as in EAGLE-1 (Li et al. 2024), with smooth-L1 regression
of the next feature f_{i+1} plus ``ce_weight`` times the cross-entropy of LM-head(predicted
feature) against the target's distribution (``_head_loss``). No step runs the target, so a step
costs the head's own forward and backward: on a 2-core CPU a few hundred steps fit in the time
one step over fresh target forwards took. The target's embedding and LM head stay frozen and are
not saved with the head. Input features get small uniform noise, so that the head tolerates the
error of its own predicted features when it drafts several steps ahead.

The result is written in EAGLE's layout: ``config.json`` + ``model.safetensors`` (the head's state
dict only) + ``train_report.json``, into a temporary directory renamed into place when complete.
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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.features import fused_features
from common.models import ModelLoadError, load_causal_lm, torch_threads
from common.verify import SamplingParams
from starsd_draftd.backends.eagle import EagleBackend, EagleHead
from starsd_draftd.backends.eagle_compat import build_head
from starsd_draftd.demo.distill import target_generations, teacher_losses, token_windows

log = logging.getLogger("starsd.eagle")

DEFAULT_TIME_BUDGET_S = 180.0
REPORT_NAME = "train_report.json"
HEAD_FORMATS = ("safetensors", "bin")


# ---------------------------------------------------------------- saving


def head_config_for(target_config, hidden_size: int, vocab_size: int):
    """A one-layer Llama-style head config shaped like a decoder layer of the target."""
    from transformers import LlamaConfig

    heads = int(target_config.num_attention_heads)
    kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
    if hidden_size % heads:
        raise ModelLoadError(f"the target's hidden size {hidden_size} is not a multiple of its {heads} heads")
    intermediate = (getattr(target_config, "intermediate_size", None) or getattr(target_config, "n_inner", None)
                    or 4 * hidden_size)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=int(intermediate), num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=int(kv_heads), hidden_act="silu",
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 2048) or 2048),
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id, architectures=["LlamaForCausalLM"])


def save_eagle_head(head_module: torch.nn.Module, config, out_dir: str | Path, fmt: str = "safetensors",
                    include_embedding: bool = False) -> Path:
    """Write a head in EAGLE's published layout: ``config.json`` plus ``model.safetensors``
    (``fmt="safetensors"``) or ``pytorch_model.bin`` (``fmt="bin"``, a torch.save'd state dict).
    The token embedding is the target's and is left out unless ``include_embedding``."""
    if fmt not in HEAD_FORMATS:
        raise ValueError(f"fmt must be one of {HEAD_FORMATS}, got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in head_module.state_dict().items()
             if include_embedding or k != "embed_tokens.weight"}
    cfg = config.to_dict()
    cfg["bias"] = "fc.bias" in state
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, out / "pytorch_model.bin")
    return out


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` to ``final``; an existing ``final`` is swapped out first, then removed."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- data


def _encode(tokenizer, data: bytes) -> torch.Tensor:
    text = data.decode("utf-8", errors="ignore")
    ids: list[int] = []
    chunk = 1 << 16
    for i in range(0, len(text), chunk):
        ids.extend(tokenizer.encode(text[i: i + chunk], add_special_tokens=False))
    return torch.tensor(ids, dtype=torch.long)


def _windows(ids: torch.Tensor, seq_len: int, count: int, gen: torch.Generator | None) -> torch.Tensor:
    hi = ids.numel() - seq_len
    if hi <= 0:
        raise ValueError(f"the corpus holds {ids.numel()} tokens, fewer than one window of {seq_len}")
    if gen is None:
        starts = torch.linspace(0, hi - 1, count).long()
    else:
        starts = torch.randint(0, hi, (count,), generator=gen)
    return ids[starts[:, None] + torch.arange(seq_len)[None, :]]


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def _heldout_agreement(target, head, lm_w: torch.Tensor, windows: torch.Tensor, chunk: int = 8) -> dict:
    """Teacher-forced: the head's greedy token from the real features of positions 0..i against the
    target's greedy token at position i+1."""
    agree = total = 0
    reg = 0.0
    for i in range(0, windows.shape[0], chunk):
        x = windows[i: i + chunk]
        out = target(input_ids=x, output_hidden_states=True)
        f = out.hidden_states[-1].float()
        pred = head(f[:, :-1].half().float(), input_ids=x[:, 1:], use_cache=False)
        agree += int((F.linear(pred, lm_w).argmax(-1) == out.logits[:, 1:].argmax(-1)).sum())
        total += pred.shape[0] * pred.shape[1]
        reg += float(F.smooth_l1_loss(pred, f[:, 1:], reduction="sum")) / f.shape[-1]
    return {"top1_agreement": agree / total, "tokens": total, "reg_loss": reg / total}


@torch.no_grad()
def greedy_rounds(backend, prompt: list[int], path: list[int], features: torch.Tensor, depth: int) -> dict:
    """Replay greedy speculative rounds along the target's own greedy continuation ``path``.

    ``features`` [len(prompt + path) - 1, H] are the target's features along prompt + path. In a
    round the verified sequence is seq[:i]; the draft keeps its leading tokens that equal path's,
    and the target adds one token of its own. Returns the counts a real run would see."""
    seq = prompt + path
    st = backend.new_state(SamplingParams())
    i = len(prompt)
    sent = 0
    rounds = accepted = 0
    by_pos = [0] * depth
    try:
        while i < len(seq):
            d = min(depth, len(seq) - i - 1)
            feats = features[sent: i - 1] if backend.feature_size else None
            if backend.feature_size:
                draft = backend.draft(st, seq[:i], d, feats)
                sent = i - 1
            else:
                draft = backend.draft(st, seq[:i], d)
            n = 0
            while n < len(draft.tokens) and draft.tokens[n] == seq[i + n]:
                by_pos[n] += 1
                n += 1
            rounds += 1
            accepted += n
            i += n + 1
    finally:
        backend.release(st)
    return {"rounds": rounds, "accepted": accepted, "acceptance_by_position": by_pos}


def _path_eval(target, backend, heldout_ids: torch.Tensor, prompts: int, prompt_len: int, new_tokens: int,
               depth: int, feature_layers=None) -> dict:
    """Greedy rounds (``greedy_rounds``) along the target's own continuations of ``prompts``
    held-out prompts. ``feature_layers``: the target hidden states fused into each position's
    feature (``common.features.fused_features``; None: the final one, an EAGLE-1 head's)."""
    totals = {"rounds": 0, "accepted": 0, "acceptance_by_position": [0] * depth}
    generated = 0
    for start in torch.linspace(0, heldout_ids.numel() - prompt_len - 1, prompts).long().tolist():
        prompt = heldout_ids[start: start + prompt_len].tolist()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False)
            path = out[0, len(prompt):].tolist()
            seq = torch.tensor([prompt + path])
            hs = target(input_ids=seq[:, :-1], output_hidden_states=True).hidden_states
            feats = fused_features(hs, feature_layers)[0].half()
        r = greedy_rounds(backend, prompt, path, feats, depth)
        totals["rounds"] += r["rounds"]
        totals["accepted"] += r["accepted"]
        totals["acceptance_by_position"] = [a + b for a, b in zip(totals["acceptance_by_position"],
                                                                   r["acceptance_by_position"])]
        generated += len(path)
    rounds = totals["rounds"]
    return {
        "depth": depth,
        "prompts": prompts,
        "generated_tokens": generated,
        "rounds": rounds,
        "mean_tokens_per_round": round(generated / rounds, 3) if rounds else 0.0,
        "mean_accepted_per_round": round(totals["accepted"] / rounds, 3) if rounds else 0.0,
        "first_token_acceptance": round(totals["acceptance_by_position"][0] / rounds, 4) if rounds else 0.0,
        "acceptance_by_position": totals["acceptance_by_position"],
    }


# ---------------------------------------------------------------- training


def _head_loss(pred: torch.Tensor, f_next: torch.Tensor, kid: torch.Tensor, klp: torch.Tensor, lm_w: torch.Tensor,
               ce_weight: float, gen: torch.Generator, full_positions: int = 128) -> tuple[torch.Tensor, dict]:
    """EAGLE-1's loss on recorded teacher outputs: smooth-L1 regression of the next feature, plus
    ``ce_weight`` times the cross-entropy of the LM head on the predicted feature against the
    target's distribution, taken over the target's top-k tokens (a KL on every position, no
    vocabulary-wide softmax) and over the whole vocabulary on ``full_positions`` sampled
    positions (which pushes down the tokens outside the top-k)."""
    reg, kl, ce, top1 = teacher_losses(pred, f_next, kid, klp, lm_w, gen, full_positions)
    loss = reg + ce_weight * (kl + ce)
    return loss, {"reg": float(reg.detach()), "ce": float(ce.detach()), "kl": float(kl.detach()),
                  "top1_in_topk": top1}


def training_text(loaded, train_bytes: bytes, teacher: Path | None, *, seq_len: int, batch_size: int,
                  time_budget_s: float | None, teacher_share: float, seed: int, progress: bool) -> tuple[dict, dict]:
    """The text a head trains on and what the target said about it: ``teacher`` (a file the demo
    build wrote: ``ids``, ``hidden``, ``topk_ids``, ``topk_logp``), else the target's greedy
    continuations of prompts cut from ``train_bytes``, written now within ``teacher_share`` of the
    budget (without a budget: ``4 * batch_size`` rows of ``seq_len`` tokens). Returns (the data,
    a description of it for the report)."""
    if teacher is not None:
        from starsd_draftd.demo.checkpoints import load_teacher

        return load_teacher(Path(teacher)), {"source": str(teacher), "wall_s": 0.0}
    prompt_len = max(2, seq_len // 4)
    rows = 4 * batch_size if time_budget_s is None else 100_000
    budget = float("inf") if time_budget_s is None else teacher_share * time_budget_s
    prompts = token_windows(loaded.tokenizer, train_bytes, prompt_len, rows, seed=seed + 5)
    data = target_generations(loaded.model, prompts, seq_len - prompt_len, budget, progress=progress,
                              rows=min(64, rows), eos_ids=loaded.eos_token_ids)
    return data, {"source": "written by the target for this run", "wall_s": round(data["wall_s"], 1)}


@dataclass
class TrainRun:
    """What ``train_steps`` did: steps run, whether the deadline stopped it, the first step's loss
    values, their moving averages at the end, a sample of those every 25 steps, and the wall time."""

    step: int
    stopped_by_time: bool
    first: dict
    ema: dict
    history: list
    wall_s: float


def train_steps(one_step, opt, params, *, steps: int | None, deadline: float | None, lr: float, warmup: int,
                desc: str, progress: bool, postfix=None) -> TrainRun:
    """The optimisation loop both head trainers share: ``one_step()`` returns (loss, loss values
    to report); each step sets the learning rate (warm-up, then cosine by steps or by time,
    whichever is further along; a param group's ``lr_scale`` scales it), backpropagates, clips
    the gradient norm to 0.5 and steps ``opt``. It stops after ``steps`` or at ``deadline`` (a
    ``time.monotonic()`` value), after one step at least. ``postfix``: the values the progress
    bar shows (default all)."""
    train_start = time.monotonic()
    ema: dict[str, float] = {}
    first: dict[str, float] = {}
    history: list[dict] = []
    step = 0
    stopped_by_time = False
    bar = tqdm(total=steps, desc=desc, unit="step", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        while steps is None or step < steps:
            now = time.monotonic()
            if deadline is not None and now >= deadline and step > 0:
                stopped_by_time = True
                break
            frac_steps = step / steps if steps else 0.0
            frac_time = (now - train_start) / max(deadline - train_start, 1e-6) if deadline is not None else 0.0
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, max(frac_steps, frac_time), lr, warmup) * group.get("lr_scale", 1.0)
            loss, values = one_step()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            if not first:
                first = dict(values)
            for k, v in values.items():
                ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
            step += 1
            bar.update(1)
            if step % 5 == 0:
                bar.set_postfix({k: f"{ema[k]:.3f}" for k in (postfix or ema)})
            if step % 25 == 0:
                history.append({"step": step, **{k: round(v, 4) for k, v in ema.items()}})
    finally:
        bar.close()
    return TrainRun(step, stopped_by_time, first, ema, history, time.monotonic() - train_start)


def _lr_at(step: int, frac: float, lr: float, warmup: int, min_frac: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0))))


def train_eagle_head(
    base_model_dir: str | Path,
    out_dir: str | Path,
    *,
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
    steps: int | None = None,
    progress: bool = True,
    seed: int = 0,
    batch_size: int = 16,
    seq_len: int = 72,
    lr: float = 3e-3,
    ce_weight: float = 0.5,
    feature_noise: float = 0.2,
    corpus_bytes: int = 2_000_000,
    num_threads: int = 2,
    eval_windows: int = 16,
    eval_prompts: int = 3,
    eval_tokens: int = 48,
    eval_depth: int = 4,
    teacher: Path | None = None,
    teacher_share: float = 0.4,
) -> dict:
    """Train an EAGLE-1 head for the causal LM in ``base_model_dir`` and save it to ``out_dir``.

    The training text is the target's own: its greedy continuations of prompts cut from the
    standard library's sources (``teacher``: a file of them written by the demo build, else
    written first, within ``teacher_share`` of the budget; without a budget, ``4 * batch_size``
    rows of ``seq_len`` tokens). Training stops after ``steps`` steps or when ``time_budget_s``
    (which covers loading, evaluation and saving too) is nearly spent, whichever comes first; at
    least one step runs. Returns the report also written to ``out_dir/train_report.json``."""
    from starsd_draftd.demo.corpus import load_corpus
    from starsd_draftd.demo.checkpoints import demo_path

    if steps is None and time_budget_s is None:
        raise ValueError("give steps, time_budget_s, or both")
    t0 = time.monotonic()
    base = demo_path(str(base_model_dir), progress=progress)
    out = Path(out_dir)
    with torch_threads(num_threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loaded = load_causal_lm(str(base), device="cpu", dtype="float32")
        if loaded.tokenizer is None:
            raise ModelLoadError(f"{base} has no tokenizer; training an EAGLE head needs one to encode text")
        target = loaded.model.eval().requires_grad_(False)
        embed = target.get_input_embeddings().weight.detach()
        lm_w = target.get_output_embeddings().weight.detach()
        hidden, vocab = int(embed.shape[1]), int(embed.shape[0])
        config = head_config_for(target.config, hidden, vocab)
        head = build_head(config, bias=True)
        with torch.no_grad():
            head.embed_tokens.weight.copy_(embed)
        head.embed_tokens.weight.requires_grad_(False)
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

        train_bytes, heldout_bytes, corpus_info = load_corpus(byte_budget=corpus_bytes, seed=seed)
        heldout_ids = _encode(loaded.tokenizer, heldout_bytes)
        data, data_info = training_text(loaded, train_bytes, teacher, seq_len=seq_len, batch_size=batch_size,
                                        time_budget_s=time_budget_s, teacher_share=teacher_share, seed=seed,
                                        progress=progress)
        n_rows = int(data["ids"].shape[0])
        data_info.update(rows=n_rows, tokens=int(data["ids"].numel()))
        gen = torch.Generator().manual_seed(seed + 1)
        noise_gen = torch.Generator().manual_seed(seed + 2)
        setup_s = time.monotonic() - t0

        reserve = 0.0 if time_budget_s is None else min(30.0, 0.25 * time_budget_s)  # eval + save
        deadline = None if time_budget_s is None else t0 + time_budget_s - reserve
        planned = steps if steps is not None else 0
        warmup = max(1, min(30, (steps or 300) // 10))
        head.train()

        def one_step() -> tuple[torch.Tensor, dict]:
            pick = torch.randint(0, n_rows, (batch_size,), generator=gen)
            x, f = data["ids"][pick], data["hidden"][pick].float()  # features as they travel: float16
            # the pair (f_i, token i+1) predicts f_{i+1}, whose LM head gives the token after i+1
            kid, klp = data["topk_ids"][pick][:, 1:].long(), data["topk_logp"][pick][:, 1:].float()
            inp = f[:, :-1]
            if feature_noise > 0:
                inp = inp + (torch.rand(inp.shape, generator=noise_gen) - 0.5) * feature_noise
            pred = head(inp, input_ids=x[:, 1:], use_cache=False)
            return _head_loss(pred, f[:, 1:], kid, klp, lm_w, ce_weight, gen)

        run = train_steps(one_step, opt, params, steps=steps, deadline=deadline, lr=lr, warmup=warmup,
                          desc="eagle head", progress=progress)
        step, stopped_by_time, first, ema, history = run.step, run.stopped_by_time, run.first, run.ema, run.history
        train_wall = run.wall_s
        head.eval().requires_grad_(False)
        log.info("EAGLE head: %d steps in %.1fs%s; %s", step, train_wall,
                 " (time budget reached)" if stopped_by_time else "",
                 ", ".join(f"{k} {v:.3f}" for k, v in ema.items()))

        eval_start = time.monotonic()
        heldout = _heldout_agreement(target, head, lm_w, _windows(heldout_ids, seq_len, eval_windows, None))
        in_memory = EagleHead(module=head, embed_weight=head.embed_tokens.weight, lm_head_weight=lm_w,
                              hidden_size=hidden, vocab_size=vocab, config=config, device=torch.device("cpu"),
                              dtype=torch.float32, base_path=base)
        with torch_threads(1):  # one-token forwards: a second thread only adds synchronisation
            path_eval = _path_eval(target, EagleBackend(in_memory, base), heldout_ids, eval_prompts, 64,
                                   eval_tokens, eval_depth)
        eval_wall = time.monotonic() - eval_start

        report = {
            "base_model": str(base),
            "seed": seed,
            "time_budget_s": time_budget_s,
            "num_threads": num_threads,
            "steps": step,
            "planned_steps": planned or None,
            "stopped_by_time_budget": stopped_by_time,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "tokens_seen": step * batch_size * int(data["ids"].shape[1]),
            "lr": lr,
            "ce_weight": ce_weight,
            "feature_noise": feature_noise,
            "head": {"hidden_size": hidden, "intermediate_size": int(config.intermediate_size),
                     "num_attention_heads": int(config.num_attention_heads),
                     "num_key_value_heads": int(config.num_key_value_heads), "vocab_size": vocab,
                     "trained_params": sum(p.numel() for p in params)},
            "losses": {"first": {k: round(v, 4) for k, v in first.items()},
                       "final_ema": {k: round(v, 4) for k, v in ema.items()}, "history": history},
            "heldout": {k: round(v, 4) if isinstance(v, float) else v for k, v in heldout.items()},
            "greedy_path": path_eval,
            "corpus": corpus_info,
            "training_text": data_info,
            "wall_s": {"setup": round(setup_s, 2), "train": round(train_wall, 2), "eval": round(eval_wall, 2)},
        }

        write_head_dir(out, lambda tmp: save_eagle_head(head, config, tmp, "safetensors"), report, t0)
    log.info("EAGLE head saved to %s: held-out top-1 agreement %.1f%%, %.2f tokens per round at depth %d",
             out, 100 * report["heldout"]["top1_agreement"], path_eval["mean_tokens_per_round"], eval_depth)
    return report


DEMO_EAGLE_NAME = "demo-eagle"
DEMO_EAGLE_BUDGET_S = 100.0  # on the text the demo build recorded: no generation pass of its own


def ensure_demo_eagle_head(progress: bool = True) -> Path:
    """The EAGLE head for the built-in demo target, trained once and cached beside the demo pair."""
    return ensure_demo_head("eagle", "EAGLE", lambda target_dir, out, teacher: train_eagle_head(
        target_dir, out, progress=progress, time_budget_s=DEMO_EAGLE_BUDGET_S, teacher=teacher), progress)


def ensure_demo_head(sub: str, what: str, train, progress: bool = True) -> Path:
    """A head for the demo target cached as ``<demo dir>/<sub>``: trained once by
    ``train(target_dir, out, teacher)`` (teacher: the text the demo build recorded, or None), under
    a lock, so that concurrent callers wait and then reuse it."""
    import fcntl

    from common.models import demo_dir
    from starsd_draftd.demo.checkpoints import TEACHER_NAME, ensure_demo_checkpoints

    target_dir, _ = ensure_demo_checkpoints(progress=progress)
    out = demo_dir() / sub
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    lock = demo_dir() / f".{sub}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # one trainer; the others wait and then reuse its head
        if not (out / "config.json").is_file():
            log.info("training the demo %s head (about %.0f s, once)", what, DEMO_EAGLE_BUDGET_S)
            teacher = demo_dir() / TEACHER_NAME  # what the build recorded; a cache without it trains from scratch
            train(target_dir, out, teacher if teacher.is_file() else None)
    return out


def write_head_dir(out: Path, save, report: dict, t0: float) -> None:
    """Write a trained head into ``out`` atomically: ``save(tmp)`` writes its files into a
    temporary sibling, the report (with the run's total wall time since ``t0``) goes beside
    them, and the directory is renamed into place, readable by a daemon under another user."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save(tmp)
        report["total_wall_s"] = round(time.monotonic() - t0, 2)
        (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        _replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

