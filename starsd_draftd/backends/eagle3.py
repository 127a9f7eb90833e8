"""Draft backend "eagle3": an EAGLE-3 head drafting from the target's fused features.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") differs from EAGLE-1 in what the head reads and what it predicts:

* the feature of position i is the concatenation of three of the target's hidden states there,
  those entering layers 2, L//2 and L-3 of its L (``default_feature_layers``; a head's config
  may name others), in layer order; ``fc`` [H, k * H_target], without bias, maps it to the
  head's width H;
* the head's one decoder layer takes 2H inputs: its q/k/v projections read the token's
  embedding after ``input_layernorm`` followed by the hidden state after ``hidden_norm``; the
  residual is the hidden state; then the usual ``post_attention_layernorm`` and MLP;
* its output is not a predicted target feature: ``lm_head(norm(out))`` gives logits over a
  draft vocabulary of its own (``draft_vocab_size`` tokens), mapped to target ids by
  ``target id = draft id + d2t[draft id]``; a target token outside that vocabulary has q = 0;
* a later draft step feeds the head's own pre-norm output back in place of the fused feature
  (it is H wide: no ``fc``).

Pairs line up as in EAGLE-1: the feature of position i goes with the embedding of token i + 1,
at position i; the output at the last real pair gives the first draft. The module takes and
returns what ``eagle.EagleBackend`` drives an EAGLE-1 head with (legacy ``((k, v),)`` caches,
a 2-D padding mask, position ids, a ``tree_mask`` attribute), so chains, trees, batching across
sessions and lookahead are the same code for both kinds of head.

The published layout read here: ``config.json`` (Llama-style: ``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, optional ``head_dim``, ``intermediate_size``,
``rms_norm_eps``, ``rope_theta``/``rope_scaling``, ``vocab_size`` (the target's),
``draft_vocab_size``, optional ``target_hidden_size``, optional layer ids as
``eagle_aux_hidden_state_layer_ids`` or ``eagle_config.eagle_aux_hidden_state_layer_ids``) with
``model.safetensors`` or ``pytorch_model.bin`` holding ``fc.weight``, ``midlayer.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` and optionally ``embed_tokens.weight``.
Layer ids count as the target's ``hidden_states`` do: id i is the state entering layer i.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.features import check_feature_layers, default_feature_layers
from common.fp16_weights import FP16_WEIGHTS, pack_linears
from common.models import (ModelLoadError, choose_dtype, fp16_range_refusal, kv_bytes_per_token, resolve_device,
                           resolve_dtype, resolve_model_path)
from starsd_draftd.backends.eagle import EagleBackend, _head_state_dict, _read_json, _target_tensors

log = logging.getLogger("starsd.eagle3")

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalEagle3")
REQUIRED_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
LAYER_ID_KEYS = ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, heads, T, D] with cos/sin [B, T, D] (the halves convention Llama uses)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [normed embedding, normed hidden] (2H wide)."""

    def __init__(self, config, attention_bias: bool = False):
        super().__init__()
        h = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or h // self.heads)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        inter = int(config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=attention_bias)
        attn.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=attention_bias)
        attn.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=attention_bias)
        attn.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, inter, bias=False)
        mlp.up_proj = nn.Linear(h, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, h, bias=False)
        self.mlp = mlp

    def attention(self, x: torch.Tensor, cos, sin, past: tuple | None, allowed: torch.Tensor):
        """``x`` [B, T, 2H]; ``allowed`` [B, 1, T, P + T] (True: may attend). Returns the
        attention output [B, T, H] and the cache (k, v) [B, kv_heads, P + T, D]."""
        a = self.self_attn
        b, t, _ = x.shape
        q = a.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        group = self.heads // self.kv_heads
        kk = k.repeat_interleave(group, dim=1) if group > 1 else k
        vv = v.repeat_interleave(group, dim=1) if group > 1 else v
        # an additive mask with a finite floor: a row that may see nothing (a padding row) stays finite
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~allowed, torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return a.o_proj(out), (k, v)

    def forward(self, embeds, hidden, cos, sin, past, allowed):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, kv = self.attention(x, cos, sin, past, allowed)
        hidden = residual + attn
        m = self.mlp
        y = self.post_attention_layernorm(hidden)
        hidden = hidden + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))
        return hidden, kv


class Eagle3Module(nn.Module):
    """An EAGLE-3 head in the published parameter layout (see the module doc).

    ``forward(hidden, input_ids, ...)``: ``hidden`` [B, T, fused] (the target's fused features,
    put through ``fc``) or [B, T, H] (the head's own outputs, fed back as they are). Returns
    (pre-norm outputs [B, T, H], cache) with ``use_cache``, else the outputs alone."""

    def __init__(self, config, fused_size: int, attention_bias: bool = False):
        super().__init__()
        h = int(config.hidden_size)
        if fused_size == h:
            raise ModelLoadError(f"the head's fused feature width {fused_size} equals its hidden size: its own "
                                 "outputs could not be told from target features")
        self.hidden_size, self.fused_size = h, int(fused_size)
        vocab = int(config.vocab_size)
        draft_vocab = int(getattr(config, "draft_vocab_size", None) or vocab)
        self.embed_tokens = nn.Embedding(vocab, h)
        self.fc = nn.Linear(self.fused_size, h, bias=False)
        self.midlayer = Eagle3Layer(config, attention_bias)
        self.norm = RMSNorm(h, float(getattr(config, "rms_norm_eps", 1e-6)))
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(config)  # config: a LlamaConfig (``head_config``)
        self.tree_mask: torch.Tensor | None = None  # [B, 1, T, tree columns]: set by tree drafting

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: tuple | None = None,
                use_cache: bool = False):
        b, t = input_ids.shape
        past = past_key_values[0] if past_key_values is not None else None
        p = 0 if past is None else past[0].shape[2]
        dev = input_ids.device
        if hidden.shape[-1] == self.fused_size:
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"the head takes features {self.fused_size} wide (the target's) or {self.hidden_size} "
                             f"(its own), got {hidden.shape[-1]}")
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        if position_ids is None:
            position_ids = torch.arange(p, p + t, device=dev).unsqueeze(0).expand(b, t)
        cos, sin = self.rotary(hidden, position_ids)
        cols = torch.arange(p + t, device=dev)
        allowed = (cols[None, :] <= (p + torch.arange(t, device=dev))[:, None]).expand(b, 1, t, p + t).clone()
        if attention_mask is not None:
            allowed &= attention_mask[:, None, None, :].bool()
        if self.tree_mask is not None:
            n = self.tree_mask.shape[-1]
            allowed[..., -n:] &= self.tree_mask.to(dev).bool()
        out, kv = self.midlayer(embeds, hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), past, allowed)
        return (out, (kv,)) if use_cache else out

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary for the head's outputs ``x`` [..., H]."""
        return self.lm_head(self.norm(x))


@dataclass
class Eagle3Head:
    """A loaded EAGLE-3 head: what ``EagleBackend`` reads from an ``EagleHead``, plus the
    fused-feature layout and the draft-to-target vocabulary map."""

    module: Eagle3Module
    hidden_size: int  # the head's width H
    vocab_size: int  # the target's vocabulary (the embedding's rows)
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # the target hidden states fused, in order (id i: entering layer i)
    draft_ids: torch.Tensor  # [draft vocab] long: the target id of each draft token
    config: object
    device: torch.device
    dtype: torch.dtype
    path: Path | None = None
    base_path: Path | None = None

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.module.embed_tokens.weight

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size * len(self.feature_layers)

    @property
    def logits_size(self) -> int:
        return self.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_ids.shape[0])

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary for head outputs ``x`` [..., H]: the draft
        vocabulary's put at their target ids, -inf elsewhere (q = 0 there)."""
        small = self.module.draft_logits(x)
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_ids] = small
        return full


# ---------------------------------------------------------------- loading


def _layer_ids(raw: dict) -> list | None:
    for key in LAYER_ID_KEYS:
        if raw.get(key) is not None:
            return raw[key]
    nested = raw.get("eagle_config")
    if isinstance(nested, dict):
        for key in LAYER_ID_KEYS:
            if nested.get(key) is not None:
                return nested[key]
    return None


def _target_layer_count(cfg: dict) -> int | None:
    """The target's decoder layer count from its config.json, read as the target daemon reads it
    (``LoadedModel.num_layers``: a multimodal config nests it in ``text_config``; GPT-style
    configs call it ``n_layer``); None when it says none."""
    for where in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        for key in ("num_hidden_layers", "n_layer"):
            n = where.get(key)
            if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
                return n
    return None


def head_config(raw: dict):
    """The head's ``config.json`` as a LlamaConfig (one layer); ModelLoadError naming what is wrong."""
    from transformers import LlamaConfig

    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in raw]
    if missing:
        raise ModelLoadError(f"the EAGLE-3 head config lacks {', '.join(missing)}")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version", "eagle_config")}
    try:
        cfg = LlamaConfig(**fields)
    except Exception as exc:  # transformers validates configs with several error types (0 heads: ZeroDivisionError)
        raise ModelLoadError(f"cannot read the EAGLE-3 head config: {type(exc).__name__}: {exc}") from exc
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise ModelLoadError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return cfg


def _expect(state: dict, name: str, shape: tuple, where: Path) -> torch.Tensor:
    t = state.get(name)
    if t is None:
        raise ModelLoadError(f"the EAGLE-3 head weights in {where} have no {name!r}")
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{name} in {where} has shape {tuple(t.shape)}; the head's config implies {shape}")
    return t


def load_eagle3_head(head_dir: str | Path, base_model_dir: str | Path, device: str = "cpu",
                     dtype: str = "float32") -> Eagle3Head:
    """Load an EAGLE-3 head in the published layout and check it against the target checkpoint
    in ``base_model_dir`` (its embedding, hidden size, vocabulary and layer count)."""
    head_dir = Path(head_dir)
    base = resolve_model_path(str(base_model_dir))
    raw = _read_json(head_dir / "config.json", "an EAGLE-3 head directory")
    arch = raw.get("architectures") or []
    if arch and not any("eagle3" in a.lower() for a in arch):
        log.warning("%s declares architectures %s; loading it as an EAGLE-3 head", head_dir, arch)
    config = head_config(raw)
    target_cfg = _read_json(base / "config.json", "a model directory")
    state = _head_state_dict(head_dir)
    h = int(config.hidden_size)
    vocab = int(config.vocab_size)
    draft_vocab = int(getattr(config, "draft_vocab_size", None) or vocab)
    target_h = int(raw.get("target_hidden_size") or h)  # absent: the head is as wide as its target
    target_layers = _target_layer_count(target_cfg)
    if target_layers is None:
        raise ModelLoadError(f"the target config in {base} does not say its layer count (num_hidden_layers)")
    if target_cfg.get("hidden_size") is not None and int(target_cfg["hidden_size"]) != target_h:
        raise ModelLoadError(f"the EAGLE-3 head was made for a target of hidden size {target_h}; the target in "
                             f"{base} has hidden size {target_cfg['hidden_size']}")
    embed, _, embed_name, _ = _target_tensors(base, lm_head=False)  # EAGLE-3 heads have their own
    if embed.shape[0] != vocab:
        raise ModelLoadError(f"the EAGLE-3 head's vocabulary size {vocab} differs from the target's embedding rows "
                             f"{embed.shape[0]} ({embed_name} in {base})")
    explicit = _layer_ids(raw)
    if explicit is not None and not isinstance(explicit, list):
        raise ModelLoadError(f"the EAGLE-3 head config in {head_dir} names its target layers as "
                             f"{explicit!r}; expected a list of layer ids")
    try:
        layers = tuple(explicit) if explicit is not None else default_feature_layers(target_layers)
    except ValueError as exc:  # a target too shallow for the default layers
        raise ModelLoadError(f"the EAGLE-3 head in {head_dir} names no target layers: {exc}") from exc
    why = check_feature_layers(layers, target_layers)
    if why is not None:
        raise ModelLoadError(f"the EAGLE-3 head in {head_dir} fuses target layers {list(layers)}: {why}")
    fused = target_h * len(layers)
    fc = state.get("fc.weight")
    if fc is None:
        raise ModelLoadError(f"{head_dir} does not look like an EAGLE-3 head: its weights have no 'fc.weight'")
    if tuple(fc.shape) != (h, fused):
        raise ModelLoadError(f"fc.weight in {head_dir} has shape {tuple(fc.shape)}; fusing {len(layers)} target "
                             f"layers {list(layers)} of width {target_h} into hidden size {h} needs {(h, fused)}")
    if "fc.bias" in state:
        raise ModelLoadError(f"{head_dir} has an 'fc.bias': EAGLE-3's fc has none (an EAGLE-1 head? use "
                             "--backend eagle)")
    _expect(state, "lm_head.weight", (draft_vocab, h), head_dir)
    d2t = _expect(state, "d2t", (draft_vocab,), head_dir).long()
    draft_ids = torch.arange(draft_vocab) + d2t
    if draft_vocab and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab):
        raise ModelLoadError(f"d2t in {head_dir} maps draft tokens outside the target vocabulary 0..{vocab - 1}")
    if int(torch.unique(draft_ids).numel()) != draft_vocab:
        raise ModelLoadError(f"d2t in {head_dir} maps two draft tokens to the same target token")
    t2d = state.get("t2d")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise ModelLoadError(f"t2d in {head_dir} has shape {tuple(t2d.shape)}; expected ({vocab},)")
        marked = torch.zeros(vocab, dtype=torch.bool)
        marked[draft_ids] = True
        if not torch.equal(t2d.bool(), marked):
            raise ModelLoadError(f"t2d and d2t in {head_dir} disagree on which target tokens the draft vocabulary holds")
    own_embed = state.get("embed_tokens.weight")
    if own_embed is not None:
        if tuple(own_embed.shape) != (vocab, h):
            raise ModelLoadError(f"the EAGLE-3 head's own embedding has shape {tuple(own_embed.shape)}; "
                                 f"expected ({vocab}, {h})")
    elif embed.shape[1] != h:
        raise ModelLoadError(f"the EAGLE-3 head (hidden size {h}) ships no embedding, and the target's "
                             f"{embed_name} is {embed.shape[1]} wide")
    attention_bias = "midlayer.self_attn.q_proj.bias" in state

    dev = resolve_device(device)
    asked, dtype = dtype != "auto", choose_dtype(dtype, dev).name  # auto: what load_causal_lm takes for the target
    torch_dtype = resolve_dtype(dtype, dev)
    with torch.device("meta"):
        module = Eagle3Module(config, fused, attention_bias)
    state = dict(state)
    state["embed_tokens.weight"] = own_embed if own_embed is not None else embed
    state["d2t"] = d2t
    state["t2d"] = state["t2d"].bool() if t2d is not None else torch.zeros(vocab, dtype=torch.bool).index_fill_(
        0, draft_ids, True)
    state = {k: (v.to(device=dev) if k in ("d2t", "t2d") else v.to(device=dev, dtype=torch_dtype))
             for k, v in state.items()}
    try:
        result = module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"the EAGLE-3 head weights in {head_dir} do not fit its config: {exc}") from exc
    missing = [k for k in result.missing_keys if not k.startswith("rotary.")]
    if missing or result.unexpected_keys:
        raise ModelLoadError(f"the EAGLE-3 head weights in {head_dir} do not fit its config: missing "
                             f"{missing or 'none'}, unexpected {result.unexpected_keys or 'none'}")
    _rebuild_rotary(module, config, dev)
    module.eval().requires_grad_(False)
    if dtype == FP16_WEIGHTS and fp16_range_refusal(module, head_dir, asked) is not None:
        dtype = "float32"  # the head is float32 already: fp16-weights computes in it
    if dtype == FP16_WEIGHTS:
        pack_linears(module)
    log.info("EAGLE-3 head %s (hidden %d, draft vocabulary %d of %d, fusing target layers %s of %d, width %d) on "
             "%s as %s; embedding from %s", head_dir, h, draft_vocab, vocab, list(layers), target_layers, target_h,
             dev, dtype if dtype == FP16_WEIGHTS else str(torch_dtype).replace("torch.", ""),
             "the head" if own_embed is not None else f"{embed_name} in {base}")
    return Eagle3Head(module=module, hidden_size=h, vocab_size=vocab, target_hidden_size=target_h,
                      feature_layers=tuple(int(i) for i in layers), draft_ids=draft_ids.to(dev), config=config,
                      device=dev, dtype=torch_dtype, path=head_dir, base_path=base)


def _rebuild_rotary(module: Eagle3Module, config, device: torch.device) -> None:
    """The rotary tables were built on the meta device: build them again, in float32, on ``device``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device(device):
        module.rotary = LlamaRotaryEmbedding(config)


# ---------------------------------------------------------------- the backend


class Eagle3Backend(EagleBackend):
    """EAGLE-3 drafting: ``EagleBackend``'s chains, trees and batching over an ``Eagle3Head``.
    Requests bring fused features ([m, k * H_target]); the target sends them because the
    handshake names ``feature_layers``."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, tokenizer_dir: str | Path | None = None, q_topk: int = 32,
                 tree_topk: int = 1):
        super().__init__(head, tokenizer_dir, q_topk=q_topk, tree_topk=tree_topk)  # type: ignore[arg-type]
        self.feature_layers = head.feature_layers
        self.target_hidden_size = head.target_hidden_size
        self.kv_bytes_per_token = kv_bytes_per_token(head.config, head.dtype, layers=1)

    @classmethod
    def from_dirs(cls, head_dir: str | Path, base_model_dir: str | Path, device: str = "cpu", dtype: str = "float32",
                  q_topk: int = 32, tree_topk: int = 1) -> "Eagle3Backend":
        head = load_eagle3_head(head_dir, base_model_dir, device=device, dtype=dtype)
        return cls(head, head.base_path, q_topk=q_topk, tree_topk=tree_topk)


def save_eagle3_head(module: Eagle3Module, config, feature_layers, out_dir: str | Path, target_hidden_size: int,
                     include_embedding: bool = False) -> Path:
    """Write a head in the published layout: ``config.json`` (LlamaForCausalLMEagle3, its
    draft vocabulary, target width and fused layer ids) and ``model.safetensors`` (``fc``,
    ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; the embedding only if asked)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()
             if not k.startswith("rotary.") and (include_embedding or k != "embed_tokens.weight")}
    cfg = config.to_dict()
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=int(module.lm_head.weight.shape[0]), target_hidden_size=int(target_hidden_size),
               eagle_config={"eagle_aux_hidden_state_layer_ids": [int(i) for i in feature_layers]})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
