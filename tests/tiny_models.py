"""Tiny random-init checkpoints for tests, written with save_pretrained and loaded by the real code.

Weights get a large init scale so logits are sharp: greedy argmax then never sits on a
near-tie that the chunked verification forward and token-by-token generate could break
differently."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from starsd_draftd.demo.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, make_byte_tokenizer


def _config(arch: str, hidden: int, layers: int, init_std: float, context: int = 512, tied: bool = False):
    common = dict(vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  initializer_range=init_std)
    if arch == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                           tie_word_embeddings=tied, **common), LlamaForCausalLM
    if arch == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                           tie_word_embeddings=tied, **common), Qwen2ForCausalLM
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=context, **common), GPT2LMHeadModel
    raise ValueError(arch)


def make_tiny_checkpoint(out: Path, arch: str = "llama", seed: int = 0, hidden: int = 32, layers: int = 2,
                         init_std: float = 0.3, context: int = 512, tied: bool = False) -> Path:
    """``context``: the model's max_position_embeddings, which bounds prompt plus max_tokens;
    ``tied``: the output layer is the embedding table (Llama and Qwen2), as in most small models."""
    cfg, cls = _config(arch, hidden, layers, init_std, context, tied)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(4.0)  # sharp logits: top-2 margins far above float rounding
        # EOS would otherwise end random-weight generations after a few tokens; keep it possible but rare
        head[EOS_ID].zero_()
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    make_byte_tokenizer().save_pretrained(out)
    return out


def reference_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target model's own generate(), the ground truth for greedy speculation."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return out[0, len(prompt_ids):].tolist()


def make_near_copy(src: Path, out: Path, noise: float, seed: int = 0) -> Path:
    """A draft that mostly agrees with ``src``: its weights plus Gaussian noise."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp(min=1e-3))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    make_byte_tokenizer().save_pretrained(out)
    return out


def make_eagle3_head(target_dir: Path, out: Path, draft_vocab: int = 200, seed: int = 0, hidden: int | None = None,
                     heads: int = 4, kv_heads: int = 2, layer_ids: list[int] | None = None, scale: float = 0.3,
                     own_embedding: bool = False, rope_theta: float = 10000.0) -> Path:
    """A random-init EAGLE-3 head for the checkpoint in ``target_dir``, written tensor by tensor
    in the published layout (``config.json`` + ``model.safetensors``), not by StarSD's own
    saver: ``fc.weight`` [H, 3 H_target], ``midlayer.*`` with 2H-wide q/k/v, ``norm``,
    ``lm_head`` over ``draft_vocab`` tokens, and ``d2t``/``t2d`` for a draft vocabulary of
    shuffled target ids (so that d2t is non-zero almost everywhere). ``scale`` sets how sharp its
    logits are."""
    import json

    from safetensors.torch import save_file

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    th, vocab, n_layers = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"]
    h = hidden or th
    hd = h // heads
    k = len(layer_ids) if layer_ids is not None else 3
    g = torch.Generator().manual_seed(seed)

    def w(*shape, s=scale):
        return (torch.randn(*shape, generator=g) * s).contiguous()

    ids = (1 + torch.randperm(vocab - 1, generator=g)[:draft_vocab]).sort().values  # from 1: d2t > 0 everywhere
    d2t = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state = {
        "fc.weight": w(h, k * th, s=scale / 2),
        "midlayer.input_layernorm.weight": 1 + w(h, s=0.1),
        "midlayer.hidden_norm.weight": 1 + w(h, s=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(h, s=0.1),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(2 * h, h),
        "midlayer.mlp.up_proj.weight": w(2 * h, h),
        "midlayer.mlp.down_proj.weight": w(h, 2 * h),
        "norm.weight": 1 + w(h, s=0.1),
        "lm_head.weight": w(draft_vocab, h, s=4 * scale),
        "d2t": d2t,
        "t2d": t2d,
    }
    if own_embedding:
        state["embed_tokens.weight"] = w(vocab, h, s=1.0)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": 2 * h, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "max_position_embeddings": 2048, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float32", "target_num_layers_for_test": n_layers}
    if hidden is not None and hidden != th:
        cfg["target_hidden_size"] = th
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(out / "model.safetensors"))
    return out


def mapped_resident_kib(path: Path) -> int:
    """KiB of this process's mappings of the file ``path`` that are resident (Linux's smaps)."""
    total, mine = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            mine = line.rstrip().endswith(str(path))
        elif mine and head[0] == "Rss:":
            total += int(head[1])
    return total
