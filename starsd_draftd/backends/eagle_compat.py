"""The one place where the EAGLE-1 head class (``eagle.model.cnets.Model``) is adapted to the
transformers release installed here.

The head class was written against transformers 4.3x and reads its configuration the old way.
Under transformers 5.x three things need care; each shim below names the one it handles:

* RoPE settings.  ``config.rope_scaling`` is now an alias of ``config.rope_parameters``, which
  always holds a dict (``{"rope_type": "default", "rope_theta": ...}`` for plain RoPE).  The head
  class expects ``None`` for plain RoPE and ``{"type": ..., "factor": ...}`` for linear or dynamic
  scaling, and raises ``KeyError('type')`` on anything else.  :func:`cnets_config` rewrites it.
  The head class always rotates with base 10000 (it never reads ``rope_theta``); heads are trained
  and served by the same class, so that is consistent, and a different ``rope_theta`` is only
  logged.
* ``pretraining_tp``.  The head class reads it; a config without it would fail, and a value above
  1 only splits the same matrix products into slices.  :func:`cnets_config` sets it to 1.
* Rotary buffers under a cast.  ``module.to(bfloat16)`` also casts the rotary ``inv_freq`` buffer,
  and a context longer than ``max_position_embeddings`` then rebuilds the cos/sin tables from
  bfloat16 positions (integers above 256 are rounded).  :func:`restore_rotary_precision` puts the
  rotary buffers back in float32; each forward casts the tables to the activations' dtype, so
  results within the original table are unchanged.

What needs no shim (checked by tests/test_eagle.py): the causal mask is built in float32 and
promotes bfloat16/float16 attention scores for the softmax, which upcasts anyway; with a legacy
tuple cache the position ids start at the cached length, so a cropped cache continues at the
right position.
"""

from __future__ import annotations

import copy
import logging

import torch
from eagle.model.cnets import LlamaRotaryEmbedding, Model

from common.models import ModelLoadError

log = logging.getLogger("starsd.eagle")

EAGLE_ROPE_BASE = 10000.0  # the head class's rotary base, whatever the config says
_SCALED_ROPE_TYPES = ("linear", "dynamic")
REQUIRED_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def head_config_from_dict(raw: dict):
    """Parse a head's ``config.json`` (a Llama-style config with one hidden layer) into a
    ``LlamaConfig``; raise ModelLoadError naming what is missing."""
    from transformers import LlamaConfig

    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in raw]
    if missing:
        raise ModelLoadError(f"the EAGLE head config lacks {', '.join(missing)}")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        return LlamaConfig(**fields)
    except (TypeError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the EAGLE head config: {exc}") from exc


def _legacy_rope(rope: dict | None) -> dict | None:
    """transformers 5.x rope_parameters -> the head class's rope_scaling (None = plain RoPE)."""
    if not rope:
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta")
    if theta is not None and float(theta) != EAGLE_ROPE_BASE:
        log.warning("the EAGLE-1 head rotates with base %g; the config's rope_theta %g is not used",
                    EAGLE_ROPE_BASE, float(theta))
    if kind == "default":
        return None
    if kind in _SCALED_ROPE_TYPES:
        factor = rope.get("factor")
        if factor is None or float(factor) <= 1.0:
            raise ModelLoadError(f"{kind} RoPE scaling needs a factor above 1, got {factor!r}")
        return {"type": kind, "factor": float(factor)}
    raise ModelLoadError(
        f"the EAGLE-1 head supports plain, linear or dynamic RoPE, not rope_type {kind!r}")


def cnets_config(config):
    """A copy of ``config`` in the form ``eagle.model.cnets.Model`` reads (see the module doc).

    Also refuses a ``head_dim`` other than hidden_size / num_attention_heads, which the head class
    cannot express."""
    cfg = copy.deepcopy(config)
    cfg.rope_parameters = _legacy_rope(config.rope_parameters)
    cfg.pretraining_tp = 1
    heads = int(cfg.num_attention_heads)
    if cfg.hidden_size % heads:
        raise ModelLoadError(f"hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {heads}")
    implied = cfg.hidden_size // heads
    declared = getattr(cfg, "head_dim", None) or implied
    if declared != implied:
        raise ModelLoadError(
            f"the EAGLE-1 head needs head_dim = hidden_size / num_attention_heads = {implied}, "
            f"but the config declares head_dim {declared}")
    if cfg.num_key_value_heads is None:
        cfg.num_key_value_heads = heads
    if heads % int(cfg.num_key_value_heads):
        raise ModelLoadError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {cfg.num_key_value_heads}")
    return cfg


def build_head(config, bias: bool) -> torch.nn.Module:
    """Construct ``eagle.model.cnets.Model`` for ``config`` (a LlamaConfig; shims applied here)."""
    module = Model(cnets_config(config), load_emb=False, bias=bias)
    module.gradient_checkpointing = False  # the class enables activation checkpointing in training
    return module


def restore_rotary_precision(module: torch.nn.Module, device: torch.device | str | None = None) -> None:
    """Rebuild the head's rotary ``inv_freq`` and cos/sin tables in float32: after a dtype cast, or
    on ``device`` for a head that was built on the meta device."""
    for sub in module.modules():
        if isinstance(sub, LlamaRotaryEmbedding):
            dev = torch.device(device) if device is not None else sub.inv_freq.device
            exponents = torch.arange(0, sub.dim, 2, dtype=torch.float32, device=dev) / sub.dim
            sub.register_buffer("inv_freq", 1.0 / (sub.base ** exponents), persistent=False)
            sub._set_cos_sin_cache(seq_len=sub.max_seq_len_cached, device=dev, dtype=torch.float32)
