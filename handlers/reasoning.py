"""A reasoning model's thinking, apart from its answer (option.reasoning_parser): the text
between `<think>` and `</think>` is `reasoning_content`, the rest is the answer, to which tool
calls and the answer's shape apply.

`deepseek_r1`: the answer starts in thinking whether or not `<think>` is in the text (R1's
template opens it), until `</think>`; an answer cut before `</think>` is all reasoning.
`qwen3`: thinking only where the text opens it, or where the chat template did (the rendered
prompt ends with `<think>`); otherwise the whole text is the answer. Like the tool-call
formats, a reading of a longer text extends that of a shorter one, so a stream sends the
differences. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_calls import without_partial

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    always_thinks: bool  # deepseek_r1: thinking from the first token

    def split(self, text: str, prompt: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of `text` so far, generated after `prompt`."""
        opened_by_template = prompt.rstrip().endswith(START)
        stripped = text.lstrip()
        if stripped.startswith(START):
            thinking, text = True, stripped[len(START) :]
        elif not final and stripped and START.startswith(stripped):
            return "", ""  # may be the opening tag
        else:
            thinking = self.always_thinks or opened_by_template
        if not thinking:
            return "", text
        end = text.find(END)
        if end < 0:
            return (text if final else without_partial(text, END)), ""
        return text[:end], text[end + len(END) :].lstrip()


def reasoning_format(parser: str | None) -> ReasoningFormat | None:
    if parser is None:
        return None
    return ReasoningFormat(always_thinks=parser == "deepseek_r1")
