"""Write a tiny llama-architecture GGUF (SmolLM2-shaped: GPT-2 byte-level BPE tokenizer, ChatML
chat template, tied embeddings, a Q8_0 embedding and one Q4_1 tensor) for converter tests.

    ref = write_tiny_llama_gguf(tmp_path / "tiny.gguf", seed=0)

``ref`` maps Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight`` ...) to the
float32 tensors a correct GGUF loader must produce: the values exactly as stored (after any
quantisation round trip) with llama.cpp's Q/K row permutation undone.  ``lm_head.weight`` is not
in it: the file has no ``output.weight``, so the head is tied to ``model.embed_tokens.weight``.

Only needs ``numpy``, ``torch`` and ``gguf`` (``GGUFWriter`` + ``gguf.quants``).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from starsd_draftd.demo.byte_tokenizer import bytes_to_unicode  # GPT-2's byte table, as the tokenizers library uses it

# ---- shape ---------------------------------------------------------------------------------
HIDDEN = 32
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 8
INTERMEDIATE = 64
CONTEXT = 128
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
NUM_MERGES = 120

# ---- tokenizer -----------------------------------------------------------------------------
# SmolLM2 layout: the control tokens first, <|endoftext|> = 0 (also unk), <|im_start|> = 1 (bos),
# <|im_end|> = 2 (eos and pad).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 1, 2, 0, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# what the BPE merges are learned from (deterministically, see _train_bpe)
CORPUS = (
    "the quick brown fox jumps over the lazy dog. the dog sleeps; the fox runs. "
    "hello world, hello there! what is the capital of france? paris is the capital of france. "
    "def main():\n    return 0\n\nimport os\nimport sys\nfor i in range(10):\n    print(i)\n"
    "you are a helpful assistant. the user asks and the assistant answers. "
) * 3
# GPT-2's pre-tokenizer split (what GPT2Tokenizer uses when tokenizer.ggml.pre has no override)
_GPT2_SPLIT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def _train_bpe(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    """A minimal, deterministic byte-level BPE trainer (most frequent pair, ties broken by the
    pair itself)."""
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in _GPT2_SPLIT.findall(corpus))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) in llama.cpp's gpt2 layout."""
    from gguf import TokenType

    merges = _train_bpe(CORPUS, NUM_MERGES)
    tokens = SPECIAL_TOKENS + list(bytes_to_unicode().values()) + [a + b for a, b in merges]
    assert len(set(tokens)) == len(tokens), "merged tokens must be unique"
    types = [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS) + [int(TokenType.NORMAL)] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, [f"{a} {b}" for a, b in merges]


# ---- weights -------------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` for attn_q / attn_k rows (n_head is
    the kv head count for attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse, as transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does it."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_plan() -> list[tuple[str, str, tuple[int, ...], str, int | None]]:
    """(gguf name, hf name, hf shape, storage, permute heads)."""
    plan = [("token_embd.weight", "model.embed_tokens.weight", (None, HIDDEN), "Q8_0", None)]
    for i in range(LAYERS):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        # layer 0 in f32 (one Q4_1 tensor, like the real file's), layer 1 in f16
        lin = "F32" if i == 0 else "F16"
        plan += [
            (g + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,), "F32", None),
            (g + "attn_q.weight", h + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), lin, HEADS),
            (g + "attn_k.weight", h + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), lin, KV_HEADS),
            (g + "attn_v.weight", h + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), lin, None),
            (g + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), lin, None),
            (g + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,), "F32", None),
            (g + "ffn_gate.weight", h + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN), lin, None),
            (g + "ffn_up.weight", h + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN), lin, None),
            (g + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE), "Q4_1" if i == 0 else lin, None),
        ]
    plan.append(("output_norm.weight", "model.norm.weight", (HIDDEN,), "F32", None))
    return plan


def write_tiny_llama_gguf(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the tiny GGUF to ``path``; return the reference HF-named float32 weights."""
    import gguf
    from gguf.quants import dequantize, quantize

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = build_vocab()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(str(path), arch="llama")  # writes general.architecture = "llama"
    # NB: general.name must not contain "mistral" (transformers then switches to the mistral arch)
    w.add_name("tiny-llama-test")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)  # -> config.head_dim
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")  # what the real file says; transformers keeps GPT-2's split for it
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)

    ref: dict[str, torch.Tensor] = {}
    for gname, hname, shape, storage, n_perm in _tensor_plan():
        shape = tuple(vocab if s is None else s for s in shape)
        if len(shape) == 1:  # rms norm weights around 1
            hf = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = 1.0 if gname == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
            hf = (scale * rng.standard_normal(shape)).astype(np.float32)
        stored = llama_cpp_permute(hf, n_perm) if n_perm else hf
        if storage == "F32":
            w.add_tensor(gname, stored)
            back = stored
        elif storage == "F16":
            data = stored.astype(np.float16)
            w.add_tensor(gname, data)
            back = data.astype(np.float32)
        else:
            qtype = gguf.GGMLQuantizationType[storage]
            data = quantize(stored, qtype)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
            back = dequantize(data, qtype).astype(np.float32).reshape(stored.shape)
        if n_perm:
            back = llama_cpp_unpermute(back, n_perm)
        ref[hname] = torch.from_numpy(np.ascontiguousarray(back))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ggtest/tiny.gguf")
    r = write_tiny_llama_gguf(out)
    print(out, out.stat().st_size, "bytes;", len(r), "tensors")
