"""A model.py's formatters around lmserve's LLM handler, as DJL Serving runs them.

- The input formatter (`@input_formatter`) gets each request as a DJL `Input` and returns what
  the LLM handler reads: a payload dict (`{"inputs", "parameters"}`) or a DJL `TextInput`
  (`input_text`, `parameters`). The usual validation applies to what it returns.
- The output formatter (`@output_formatter`, or `option.output_formatter=<function in model.py>`
  or `=<module>:<function>`) gets the request's `TextGenerationOutput` after each new token and
  returns a string: a stream sends each string as it comes, any other answer is the strings
  joined. `get_next_token()` hands out the tokens it has not read yet.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lmserve.rolling_batch.ipc import protocol

from ..outputs import Completion, TokenOutput
from ..streamed_sequences import StreamedSequence, shape_event
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .djl_compat import INPUT_FORMATTER_MARK, OUTPUT_FORMATTER_MARK
from .djl_request_io import TextGenerationOutput, TextInput, Token
from .user_code import EntryPoint, UserCodeError, load

BUILT_IN_OUTPUT_FORMATS = ("json", "jsonlines", "sse")


@dataclass(frozen=True)
class Formatters:
    input: Callable[..., Any] | None = None
    output: Callable[[TextGenerationOutput], Any] | None = None


def load_formatters(source: str | None, user_dir: str | None, output_formatter: str) -> Formatters:
    """`source`: the model.py (or entryPoint) location when it defines formatters, not a
    handle(); `output_formatter`: option.output_formatter."""
    folder = Path(user_dir) if user_dir else None
    module = load(EntryPoint.from_location(source), folder) if source else None
    input_function = _marked(module, INPUT_FORMATTER_MARK)
    output_function = _marked(module, OUTPUT_FORMATTER_MARK)
    if output_formatter not in BUILT_IN_OUTPUT_FORMATS:
        output_function = _named(output_formatter, module, folder)
    return Formatters(input_function, output_function)


def _marked(module: ModuleType | None, mark: str) -> Callable | None:
    if module is None:
        return None
    found = [v for v in vars(module).values() if callable(v) and getattr(v, mark, False)]
    if len(found) > 1:
        names = ", ".join(f.__name__ for f in found)
        raise UserCodeError(f"{module.__name__}: more than one function marked {mark}: {names}")
    return found[0] if found else None


def _named(spec: str, module: ModuleType | None, folder: Path | None) -> Callable:
    """`function` (in model.py) or `module:function`."""
    module_name, _, function_name = spec.rpartition(":")
    if module_name:
        module = load(EntryPoint(module_name, module=module_name), folder)
    if module is None:
        raise UserCodeError(
            f"option.output_formatter={spec!r}: no model.py to find {function_name!r} in"
        )
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserCodeError(
            f"option.output_formatter={spec!r}: {module.__name__} has no function {function_name!r}"
        )
    return function


class FormattedGeneration:
    """One request's output as the output formatter sees it, fed token by token; the
    predictor's responder for it (`token`, `done`, `error`)."""

    content_type = "application/jsonlines"  # DJL's for a custom formatter's stream

    def __init__(self, formatter, prompt: str, parameters: dict, request_id: str, tgi: bool,
                 tokenizer: Tokenizer, stop_sequences: tuple[str, ...] = ()):  # fmt: skip
        self.formatter = formatter
        self.tokenizer = tokenizer
        self.stop_sequences = stop_sequences
        text_input = TextInput(request_id, prompt, parameters, tgi_compat=tgi)
        self.output = TextGenerationOutput(request_id, text_input)

    def answer(self, prompts: list[list[Completion]]) -> str:
        """One whole answer: the generation replayed token by token through the formatter,
        its strings joined, as DJL joins a formatter's strings."""
        ((completion,),) = prompts
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.stop_sequences)
        sequence = StreamedSequence(0, completion.prompt, completion.prompt_ids, detokenizer)
        replay = protocol.FinalEvent(
            "", completion.token_ids, completion.log_probs, completion.finish_reason, 1,
            completion.top_logprobs, completion.prompt_log_probs, completion.prompt_top_logprobs,
        )  # fmt: skip
        return "".join(shape_event(sequence, replay, self, self.tokenizer))

    def token(self, token: TokenOutput, completion: Completion | None) -> str:
        """The formatter's string for this token (`completion` on the last one)."""
        last = completion is not None
        reason = completion.finish_reason if last else None
        shaped = Token(token.id, token.text, token.log_prob, token.special)
        if token.top_logprobs is not None:
            self.output.set_next_top_tokens([self._token(*top) for top in token.top_logprobs])
        if last and completion.prompt_log_probs is not None:
            log_probs = [None, *completion.prompt_log_probs]  # nothing predicts the first
            self.output.prompt_tokens_details = [
                self._token(token_id, log_prob)
                for token_id, log_prob in zip(completion.prompt_ids, log_probs)
            ]
        self.output.set_next_token(shaped, is_last_token=last, finish_reason=reason)
        self.output.finished = last
        piece = self.formatter(self.output)
        if piece is None:
            return ""
        return piece if isinstance(piece, str) else str(piece)

    def done(self, completions: list[Completion]) -> str:
        return ""  # the formatter saw the last token with finished set

    def error(self, status: int, message: str) -> str:
        return json.dumps({"code": status, "error": message}) + "\n"

    def _token(self, token_id: int, log_prob: float | None) -> Token:
        special = token_id in self.tokenizer.special_ids
        return Token(token_id, self.tokenizer.token_text(token_id), log_prob, special)
