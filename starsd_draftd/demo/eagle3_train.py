"""Training an EAGLE-3 head for a local target, with the published objective in a simple form.

EAGLE-3 (Li et al. 2025) reads, per position i, the target's fused feature (the hidden states
entering layers 2, L//2 and L-3, concatenated: ``common.features``) paired with the embedding of
token i+1, and predicts the target's next-token distribution directly over a draft vocabulary of
its own: there is no feature regression. What it is trained on is what it meets when it drafts
several tokens: "training-time test" (TTT). Step 0 reads the real pairs (fc(f_i), embed(t_{i+1}))
at positions i; its output out_{0,i} predicts the target's distribution at position i+1. Step k
(k = 1..K-1) reads the pairs (out_{k-1,i}, embed(t_{i+k+1})) at positions i+k, its own earlier
outputs in place of the target's features, and predicts the distribution at position i+k+1. In
step k the query of index i attends to the step-0 keys of positions 0..i (causal) and to the
keys of steps 1..k at its own index i (the "diagonal"): exactly what the serving backend's cache
holds when it drafts the (k+1)-th token after a verified prefix ending at i (``ttt_forward``;
the test checks both against ``Eagle3Module`` itself). Gradients flow through the rollout.

The loss of step k is the cross-entropy of the draft-vocabulary logits against the target's
recorded top-k distribution, restricted to the draft vocabulary and renormalised (teacher
tokens outside it are dropped; a position whose top-k lies wholly outside is skipped), weighted
by ``step_weight ** k``. Positions whose target runs past the row simply do not exist at step k
(step k has k fewer of them).

Data: the same text as the EAGLE-1 trainer (the demo build's teacher file, else the target's own
greedy continuations written first). The teacher's stored features are the final hidden state
only, so the frozen target runs once over the rows (batched, no grad) to record the fused
features, kept in float16 as they travel on the wire; that pass counts in the time budget (at
most ``feature_share`` of it: rows it does not reach are not trained on).

Draft vocabulary: the ``draft_vocab`` target tokens most frequent in the training ids (ties
broken by the teacher's top-k probability mass, then by id), sorted by target id; ``d2t[i] =
target_id[i] - i``. Warm start: ``lm_head`` starts as the target's LM-head rows of those tokens
and ``norm`` as the target's final norm, so the head's output space starts as the target's own
pre-norm residual space (where the target's LM head reads the next token); ``fc`` starts by
copying the last fused state (the one entering layer L-3) into that residual stream, plus small
noise on the rest (``fc_init``). The embedding is the target's, frozen and not saved.

Defaults, as measured on the demo target with the EAGLE-1 demo head's 100 s on a 2-core CPU
(held-out top-1 agreement / tokens per round at depth 4 over 16 held-out greedy paths): rows of
4 per step (about 190 steps: 35.8% / 1.44; 8 rows, 117 steps: 34.3% / 1.36; 2 rows: 33.1% /
1.35), lr 3e-3 (1e-2: 28.7% / 1.35 from 8 rows), 3 TTT steps (4: 28.0% / 1.30, fewer steps fit),
``fc_init="last"`` (random: 28.1% / 1.29 from 8 rows, and little acceptance past the first
token); a 4096-token draft vocabulary fits more steps and did as well (35.7% / 1.47, and 32.1% /
1.44 with another seed). The EAGLE-1 trainer on the same text and budget: 23.2% / 1.23.

The result is written in the published layout (``backends.eagle3.save_eagle3_head``) plus
``train_report.json``, into a temporary directory renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.features import default_feature_layers, fused_features
from common.models import ModelLoadError, load_causal_lm, torch_threads
from starsd_draftd.backends.eagle3 import Eagle3Backend, Eagle3Head, Eagle3Module, rotate, save_eagle3_head
from starsd_draftd.demo.eagle_train import (_encode, _path_eval, _windows,
                                            head_config_for, train_steps, training_text,
                                            write_head_dir)

log = logging.getLogger("starsd.eagle3")

DEFAULT_TIME_BUDGET_S = 180.0
DEFAULT_TTT_STEPS = 3
DEFAULT_DRAFT_VOCAB = 8192
FC_INITS = ("last", "random")


# ---------------------------------------------------------------- the draft vocabulary


def draft_vocabulary(ids: torch.Tensor, vocab_size: int, size: int, topk_ids: torch.Tensor | None = None,
                     topk_logp: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` target tokens most frequent in ``ids``, sorted by target id [size] long.
    Ties (most tokens, when the text is short) go to the tokens with more of the teacher's top-k
    probability mass, then to the lower id."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"the draft vocabulary must hold 1..{vocab_size} tokens (the target's), got {size}")
    counts = torch.bincount(ids.reshape(-1).long(), minlength=vocab_size)[:vocab_size].double()
    mass = torch.zeros(vocab_size, dtype=torch.double)
    if topk_ids is not None and topk_logp is not None:
        p = torch.softmax(topk_logp.float(), -1).double()
        mass.index_add_(0, topk_ids.reshape(-1).long(), p.reshape(-1))
    # rank by (count, mass, -id): mass < rows * positions, so scaling the count past it keeps the order
    score = counts * (float(mass.sum()) + 2.0) + mass
    order = sorted(range(vocab_size), key=lambda t: (-float(score[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d2t [D] long: target id - draft id; t2d [V] bool; index [V] long: a target token's draft id, -1 if none)."""
    d = int(draft_ids.numel())
    d2t = draft_ids - torch.arange(d)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[draft_ids] = torch.arange(d)
    return d2t, t2d, index


# ---------------------------------------------------------------- features


class _Enough(Exception):
    """Raised by a hook once the deepest state a head fuses is captured: the rest is not needed."""


def _decoder_layers(body) -> torch.nn.ModuleList | None:
    for name in ("layers", "h", "blocks"):
        mods = getattr(body, name, None)
        if isinstance(mods, torch.nn.ModuleList) and len(mods):
            return mods
    return None


def _fused_forward(body, x: torch.Tensor, layers) -> torch.Tensor:
    """``fused_features`` of a forward of the decoder ``body`` over ``x``, stopped at the deepest
    layer the head reads (the state entering layer i is what layer i's forward is called with);
    a decoder whose layers cannot be found runs whole with ``output_hidden_states``."""
    mods = _decoder_layers(body)
    if mods is None or max(layers) >= len(mods):
        hs = body(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True,
                  use_cache=False).hidden_states
        return fused_features(hs, layers)
    got: dict[int, torch.Tensor] = {}
    last = max(layers)

    def hook_for(i):
        def hook(_mod, args, kwargs):
            got[i] = args[0] if args else kwargs["hidden_states"]
            if i == last:
                raise _Enough

        return hook

    handles = [mods[i].register_forward_pre_hook(hook_for(i), with_kwargs=True) for i in sorted(set(layers))]
    try:
        body(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()
    return torch.cat([got[i] for i in layers], dim=-1)


@torch.no_grad()
def record_fused_features(target, ids: torch.Tensor, layers, *, rows_per_batch: int = 32,
                          time_budget_s: float = float("inf"), progress: bool = True) -> tuple[torch.Tensor, float]:
    """The target's fused features over ``ids`` [rows, T] (one forward of its decoder up to the
    deepest layer fused, no LM head), float16 [n, T, k * H_target] for the first n rows the
    budget reached (at least one batch); and the pass's wall time."""
    t0 = time.monotonic()
    body = target.base_model
    done: list[torch.Tensor] = []
    bar = tqdm(total=int(ids.shape[0]), desc="eagle3: target features", unit="row", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        for i in range(0, ids.shape[0], rows_per_batch):
            if done and time.monotonic() - t0 > time_budget_s:
                break
            x = ids[i: i + rows_per_batch]
            done.append(_fused_forward(body, x, layers).half())
            bar.update(int(x.shape[0]))
    finally:
        bar.close()
    return torch.cat(done), time.monotonic() - t0


# ---------------------------------------------------------------- the training forward


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def ttt_forward(module: Eagle3Module, fused: torch.Tensor, ids: torch.Tensor, ttt_steps: int,
                feature_noise: float = 0.0, gen: torch.Generator | None = None) -> list[torch.Tensor]:
    """The head's outputs over a training-time-test rollout of ``ttt_steps`` steps.

    ``fused`` [B, N, k * H_target]: the target's fused features of positions 0..N-1; ``ids``
    [B, N + 1]: the row's tokens t_0..t_N (pair i is (f_i, t_{i+1})). Returns ``ttt_steps``
    tensors; the k-th, [B, N - k, H], holds out_{k,i} for i = 0..N-1-k: the head's output when it
    reads the pair (out_{k-1,i}, t_{i+k+1}) at position i+k (step 0: (f_i, t_{i+1}) at i) after
    the real pairs 0..i and its own pairs of steps 1..k-1 at index i. ``module.draft_logits`` of
    out_{k,i} predicts the token at position i+k+2, i.e. the target's distribution at i+k+1."""
    layer = module.midlayer
    attn = layer.self_attn
    b, n_pos, _ = fused.shape
    if ids.shape != (b, n_pos + 1):
        raise ValueError(f"ids must be [B, N + 1] = {(b, n_pos + 1)} for features {tuple(fused.shape)}")
    if not 1 <= ttt_steps <= n_pos:
        raise ValueError(f"a rollout of {ttt_steps} steps needs at least as many positions, got {n_pos}")
    heads, kv_heads, d = layer.heads, layer.kv_heads, layer.head_dim
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d)
    if feature_noise > 0:
        fused = fused + (torch.rand(fused.shape, generator=gen) - 0.5) * feature_noise
    hidden = module.fc(fused)
    k0 = v0 = None
    diag: list[tuple[torch.Tensor, torch.Tensor]] = []  # steps 1..k's keys/values at each index [B, heads, n, D]
    outs: list[torch.Tensor] = []
    for step in range(ttt_steps):
        n = n_pos - step
        h_in = hidden[:, :n]
        emb = module.embed_tokens(ids[:, step + 1: step + 1 + n]).to(h_in.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h_in)], dim=-1)
        q = attn.q_proj(x).view(b, n, heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, n, kv_heads, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, kv_heads, d).transpose(1, 2)
        pos = (torch.arange(n, device=x.device) + step).unsqueeze(0).expand(b, n)
        cos, sin = module.rotary(h_in, pos)
        q, k = rotate(q, cos.to(q.dtype), sin.to(q.dtype)), rotate(k, cos.to(q.dtype), sin.to(q.dtype))
        k, v = _repeat_kv(k, group), _repeat_kv(v, group)
        if step == 0:
            k0, v0 = k, v
        else:
            diag.append((k, v))
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = [(q @ k0[:, :, :n].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * dk[:, :, :n]).sum(-1, keepdim=True) * scale for dk, _ in diag]
        w = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
        mixed = w[..., :n] @ v0[:, :, :n]
        for j, (_, dv) in enumerate(diag):
            mixed = mixed + w[..., n + j: n + j + 1] * dv[:, :, :n]
        a = attn.o_proj(mixed.transpose(1, 2).reshape(b, n, heads * d))
        h = h_in + a
        m = layer.mlp
        y = layer.post_attention_layernorm(h)
        out = h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))
        outs.append(out)
        hidden = out
    return outs


def teacher_targets(kid: torch.Tensor, klp: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The teacher's top-k distribution moved onto the draft vocabulary: (draft ids [.., K] (0
    where outside), probabilities [.., K] renormalised over the tokens inside, a mask [..] of the
    positions with any mass inside, the draft id of the teacher's top-1 [..] (-1: outside))."""
    didx = index[kid]
    inside = didx >= 0
    p = torch.softmax(klp.float(), -1) * inside
    mass = p.sum(-1)
    ok = mass > 0
    p = p / mass.clamp(min=1e-12).unsqueeze(-1)
    return didx.clamp(min=0), p, ok, didx[..., 0]


def _step_loss(logits: torch.Tensor, didx: torch.Tensor, p: torch.Tensor, ok: torch.Tensor,
               top1: torch.Tensor) -> tuple[torch.Tensor, float]:
    logp = torch.log_softmax(logits.float(), -1)
    ce = -(p * logp.gather(-1, didx)).sum(-1)
    loss = (ce * ok).sum() / ok.sum().clamp(min=1)
    acc = float(((logits.detach().argmax(-1) == top1) & (top1 >= 0)).float().mean())
    return loss, acc


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_agreement3(target, module: Eagle3Module, draft_ids: torch.Tensor, layers, windows: torch.Tensor,
                       chunk: int = 8) -> dict:
    """Teacher-forced (step 0): the head's greedy token from the real fused features of
    positions 0..i (float16, as they travel) against the target's greedy token at position i+1;
    also how often that target token lies inside the draft vocabulary."""
    agree = total = inside = 0
    in_vocab = torch.zeros(int(module.t2d.shape[0]), dtype=torch.bool)
    in_vocab[draft_ids] = True
    for i in range(0, windows.shape[0], chunk):
        x = windows[i: i + chunk]
        out = target(input_ids=x, output_hidden_states=True)
        f = fused_features(out.hidden_states, layers)[:, :-1].half().float()
        pred = draft_ids[module.draft_logits(module(f, input_ids=x[:, 1:])).argmax(-1)]
        want = out.logits[:, 1:].argmax(-1)
        agree += int((pred == want).sum())
        inside += int(in_vocab[want].sum())
        total += int(want.numel())
    return {"top1_agreement": agree / total, "tokens": total, "target_token_in_draft_vocab": inside / total}


# ---------------------------------------------------------------- training


def _feature_dtype(name: str) -> torch.dtype:
    if name == "auto":
        from starsd_draftd.demo.run import cpu_has_native_bf16

        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"feature_dtype must be auto, float32 or bfloat16, got {name!r}")
    return getattr(torch, name)


def _train_context(name: str):
    """A context factory: bfloat16 autocast for the head's training forward, or nothing."""
    import functools

    dtype = _feature_dtype(name)
    if dtype == torch.float32:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, "cpu", dtype=dtype)


def _final_norm_weight(target, hidden: int) -> torch.Tensor | None:
    body = target.base_model
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        w = getattr(getattr(body, name, None), "weight", None)
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (hidden,):
            return w.detach().float()
    return None


def train_eagle3_head(
    base_model_dir: str | Path,
    out_dir: str | Path,
    *,
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
    steps: int | None = None,
    progress: bool = True,
    seed: int = 0,
    ttt_steps: int = DEFAULT_TTT_STEPS,
    step_weight: float = 0.8,
    draft_vocab: int | None = None,
    batch_size: int = 4,
    seq_len: int = 72,
    lr: float = 3e-3,
    feature_noise: float = 0.0,
    fc_init: str = "last",
    feature_layers: tuple[int, ...] | None = None,
    corpus_bytes: int = 2_000_000,
    num_threads: int = 2,
    eval_windows: int = 16,
    eval_prompts: int = 3,
    eval_tokens: int = 48,
    eval_depth: int = 4,
    teacher: Path | None = None,
    teacher_share: float = 0.3,
    feature_share: float = 0.35,
    feature_dtype: str = "auto",
    train_dtype: str = "auto",
    warmup: int = 5,
    head_lr_scale: float = 1.0,
    features_outside_budget: bool = False,
) -> dict:
    """Train an EAGLE-3 head for the causal LM in ``base_model_dir`` and save it to ``out_dir``.

    ``ttt_steps`` (>= 2): the rollout's length; step k's loss is weighted ``step_weight ** k``.
    ``draft_vocab``: the draft vocabulary's size (default: min(target vocabulary, 8192)).
    ``feature_layers``: the target hidden states fused (default (2, L//2, L-3); a target of
    fewer than 7 layers must name them). The training text is the EAGLE-1 trainer's
    (``teacher``, else written first within ``teacher_share`` of the budget); the target's
    fused features over it are recorded within ``feature_share`` of the budget, by a copy of the
    target in ``feature_dtype`` (auto: bfloat16 where the CPU computes it natively, about 2.5x
    float32's speed there, else float32); ``train_dtype`` likewise picks bfloat16 autocast for the
    head's forward and backward (master weights, optimizer and the loss's softmax stay float32),
    about twice as many steps in the budget. Training stops
    after ``steps`` steps or when ``time_budget_s`` (loading, the feature pass, evaluation and
    saving included) is nearly spent; at least one step runs. ``features_outside_budget``: the
    feature pass runs to the end and does not count in ``time_budget_s`` (data preparation, as
    the final hidden states an EAGLE-1 head trains on are recorded by the demo build outside its
    budget: the demo heads then get the same time to train). Returns the report also written
    to ``out_dir/train_report.json``."""
    from starsd_draftd.demo.checkpoints import demo_path
    from starsd_draftd.demo.corpus import load_corpus

    if steps is None and time_budget_s is None:
        raise ValueError("give steps, time_budget_s, or both")
    if ttt_steps < 2:
        raise ValueError(f"EAGLE-3's training-time test needs at least 2 steps, got {ttt_steps}")
    if fc_init not in FC_INITS:
        raise ValueError(f"fc_init must be one of {FC_INITS}, got {fc_init!r}")
    t0 = time.monotonic()
    base = demo_path(str(base_model_dir), progress=progress)
    out = Path(out_dir)
    with torch_threads(num_threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loaded = load_causal_lm(str(base), device="cpu", dtype="float32")
        if loaded.tokenizer is None:
            raise ModelLoadError(f"{base} has no tokenizer; training an EAGLE-3 head needs one to encode text")
        target = loaded.model.eval().requires_grad_(False)
        n_layers = int(getattr(target.config, "num_hidden_layers", 0) or 0)
        layers = tuple(int(i) for i in feature_layers) if feature_layers is not None else default_feature_layers(n_layers)
        embed = target.get_input_embeddings().weight.detach()
        lm_w = target.get_output_embeddings().weight.detach()
        hidden, vocab = int(embed.shape[1]), int(embed.shape[0])
        fused_size = hidden * len(layers)
        d_vocab = min(vocab, DEFAULT_DRAFT_VOCAB) if draft_vocab is None else int(draft_vocab)
        if not 1 <= d_vocab <= vocab:
            raise ValueError(f"the draft vocabulary must hold 1..{vocab} tokens (the target's), got {d_vocab}")

        train_bytes, heldout_bytes, corpus_info = load_corpus(byte_budget=corpus_bytes, seed=seed)
        heldout_ids = _encode(loaded.tokenizer, heldout_bytes)
        data, data_info = training_text(loaded, train_bytes, teacher, seq_len=seq_len, batch_size=batch_size,
                                        time_budget_s=time_budget_s, teacher_share=teacher_share, seed=seed,
                                        progress=progress)
        ids_all = data["ids"].long()
        if ids_all.shape[1] < ttt_steps + 2:
            raise ValueError(f"rows of {ids_all.shape[1]} tokens are too short for {ttt_steps} TTT steps")
        feat_budget = (float("inf") if time_budget_s is None or features_outside_budget
                       else feature_share * time_budget_s)
        feat_dtype = _feature_dtype(feature_dtype)
        feat_model = target if feat_dtype == torch.float32 else copy.deepcopy(target).to(feat_dtype)
        fused_all, feature_wall = record_fused_features(feat_model, ids_all, layers, time_budget_s=feat_budget,
                                                        progress=progress)
        del feat_model
        n_rows = int(fused_all.shape[0])
        ids_all = ids_all[:n_rows]
        topk_ids = data["topk_ids"][:n_rows]
        topk_logp = data["topk_logp"][:n_rows]
        data_info.update(rows=int(data["ids"].shape[0]), rows_with_features=n_rows, tokens=int(ids_all.numel()),
                         feature_pass_s=round(feature_wall, 2), feature_dtype=str(feat_dtype).replace("torch.", ""))

        draft_ids = draft_vocabulary(ids_all, vocab, d_vocab, topk_ids, topk_logp)
        d2t, t2d, index = vocab_maps(draft_ids, vocab)
        coverage = float(t2d[ids_all[:, 1:]].float().mean())
        teacher_top1_coverage = float(t2d[topk_ids[..., 0].long()].float().mean())

        config = head_config_for(target.config, hidden, vocab)
        config.draft_vocab_size = d_vocab
        module = Eagle3Module(config, fused_size)
        with torch.no_grad():
            module.embed_tokens.weight.copy_(embed)
            module.lm_head.weight.copy_(lm_w[draft_ids])
            norm_w = _final_norm_weight(target, hidden)
            if norm_w is not None:
                module.norm.weight.copy_(norm_w)
            module.d2t.copy_(d2t)
            module.t2d.copy_(t2d)
            if fc_init == "last":  # the residual stream starts as the state entering layer L-3
                module.fc.weight.mul_(0.1)
                module.fc.weight[:, fused_size - hidden:] += torch.eye(hidden)
        module.embed_tokens.weight.requires_grad_(False)
        out_params = [module.lm_head.weight, module.norm.weight]  # the warm-started output layer
        if head_lr_scale <= 0:
            for p_ in out_params:
                p_.requires_grad_(False)
        params = [p for p in module.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if all(p is not q for q in out_params)], "lr_scale": 1.0}]
        if head_lr_scale > 0:
            groups.append({"params": out_params, "lr_scale": head_lr_scale})
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed + 1)
        noise_gen = torch.Generator().manual_seed(seed + 2)
        weights = [step_weight ** k for k in range(ttt_steps)]
        setup_s = time.monotonic() - t0

        reserve = 0.0 if time_budget_s is None else min(30.0, 0.25 * time_budget_s)  # eval + save
        deadline = None if time_budget_s is None else t0 + time_budget_s - reserve
        if deadline is not None and features_outside_budget:
            deadline += feature_wall
        planned = steps if steps is not None else 0
        warmup = max(1, int(warmup))
        train_ctx = _train_context(train_dtype)
        module.train()

        def one_step() -> tuple[torch.Tensor, dict]:
            pick = torch.randint(0, n_rows, (batch_size,), generator=gen)
            x = ids_all[pick]
            f = fused_all[pick][:, :-1].float()  # positions 0..T-2: each has a next token
            kid, klp = topk_ids[pick].long(), topk_logp[pick]
            loss = 0.0
            values: dict[str, float] = {}
            with train_ctx():
                outs = ttt_forward(module, f, x, ttt_steps, feature_noise, noise_gen)
                for k, o in enumerate(outs):
                    n = o.shape[1]
                    # out_{k,i} predicts the target's distribution at position i+k+1
                    didx, p, ok, top1 = teacher_targets(kid[:, k + 1: k + 1 + n], klp[:, k + 1: k + 1 + n], index)
                    lk, acc = _step_loss(module.draft_logits(o), didx, p, ok, top1)
                    loss = loss + weights[k] * lk
                    values[f"ce{k}"] = float(lk.detach())
                    values[f"acc{k}"] = acc
            loss = loss / sum(weights)
            values["loss"] = float(loss.detach())
            return loss, values

        run = train_steps(one_step, opt, params, steps=steps, deadline=deadline, lr=lr, warmup=warmup,
                          desc="eagle3 head", progress=progress, postfix=("loss", "acc0", f"acc{ttt_steps - 1}"))
        step, stopped_by_time, first, ema, history = run.step, run.stopped_by_time, run.first, run.ema, run.history
        train_wall = run.wall_s
        module.eval().requires_grad_(False)
        log.info("EAGLE-3 head: %d steps in %.1fs%s; %s", step, train_wall,
                 " (time budget reached)" if stopped_by_time else "",
                 ", ".join(f"{k} {v:.3f}" for k, v in ema.items()))

        eval_start = time.monotonic()
        heldout = heldout_agreement3(target, module, draft_ids, layers,
                                     _windows(heldout_ids, seq_len, eval_windows, None))
        in_memory = Eagle3Head(module=module, hidden_size=hidden, vocab_size=vocab, target_hidden_size=hidden,
                               feature_layers=layers, draft_ids=draft_ids, config=config,
                               device=torch.device("cpu"), dtype=torch.float32, base_path=base)
        with torch_threads(1):  # one-token forwards: a second thread only adds synchronisation
            path_eval = _path_eval(target, Eagle3Backend(in_memory, base), heldout_ids, eval_prompts, 64,
                                   eval_tokens, eval_depth, feature_layers=layers)
        eval_wall = time.monotonic() - eval_start

        report = {
            "kind": "eagle3",
            "base_model": str(base),
            "seed": seed,
            "time_budget_s": time_budget_s,
            "features_outside_budget": features_outside_budget,
            "num_threads": num_threads,
            "steps": step,
            "planned_steps": planned or None,
            "stopped_by_time_budget": stopped_by_time,
            "ttt_steps": ttt_steps,
            "step_weights": [round(w, 4) for w in weights],
            "batch_size": batch_size,
            "seq_len": int(ids_all.shape[1]),
            "tokens_seen": step * batch_size * int(ids_all.shape[1] - 1),
            "lr": lr,
            "warmup_steps": warmup,
            "head_lr_scale": head_lr_scale,
            "train_dtype": "bfloat16 autocast" if train_ctx is not contextlib.nullcontext else "float32",
            "feature_noise": feature_noise,
            "fc_init": fc_init,
            "feature_layers": list(layers),
            "draft_vocab": {"size": d_vocab, "coverage_train_next_tokens": round(coverage, 4),
                            "coverage_teacher_top1": round(teacher_top1_coverage, 4)},
            "head": {"hidden_size": hidden, "fused_size": fused_size,
                     "intermediate_size": int(config.intermediate_size),
                     "num_attention_heads": int(config.num_attention_heads),
                     "num_key_value_heads": int(config.num_key_value_heads), "vocab_size": vocab,
                     "draft_vocab_size": d_vocab, "trained_params": sum(p.numel() for p in params)},
            "losses": {"first": {k: round(v, 4) for k, v in first.items()},
                       "final_ema": {k: round(v, 4) for k, v in ema.items()}, "history": history},
            "heldout": {k: round(v, 4) if isinstance(v, float) else v for k, v in heldout.items()},
            "greedy_path": path_eval,
            "corpus": corpus_info,
            "training_text": data_info,
            "wall_s": {"setup": round(setup_s, 2), "feature_pass": round(feature_wall, 2),
                       "train": round(train_wall, 2), "eval": round(eval_wall, 2)},
        }

        write_head_dir(out, lambda tmp: save_eagle3_head(module, config, layers, tmp, target_hidden_size=hidden),
                       report, t0)
    log.info("EAGLE-3 head saved to %s: held-out top-1 agreement %.1f%%, %.2f tokens per round at depth %d",
             out, 100 * report["heldout"]["top1_agreement"], path_eval["mean_tokens_per_round"], eval_depth)
    return report


DEMO_EAGLE3_NAME = "demo-eagle3"
DEMO_DRAFT_VOCAB = 4096  # of the demo target's 49152: 99.98% of the teacher's top-1 tokens


def ensure_demo_eagle3_head(progress: bool = True) -> Path:
    """The EAGLE-3 head for the built-in demo target, trained once (with the EAGLE-1 demo head's
    training time, on the same recorded text) and cached beside the demo pair as ``eagle3``.
    The EAGLE-1 head's features were recorded by the demo build; these are recorded first,
    outside the budget, so both heads get the same time to train."""
    from starsd_draftd.demo.eagle_train import DEMO_EAGLE_BUDGET_S, ensure_demo_head

    return ensure_demo_head("eagle3", "EAGLE-3", lambda target_dir, out, teacher: train_eagle3_head(
        target_dir, out, progress=progress, time_budget_s=DEMO_EAGLE_BUDGET_S, teacher=teacher,
        draft_vocab=DEMO_DRAFT_VOCAB, features_outside_budget=True), progress)
