"""An engine's final token ids -> the JSON a client gets (DJL shape, or TGI's with tgi_compat).

Stop sequences are applied here, on the detokenized text, because the engine deals in token ids:
the text ends right before the first stop sequence (removed, as vLLM and LMI do), the token list
with the token that completed it, and finish_reason becomes "stop_sequence".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.protocol import TopLogprobs

from .tokenizer import Tokenizer, find_stop


@dataclass
class Generation:
    """What the engine produced for one sequence so far, its events added in order."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    top_logprobs: list[TopLogprobs] | None = None  # one list per token, when asked
    prompt_log_probs: list[float] | None = None  # prompt tokens 2.., when asked
    prompt_top_logprobs: list[TopLogprobs] | None = None

    def add(self, event: protocol.TokenEvent | protocol.FinalEvent) -> None:
        self.token_ids += event.token_ids
        self.log_probs += event.log_probs
        if event.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + event.top_logprobs
        if event.prompt_log_probs is not None:
            self.prompt_log_probs = event.prompt_log_probs
            self.prompt_top_logprobs = event.prompt_top_logprobs
        if isinstance(event, protocol.FinalEvent):
            self.finish_reason = event.finish_reason


@dataclass(frozen=True)
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    top_logprobs: list[TopLogprobs] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_log_probs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None

    @property
    def cumulative_log_prob(self) -> float:
        """What best_of ranks sequences by."""
        return sum(self.log_probs)


@dataclass(frozen=True)
class TokenOutput:
    """One generated token as a stream's responder shapes it."""

    id: int
    text: str  # the text it adds (may be empty while a character is incomplete)
    log_prob: float
    special: bool
    top_logprobs: TopLogprobs | None = None
    index: int = 0  # the sequence it belongs to (OpenAI's choice index)
    prompt: str = ""  # the sequence's prompt (a chat's rendered template)


def complete(
    tokenizer: Tokenizer,
    prompt: str,
    generation: Generation,
    stop_sequences: tuple[str, ...],
    prompt_ids: list[int] | None = None,
) -> Completion:
    """The generation's text, cut at its first stop sequence (tokens and their log-probs with
    it)."""
    token_ids = generation.token_ids
    text = tokenizer.decode(token_ids)
    stop = find_stop(text, stop_sequences)
    reason = generation.finish_reason or protocol.FinishReason.LENGTH
    num_tokens = len(token_ids)
    if stop is not None:
        start, end = stop
        text, reason = text[:start], "stop_sequence"
        num_tokens = _tokens_covering(tokenizer, token_ids, end)
    top = generation.top_logprobs
    return Completion(
        prompt,
        text,
        token_ids[:num_tokens],
        generation.log_probs[:num_tokens],
        reason,
        None if top is None else top[:num_tokens],
        list(prompt_ids or []),
        generation.prompt_log_probs,
        generation.prompt_top_logprobs,
    )


def _tokens_covering(tokenizer: Tokenizer, token_ids: list[int], num_chars: int) -> int:
    """The fewest leading tokens whose text is at least `num_chars` long (binary search: a
    longer prefix never decodes to shorter text)."""
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(token_ids[:middle])) >= num_chars:
            high = middle
        else:
            low = middle + 1
    return low


def to_json(
    completion: Completion,
    tokenizer: Tokenizer,
    details: bool,
    return_full_text: bool,
    tgi_compat: bool,
    others: list[Completion] | tuple = (),
) -> dict:
    """The DJL/TGI answer for one input. `others` are the other sequences of a request for
    several (`n`, `best_of`), returned as `details.best_of_sequences`."""
    text = completion.prompt + completion.text if return_full_text else completion.text
    output: dict = {"generated_text": text}
    if details:
        shape = TokenShape(tokenizer, tgi_compat)
        output["details"] = {"inputs": completion.prompt, **shape.sequence(completion)}
        if others:
            output["details"]["best_of_sequences"] = [
                {
                    "generated_text": other.prompt + other.text if return_full_text else other.text,
                    **shape.sequence(other),
                }
                for other in others
            ]
    return output


class TokenShape:
    """Tokens as DJL writes them (`log_prob`), or TGI (`logprob`, `special`)."""

    def __init__(self, tokenizer: Tokenizer, tgi_compat: bool):
        self.tokenizer = tokenizer
        self.tgi_compat = tgi_compat

    def sequence(self, completion: Completion) -> dict:
        """A sequence's details: its tokens, their top alternatives (`top_n_tokens`) and the
        prompt's tokens with their log-probs (`decoder_input_details`) when asked."""
        shaped: dict = {
            "finish_reason": completion.finish_reason,
            "generated_tokens": len(completion.token_ids),
            "tokens": [
                self.token(token_id, log_prob)
                for token_id, log_prob in zip(completion.token_ids, completion.log_probs)
            ],
        }
        if completion.top_logprobs is not None:
            shaped["top_tokens"] = [self.alternatives(top) for top in completion.top_logprobs]
        if completion.prompt_log_probs is not None:
            log_probs = [None, *completion.prompt_log_probs]  # nothing predicts the first token
            shaped["prefill"] = [
                self.token(t, lp) for t, lp in zip(completion.prompt_ids, log_probs)
            ]
        return shaped

    def alternatives(self, top: TopLogprobs) -> list[dict]:
        return [self.token(token_id, log_prob) for token_id, log_prob in top]

    def token(self, token_id: int, log_prob: float | None) -> dict:
        text = self.tokenizer.token_text(token_id)
        if self.tgi_compat:
            special = token_id in self.tokenizer.special_ids
            return {"id": token_id, "text": text, "logprob": log_prob, "special": special}
        return {"id": token_id, "text": text, "log_prob": log_prob}


def shape_response(outputs: list[dict], batched: bool, tgi_compat: bool) -> dict | list:
    """A list input gets a list; tgi_compat wraps even a single output in a list (TGI's shape)."""
    if batched or tgi_compat:
        return outputs
    return outputs[0]
