"""The bytes a token stands for, whatever the tokenizer: what a token's log-probability entry
reports, since one token's text alone may be part of a character (byte-level vocabularies)."""

from __future__ import annotations

import re

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte-fallback pieces


def bytes_to_unicode() -> dict[int, str]:
    """Reversible map from each byte to a printable unicode character.

    This is the standard byte-level mapping that the ``ByteLevel``
    pre-tokenizer and decoder of the ``tokenizers`` library use internally.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes of one token: its text in UTF-8 when it decodes to whole characters (with its
    leading space where a SentencePiece piece marks one, as the token carries it in a text); else the
    raw bytes of a byte-level piece (GPT-2-style vocabularies) or of a SentencePiece byte
    fallback (``<0xNN>``); else its text with replacement characters, in UTF-8."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if "\ufffd" not in text:
        if isinstance(piece, str) and piece.startswith("\u2581"):
            # SentencePiece's word-start marker: decoding one token alone drops its space, which
            # the token carries within a text (OpenAI's token strings concatenate to the text)
            return piece.replace("\u2581", " ").encode("utf-8")
        return text.encode("utf-8")
    if isinstance(piece, str) and piece:
        m = _SP_BYTE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
    return text.encode("utf-8")
