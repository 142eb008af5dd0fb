"""The request and output objects DJL Serving hands a model.py's formatters, with the names and
behaviour of DJL's `djl_python.request_io` that formatters use: a `TextGenerationOutput` whose
best `Sequence` collects `Token`s as they are generated (and their `top_tokens` under
`top_n_tokens`), read with `get_next_token()`, the prompt's tokens with their log-probs
(`prompt_tokens_details`, under `decoder_input_details`), and the request's `TextInput`
(`input_text`, `parameters`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Token:
    id: int
    text: str
    log_prob: float | None = None
    special_token: bool | None = None
    error_msg: str | None = None

    def as_dict(self) -> dict[str, Any]:
        output = {"id": self.id, "text": self.text, "log_prob": self.log_prob}
        if self.special_token:
            output["special_token"] = self.special_token
        return output

    def as_tgi_dict(self) -> dict[str, Any]:
        output = {"id": self.id, "text": self.text, "logprob": self.log_prob}
        if self.special_token:
            output["special"] = self.special_token
        return output


@dataclass
class Sequence:
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_log_prob: float = 0.0
    _last_token_index: int | None = None
    _read: int = 0  # tokens get_next_token() has handed out

    def set_next_token(self, token: Token, is_last_token: bool = False) -> None:
        self.tokens.append(token)
        self.cumulative_log_prob += token.log_prob or 0.0
        if is_last_token:
            self._last_token_index = len(self.tokens) - 1

    def has_next_token(self) -> bool:
        return self._read < len(self.tokens)

    def get_next_token(self) -> tuple[Token | None, bool, bool]:
        """(the next token not read yet, whether it is the first, whether it is the last)."""
        if not self.has_next_token():
            return None, False, False
        index = self._read
        self._read += 1
        return self.tokens[index], index == 0, index == self._last_token_index


@dataclass
class TextInput:
    request_id: int | str = 0
    input_text: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    input_ids: list[int] = field(default_factory=list)
    tgi_compat: bool = False

    def prompt_tokens_length(self) -> int:
        return len(self.input_ids)


@dataclass
class TextGenerationOutput:
    request_id: int | str
    input: TextInput
    finished: bool = False
    sequences: dict[int, Sequence] = field(default_factory=lambda: {0: Sequence()})
    best_sequence_index: int = 0
    prompt_tokens_details: list[Token] = field(default_factory=list)

    def set_next_token(
        self,
        token: Token,
        sequence_index: int = 0,
        is_last_token: bool = False,
        finish_reason: str | None = None,
    ) -> None:
        sequence = self.sequences.setdefault(sequence_index, Sequence())
        sequence.set_next_token(token, is_last_token)
        if finish_reason:
            sequence.finish_reason = finish_reason

    def set_next_top_tokens(self, top_tokens: list[Token], sequence_index: int = 0) -> None:
        self.sequences.setdefault(sequence_index, Sequence()).top_tokens.append(top_tokens)

    def get_tokens_as_dict(self, sequence_index: int = 0) -> list[dict[str, Any]]:
        return self._as_dicts(self.sequences[sequence_index].tokens)

    def get_top_tokens_as_dict(self, sequence_index: int = 0) -> list[list[dict[str, Any]]]:
        return [self._as_dicts(top) for top in self.sequences[sequence_index].top_tokens]

    def get_prompt_tokens_as_dict(self) -> list[dict[str, Any]]:
        return self._as_dicts(self.prompt_tokens_details)

    def _as_dicts(self, tokens: list[Token]) -> list[dict[str, Any]]:
        return [t.as_tgi_dict() if self.input.tgi_compat else t.as_dict() for t in tokens]
