"""Tiny random-init checkpoints for tests, written with save_pretrained and loaded by the real code.

Weights get a large init scale so logits are sharp: greedy argmax then never sits on a
near-tie that the chunked verification forward and token-by-token generate could break
differently."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from starsd_draftd.demo.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, make_byte_tokenizer


def _config(arch: str, hidden: int, layers: int, init_std: float, context: int = 512):
    common = dict(vocab_size=BYTE_VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  initializer_range=init_std)
    if arch == "llama":
        return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                           tie_word_embeddings=False, **common), LlamaForCausalLM
    if arch == "qwen2":
        return Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                           tie_word_embeddings=False, **common), Qwen2ForCausalLM
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=context, **common), GPT2LMHeadModel
    raise ValueError(arch)


def make_tiny_checkpoint(out: Path, arch: str = "llama", seed: int = 0, hidden: int = 32, layers: int = 2,
                         init_std: float = 0.3, context: int = 512) -> Path:
    """``context``: the model's max_position_embeddings, which bounds prompt plus max_tokens."""
    cfg, cls = _config(arch, hidden, layers, init_std, context)
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
