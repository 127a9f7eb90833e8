"""The lean forward's decoder layers as TorchScript: the same aten ops, without Python between them.

On a CPU core a small model's step spends about as long in Python dispatching its small ops as
in those ops: a layer's norm, rotary embedding, attention call, residual adds and gated
activation cost the demo target about 50 us a layer in Python calls, 30 layers a step. Compiled
by TorchScript and run by its interpreter without its graph optimisations (and its fusers off),
the same aten ops run in the same order on the same inputs, so the results are the same bits; ``script_layers``
checks that on the model's own first layer (every layer runs the same graph with its own weights),
with the shapes and masks serving passes, before it is used.

Each layer is two calls, because its KV cache is Python (a slot cache, a pool row, a batch of
rows): ``pre`` (the input norm, the fused q/k/v GEMM and the rotary embedding) returns the
queries, keys and values; the cache takes the keys and values and returns the layer's whole
keys and values; ``post`` (attention as ``LeanForward._attend`` runs it, the output GEMM, the
residual, the post norm, the fused gate/up GEMM, SiLU, the down GEMM, the residual) returns the
layer's output. Only the configuration the CPU serving default runs is taken: fp16-weights with
the q/k/v and gate/up GEMMs fused, float32 norms as one ``torch.rms_norm``, SiLU, rotary heads of
an even width, and attention through the inline SDPA branches."""

from __future__ import annotations

import logging
import warnings
from typing import Optional, Tuple

import torch

from common.slot_cache import flat_places

log = logging.getLogger("starsd.lean")


class ScriptedLayer(torch.nn.Module):
    """One decoder layer's arithmetic in two TorchScript methods (see the module docstring). Call
    them only inside ``torch.jit.optimized_execution(False)``: a plan TorchScript has once
    optimised stays in use for that method, and only the plain one is checked."""

    def __init__(self, L, packed_qkv, packed_o, packed_gate_up, packed_down, in_weight: torch.Tensor,
                 post_weight: torch.Tensor, in_eps: float, post_eps: float):
        super().__init__()
        self.qkv = packed_qkv
        self.o = packed_o
        self.gate_up = packed_gate_up
        self.down = packed_down
        self.register_buffer("in_weight", in_weight.detach(), persistent=False)
        self.register_buffer("post_weight", post_weight.detach(), persistent=False)
        self.in_eps = float(in_eps)
        self.post_eps = float(post_eps)
        self.width = int(in_weight.shape[-1])
        self.heads = int(L.heads)
        self.qk_heads = int(L.qk_heads)
        self.head_dim = int(L.head_dim)
        self.half = int(L.head_dim) // 2
        self.inter = int(L.inter)
        self.groups = int(L.groups)
        self.scaling = float(L.scaling)
        self.mask_gqa = torch.float32 in L.mask_gqa  # fp16-weights' activations are float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the layer runs as pre and post, around the cache

    @torch.jit.export
    def pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
        b, t = x.shape[0], x.shape[1]
        h = torch.rms_norm(x, [self.width], self.in_weight, self.in_eps)
        y = torch.ops.quantized.linear_dynamic_fp16(h, self.qkv).view(b, t, -1, self.head_dim).transpose(1, 2)
        qk, v = y[:, : self.qk_heads], y[:, self.qk_heads:]
        qk = (qk * cos) + (qk.roll(self.half, -1) * sin)
        return qk[:, : self.heads], qk[:, self.heads:], v

    @torch.jit.export
    def pool_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                  keys: torch.Tensor, values: torch.Tensor, flat: torch.Tensor, a: int, b: int,
                  kv_len: int) -> torch.Tensor:
        """The whole layer over adjacent pool rows [a, b): ``pre``, the new keys and values written
        to their places ``flat`` in the buffers seen flat, as ``PoolBatch`` writes them, then
        ``post`` over the rows' first ``kv_len`` slots."""
        q, k, v = self.pre(x, cos, sin)
        width = k.shape[-1]
        keys.view(-1, width).index_copy_(0, flat, k.reshape(-1, width))
        values.view(-1, v.shape[-1]).index_copy_(0, flat, v.reshape(-1, v.shape[-1]))
        return self.post(x, q, keys[a:b, :, :kv_len], values[a:b, :, :kv_len], mask)

    @torch.jit.export
    def post(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: Optional[torch.Tensor]) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q_len = q.shape[2]
        gqa = False
        if self.groups > 1:
            if mask is None and k.shape[-1] == v.shape[-1] and v.shape[-1] <= 256:
                gqa = True
            elif q_len == 1:
                q = q.reshape(q.shape[0], q.shape[1] // self.groups, self.groups, q.shape[3])
                if mask is not None and mask.shape[1] != 1:
                    mask = mask.reshape(mask.shape[0], mask.shape[1] // self.groups, self.groups, mask.shape[3])
            elif self.mask_gqa and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
                gqa = True  # repeated keys' bits without their copies (common.lean.mask_gqa_dtypes)
            else:
                kb, kh, ks, kd = k.shape
                k = k[:, :, None].expand(kb, kh, self.groups, ks, kd).reshape(kb, kh * self.groups, ks, kd)
                vb, vh, vs, vd = v.shape
                v = v[:, :, None].expand(vb, vh, self.groups, vs, vd).reshape(vb, vh * self.groups, vs, vd)
        causal = q_len > 1 and mask is None
        if causal and k.shape[2] > q_len:
            k, v = k[:, :, :q_len], v[:, :, :q_len]
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0,
                                                             is_causal=causal, scale=self.scaling, enable_gqa=gqa)
        a = a.reshape(a.shape[0], -1, q_len, v.shape[-1]).transpose(1, 2).contiguous()
        x = x + torch.ops.quantized.linear_dynamic_fp16(a.reshape(b, t, -1).contiguous(), self.o)
        h = torch.rms_norm(x, [self.width], self.post_weight, self.post_eps)
        gu = torch.ops.quantized.linear_dynamic_fp16(h, self.gate_up)
        act = torch.nn.functional.silu(gu[..., : self.inter])
        return x + torch.ops.quantized.linear_dynamic_fp16(act * gu[..., self.inter:], self.down)


def script_layers(lean, base) -> tuple[list | None, str | None]:
    """The scripted layers for a built ``LeanForward`` over ``base`` (the model's decoder), or
    None and why not: a configuration outside the one taken (module docstring), TorchScript
    failing, or a check finding any bit different from the lean forward's Python ops."""
    from common.fp16_weights import Fp16Linear

    if not lean.fused:
        return None, "the linears are not fused fp16-weights"
    if not lean._inline_attention:
        return None, "attention does not take the inline SDPA branches here"
    inv_freq = getattr(base.rotary_emb, "inv_freq", None)
    if inv_freq is None or 2 * inv_freq.shape[-1] != lean.layers[0].head_dim:
        return None, "the rotary embedding does not cover whole heads"
    layers = []
    for L, layer in zip(lean.layers, base.layers):
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (getattr(L.in_norm, "one_op", False) and getattr(L.post_norm, "one_op", False)):
            return None, "the norms do not run as one op"
        if type(layer.mlp.act_fn).__name__ != "SiLUActivation" or L.head_dim % 2 or not L.causal:
            return None, "not a SiLU layer with even rotary heads and causal attention"
        whole = [getattr(layer.self_attn.q_proj, "whole", None), layer.self_attn.o_proj,
                 getattr(layer.mlp.gate_proj, "whole", None), layer.mlp.down_proj]
        if not all(type(m) is Fp16Linear and m._packed is not None for m in whole):
            return None, "a linear is not fp16-weights"
        layers.append(ScriptedLayer(L, *[m._packed for m in whole], norms[0].weight, norms[1].weight,
                                    norms[0].variance_epsilon, norms[1].variance_epsilon))
    try:
        # never fused kernels, even in an optimised plan (process-wide; nothing else here uses TorchScript)
        torch._C._jit_set_texpr_fuser_enabled(False)
        torch._C._jit_override_can_fuse_on_cpu(False)
        with warnings.catch_warnings():  # PyTorch calls TorchScript deprecated; this pinned build runs it
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = [torch.jit.script(s) for s in layers]
    except Exception as exc:  # a PyTorch without TorchScript, or with other limits: the Python ops work
        return None, f"TorchScript could not compile a layer ({type(exc).__name__}: {exc})"
    try:
        same = _same_bits(lean, lean.layers[0], scripted[0])
    except Exception as exc:  # a scripted call that fails at run time: the Python ops work
        return None, f"a scripted layer failed its check ({type(exc).__name__}: {exc})"
    if not same:
        log.info("scripted layers differ from the lean forward's Python ops: the layers stay in Python")
        return None, "a scripted layer's output differs from the Python ops'"
    return scripted, None


def _same_bits(lean, L, S) -> bool:
    """The scripted layer against the lean forward's own Python ops (``lean._pre``/``lean._post``,
    and for ``pool_step`` the cache write ``PoolBatch`` makes), on random inputs with the shapes
    and masks serving passes: decode of one row and several without a mask (a lone generation's
    step) and with one (a batch's), verification-sized feeds with masks bool and additive, prefill
    chunks without a mask (causal), a few cached positions or none."""
    gen = torch.Generator().manual_seed(0)
    width, hd = S.width, S.head_dim
    kv_heads = S.qk_heads - S.heads
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        for rows, tokens, cached, masked in ((1, 1, 7, False), (3, 1, 9, False), (1, 1, 7, True), (3, 1, 9, True),
                                             (1, 5, 4, True), (2, 5, 0, False), (1, 9, 0, False), (1, 64, 0, False),
                                             (4, 1, 30, True)):
            x = torch.randn(rows, tokens, width, generator=gen)
            ang = torch.randn(rows, tokens, hd, generator=gen)
            cos, sin = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
            old_k = torch.randn(rows, kv_heads, cached, hd, generator=gen)
            old_v = torch.randn(rows, kv_heads, cached, hd, generator=gen)
            mask = None
            if masked:
                keep = torch.rand(rows, 1, tokens, cached + tokens, generator=gen) > 0.2
                keep[..., cached:] = torch.ones(tokens, tokens, dtype=torch.bool).tril()
                mask = keep if rows == 3 else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
            want = lean._pre(L, x, cos, sin)
            got = S.pre(x, cos, sin)
            if not all(torch.equal(a, b) for a, b in zip(want, got)):
                return False
            k, v = torch.cat((old_k, want[1]), 2), torch.cat((old_v, want[2]), 2)
            out = lean._post(L, x, want[0], k, v, mask)
            if not torch.equal(out, S.post(x, want[0], k, v, mask)):
                return False
            if masked and not _same_pool_step(S, x, cos, sin, mask, old_k, old_v, want, out, gen):
                return False
    return True


def _same_pool_step(S, x, cos, sin, mask, old_k, old_v, want, out, gen) -> bool:
    """``pool_step`` over rows 1.. of a pool of one more row (a batch's rows adjacent, not from
    0), against the Python path's outputs ``want`` and ``out`` for the same inputs: the same
    output, and the same keys and values at the same places of the buffers."""
    rows, kv_heads, cached, hd = old_k.shape
    tokens = x.shape[1]
    slots = cached + tokens + 3
    buffers = []
    for old in (old_k, old_v):
        buf = torch.randn(rows + 1, kv_heads, slots, hd, generator=gen)
        buf[1:, :, :cached] = old
        buffers.append(buf)
    keys, values = buffers
    flat = flat_places(torch.arange(1, rows + 1), kv_heads, slots, torch.full((rows,), cached), tokens)
    got = S.pool_step(x, cos, sin, mask, keys, values, flat, 1, rows + 1, cached + tokens)
    return (torch.equal(got, out) and torch.equal(keys[1:, :, cached: cached + tokens], want[1])
            and torch.equal(values[1:, :, cached: cached + tokens], want[2]))
