"""Incremental detokenization for streaming, with stop sequences.

Text is decoded from all tokens so far and released in pieces: a piece never ends inside a
multi-byte character (a trailing U+FFFD means the bytes are incomplete) and never shows text
that could still turn out to be the start of a stop sequence. Once a stop sequence appears,
the text ends right before it.
"""

from __future__ import annotations

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_sequences: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_sequences = stop_sequences
        self._holdback = max((len(s) for s in stop_sequences), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # everything released so far
        self.stopped = False

    def add(self, token_id: int) -> str:
        """The new text this token releases (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        full = self.tokenizer.decode(self.token_ids)
        stop = _first_stop(full, self.stop_sequences)
        if stop is not None:
            self.stopped = True
            return self._release(full[:stop])
        if full.endswith("\ufffd"):
            return ""
        return self._release(full[: max(len(self.text), len(full) - self._holdback)])

    def finish(self) -> str:
        """Whatever was held back, at the end of generation."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.token_ids))

    def _release(self, upto: str) -> str:
        piece = upto[len(self.text) :]
        self.text = upto if len(upto) > len(self.text) else self.text
        return piece


def _first_stop(text: str, stop_sequences: tuple[str, ...]) -> int | None:
    starts = [text.find(s) for s in stop_sequences if s in text]
    return min(starts) if starts else None
