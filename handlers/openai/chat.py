"""OpenAI-style chat: `messages` bodies (on /v1/chat/completions, or any body with `messages` on
/invocations, as DJL does), the model's chat template, and the `chat.completion` /
`chat.completion.chunk` shapes with `usage`.

Parameters follow OpenAI: `max_tokens` (or `max_completion_tokens`; default 30 as for text
requests), `temperature` (default 1.0, which samples; 0 is greedy), `top_p`, `seed`, `stop`,
`stream`, `n` (choices, streamed too), `logprobs` and `top_logprobs` (up to 20 alternatives per
token, under the distribution the token was drawn from), and vLLM's `top_k`,
`repetition_penalty` and `ignore_eos`. What would change the answer and is not done here
(non-zero penalties, `logit_bias`, `best_of`, `suffix`, vLLM's `min_p`, `min_tokens`,
`stop_token_ids`, `use_beam_search`) is refused rather than ignored. Messages may carry
assistant `tool_calls` and `tool` results (`tool_call_id`), which reach the chat template as
given."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from lmserve.rolling_batch.ipc.protocol import MAX_TOP_LOGPROBS, GenerationParams

from ..agents.assistant_message import MessageFormat, StreamedMessage
from ..agents.structured_output import openai_structured_output
from ..agents.tool_calls import forced_grammar, read_tool_choice, read_tools
from ..job import MAX_SEQUENCES, BadRequest, Dialect, FieldReader, GenerationJob
from ..outputs import Completion, TokenOutput
from ..tokenizer import Tokenizer

_ROLES = ("system", "user", "assistant", "tool", "developer")
FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def parse_chat(payload: dict[str, Any], served_model: str | None = None) -> GenerationJob:
    """A chat body's job; `served_model`: read_openai_sampling's."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "expected a non-empty list of {role, content} objects")
    parsed = [_parse_message(index, message) for index, message in enumerate(messages)]
    reader = FieldReader(payload, prefix="")
    max_tokens = reader.integer("max_completion_tokens", None, minimum=1)
    sampling = read_openai_sampling(reader, max_tokens or 30, served_model)
    logprobs = reader.boolean("logprobs", False)
    top_logprobs = reader.integer("top_logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise BadRequest("top_logprobs", "needs logprobs: true")
    tools = read_tools(payload.get("tools"))
    tool_choice = read_tool_choice(payload, tools)
    params = msgspec.structs.replace(
        sampling.params, top_logprobs=top_logprobs or 0, log_probs=logprobs
    )
    if tool_choice.forced:
        if params.grammar is not None:
            raise BadRequest(
                "tool_choice", "a forced tool call and a response_format exclude each other"
            )
        params = msgspec.structs.replace(params, grammar=forced_grammar(tool_choice, tools))
    return GenerationJob(
        Dialect.CHAT,
        prompts=[],  # the chat template renders `messages` into the one prompt
        batched=False,
        params=params,
        stop_sequences=sampling.stop,
        stream=sampling.stream,
        n=sampling.n,
        best_of=sampling.n,
        messages=parsed,
        tools=tools,
        tool_choice=tool_choice,
        model=sampling.model,
        logprobs=logprobs,
        include_usage=sampling.include_usage,
    )


@dataclass(frozen=True)
class OpenAISampling:
    params: GenerationParams
    stop: tuple[str, ...]
    stream: bool
    model: str | None
    include_usage: bool = False
    n: int = 1


def read_openai_sampling(
    reader: FieldReader, default_max_tokens: int, served_model: str | None = None
) -> OpenAISampling:
    """The parameters chat and completions share, with OpenAI's names and defaults
    (`temperature` 1.0 samples, 0 is greedy; `n` choices). What lmserve cannot do is refused,
    not ignored. With LoRA on, `served_model` is the base model's name: a `model` naming
    anything else names an adapter (as in vLLM)."""
    temperature = reader.number("temperature", 1.0, minimum=0.0, maximum=2.0)
    params = GenerationParams(
        max_new_tokens=reader.integer("max_tokens", default_max_tokens, minimum=1),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=reader.number("top_p", 1.0, minimum=0.0, exclusive_minimum=True, maximum=1.0),
        seed=reader.integer("seed", None, minimum=0),
        # vLLM's extensions, as its clients send them: `top_k` (0 or -1: off), a
        # multiplicative `repetition_penalty`, and `ignore_eos`: `max_tokens` tokens whatever
        # the model emits (benchmarks ask for it; left unread, they stopped at the first EOS).
        top_k=max(0, reader.integer("top_k", 0, minimum=-1)),
        repetition_penalty=reader.number(
            "repetition_penalty", 1.0, minimum=0.0, exclusive_minimum=True
        ),
        ignore_eos=reader.boolean("ignore_eos", False),
        # vLLM's: prompts share the prefix cache only with requests of the same salt.
        cache_salt=reader.text("cache_salt"),
        # Structured outputs: response_format, vLLM's structured_outputs (structured_output.py).
        grammar=openai_structured_output(reader.raw),
    )
    n = reader.integer("n", 1, minimum=1, maximum=MAX_SEQUENCES)
    for penalty in ("frequency_penalty", "presence_penalty"):
        if reader.number(penalty, 0.0, minimum=-2.0, maximum=2.0) != 0.0:
            raise BadRequest(penalty, "not supported (use 0)")
    _refuse_what_would_change_the_answer(reader.raw)
    model = reader.raw.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model", f"expected a string, got {model!r}")
    if served_model is not None and model and model != served_model:
        params = msgspec.structs.replace(params, adapter=model)
    stream = reader.boolean("stream", False)
    stop = reader.stop_sequences("stop")
    return OpenAISampling(params, stop, stream, model, _include_usage(reader.raw, stream), n)


# OpenAI's and vLLM's parameters that would change the answer, which lmserve does not do: a
# request that sets one is refused rather than answered as if it had not.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {  # field -> the values that leave the answer alone
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "use_beam_search": (None, False),
}


def _refuse_what_would_change_the_answer(payload: dict[str, Any]) -> None:
    for field, neutral in _UNSUPPORTED.items():
        value = payload.get(field)
        if not any(value == n and type(value) is type(n) for n in neutral):
            raise BadRequest(field, f"not supported, got {value!r}")


def _include_usage(payload: dict[str, Any], stream: bool) -> bool:
    """OpenAI's `stream_options.include_usage`: only with `stream: true`."""
    options = payload.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest("stream_options", "only with stream: true")
    if not isinstance(options, dict):
        raise BadRequest("stream_options", f"expected an object, got {options!r}")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest("stream_options.include_usage", f"expected true or false, got {include!r}")
    return include


def _parse_message(index: int, message: Any) -> dict[str, Any]:
    field = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise BadRequest(f"{field}.role", f"expected one of {', '.join(_ROLES)}")
    role = message["role"]
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise BadRequest(f"{field}.content", "only text content parts are supported")
        content = "".join(str(p.get("text", "")) for p in content)
    tool_calls = message.get("tool_calls")
    if not isinstance(content, str) and not (content is None and tool_calls):
        raise BadRequest(f"{field}.content", "expected a string or a list of text parts")
    parsed: dict[str, Any] = {"role": role, "content": content}
    if tool_calls is not None:
        if role != "assistant":
            raise BadRequest(f"{field}.tool_calls", "only an assistant message makes tool calls")
        if not isinstance(tool_calls, list):
            raise BadRequest(f"{field}.tool_calls", "expected a list of tool calls")
        parsed["tool_calls"] = [
            _parse_tool_call(f"{field}.tool_calls[{i}]", call) for i, call in enumerate(tool_calls)
        ]
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise BadRequest(f"{field}.{name}", f"expected a string, got {value!r}")
            parsed[name] = value
    return parsed


def _parse_tool_call(field: str, call: Any) -> dict[str, Any]:
    """An assistant's earlier tool call, for the template. Its `arguments` arrive as a JSON
    string (OpenAI's shape) and go to the template as an object, which chat templates expect
    (they write it out with `tojson`)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{field}.function", "expected {name, arguments}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise BadRequest(f"{field}.function.arguments", f"not JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise BadRequest(f"{field}.function.arguments", "expected a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}


class ChatResponder:
    """Shapes one chat request's answer: a `chat.completion`, or `chat.completion.chunk` SSE
    events ending in `data: [DONE]`."""

    content_type = "text/event-stream"

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        job: GenerationJob,
        message_format: MessageFormat | None = None,
    ):
        self.tokenizer = tokenizer
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.request = job
        # Tool calls and reasoning, where the server or the request reads them.
        self.format = message_format or MessageFormat()
        self._messages: dict[int, StreamedMessage] = {}  # the choices whose first chunk went out

    def answer(self, prompts: list[list[Completion]]) -> dict:
        """A `chat.completion` with one choice per completion of its one prompt (OpenAI's
        `n`)."""
        (completions,) = prompts
        choices = []
        for index, completion in enumerate(completions):
            message, has_calls = self.format.message(completion.text, completion.prompt)
            logprobs = self._logprobs(
                completion.token_ids, completion.log_probs, completion.top_logprobs
            )
            finish = _finish_reason(completion, has_calls)
            choices.append(
                {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            )
        return {
            **self._envelope("chat.completion"),
            "choices": choices,
            "usage": self._usage(*completions),
        }

    def token(self, token: TokenOutput, completion: Completion | None) -> str:
        """Chunks with what the token adds to its choice's message (its text as content, or
        with tool calls or reasoning read, the pieces of those it completes; the log-probs in
        the first); the choice's last token adds a chunk with its finish_reason."""
        message = self._messages.get(token.index)
        first = message is None
        if first:
            message = self._messages[token.index] = StreamedMessage(self.format, token.prompt)
        if self.format.reads_parts:
            deltas = message.add(token.text, final=completion is not None)
        else:
            deltas = [{"content": token.text}]
        if first:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {})}, *deltas[1:]]
        if not deltas and self.request.logprobs:
            deltas = [{}]  # the token's log-probs go out even where its text waits
        top = None if token.top_logprobs is None else [token.top_logprobs]
        logprobs = self._logprobs([token.id], [token.log_prob], top)
        lines = [
            self._chunk(token.index, delta, logprobs if i == 0 else None, None)
            for i, delta in enumerate(deltas)
        ]
        if completion is not None:
            finish = _finish_reason(completion, message.has_calls)
            lines.append(self._chunk(token.index, {}, None, finish))
        return _events(lines)

    def done(self, completions: list[Completion]) -> str:
        """After every choice's last token: the usage chunk (stream_options.include_usage; it
        has no choices, as OpenAI's), then [DONE]."""
        lines = []
        if self.request.include_usage:
            usage = self._usage(*completions)
            lines.append({**self._envelope("chat.completion.chunk"), "choices": [], "usage": usage})
        return _events(lines) + "data: [DONE]\n\n"

    def error(self, status: int, message: str) -> str:
        return _events([{"code": status, "error": message}])

    def _logprobs(self, token_ids, log_probs, top_logprobs) -> dict | None:
        """OpenAI's `logprobs.content`: each token with its log-prob and bytes, and its
        `top_logprobs` alternatives."""
        if not self.request.logprobs:
            return None
        tops = top_logprobs or [[]] * len(token_ids)
        content = [
            {**self._entry(token, log_prob), "top_logprobs": [self._entry(*t) for t in top]}
            for token, log_prob, top in zip(token_ids, log_probs, tops)
        ]
        return {"content": content, "refusal": None}

    def _entry(self, token_id: int, log_prob: float) -> dict:
        text = self.tokenizer.token_text(token_id)
        return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}

    def _chunk(self, index: int, delta: dict, logprobs, finish_reason: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs}
        return {
            **self._envelope("chat.completion.chunk"),
            "choices": [{**choice, "finish_reason": finish_reason}],
        }

    def _envelope(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, *completions: Completion) -> dict:
        prompt_tokens = len(completions[0].prompt_ids)  # the choices share the prompt
        generated = sum(len(completion.token_ids) for completion in completions)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }


def _finish_reason(completion: Completion, has_calls: bool) -> str:
    """OpenAI's: tool_calls where the answer holds calls (however they were chosen)."""
    return "tool_calls" if has_calls else FINISH_REASONS.get(completion.finish_reason, "stop")


def _events(bodies: list[dict]) -> str:
    return "".join(f"data: {json.dumps(body, ensure_ascii=False)}\n\n" for body in bodies)
