"""An engine's final token ids -> the JSON a client gets (DJL shape, or TGI's with tgi_compat).

Stop sequences are applied here, on the detokenized text, because the engine deals in token ids:
the text ends right before the first stop sequence (removed, as vLLM and LMI do), the token list
with the token that completed it, and finish_reason becomes "stop_sequence".
"""

from __future__ import annotations

from dataclasses import dataclass

from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str


def complete(
    tokenizer: Tokenizer,
    prompt: str,
    token_ids: list[int],
    log_probs: list[float],
    finish_reason: str,
    stop_sequences: tuple[str, ...],
) -> Completion:
    text = tokenizer.decode(token_ids)
    stop = find_stop(text, stop_sequences)
    if stop is None:
        return Completion(prompt, text, token_ids, log_probs, finish_reason)
    start, end = stop
    num_tokens = _tokens_covering(tokenizer, token_ids, end)
    return Completion(
        prompt, text[:start], token_ids[:num_tokens], log_probs[:num_tokens], "stop_sequence"
    )


def find_stop(text: str, stop_sequences: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, end) of the earliest stop sequence in `text` (the shortest of those starting
    there), or None. Streams and final answers both cut here, so they agree."""
    found = [(text.find(s), len(s)) for s in stop_sequences if s in text]
    if not found:
        return None
    start, length = min(found)
    return start, start + length


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
) -> dict:
    text = completion.prompt + completion.text if return_full_text else completion.text
    output: dict = {"generated_text": text}
    if details:
        output["details"] = {
            "finish_reason": completion.finish_reason,
            "generated_tokens": len(completion.token_ids),
            "inputs": completion.prompt,
            "tokens": [
                _token_json(tokenizer, token_id, log_prob, tgi_compat)
                for token_id, log_prob in zip(completion.token_ids, completion.log_probs)
            ],
        }
    return output


def _token_json(tokenizer: Tokenizer, token_id: int, log_prob: float, tgi_compat: bool) -> dict:
    text = tokenizer.token_text(token_id)
    if tgi_compat:
        return {
            "id": token_id,
            "text": text,
            "logprob": log_prob,
            "special": token_id in tokenizer.special_ids,
        }
    return {"id": token_id, "text": text, "log_prob": log_prob}


def shape_response(outputs: list[dict], batched: bool, tgi_compat: bool) -> dict | list:
    """A list input gets a list; tgi_compat wraps even a single output in a list (TGI's shape)."""
    if batched or tgi_compat:
        return outputs
    return outputs[0]
