"""A user's `handle(inputs: Input) -> Output` in the engine process: the load-time call, batches
of raw requests in, one answer per request out.

DJL's conventions: at load, `handle` gets an Input with no content whose properties are the
model's options (`inputs.is_empty()` is how handlers tell); a batch of several requests is one
Input (`get_batches()`), and the Output answers them by position, through entries tagged with
`batch_index` or, untagged, one entry per request in order. A handler that returns None for a
request answers it with an empty body. Torch-free.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..custom.djl_io import Input, Output, encode_value

log = logging.getLogger(__name__)

_BATCH_TAG = "batch_"


@dataclass(frozen=True)
class RawRequest:
    """One HTTP request as the front end forwards it."""

    body: bytes
    headers: dict[str, str]


@dataclass
class Answer:
    """The HTTP answer to one request: a whole body, or (`stream`) pieces as they come."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: Iterator[bytes] | None = None


class HandlerError(Exception):
    """The user's handler raised: its request(s) get 424, the server goes on."""


class UserHandlerService:
    def __init__(self, module: ModuleType, name: str):
        handle = getattr(module, "handle", None)
        if not callable(handle):
            raise TypeError(f"{name} has no handle(inputs) function")
        self.name = name
        self._handle: Callable[[Input], Output | None] = handle

    def initialize(self, properties: dict[str, str]) -> None:
        """DJL's load-time call; an exception here fails start-up with its traceback."""
        self._handle(Input(properties))

    def answer(self, batch: list[RawRequest]) -> list[Answer]:
        """One answer per request of `batch`, in order. Raises HandlerError when the
        handler raised (the caller decides whether to retry the requests one by one)."""
        inputs = [Input.from_request(r.headers, r.body) for r in batch]
        given = inputs[0] if len(inputs) == 1 else Input.batch_of(inputs)
        try:
            output = self._handle(given)
        except Exception as error:
            log.exception("%s: handle() raised on a batch of %d", self.name, len(batch))
            raise HandlerError(f"{type(error).__name__}: {error}") from error
        return split_output(output, len(batch))


def split_output(output: Output | None, batch_size: int) -> list[Answer]:
    if output is None:  # DJL answers a None with an empty body
        return [Answer(200) for _ in range(batch_size)]
    if not isinstance(output, Output):
        message = f"handle() returned {type(output).__name__}, expected an Output (or None)"
        return [_error_answer(500, message) for _ in range(batch_size)]
    headers = {key.lower(): str(value) for key, value in output.properties.items()}
    if output.stream_content is not None:
        if batch_size != 1:
            message = "a streamed Output answers one request: use batch_size=1 with streaming"
            return [_error_answer(500, message) for _ in range(batch_size)]
        headers.setdefault("content-type", "application/jsonlines")
        return [Answer(output.code, headers, stream=_pieces(output.stream_content))]
    bodies = _bodies_by_request(output, batch_size)
    if bodies is None:
        message = (
            f"handle() answered {output.content.size()} untagged entries for a batch of"
            f" {batch_size}; add one per request, or tag them with batch_index"
        )
        return [_error_answer(500, message) for _ in range(batch_size)]
    return [Answer(output.code, _with_content_type(headers, body), body) for body in bodies]


def _bodies_by_request(output: Output, batch_size: int) -> list[bytes] | None:
    entries = output.content.items()
    tagged: dict[int, list[bytes]] = {}
    untagged: list[bytes] = []
    for key, value in entries:
        index = _batch_index(key)
        if index is None:
            untagged.append(bytes(value))
        else:
            tagged.setdefault(index, []).append(bytes(value))
    if tagged:
        return [b"".join(tagged.get(i, [])) for i in range(batch_size)]
    if batch_size == 1:
        return [b"".join(untagged)]
    if len(untagged) == batch_size:
        return untagged
    return None


def _batch_index(key: str | None) -> int | None:
    """`batch_3.data` (what `Output.add(..., batch_index=3)` writes) -> 3."""
    if not key or not key.startswith(_BATCH_TAG):
        return None
    index = key[len(_BATCH_TAG) :].partition(".")[0]
    return int(index) if index.isdigit() else None


def _with_content_type(headers: dict[str, str], body: bytes) -> dict[str, str]:
    """The handler's content-type, else what the body is: JSON, UTF-8 text, or bytes."""
    if "content-type" in headers:
        return headers
    return {**headers, "content-type": _sniff(body)}


def _sniff(body: bytes) -> str:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "application/octet-stream"
    try:
        json.loads(text)
    except ValueError:
        return "text/plain; charset=utf-8"
    return "application/json"


def _pieces(stream: Iterator[Any]) -> Iterator[bytes]:
    """Text and bytes as they are; anything else as one JSON line (a stream's default type is
    application/jsonlines)."""
    for piece in stream:
        if isinstance(piece, (str, bytes, bytearray)):
            yield encode_value(piece)
        else:
            yield encode_value(piece) + b"\n"


def _error_answer(status: int, message: str) -> Answer:
    body = json.dumps({"code": status, "message": message}).encode()
    return Answer(status, {"content-type": "application/json"}, body)
