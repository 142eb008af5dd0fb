"""What gives a job's answer its dialect's shape. One implementation per dialect: DJL's JSON,
jsonlines and SSE, TGI's (djl/answers.py), OpenAI chat (openai/chat.py), OpenAI completions
(openai/completions.py) and a model.py's output formatter (custom/formatters.py). The Predictor
hands a responder the finished completions of a whole answer, or a stream's tokens one by
one."""

from __future__ import annotations

from typing import Any, Protocol

from .outputs import Completion, TokenOutput


class Responder(Protocol):
    content_type: str  # of a stream's body

    def answer(self, prompts: list[list[Completion]]) -> Any:
        """The whole answer from each prompt's completions (sequences in request order): a
        JSON value, or a str sent as it is."""
        ...

    def token(self, token: TokenOutput, completion: Completion | None) -> str:
        """A stream's piece for one token; `completion` is set on its sequence's last one."""
        ...

    def done(self, completions: list[Completion]) -> str:
        """A stream's trailer once every sequence has completed ("" for none)."""
        ...

    def error(self, status: int, message: str) -> str:
        """A stream's last piece when it fails after its first byte."""
        ...
