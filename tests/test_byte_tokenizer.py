import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import transformers

from starsd_draftd.demo.byte_tokenizer import (
    BOS_ID,
    BYTE_VOCAB_SIZE,
    EOS_ID,
    PAD_ID,
    byte_to_id,
    make_byte_tokenizer,
)

SAMPLES = [
    "",
    "a",
    "hello world",
    "  leading spaces and trailing  ",
    " x",
    "tabs\tand\nnewlines\r\n\n",
    "déjà vu — naïve café",
    "emoji 😀👍🏽 and CJK 中文字符",
    "def f(x):\n    return x ** 2  # comment\n",
    "\x00\x01\x7f control chars",
    "literal <s> and </s> and <pad> markers",
]


@pytest.fixture(scope="module")
def tok():
    return make_byte_tokenizer()


def test_constants():
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert BYTE_VOCAB_SIZE == 259


def test_special_ids_and_vocab(tok):
    assert len(tok) == BYTE_VOCAB_SIZE
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.bos_token == "<s>" and tok.bos_token_id == 1
    assert tok.eos_token == "</s>" and tok.eos_token_id == 2
    assert sorted(tok.get_vocab().values()) == list(range(BYTE_VOCAB_SIZE))


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip_and_ids_are_bytes(tok, text):
    expected = [b + 3 for b in text.encode("utf-8")]
    assert tok.encode(text, add_special_tokens=False) == expected
    # add_special_tokens must not add bos/eos either.
    assert tok.encode(text) == expected
    assert tok.decode(expected) == text
    assert tok(text)["input_ids"] == expected


def test_fixed_byte_ids(tok):
    assert tok.encode("A", add_special_tokens=False) == [ord("A") + 3]
    assert tok.encode(" ", add_special_tokens=False) == [35]
    assert tok.encode("\n", add_special_tokens=False) == [13]
    assert tok.encode("é", add_special_tokens=False) == [0xC3 + 3, 0xA9 + 3]
    assert byte_to_id(0) == 3 and byte_to_id(255) == 258
    with pytest.raises(ValueError):
        byte_to_id(256)


def test_all_single_bytes_map_to_distinct_ids(tok):
    vocab = tok.get_vocab()
    byte_ids = {i for t, i in vocab.items() if t not in ("<pad>", "<s>", "</s>")}
    assert byte_ids == set(range(3, 259))


def test_special_token_decode(tok):
    ids = [BOS_ID] + tok.encode("hi", add_special_tokens=False) + [EOS_ID]
    assert tok.decode(ids) == "<s>hi</s>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_partial_utf8_does_not_crash(tok):
    full = tok.encode("😀", add_special_tokens=False)
    assert len(full) == 4
    for cut in range(1, 4):
        out = tok.decode(full[:cut])
        assert isinstance(out, str)
        assert "\ufffd" in out
    assert tok.decode(full) == "😀"


def test_batch_padding(tok):
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0] == [100, 101, PAD_ID, PAD_ID]
    assert batch["attention_mask"][0] == [1, 1, 0, 0]


def test_save_and_autotokenizer_reload(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(loaded) == BYTE_VOCAB_SIZE
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.encode(text) == ids
        assert loaded.decode(ids) == text
    assert loaded.decode([BOS_ID, 3 + ord("x"), EOS_ID], skip_special_tokens=True) == "x"
