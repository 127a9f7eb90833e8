"""Byte-level tokenizer used by the built-in demo models.

Every UTF-8 string maps to the sequence of its bytes, so any text round-trips
exactly and nothing has to be downloaded.  Layout of the vocabulary:

* ``<pad>`` = 0, ``<s>`` = 1 (bos), ``</s>`` = 2 (eos)
* byte ``b`` (0..255) = ``3 + b``

Encoding never adds special tokens (``add_special_tokens=True`` is a no-op),
and the literal strings ``"<s>"``, ``"</s>"`` and ``"<pad>"`` inside input
text are encoded as ordinary bytes, not as the special ids.  Decoding an
incomplete UTF-8 sequence yields U+FFFD instead of raising.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from common.token_bytes import bytes_to_unicode

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = BYTE_OFFSET + 256

__all__ = [
    "bytes_to_unicode",
    "BOS_ID",
    "BOS_TOKEN",
    "BYTE_OFFSET",
    "BYTE_VOCAB_SIZE",
    "EOS_ID",
    "EOS_TOKEN",
    "PAD_ID",
    "PAD_TOKEN",
    "byte_to_id",
    "make_byte_tokenizer",
]


def byte_to_id(b: int) -> int:
    """Token id of the raw byte ``b`` (0..255)."""
    if not 0 <= b < 256:
        raise ValueError(f"byte out of range: {b}")
    return BYTE_OFFSET + b


def _build_backend() -> Tokenizer:
    mapping = bytes_to_unicode()
    vocab = {PAD_TOKEN: PAD_ID, BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    for b in range(256):
        vocab[mapping[b]] = byte_to_id(b)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)]
    )
    backend.encode_special_tokens = True
    if backend.get_vocab_size(with_added_tokens=True) != BYTE_VOCAB_SIZE:
        raise RuntimeError("byte tokenizer vocabulary has an unexpected size")
    return backend


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer (vocab size 259, no bos/eos added on encode).

    The returned object can be saved with ``save_pretrained(dir)`` and loaded
    back with ``transformers.AutoTokenizer.from_pretrained(dir)``. It carries a plain-text chat
    template, so chat requests work with models that use it.
    """
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_build_backend(),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
        padding_side="right",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# Role-tagged turns in plain text (the tokenizer is byte-level, so the tags are ordinary bytes).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
