"""A reasoning model's thinking, apart from its answer (option.reasoning_parser): the text
between `<think>` and `</think>` is `reasoning_content`, the rest is the answer, to which tool
calls and the answer's shape apply.

`deepseek_r1`: the answer starts in thinking whether or not `<think>` is in the text (R1's
template opens it), until `</think>`; an answer cut before `</think>` is all reasoning.
`qwen3`: thinking only where the text opens it, or where the chat template did (the rendered
prompt ends with `<think>`); otherwise the whole text is the answer. Like the tool-call
formats, a reading of a longer text extends that of a shorter one, so a stream sends the
differences.

A grammar (structured outputs, a forced tool call) applies to the answer after the thinking:
`after_thinking` wraps it in one that lets the model think first, as freely as without it.
Torch-free.
"""

from __future__ import annotations

import json
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

    def after_thinking(self, grammar: str, prompt: str) -> str:
        """`grammar` (llguidance's JSON) for the answer, behind the thinking this model does
        after `prompt`: free text up to the first `</think>`, then any whitespace."""
        outer = json.loads(grammar)
        answer, *rest = outer["grammars"]
        name = answer.get("name") or "lmserve_answer"
        if prompt.rstrip().endswith(START):  # the template opened it: thinking comes first
            start = f"start: {_THOUGHT} @{name}"
        elif self.always_thinks:
            start = f'start: "{START}"? {_THOUGHT} @{name}'
        else:  # thinking where the model opens it
            start = f'start: ("{START}" {_THOUGHT})? @{name}'
        lark = f"{start}\n{_THOUGHT_TERMINALS}"
        grammars = [{"lark_grammar": lark}, {**answer, "name": name}, *rest]
        return json.dumps({**outer, "grammars": grammars})


# Thinking ends at its first `</think>`: text that ends with it and holds it nowhere else.
_THOUGHT = "THOUGHT SPACE"
_THOUGHT_TERMINALS = (
    r"THOUGHT: /(?s:.*)<\/think>/ & ~/(?s:.*<\/think>.+)/" + "\n" + r"SPACE: /[ \t\r\n]*/" + "\n"
)


def reasoning_format(parser: str | None) -> ReasoningFormat | None:
    if parser is None:
        return None
    return ReasoningFormat(always_thinks=parser == "deepseek_r1")
