"""A chat answer's text as OpenAI's assistant message: the reasoning (reasoning.py) apart,
then the answer's tool calls (tool_calls.py) apart from its content; whole, or as deltas while
a stream's text grows. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ReasoningFormat
from .tool_calls import ToolCallFormat, call_id, openai_tool_calls


@dataclass(frozen=True)
class MessageFormat:
    """How a chat's answers are read: None for either part: not read."""

    tool_calls: ToolCallFormat | None = None
    reasoning: ReasoningFormat | None = None

    @property
    def reads_parts(self) -> bool:
        return self.tool_calls is not None or self.reasoning is not None

    def split(self, text: str, prompt: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer)."""
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, prompt, final)

    def message(self, text: str, prompt: str) -> tuple[dict, bool]:
        """The whole answer's message, and whether it holds tool calls."""
        reasoning, answer = self.split(text, prompt, final=True)
        message: dict = {"role": "assistant", "content": answer}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if self.tool_calls is None:
            return message, False
        reading = self.tool_calls.read(answer, final=True)
        if reading.malformed or not reading.calls:
            return message, False
        message["content"] = reading.content.strip() or None
        message["tool_calls"] = openai_tool_calls(reading.calls)
        return message, True


@dataclass
class StreamedMessage:
    """One choice's message as a stream: `add` each piece of text, get the deltas to send."""

    format: MessageFormat
    prompt: str
    text: str = ""
    num_reasoning_sent: int = 0
    num_content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)  # the calls whose name went out
    num_arguments_sent: list[int] = field(default_factory=list)
    malformed: bool = False  # the calls' markup turned out invalid

    @property
    def has_calls(self) -> bool:
        return bool(self.call_ids) and not self.malformed

    def add(self, piece: str, final: bool) -> list[dict]:
        self.text += piece
        reasoning, answer = self.format.split(self.text, self.prompt, final)
        deltas = []
        if len(reasoning) > self.num_reasoning_sent:
            deltas.append({"reasoning_content": reasoning[self.num_reasoning_sent :]})
            self.num_reasoning_sent = len(reasoning)
        if self.format.tool_calls is None:
            return deltas + self._content(answer)
        reading = self.format.tool_calls.read(answer, final)
        if reading.malformed:
            # Not calls after all: the text is content, unless a call's name went out already
            # (a stream cannot take it back; the answer then ends with finish_reason "stop").
            self.malformed = True
            return deltas + ([] if self.call_ids else self._content(answer))
        deltas += self._content(reading.content)
        for index, call in enumerate(reading.calls):
            if index == len(self.call_ids):
                if call.name is None:
                    break
                self.call_ids.append(call_id())
                self.num_arguments_sent.append(0)
                header = {"id": self.call_ids[index], "type": "function"}
                function = {"name": call.name, "arguments": ""}
                deltas.append({"tool_calls": [{"index": index, **header, "function": function}]})
            sent = self.num_arguments_sent[index]
            if len(call.arguments) > sent:
                piece = {"arguments": call.arguments[sent:]}
                deltas.append({"tool_calls": [{"index": index, "function": piece}]})
                self.num_arguments_sent[index] = len(call.arguments)
        return deltas

    def _content(self, content: str) -> list[dict]:
        if len(content) <= self.num_content_sent:
            return []
        piece = content[self.num_content_sent :]
        self.num_content_sent = len(content)
        return [{"content": piece}]
