"""One request as the front end runs it, whatever route and dialect it came in on.

Every route parses into a `GenerationJob` (request_parsing.py for DJL/TGI bodies, chat.py and
openai_completions.py for OpenAI's): the prompts (text, or chat messages the model's template
renders), the generation parameters of each prompt's sequences, stop sequences, how many
sequences to generate and answer per prompt, whether to stream, and what the answer shows.
The Predictor runs a job (tokenize, check the length, submit, follow the events, detokenize,
apply stops) the same way for all of them; a Responder (responder.py) gives the answer its
dialect's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import msgspec

from lmserve.rolling_batch.protocol import GenerationParams

if TYPE_CHECKING:
    from .tool_calls import ToolChoice


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
