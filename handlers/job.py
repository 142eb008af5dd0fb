"""One request as the front end runs it, whatever route and dialect it came in on.

Every route parses into a `GenerationJob` (djl/request_parsing.py for DJL/TGI bodies,
openai/chat.py and openai/completions.py for OpenAI's), its fields read through a
`FieldReader`: the prompts (text, or chat messages the model's template
renders), the generation parameters of each prompt's sequences, stop sequences, how many
sequences to generate and answer per prompt, whether to stream, and what the answer shows.
The Predictor runs a job (tokenize, check the length, submit, follow the events, detokenize,
apply stops) the same way for all of them; a Responder (responder.py) gives the answer its
dialect's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import msgspec

from lmserve.rolling_batch.ipc.protocol import GenerationParams

if TYPE_CHECKING:
    from .agents.tool_calls import ToolChoice


# Sequences one input may ask for (`n`, `best_of`; OpenAI's `n`): each is a place in the batch.
MAX_SEQUENCES = 16


class Dialect(StrEnum):
    """The request schema a body speaks, which decides how it is parsed and answered."""

    DJL = "djl"  # {"inputs", "parameters"} or text/plain: DJL's answer, TGI's with tgi_compat
    CHAT = "chat"  # OpenAI chat completions: {"messages", ...}
    COMPLETION = "completion"  # OpenAI's legacy completions: {"prompt", ...}


class BadRequest(Exception):
    """A body the front end refuses: the status (400 unless said) and a message naming the
    field."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.status = status


@dataclass(frozen=True)
class PromptFields:
    """How errors about a dialect's prompt name its fields, and how its prompt is tokenized."""

    prompt: str  # the prompt's field
    max_new_tokens: str  # the cap on new tokens
    add_special_tokens: bool  # a chat template writes its own BOS


PROMPT_FIELDS = {
    Dialect.DJL: PromptFields("inputs", "parameters.max_new_tokens", True),
    Dialect.CHAT: PromptFields("messages", "max_tokens", False),
    Dialect.COMPLETION: PromptFields("prompt", "max_tokens", True),
}


@dataclass(frozen=True)
class GenerationJob:
    dialect: Dialect
    # The text prompts; a chat job has one, rendered from `messages` by the chat template.
    prompts: list[str]
    batched: bool  # the prompt was a list: the answer is a list too (or has a choice each)
    params: GenerationParams
    stop_sequences: tuple[str, ...] = ()
    stream: bool = False
    n: int = 1  # sequences answered per prompt
    best_of: int = 1  # sequences generated per prompt; the n most likely are answered (DJL)
    # One LoRA adapter (or None: the base model) per prompt, where a list of prompts names
    # one each; else `params.adapter` serves every prompt.
    adapters: tuple[str | None, ...] | None = None
    # TGI's `truncate`: keep only the prompt's last `truncate` tokens.
    truncate: int | None = None
    # Chat: the conversation and OpenAI's function tools, for the chat template.
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None  # chat: which tool calls the answer may hold
    # What the answer shows.
    model: str | None = None  # OpenAI's `model` as the request named it
    details: bool = False  # DJL: `details` (tokens, log-probs, other sequences)
    return_full_text: bool = False  # DJL: the prompt before the generated text
    output_formatter: str | None = None  # DJL: the answer format this request names
    logprobs: bool = False  # OpenAI: each token's log-prob (params.top_logprobs alternatives)
    echo: bool = False  # OpenAI completions: the prompt before the text
    include_usage: bool = False  # OpenAI streams: a last chunk with usage

    def params_of_prompt(self, index: int) -> GenerationParams:
        if self.adapters is None:
            return self.params
        return msgspec.structs.replace(self.params, adapter=self.adapters[index])

    @property
    def prompt_fields(self) -> PromptFields:
        return PROMPT_FIELDS[self.dialect]


class FieldReader:
    """Reads a body's fields, each checked: a wrong type or a value out of range raises
    BadRequest naming the field (`prefix` + name); `known` collects the names read."""

    def __init__(self, raw: dict[str, Any], prefix: str = "parameters."):
        self.raw = raw
        self.prefix = prefix  # how error messages name the fields
        self.known: set[str] = set()

    def _get(self, name: str) -> Any:
        self.known.add(name)
        return self.raw.get(name)

    def boolean(self, name: str, default: bool) -> bool:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise BadRequest(f"{self.prefix}{name}", f"expected true or false, got {value!r}")
        return value

    def integer(
        self, name: str, default: int | None, minimum: int, maximum: int | None = None
    ) -> int | None:
        value = self._get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest(f"{self.prefix}{name}", f"expected an integer, got {value!r}")
        if value < minimum:
            raise BadRequest(f"{self.prefix}{name}", f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise BadRequest(f"{self.prefix}{name}", f"must be <= {maximum}, got {value}")
        return value

    def number(
        self,
        name: str,
        default: float,
        minimum: float,
        exclusive_minimum: bool = False,
        maximum: float | None = None,
    ) -> float:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise BadRequest(f"{self.prefix}{name}", f"expected a number, got {value!r}")
        too_low = value <= minimum if exclusive_minimum else value < minimum
        too_high = maximum is not None and value > maximum
        if too_low or too_high or math.isinf(value):
            low = f"> {minimum}" if exclusive_minimum else f">= {minimum}"
            high = f" and <= {maximum}" if maximum is not None else ""
            raise BadRequest(f"{self.prefix}{name}", f"must be {low}{high}, got {value}")
        return float(value)

    def text(self, name: str) -> str | None:
        """A non-empty string, or None when absent."""
        value = self._get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise BadRequest(f"{self.prefix}{name}", f"expected a non-empty string, got {value!r}")
        return value

    def stop_sequences(self, name: str = "stop_sequences") -> tuple[str, ...]:
        value = self._get(name)
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise BadRequest(f"{self.prefix}{name}", "expected a list of non-empty strings")
        return tuple(value)

    def choice(self, name: str, allowed: tuple[str, ...]) -> str | None:
        value = self._get(name)
        if value is not None and value not in allowed:
            raise BadRequest(
                f"{self.prefix}{name}", f"expected one of {', '.join(allowed)}, got {value!r}"
            )
        return value
