"""What the front end and an engine say to each other over the IPC socket.

Every engine (the dynamic-batching HF engine and the rolling-batch MPI engine) speaks this: token
ids in, token ids out. Frames are msgpack maps, never pickle. Each message is a typed
`msgspec.Struct`; a tag field ("op" towards the engine, "kind" back) names its type, so one
decoder per direction turns any frame into the right message and checks every field's type on
the way: a malformed frame fails to decode (MalformedFrame) instead of failing later, deep inside
whoever reads it.

The front end talks through a DEALER socket, the engine answers through a ROUTER, so replies find
the gunicorn worker that asked. The rolling engine sends each web worker one frame per step: its
events of that step in a BatchEvent (a single event goes alone). Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum
from typing import Any

import msgspec

ENGINE_SOCKET = "engine.sock"
STATE_FILE = "state.json"


class EngineState(StrEnum):
    """The engine's state, written to STATE_FILE by the launcher and the engine."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class FinishReason(StrEnum):
    """Why a generation ended. Engines send LENGTH or EOS_TOKEN; the front end, which owns the
    stop-sequence scan, turns an answer into STOP_SEQUENCE."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


# The most alternatives a request may ask for at each position (OpenAI chat's limit).
MAX_TOP_LOGPROBS = 20


class GenerationParams(msgspec.Struct, frozen=True):
    """The parameters an engine acts on. Requests with equal params can share a static batch."""

    max_new_tokens: int = 30
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    # Log-probs to report, which change nothing generated: the `top_logprobs` most likely
    # tokens at each generated position (0: only the chosen token's), and with
    # `prompt_logprobs` each prompt token's log-prob given the tokens before it (the prefill
    # computes them; the same `top_logprobs` alternatives per position).
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    # Whether the answer shows each generated token's log-prob (DJL's and TGI's token
    # details always do; OpenAI's only when `logprobs` asks). A greedy request that shows none
    # may take the greedy token without the fp32 logits (rolling_batch/model/layers/greedy_head.py).
    log_probs: bool = True
    # The LoRA adapter (option.enable_lora) that modifies the model for this request; None:
    # the base model. The engine refuses a name it does not know.
    adapter: str | None = None
    # vLLM's `cache_salt`: the prefix cache shares blocks only between requests with the same
    # salt (None: the unsalted ones), for tenants who must not share cached prompts.
    cache_salt: str | None = None
    # Structured output: an llguidance grammar (handlers/agents/structured_output.py writes it) that
    # the generated tokens follow, enforced at each step by masking the logits; None: free text.
    grammar: str | None = None

    def batch_key(self) -> tuple:
        """Requests that may run in one HF `generate` call: everything but the length, which
        each request cuts to its own. Greedy ignores the sampling knobs (as the contract says),
        so all greedy requests batch together."""
        if not self.do_sample:
            return (False, self.repetition_penalty, self.ignore_eos, self.adapter)
        return (
            True,
            self.adapter,
            self.temperature,
            self.top_k,
            self.top_p,
            self.repetition_penalty,
            self.seed,
            self.ignore_eos,
        )


# front end -> engine


class _ToEngine(msgspec.Struct, frozen=True, tag_field="op"):
    pass


class GenerateRequest(_ToEngine, tag="generate"):
    """`stream=False`: no token events, the final event carries every token (the rolling
    engine; the Python engine only ever sends final events)."""

    id: str
    prompt_ids: list[int]
    params: GenerationParams
    stream: bool = True


class AbortRequest(_ToEngine, tag="abort"):
    id: str


class StatsRequest(_ToEngine, tag="stats"):
    id: str


class CountResponse(_ToEngine, tag="count_response"):
    """The front end's HTTP status of a finished request, counted in the engine so every web
    worker's /metrics agrees. Gets no reply."""

    status: int


class HandleRequest(_ToEngine, tag="handle"):
    """An HTTP request as it came, for a user's `handle(inputs)` in the engine process
    (engine=Python with a model.py): the body and the headers, content-type among them."""

    id: str
    body: bytes
    headers: dict[str, str]


class AdapterCommand(_ToEngine, tag="adapter"):
    """The LoRA adapter management API (DJL's): "list" the adapters served, "register" one
    (`name`, `path`: the folder on this machine, `src`: where it came from, as the client gave
    it), or "unregister" one. Answered with an AdaptersEvent, or an ErrorEvent."""

    id: str
    action: str
    name: str | None = None
    src: str | None = None
    path: str | None = None


ToEngine = (
    GenerateRequest | AbortRequest | StatsRequest | CountResponse | HandleRequest | AdapterCommand
)


# engine -> front end. Events are plain (not frozen): the engine builds many per step.


class _FromEngine(msgspec.Struct, tag_field="kind"):
    pass


# The most likely tokens at one position, most likely first: (token id, log-prob) pairs.
TopLogprobs = list[tuple[int, float]]


class TokenEvent(_FromEngine, tag="token"):
    """More tokens of a request still running (rolling engine, streamed requests). The
    request's first event carries its prompt's log-probs when it asked for them."""

    id: str
    token_ids: list[int]
    log_probs: list[float]
    top_logprobs: list[TopLogprobs] | None = None  # one list per token, when asked
    prompt_log_probs: list[float] | None = None  # prompt tokens 2.. (the first has none)
    prompt_top_logprobs: list[TopLogprobs] | None = None


class FinalEvent(_FromEngine, tag="final"):
    """The last event of a request that finished: its last token, or every token when it was
    not streamed."""

    id: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    batch_size: int
    top_logprobs: list[TopLogprobs] | None = None
    prompt_log_probs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None


class ErrorEvent(_FromEngine, tag="error"):
    """The request failed or was refused; nothing else follows for it."""

    id: str
    status: int  # the HTTP status the front end answers with
    message: str


class StatsEvent(_FromEngine, tag="stats"):
    id: str
    stats: dict[str, Any]


class ReplyEvent(_FromEngine, tag="reply"):
    """A user handler's answer: its status and headers, and the whole body; or, when
    `streaming`, the body's first piece and ChunkEvents after it until one says `last`."""

    id: str
    status: int
    headers: dict[str, str]
    body: bytes
    streaming: bool = False


class ChunkEvent(_FromEngine, tag="chunk"):
    """The next piece of a streamed ReplyEvent's body."""

    id: str
    data: bytes
    last: bool = False


class AdaptersEvent(_FromEngine, tag="adapters"):
    """The adapters an AdapterCommand concerns (all for "list", the one registered or
    unregistered otherwise): {"name": ..., "src": ...} each."""

    id: str
    adapters: list[dict[str, str]]


Event = TokenEvent | FinalEvent | ErrorEvent | StatsEvent | ReplyEvent | ChunkEvent | AdaptersEvent


class BatchEvent(_FromEngine, tag="batch"):
    """One step's events for one web worker, sent as one frame."""

    events: list[Event]


FromEngine = Event | BatchEvent


class MalformedFrame(ValueError):
    """A frame that is not msgpack, or not a message of the expected direction and types."""


_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_request(frame: bytes) -> ToEngine:
    """A frame the engine received from a front end."""
    try:
        return _to_engine.decode(frame)
    except msgspec.DecodeError as error:
        raise MalformedFrame(str(error)) from None


def decode_events(frame: bytes) -> list[Event]:
    """The events a frame from an engine carries: a batch's, or the one event it is."""
    try:
        message = _from_engine.decode(frame)
    except msgspec.DecodeError as error:
        raise MalformedFrame(str(error)) from None
    return message.events if isinstance(message, BatchEvent) else [message]


def request_id_of(frame: bytes) -> str | None:
    """The "id" of a frame that failed to decode as a request, if it has a readable one: enough
    to answer its sender with an error instead of leaving it to time out."""
    try:
        message = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    request_id = message.get("id") if isinstance(message, dict) else None
    return request_id if isinstance(request_id, str) else None


def adapter_refusal(
    request_id: str, adapter: str | None, served: Collection[str] | None
) -> ErrorEvent | None:
    """The answer to a request naming a LoRA adapter the engine does not serve (None when it
    is served, or the request names none): never the base model's answer instead."""
    if adapter is None or (served is not None and adapter in served):
        return None
    if served is None:
        message = (
            f"adapters: LoRA adapter {adapter!r} asked for, but LoRA is off"
            " (option.enable_lora=false)"
        )
        return ErrorEvent(request_id, 400, message)
    names = ", ".join(sorted(served)) or "none"
    message = (
        f"adapters: no LoRA adapter named {adapter!r} (the request's `adapters`, or `model` on"
        f" the OpenAI routes); served: {names}"
    )
    return ErrorEvent(request_id, 404, message)


def queue_full_event(request_id: str, limit: int) -> ErrorEvent:
    return ErrorEvent(request_id, 503, f"job queue full ({limit} requests waiting; job_queue_size)")
