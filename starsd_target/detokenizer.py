"""One generation's output text, decoded incrementally, with its stop strings checked on the tail.

Decoding the whole output after every round (to stream it, or to look for a stop string) costs
time quadratic in its length. ``IncrementalText`` decodes a short window per new token instead, as
vLLM's incremental detokenizer and transformers' ``TextStreamer`` do: the tokens whose text is not
final yet, after the last final ones as context (so that a tokenizer whose decoding of a token
depends on its neighbour, as SentencePiece's leading space does, decodes the same as the whole).
Text ending in an incomplete character (a byte token holding part of a UTF-8 sequence: U+FFFD at
the end of the window's decode) is held back until the character completes.

The text equals a decode of the whole for decoders that render bytes locally: byte-level BPE
(invalid bytes become U+FFFD one maximal invalid run at a time, as Python's decoder does) and
SentencePiece's byte fallback on valid UTF-8. Byte fallback renders a run of byte tokens that
holds any invalid byte as U+FFFD throughout, characters that were complete included; what was
already final then stays as it was (vLLM's detokenizer does the same).
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"
# Tokens held back before a split into final text is forced: a UTF-8 character spans at most 4
# bytes, so a longer run ending in U+FFFD is mostly invalid bytes (which stay U+FFFD), and waiting
# for it to end would make every round decode the whole run again.
MAX_PENDING = 8
# Tokens after a forced split: enough bytes to settle whether the byte before the split starts a
# character they complete (a UTF-8 sequence is at most 4 bytes, so 3 more decide it).
SPLIT_LOOKAHEAD = 3


class IncrementalText:
    """The text of a growing token sequence, equal to ``decode`` of the whole, and where the first
    of ``stop`` occurs in it.

    Each token ``add`` takes costs one decode of a bounded window (the held-back tokens, at most
    ``MAX_PENDING`` and the new one, after the last final chunk as context), whatever the length so
    far; ``decoded`` counts the tokens decoded, the work done. ``text`` is the final text so far
    (no incomplete character at its end: it only ever grows); ``full()`` is that and the text of
    the held-back tokens, U+FFFD for an incomplete character, as a decode of all of them gives it."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self.decode = decode
        self.stop = tuple(stop)
        self._look = max((len(s) for s in self.stop), default=1) - 1  # final characters a stop may start in
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:_read], final
        self.stop_at: int | None = None  # index in full() where the first stop string begins
        self.decoded = 0
        self._prefix = 0  # ids[_prefix:_read]: the context decoded again before the new tokens
        self._read = 0
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self._pending = ""  # the text of ids[_read:] as the last window decoded it (may end incomplete)

    def full(self) -> str:
        """The text of every token added: ``decode(ids)``."""
        return self.text + self._pending

    def add(self, tokens: list[int]) -> int | None:
        """Append ``tokens``. When the text now holds a stop string (it did not before): how many of
        ``tokens`` to keep, the fewest whose text holds it; the rest are not added, ``stop_at``
        says where the stop string begins, and nothing may be added after. Else None."""
        if self.stop_at is not None:
            raise RuntimeError("the text already ended at a stop string")
        for i, token in enumerate(tokens):  # one at a time: a stop string's cut, and text final at once
            self.ids.append(token)
            self._pending = self._window(len(self.ids))
            if self.stop:
                self.stop_at = self._find_stop(self._pending)
                if self.stop_at is not None:
                    return i + 1
            self._settle()
        return None

    def _window(self, end: int) -> str:
        """The text of ids[_read:end], decoded after the context ids[_prefix:_read]."""
        window = self.ids[self._prefix: end]
        self.decoded += len(window)
        return self.decode(window)[len(self._prefix_text):]

    def _find_stop(self, pending: str) -> int | None:
        """Where in ``text + pending`` the earliest stop string begins. The search covers what could
        hold one that was not there before: the pending text and the final characters before it."""
        base = max(0, len(self.text) - self._look)
        tail = self.text[base:] + pending
        found = [i for i in (tail.find(s) for s in self.stop) if i >= 0]
        return base + min(found) if found else None

    def _settle(self) -> None:
        """Make the pending text final when it ends in a complete character. Tokens with no text
        (special ones) stay pending, so the context stays what precedes them. Past ``MAX_PENDING``
        held-back tokens, split off a final part where decoding the two parts apart gives the same
        text as together, ``SPLIT_LOOKAHEAD`` tokens before the end or earlier."""
        if self._pending and not self._pending.endswith(REPLACEMENT):
            self._accept(len(self.ids), self._pending, context=True)
            return
        if len(self.ids) - self._read <= MAX_PENDING:
            return
        for end in range(len(self.ids) - SPLIT_LOOKAHEAD, self._read, -1):
            head = self._window(end)
            rest = self.decode(self.ids[end:])
            self.decoded += len(self.ids) - end
            if head + rest == self._pending:
                self._accept(end, head, context=False)
                self._pending = rest
                return

    def _accept(self, end: int, text: str, context: bool) -> None:
        """ids[_read:end], whose text is ``text``, become final. The next window starts after them
        with them as its context, or (``context`` false, at a split checked to need none) at them."""
        self.text += text
        if context:
            self._prefix, self._prefix_text = self._read, self.decode(self.ids[self._read: end])
            self.decoded += end - self._read
        else:
            self._prefix, self._prefix_text = end, ""
        self._read = end
        if end == len(self.ids):
            self._pending = ""
