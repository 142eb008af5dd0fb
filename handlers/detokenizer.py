"""Incremental detokenization for streaming, with stop sequences.

Each token costs a decode of a few tokens, not of the whole text (which made a stream
quadratic in its length): as in TGI and vLLM, `tokens[prefix_offset:]` is decoded and the text
of `tokens[prefix_offset:read_offset]` (already released) is cut off its front. The window
starts a token back, so a decoder that treats a sequence's first token specially (a
sentencepiece leading space) sees the same context as in a full decode. The offsets only move
when the window's text ends on a whole character: a trailing U+FFFD means its bytes are
incomplete, and bytes decode the same once the decoder is back at a character boundary. So,
for byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2), the pieces add up to exactly the full
decode.

A piece never shows text that could still turn out to be the start of a stop sequence (the
last `max(len(stop)) - 1` characters are held back). Once a stop sequence appears, the text
ends right before it.
"""

from __future__ import annotations

from .outputs import find_stop
from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_sequences: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_sequences = stop_sequences
        self._holdback = max((len(s) for s in stop_sequences), default=1) - 1
        self.token_ids: list[int] = []
        self._released: list[str] = []  # pieces handed out so far
        # Decoded text not released yet: the held-back tail (no stop sequence in it).
        self._pending = ""
        self._prefix_offset = 0  # the window starts here ...
        self._read_offset = 0  # ... and its text up to here is in _released + _pending
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)

    def add(self, token_id: int) -> str:
        """The new text this token releases (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        new_text, complete = self._decode_window()
        # Stop sequences are looked for even in text that ends inside a character.
        candidate = self._pending + new_text
        stop = find_stop(candidate, self.stop_sequences)
        if stop is not None:
            self.stopped = True
            self._pending = ""
            return self._release(candidate[: stop[0]])
        if not complete:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        keep = max(0, len(candidate) - self._holdback)
        self._pending = candidate[keep:]
        return self._release(candidate[:keep])

    def finish(self) -> str:
        """Whatever was held back, at the end of generation."""
        if self.stopped:
            return ""
        new_text, _ = self._decode_window()
        rest = self._pending + new_text
        self._pending = ""
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return self._release(rest)

    def _decode_window(self) -> tuple[str, bool]:
        """(the text the tokens after read_offset add, whether it is some and ends on a whole
        character)."""
        window = self.token_ids[self._prefix_offset :]
        known = self._read_offset - self._prefix_offset
        prefix_text = self.tokenizer.decode(window[:known]) if known else ""
        new_text = self.tokenizer.decode(window)[len(prefix_text) :]
        # A token with no text of its own (a skipped special token) does not move the window
        # either: the next token then still decodes with real text before it.
        return new_text, bool(new_text) and not new_text.endswith("\ufffd")

    def _release(self, piece: str) -> str:
        if piece:
            self._released.append(piece)
        return piece
