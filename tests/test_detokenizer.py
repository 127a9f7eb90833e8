"""Incremental text (starsd_target.detokenizer): equal to decoding the whole sequence, whatever
the tokens and however they arrive; stop strings cut exactly where a search of every prefix's
full decode would; and the tokens decoded per round stay bounded however long the text grows."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from starsd_draftd.demo.byte_tokenizer import BYTE_OFFSET, BYTE_VOCAB_SIZE, make_byte_tokenizer
from starsd_target.detokenizer import MAX_PENDING, IncrementalText

ALPHABET = "ab x_\né中😀👍🏽"  # one to four UTF-8 bytes a character, a grapheme of two code points


@pytest.fixture(scope="module")
def byte_decode():
    tok = make_byte_tokenizer()
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def piece_tokenizer():
    """A SentencePiece-style BPE (as Llama's): "▁" for spaces, a byte token for each byte of a
    character outside the vocabulary, and a decoder that strips the text's leading space, so that a
    token's text depends on what precedes it."""
    pieces = ["▁", *"abcdefhilmnorstx", "th", "▁th", "the", "▁the", "at", "▁c", "▁cat", "▁s", "▁sat", "▁m", "▁mat"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    merges = [("t", "h"), ("▁", "th"), ("th", "e"), ("▁th", "e"), ("a", "t"), ("▁", "c"), ("▁c", "at"),
              ("▁", "s"), ("▁s", "at"), ("▁", "m"), ("▁m", "at")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _rounds(text: IncrementalText, ids: list[int], rng: random.Random, most: int = 6):
    """Add ``ids`` in random batches of 1 to ``most`` (as rounds do) until a stop string ends the
    text; after each: how many of ``ids`` were offered so far, and the tokens that add decoded."""
    i = 0
    while i < len(ids) and text.stop_at is None:
        k = rng.randint(1, most)
        before = text.decoded
        text.add(ids[i: i + k])
        i += k
        yield min(i, len(ids)), text.decoded - before


def _random_ids(rng: random.Random, n: int) -> list[int]:
    """Either any token ids at all (invalid UTF-8, specials, characters split anywhere) or the bytes
    of text made of one- to four-byte characters."""
    if rng.random() < 0.5:
        return [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(n)]
    s = "".join(rng.choice(ALPHABET) for _ in range(n // 2))
    return [BYTE_OFFSET + b for b in s.encode()]


def test_byte_level_text_equals_a_full_decode_at_every_round(byte_decode):
    rng = random.Random(0)
    for _ in range(300):
        ids = _random_ids(rng, rng.randint(0, 200))
        text = IncrementalText(byte_decode)
        for i, _ in _rounds(text, ids, rng):
            whole = byte_decode(ids[:i])
            assert text.full() == whole
            assert whole.startswith(text.text)  # the final part never changes
        assert text.full() == byte_decode(ids) and text.stop_at is None


def test_an_incomplete_character_is_held_back_until_it_completes(byte_decode):
    text = IncrementalText(byte_decode)
    for b in "a😀".encode():
        text.add([BYTE_OFFSET + b])
        assert "\ufffd" not in text.text
    assert text.text == "a😀"
    text.add([BYTE_OFFSET + 0xE4, BYTE_OFFSET + 0xB8])  # the first two bytes of 中
    assert text.text == "a😀" and text.full() == "a😀\ufffd"
    text.add([BYTE_OFFSET + 0xAD])
    assert text.text == "a😀中"


def test_sentencepiece_style_text_equals_a_full_decode(piece_tokenizer):
    tok = piece_tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    byte_ids = set(tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)]))
    rng = random.Random(1)
    words = ["the", "cat", "sat", "mat", "fox", "café", "中文", "😀", "x", " "]
    split_characters = 0
    for _ in range(200):
        s = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(s, add_special_tokens=False)
        assert decode(ids) == s  # the tokenizer round-trips
        split_characters += sum(t in byte_ids for t in ids)
        text = IncrementalText(decode)
        for _ in _rounds(text, ids, rng):
            assert s.startswith(text.text)  # what is final stays: the rest of the text only adds to it
        assert text.full() == s
    assert split_characters > 1000  # 中, 文, é and 😀 are not in the vocabulary: they come as bytes


def _reference_cut(decode, ids: list[int], stop: tuple[str, ...]) -> tuple[int, str] | None:
    """The cut by brute force: the fewest tokens whose full decode holds a stop string, and that
    decode up to the first stop string in it."""
    for i in range(1, len(ids) + 1):
        whole = decode(ids[:i])
        found = [whole.find(s) for s in stop if s in whole]
        if found:
            return i, whole[: min(found)]
    return None


def test_stop_strings_cut_exactly_across_round_boundaries(byte_decode):
    rng = random.Random(2)
    checked = 0
    for _ in range(400):
        ids = _random_ids(rng, rng.randint(1, 120))
        whole = byte_decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if whole and rng.random() < 0.8:  # mostly strings the text holds, often spanning batches
                a = rng.randrange(len(whole))
                stops.append(whole[a: a + rng.randint(1, 6)])
            else:
                stops.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))))
        stops = tuple(s for s in stops if s)
        if not stops:
            continue
        text = IncrementalText(byte_decode, stops)
        kept, i = 0, 0
        while i < len(ids) and text.stop_at is None:
            batch = ids[i: i + rng.randint(1, 6)]
            keep = text.add(batch)
            kept += len(batch) if keep is None else keep
            i += len(batch)
        ref = _reference_cut(byte_decode, ids, stops)
        if ref is None:
            assert text.stop_at is None and text.full() == whole
        else:
            checked += 1
            assert (kept, text.ids, text.full()[: text.stop_at]) == (ref[0], ids[: ref[0]], ref[1])
    assert checked > 200


def test_tokens_decoded_per_round_stay_bounded_as_the_text_grows(byte_decode):
    rng = random.Random(3)
    k = 6  # the most tokens one round adds here (a round adds depth + 1 at most)
    bound = 2 * (MAX_PENDING + k) ** 2 + 3 * (MAX_PENDING + k)  # forced splits of invalid bytes included
    for ids in ([rng.randrange(BYTE_VOCAB_SIZE) for _ in range(4000)],
                [BYTE_OFFSET + b for b in "".join(rng.choice(ALPHABET) for _ in range(2000)).encode()],
                [BYTE_OFFSET + 0x80] * 3000):  # a run of continuation bytes, never a complete character
        text = IncrementalText(byte_decode, ("never in it \x01",))
        costs = [cost for _, cost in _rounds(text, ids, rng, most=k)]
        assert text.full() == byte_decode(ids)
        assert max(costs) <= bound
        assert sum(costs) <= 10 * len(ids)  # linear: a full decode per round would be ~len(ids)**2 / 7
        late = costs[len(costs) // 2:]
        assert max(late) <= bound and sum(late) <= 10 * len(ids) / 2


def test_token_bytes_concatenate_to_the_text_with_sentencepiece_spaces(piece_tokenizer):
    """The bytes a token's log-probability entry reports join into the decoded text: a
    SentencePiece piece keeps the space its marker stands for (decoding it alone drops it), and a
    byte-fallback token is its byte."""
    from common.token_bytes import token_bytes

    ids = piece_tokenizer.encode("x the cat sat on the mat é", add_special_tokens=False)
    joined = b"".join(token_bytes(piece_tokenizer, t) for t in ids)
    assert joined.decode("utf-8") == " " + piece_tokenizer.decode(ids)  # the text's first space is the prompt's
    assert token_bytes(piece_tokenizer, piece_tokenizer.convert_tokens_to_ids("▁cat")) == b" cat"
