"""A lean eager forward for Llama-shaped decoders: the model's own arithmetic, less Python around it.

On a CPU core a small model's step is largely overhead: on the demo target (30 layers, 576 wide)
the GEMMs and attention took about 11 ms of an 18.9 ms decode step; the rest was transformers'
module calls, decorators, output recording and keyword plumbing (30 layers times a dozen
modules) and the many small tensor ops around the GEMMs. ``LeanForward`` runs the same forward
with less of both:

- it calls each submodule's own ``forward`` directly (activation, LM head: a cut draft head works
  unchanged), and the model's own rotary embedding, mask builder and cache ``update``;
- it runs the RMS norms and transformers' SDPA dispatch inline with the same ops in the same order
  (``_norm``, ``LeanForward._attend``; other accelerators keep transformers' attention function);
  a float32 norm runs as one ``torch.rms_norm`` where a check at build time finds the same bits;
- it applies the rotary embedding to queries and keys in one go, rotating by ``roll`` with the
  sign moved onto ``sin`` (elementwise: the same values);
- with fp16-weights it runs q/k/v as one GEMM and gate/up as one, calling fbgemm's GEMM directly
  (fbgemm computes each output column the same way whatever the matrix's width; ``fuse_fp16``
  checks that on the model's own shapes before it fuses, and leaves the layers apart if any bit
  differs). The fused weights replace the separate ones (``Fp16Part`` serves the original
  modules from them), so the model takes no more memory;
- with packed bfloat16 linears (``common.bf16_packed``), a verification of one sequence (every
  row's logits read, at most ``row_exact_rows`` rows) runs attention per query row, as a one-row
  step calls it, so that each row gets a one-row step's bits (``row_exact_rows`` checks at build
  that the linears keep a row's bits at that many rows); bfloat16 rounds any other order's
  one-ulp differences into different tokens at near-ties. Such forwards are the one place where
  the lean forward's bits are not transformers' (which runs the rows' attention at once);
- with fp16-weights fused and float32 one-op norms, it runs each decoder layer as two
  TorchScript methods around the cache update (``common.lean_script``: the same ops without
  Python between them, checked bit for bit at build time);
- with fp16-weights read from a mapped checkpoint on a CPU with bfloat16 matrix instructions, a
  forward that reads no logits but the last (a prefill chunk) over at least ``wide_rows`` rows
  multiplies the checkpoint's weights in bfloat16 (``common.fp16_weights``, "Wide prefill"), the
  one place where the lean forward computes differently from the model's own forward on purpose.

The result is the same tensors, bit for bit (``tests/test_lean.py`` checks logits, hidden states
and caches against the model's own forward, in float32, bfloat16 and fp16-weights), but for a
bfloat16 verification's rows, which get one-row steps' bits (``tests/test_bf16_packed.py``), and
a wide prefill. Measured
interleaved on one core (demo target, fp16-weights, 200 cached positions): a decode step 22.9 ms
through transformers, 18.2 ms lean; docs/architecture.md, "The model runner", has more.

It covers ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` in inference mode with full attention in
every layer, SDPA and no module hooks; ``LeanForward.build`` says why it cannot take any other
model, which then runs through transformers as before. A hook set on any of the model's modules
after the build sends calls through the model's own forward while it is set, so that it runs
(transformers' own output-recording hooks excepted: they act only inside the model's own
forward). It takes what the runner's callers pass: ids, a cache (including ``PoolBatch``), an
optional 2-D or 4-D mask and position ids, ``output_hidden_states`` and ``logits_to_keep``.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

from common.fp16_weights import wide_begin, wide_done

log = logging.getLogger("starsd.lean")

SUPPORTED = {
    "LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention"),
    "Qwen2ForCausalLM": ("Qwen2DecoderLayer", "Qwen2Attention"),
}
# row counts the fusion check feeds: decode, verification lengths, prefill chunk sizes
FUSE_CHECK_ROWS = (1, 2, 5, 9, 16, 64, 256)


class Unsupported(Exception):
    """Why the lean forward cannot run a model."""


# transformers' own output-recording hooks: installed on a model's layers at its first forward that
# records hidden states, and inert outside such a forward (the lean forward records its own)
_CAPTURE_HOOKS = "transformers.utils.output_capturing"


def _foreign(table) -> bool:
    """Whether a module's hook table holds a hook other than transformers' output recording."""
    return any(getattr(hook, "__module__", None) != _CAPTURE_HOOKS for hook in table.values())


def _plain(module):
    """``module.forward`` bound, skipping ``nn.Module.__call__``'s hook handling (refused when a
    hook is set: it would be skipped too)."""
    if _foreign(module._forward_hooks) or _foreign(module._forward_pre_hooks):
        raise Unsupported(f"{type(module).__name__} has forward hooks")
    return module.forward


def _linear(module):
    """A linear layer's forward for the lean loop, whose inputs are contiguous and in the
    activations' dtype: fp16-weights' or packed bfloat16's GEMM called directly, else the
    module's own forward."""
    from common.bf16_packed import Bf16Linear
    from common.fp16_weights import LINEAR_FP16, Fp16Linear

    if type(module) is Fp16Linear:
        _plain(module)
        packed = module._packed
        return lambda x: LINEAR_FP16(x, packed)
    if type(module) is Bf16Linear:
        _plain(module)
        packed, bias, op = module._packed, module.bias, torch.ops.mkldnn._linear_pointwise
        return lambda x: op(x, packed, bias, "none", [], "")
    return _plain(module)


RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm")


def _norm(module):
    """An RMS norm's forward: transformers' arithmetic for these classes (the same ops in the same
    order) without the module call, in float32 as one ``torch.rms_norm`` where that gives the
    same bits (``_one_op_norm_matches``); any other norm's own forward."""
    if type(module).__name__ not in RMS_NORMS:
        return _plain(module)
    _plain(module)

    weight, eps = module.weight, module.variance_epsilon

    def rms(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # transformers' casts to and from float32 are no-ops then
            return _rms_float32(x, weight, eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    if weight.dtype != torch.float32 or not _one_op_norm_matches(weight, eps):
        return rms
    width = (weight.shape[-1],)

    def rms_one_op(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.rms_norm(x, width, weight, eps)
        return rms(x)

    rms_one_op.one_op = True  # common.lean_script runs such norms as the same one op
    return rms_one_op


def _rms_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMS norm of a float32 ``x``, op for op."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


_NORM_CHECKS: dict = {}


def _one_op_norm_matches(weight: torch.Tensor, eps: float) -> bool:
    """Whether ``torch.rms_norm`` (one op: the same arithmetic, less Python) gives transformers'
    float32 RMS norm bit for bit here, checked with a random weight on random rows of this width
    and epsilon (at the row counts of decode, verification and prefill chunks, and several
    scales, on the weight's device); the answer is kept per width, epsilon and device, and the
    norm keeps its ops apart wherever it is not."""
    width = weight.shape[-1]
    key = (width, eps, weight.device.type)
    if key not in _NORM_CHECKS:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(width, generator=gen).to(weight.device)
        ok = True
        with torch.inference_mode():
            for rows in FUSE_CHECK_ROWS:
                for scale in (1e-3, 1.0, 30.0):
                    x = (torch.randn(rows, width, generator=gen) * scale).to(weight.device)
                    ok = ok and torch.equal(_rms_float32(x, w, eps), torch.rms_norm(x, (width,), w, eps))
        if not ok:
            log.info("torch.rms_norm differs from the RMS norm's own ops: they stay apart")
        _NORM_CHECKS[key] = ok
    return _NORM_CHECKS[key]


def _sdpa_inline() -> bool:
    """Whether transformers' SDPA attention takes its CPU/CUDA branches here, which
    ``LeanForward._attend`` repeats (other accelerators and a forced GQA keep its function)."""
    import os

    from transformers.integrations import sdpa_attention as sa

    return not (os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1" or sa._is_torch_xpu_available
                or sa._is_torch_npu_available or sa._is_torch_mps_available)


def _pack_gqa(x: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """One query's heads [B, H, 1, D] as [B, H / groups, groups, D] (a mask shared by all heads as
    it is), so that attention runs per key head (transformers' ``pack_gqa``)."""
    if x is None or x.shape[1] == 1:
        return x
    return x.reshape(x.shape[0], x.shape[1] // groups, groups, x.shape[3])


def mask_gqa_dtypes(heads: int, kv_heads: int, head_dim: int) -> frozenset:
    """The dtypes (of float32 and bfloat16) in which SDPA's own grouped-query attention, for
    several queries with a mask on this CPU and PyTorch build, gives the bits of keys and values
    repeated to the query heads (transformers' way), on a few shapes like verifications' (2-17
    rows after 1-300 cached positions). Where it does, the lean forward skips the repeat, which
    copies the cache's keys and values in every layer."""
    if kv_heads >= heads or head_dim > 256:
        return frozenset()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ok = set()
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        try:
            for rows, cached in ((2, 1), (5, 37), (17, 300)):
                q = torch.randn(1, heads, rows, head_dim, generator=g).to(dtype)
                k, v = (torch.randn(1, kv_heads, cached + rows, head_dim, generator=g).to(dtype) for _ in range(2))
                allowed = torch.ones(rows, cached + rows, dtype=torch.bool).tril(cached)
                mask = torch.zeros(1, 1, rows, cached + rows, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
                want = sdpa(q, _repeat_kv(k, heads // kv_heads), _repeat_kv(v, heads // kv_heads), attn_mask=mask)
                if not torch.equal(sdpa(q, k, v, attn_mask=mask, enable_gqa=True), want):
                    break
            else:
                ok.add(dtype)
        except (RuntimeError, TypeError):  # a PyTorch whose SDPA takes no enable_gqa, or not with a mask
            pass
    return frozenset(ok)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key or value heads [B, Hkv, S, D] repeated to the query heads (transformers' ``repeat_kv``)."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin`` is ``x.roll(half, -1) *
    _signed_sin(sin)`` bit for bit (x's halves swapped, the sign moved from x's element to sin's;
    a product's rounding does not depend on which factor carries the sign), one op per layer
    instead of four, the negation once per forward. Even widths only, as rotary heads are."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class LeanForward:
    """Call as the model is called (keyword arguments); returns an object with ``logits``,
    ``hidden_states`` (a tuple when asked, else None) and ``cache``. ``fuse``: fuse fp16-weights
    GEMMs (changes the model's modules in place, see the module docstring)."""

    def __init__(self, model: torch.nn.Module, fuse: bool = True, script: bool = True):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import create_causal_mask
        from transformers.modeling_utils import slice_logits_to_keep

        cls = type(model).__name__
        if cls not in SUPPORTED:
            raise Unsupported(f"{cls} is not a model the lean forward knows (Llama, Qwen2)")
        layer_cls, attn_cls = SUPPORTED[cls]
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            raise Unsupported("global module hooks are set")
        if model.training:
            raise Unsupported("the model is in training mode (dropout)")
        base = model.model
        config = base.config
        if getattr(config, "tie_last_hidden_states", None) is False:
            raise Unsupported("config.tie_last_hidden_states is False (the last hidden state before the norm)")
        impl = getattr(config, "_attn_implementation", None)
        if impl != "sdpa":
            raise Unsupported(f"attention implementation {impl!r} (the lean forward runs SDPA)")
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise Unsupported(f"layer kinds {sorted(kinds)} (the lean forward runs full attention only)")
        if len(base.layers) != config.num_hidden_layers:
            raise Unsupported("the model's layers do not match its config")
        for m in (model, base):
            _plain(m)
        for m in (base.embed_tokens, base.rotary_emb, base.norm, model.lm_head):
            _plain(m)
        for layer in base.layers:
            if type(layer).__name__ != layer_cls or type(layer.self_attn).__name__ != attn_cls:
                raise Unsupported(f"layer {type(layer).__name__} / {type(layer.self_attn).__name__}")
            attn, mlp = layer.self_attn, layer.mlp
            for m in (layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm, attn.q_proj,
                      attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                _plain(m)
            if isinstance(mlp.act_fn, torch.nn.Module):
                _plain(mlp.act_fn)
        self.fused = fuse and fuse_fp16(model)  # last: a model the lean forward refuses stays as it was
        self.model = model
        # after fusing: the hook tables of the modules a forward runs (registering a hook adds to
        # its module's table, so these are read at each call: about 10 us for the demo target)
        self._hook_tables = [t for m in model.modules() for t in (m._forward_hooks, m._forward_pre_hooks)]
        self.config = config
        self._mask = create_causal_mask
        self._slice = slice_logits_to_keep
        self._attention = sdpa_attention_forward
        self._embed = _plain(base.embed_tokens)
        self._rotary = _plain(base.rotary_emb)
        self._norm = _norm(base.norm)
        self._inline_attention = _sdpa_inline()
        self._head = _linear(model.lm_head)
        on_cpu = next(model.parameters()).device.type == "cpu"
        mask_gqa = mask_gqa_dtypes(config.num_attention_heads, config.num_key_value_heads,
                                   base.layers[0].self_attn.head_dim) if on_cpu and base.layers else frozenset()
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            act = mlp.act_fn
            fused_qkv = getattr(attn.q_proj, "whole", None)
            fused_gu = getattr(mlp.gate_proj, "whole", None)
            self.layers.append(SimpleNamespace(
                idx=attn.layer_idx, attn=attn, head_dim=attn.head_dim, scaling=attn.scaling,
                heads=config.num_attention_heads, qk_heads=config.num_attention_heads + config.num_key_value_heads,
                inter=mlp.gate_proj.out_features,
                groups=attn.num_key_value_groups, causal=getattr(attn, "is_causal", True), mask_gqa=mask_gqa,
                in_norm=_norm(layer.input_layernorm), post_norm=_norm(layer.post_attention_layernorm),
                qkv=None if fused_qkv is None else _linear(fused_qkv),
                q=_linear(attn.q_proj), k=_linear(attn.k_proj), v=_linear(attn.v_proj), o=_linear(attn.o_proj),
                gate_up=None if fused_gu is None else _linear(fused_gu),
                gate=_linear(mlp.gate_proj), up=_linear(mlp.up_proj), down=_linear(mlp.down_proj),
                act=_plain(act) if isinstance(act, torch.nn.Module) else act))
        self.wide_layers, self.wide_reason = None, "off (a target's engine turns it on)"
        self.wide_rows = 0  # the chunk length from which a prefill goes wide (0: none does)
        self.row_exact_rows = 0  # a target's engine turns it on (enable_row_exact)
        self.scripted, self.script_reason = None, "off"
        if script:
            from common.lean_script import script_layers

            self.scripted, self.script_reason = script_layers(self, base)

    def enable_wide_prefill(self) -> bool:
        """Prefill chunks of ``wide_rows`` or more go wide from now on, where the model and the
        CPU allow (``common.fp16_weights``, "Wide prefill"); returns whether they do, the reason
        in ``wide_reason``. A target's engine asks for it, and prefills each wide chunk alone. A
        draft daemon does not (its prefill runs while the target's does, and a seeded sampled
        session's draws follow its forwards' rounding, which would then depend on the feeds
        batched beside it)."""
        self.wide_layers, self.wide_reason = self._wide_layers()
        return self.wide_layers is not None

    def _wide_layers(self) -> tuple[list | None, str]:
        """The layers as a wide prefill runs them: each fp16-weights GEMM on its checkpoint
        source in bfloat16, the rest as they are; or None and why not."""
        from common.fp16_weights import Fp16Linear, wide_linear, wide_prefill_available, wide_rows_for
        from common.memory import weight_file_ranges

        ok, why = wide_prefill_available()
        if not ok:
            return None, why
        wide, weights = [], []
        for L, layer in zip(self.layers, self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            mods = {"o": attn.o_proj, "down": mlp.down_proj}
            if L.qkv is not None:
                mods["qkv"] = attn.q_proj.whole
            else:
                mods.update(q=attn.q_proj, k=attn.k_proj, v=attn.v_proj)
            if L.gate_up is not None:
                mods["gate_up"] = mlp.gate_proj.whole
            else:
                mods.update(gate=mlp.gate_proj, up=mlp.up_proj)
            if any(type(m) is not Fp16Linear or m.source is None for m in mods.values()):
                return None, "the layers are not fp16-weights read from a mapped checkpoint"
            W = SimpleNamespace(**vars(L))
            for name, m in mods.items():
                setattr(W, name, functools.partial(wide_linear, m.source))
                weights += [w for w, _ in m.source]
            wide.append(W)
        self._wide_weights, self._wide_ranges = weights, weight_file_ranges()
        self.wide_rows = wide_rows_for(weights)
        log.info("prefill chunks of %d or more tokens multiply the checkpoint's weights in bfloat16 (%s)",
                 self.wide_rows, why)
        return wide, why

    def enable_row_exact(self) -> int:
        """Verifications of one sequence run row by row from now on, up to the rows
        ``row_exact_rows`` finds exact (0: not this model, device or kernel); returns them. A
        target's engine asks for it: a draft gains nothing by it."""
        self.row_exact_rows = row_exact_rows(self) if self._inline_attention else 0
        if self.row_exact_rows:
            log.info("bfloat16 verifications of up to %d rows give each row a one-row step's bits", self.row_exact_rows)
        return self.row_exact_rows

    def _pre(self, L, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rolled: bool = True):
        """A layer up to its cache: the input norm, q/k/v and the rotary embedding (``sin``
        signed when ``rolled``); returns the queries, keys and values."""
        shape = x.shape[:-1]
        h = L.in_norm(x)
        if L.qkv is not None:
            y = L.qkv(h).view(*shape, -1, L.head_dim).transpose(1, 2)
            qk, v = y[:, : L.qk_heads], y[:, L.qk_heads:]
        else:
            qk = torch.cat((L.q(h), L.k(h)), dim=-1).view(*shape, -1, L.head_dim).transpose(1, 2)
            v = L.v(h).view(*shape, -1, L.head_dim).transpose(1, 2)
        # queries and keys rotated together: the same elementwise products and sums, once
        qk = (qk * cos) + ((qk.roll(sin.shape[-1] // 2, -1) if rolled else _rotate_half(qk)) * sin)
        return qk[:, : L.heads], qk[:, L.heads:], v

    def _post(self, L, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None, row_keys: list | None = None) -> torch.Tensor:
        """A layer from its cache's keys and values on: attention (with ``row_keys``: each query
        row as a one-row step computes it, ``_attend_by_row``), the output projection, the
        residual, the MLP and its residual; returns the layer's output."""
        shape = x.shape[:-1]
        by_row = row_keys is not None
        if by_row:
            a = self._attend_by_row(L, q, k, v, row_keys)
        elif self._inline_attention and L.causal:
            a = self._attend(L, q, k, v, mask)
        else:
            a, _ = self._attention(L.attn, q, k, v, mask, dropout=0.0, scaling=L.scaling)
        x = x + L.o(a.reshape(*shape, -1).contiguous())
        h = L.post_norm(x)
        if L.gate_up is not None:
            gu = L.gate_up(h)
            gate, up = gu[..., : L.inter], gu[..., L.inter:]
        else:
            gate, up = L.gate(h), L.up(h)
        if by_row:  # a transcendental over many rows splits its work where a one-row step does not
            act = torch.cat([L.act(gate[:, r: r + 1]) for r in range(gate.shape[1])], dim=1)
        else:
            act = L.act(gate)
        return x + L.down(act * up)

    @staticmethod
    def _attend(L, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """transformers' ``sdpa_attention_forward`` on CPU and CUDA for a causal module, without
        its per-call environment lookups: the same GQA choice (SDPA's own GQA without a mask,
        query heads packed per key head for one query with a mask, keys repeated otherwise, but
        on a CPU SDPA's own GQA for several queries with a mask too, which gives repeated keys'
        bits without their copies), the same causal flag and the same call."""
        q_len = q.shape[2]
        extra = {}
        if L.groups > 1:
            if mask is None and k.shape[-1] == v.shape[-1] <= 256:
                extra["enable_gqa"] = True
            elif q_len == 1:
                q, mask = _pack_gqa(q, L.groups), _pack_gqa(mask, L.groups)
            elif q.dtype in L.mask_gqa and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
                # transformers repeats the key and value heads here, copying the cache's keys and
                # values in every layer (half the attention's time at 5 rows, 200 cached positions);
                # SDPA's CPU kernel takes the key heads as they are and computes each query head as
                # over repeated keys, bit for bit where ``mask_gqa_dtypes`` found it so at the build
                # (torch 2.13: float32 and bfloat16, 2-100 rows, 1-700 cached positions, head widths
                # 8-128; tests/test_lean.py holds it to transformers' bits)
                extra["enable_gqa"] = True
            else:
                k, v = _repeat_kv(k, L.groups), _repeat_kv(v, L.groups)
        causal = q_len > 1 and mask is None
        if causal and k.shape[2] > q_len:
            k, v = k[:, :, :q_len], v[:, :, :q_len]
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=L.scaling,
                                                             is_causal=causal, **extra)
        return a.reshape(a.shape[0], -1, q_len, v.shape[-1]).transpose(1, 2).contiguous()

    @staticmethod
    def _row_keys(mask: torch.Tensor | None, rows: int, kv_len: int) -> list:
        """For each of a verification's rows, the keys a one-row step would attend to: the
        length of the cache's prefix it sees, or (a tree row off the main line) the positions its
        mask allows, in order. The same for every layer, so found once per forward."""
        base = kv_len - rows
        out: list = []
        for i in range(rows):
            keys = None
            if mask is not None:
                m = mask[0, 0, i]
                keys = (m if m.dtype == torch.bool else m == 0).nonzero().flatten()
                if keys.numel() == base + i + 1 and int(keys[-1]) == base + i:
                    keys = None  # the cache and the rows before: a slice, as for a chain
            out.append(base + i + 1 if keys is None else keys)
        return out

    @staticmethod
    def _attend_by_row(L, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_keys: list) -> torch.Tensor:
        """Attention for a verification's rows (one sequence), each row computed as a one-row
        decoding step computes it: one query, the keys it may see in their order (``_row_keys``),
        no mask. With linear layers that give a row the same bits whatever the row count
        (``row_exact_rows``), the whole forward then gives each row a one-row step's bits."""
        rows = []
        for i, keys in enumerate(row_keys):
            if isinstance(keys, int):
                ki, vi = k[:, :, :keys], v[:, :, :keys]
            else:
                ki, vi = k.index_select(2, keys), v.index_select(2, keys)
            rows.append(LeanForward._attend(L, q[:, :, i: i + 1], ki, vi, None))
        return torch.cat(rows, dim=1)

    def _hooked(self) -> bool:
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return True
        return any(self._hook_tables) and any(_foreign(t) for t in self._hook_tables if t)

    @classmethod
    def build(cls, model: torch.nn.Module, fuse: bool = True) -> tuple["LeanForward | None", str | None]:
        """The lean forward for ``model``, or None and the reason it cannot run it."""
        try:
            return cls(model, fuse), None
        except Unsupported as exc:
            return None, str(exc)

    def __call__(self, input_ids: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, use_cache: bool = True,
                 output_hidden_states: bool = False, logits_to_keep: int = 0) -> SimpleNamespace:
        if cache is None or not use_cache:
            raise ValueError("the lean forward runs with a cache")
        if self._hooked():  # hooks set since the build (a debugger, a fault injected): they must run
            return self.model(input_ids=input_ids, cache=cache, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=True, output_hidden_states=output_hidden_states,
                              logits_to_keep=logits_to_keep)
        x = self._embed(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(x.shape[1], device=x.device) + cache.get_seq_length()).unsqueeze(0)
        mask = self._mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                          position_ids=position_ids)
        cos, sin = self._rotary(x, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rolled = sin.shape[-1] % 2 == 0
        if rolled:
            sin = _signed_sin(sin)
        hidden = [] if output_hidden_states else None
        # a prefill chunk (no logits but the last) of wide_rows or more: its GEMMs in bfloat16 on the
        # checkpoint's weights (a target's engine prefills such a chunk alone: its rounding then
        # follows the prompt alone)
        wide = self.wide_layers is not None and logits_to_keep != 0 and x.shape[1] >= self.wide_rows
        if self.scripted is not None and x.dtype == torch.float32 and not wide:
            # adjacent pool rows (a batched verification): the cache write inside the scripted call too
            span = cache.adjacent_rows() if hasattr(cache, "adjacent_rows") else None
            with torch.jit.optimized_execution(False):  # the scripted ops as written (common.lean_script)
                for L, S in zip(self.layers, self.scripted):
                    if hidden is not None:
                        hidden.append(x)
                    if span is not None:
                        keys, values, flat = cache.flat(L.idx, x.device)
                        x = S.pool_step(x, cos, sin, mask, keys, values, flat, span[0], span[1], cache.kv_len)
                        continue
                    q, k, v = S.pre(x, cos, sin)
                    k, v = cache.update(k, v, L.idx)
                    x = S.post(x, q, k, v, mask)
        else:
            # a verification (every row's logits read) of one sequence, within the rows whose bits
            # the linear layers keep whatever their count: each row as a one-row step computes it
            by_row = logits_to_keep == 0 and x.shape[0] == 1 and 1 < x.shape[1] <= self.row_exact_rows
            row_keys = None
            try:
                if wide:  # the whole checkpoint mapped up front: resident until wide_done, as it was
                    wide_begin(self._wide_weights, self._wide_ranges)
                for L in self.wide_layers if wide else self.layers:
                    if hidden is not None:
                        hidden.append(x)
                    q, k, v = self._pre(L, x, cos, sin, rolled)
                    k, v = cache.update(k, v, L.idx)
                    if by_row and row_keys is None:
                        row_keys = self._row_keys(mask, x.shape[1], k.shape[2])
                    x = self._post(L, x, q, k, v, mask, row_keys)
            finally:
                if wide:  # its scratch and the pages it read given back, even after a failure
                    wide_done(self._wide_weights, self._wide_ranges)
        x = self._norm(x)
        if hidden is not None:
            hidden.append(x)
        logits = self._head(self._slice(x, logits_to_keep).contiguous())
        return SimpleNamespace(logits=logits, hidden_states=tuple(hidden) if hidden is not None else None,
                               cache=cache)


ROW_EXACT_MAX = 25  # the most rows a verification runs row-exact: a 24-token tree and its root


def row_exact_rows(lean: "LeanForward") -> int:
    """The most rows (0: none) a bfloat16 verification runs with each row's bits a one-row
    step's: where the model computes in bfloat16 on a CPU with packed linear layers
    (``common.bf16_packed``), every row count from 2 up to ROW_EXACT_MAX at which each linear of
    the first layer, and the output layer, give every row of a forward the bits that row gets
    alone (oneDNN's packed kernel does up to 27 rows on a Qwen2.5-1.5B's shapes: its down
    projection changes its blocking beyond). Attention then runs row by row (``_attend_by_row``)."""
    from common.bf16_packed import Bf16Linear

    model = lean.model
    if not any(type(m) is Bf16Linear for m in model.modules()):
        return 0
    head = model.get_output_embeddings()
    linears = [m for m in model.model.layers[0].modules() if isinstance(m, (torch.nn.Linear, Bf16Linear))]
    linears.append(getattr(head, "inner", head))  # a cut draft head's own layer
    gen = torch.Generator().manual_seed(0)
    best = ROW_EXACT_MAX
    with torch.inference_mode():
        for m in linears:
            x = torch.randn(best, m.in_features, generator=gen).to(torch.bfloat16)
            alone = torch.cat([m(x[r: r + 1]) for r in range(best)])
            for rows in range(2, best + 1):
                if not torch.equal(m(x[:rows]), alone[:rows]):
                    log.info("bfloat16 verifications run row-exact up to %d rows (a linear's rows differ at %d)",
                             rows - 1, rows)
                    best = rows - 1
                    break
    return best if best > 1 else 0


def fuse_fp16(model: torch.nn.Module) -> bool:
    """Fuse each layer's q/k/v and gate/up fp16-weights GEMMs into one each (see the module
    docstring), in place; False (nothing changed) where the layers are not fp16-weights or the
    fused GEMM's output differs in any bit from the separate ones on the model's shapes."""
    from common.fp16_weights import Fp16Linear, Fp16Part, in_order
    from common.memory import give_back_freed_memory

    layers = model.model.layers
    groups = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups.append([(attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))])
    if not all(type(getattr(owner, n)) is Fp16Linear for g in groups for owner, names in g for n in names):
        return False
    gen = torch.Generator().manual_seed(0)
    checked = {}  # the first layer's fused GEMMs, checked, then used
    for owner, names in groups[0]:  # every layer has the first's shapes
        linears = [getattr(owner, n) for n in names]
        whole = checked[id(owner)] = Fp16Linear.fuse(linears)
        for rows in FUSE_CHECK_ROWS:
            x = torch.randn(rows, linears[0].in_features, generator=gen)
            with torch.inference_mode():
                apart = torch.cat([lin(x) for lin in linears], dim=-1)
                together = whole(x)
            if not torch.equal(apart, together):
                log.info("fused GEMMs differ from separate ones at %d rows: layers stay apart", rows)
                return False
    def fused(job):  # on a packing thread
        owner, names = job
        whole = checked.get(id(owner))
        return whole if whole is not None else Fp16Linear.fuse([getattr(owner, n) for n in names])

    jobs = [(owner, names) for g in groups for owner, names in g]
    for (owner, names), whole in in_order(fused, jobs):  # a few at a time, replaced in order
        start = 0
        for n in names:
            stop = start + getattr(owner, n).out_features
            setattr(owner, n, Fp16Part(whole, start, stop))
            start = stop
        del whole
        give_back_freed_memory()  # the separate weights, before more fused copies are made
    return True
