"""TGI's `truncate`: a prompt longer than `truncate` tokens keeps only its last `truncate`
tokens (TGI truncates the encoding from the left), so the newest text, the part a
continuation depends on, survives."""

from __future__ import annotations

from .job import BadRequest


def keep_last_tokens(prompt_ids: list[int], truncate: int, max_model_len: int) -> list[int]:
    """`prompt_ids` cut to their last `truncate` tokens. A `truncate` that no prompt could
    reach is refused, as TGI refuses one over its max input length: a prompt needs room for
    at least one new token, so it holds at most `max_model_len - 1` tokens."""
    max_prompt_len = max_model_len - 1
    if truncate > max_prompt_len:
        raise BadRequest(
            "parameters.truncate",
            f"must be <= {max_prompt_len} (the context is {max_model_len} tokens and at least"
            f" one new token must fit), got {truncate}",
        )
    return prompt_ids[-truncate:]
