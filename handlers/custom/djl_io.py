"""`Input` and `Output` with the interface of DJL Serving's `djl_python` package, so that a
`model.py` written for DJL (`def handle(inputs: Input) -> Output`) runs unchanged.

The behaviour follows DJL's: an Input holds the request's properties (its HTTP headers; at
load time, the model's options) and named content entries (the body is "data"); a batch of
requests arrives as one Input whose properties hold `batch_size` and whose entries are named
`batch_<index:03d>_<name>`. An Output holds a status code, a message, properties (response
headers such as `content-type`) and content entries (bytes); `batch_index` tags an entry with
the request it answers; `add_stream_content` makes the answer a stream of pieces.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..djl.custom_attributes import custom_attributes_of

log = logging.getLogger(__name__)

BATCH_SIZE = "batch_size"
_BATCH_PREFIX = "batch_"


class Entries:
    """Named values in order; several may share a name (DJL's PairList)."""

    def __init__(self, pairs: Iterable[tuple[str | None, Any]] = ()):
        self._pairs: list[tuple[str | None, Any]] = list(pairs)

    def add(self, key: str | None = None, value: Any = None) -> None:
        self._pairs.append((key, value))

    def get(self, key: str) -> Any:
        return next((value for name, value in self._pairs if name == key), None)

    def size(self) -> int:
        return len(self._pairs)

    def is_empty(self) -> bool:
        return not self._pairs

    def key_at(self, index: int) -> str | None:
        return self._pairs[index][0]

    def value_at(self, index: int) -> Any:
        return self._pairs[index][1]

    def get_keys(self) -> list[str | None]:
        return [name for name, _ in self._pairs]

    def get_values(self) -> list[Any]:
        return [value for _, value in self._pairs]

    def items(self) -> list[tuple[str | None, Any]]:
        return list(self._pairs)


class Input:
    def __init__(self, properties: dict[str, str] | None = None, content: Entries | None = None):
        self.properties: dict[str, str] = dict(properties or {})
        self.content = content if content is not None else Entries()
        self.function_name: str | None = None

    @classmethod
    def from_request(cls, headers: Mapping[str, str], body: bytes) -> Input:
        """One HTTP request as DJL hands it over: headers as properties, the body as "data".
        As in DJL, each SageMaker custom attribute (`key=value;...`) is a property of its own;
        a header of the same name wins, so an attribute cannot change how the body is read."""
        properties = dict(headers)
        header_names = {name.lower() for name in headers}
        for key, value in custom_attributes_of(headers).items():
            if key.lower() not in header_names:
                properties[key] = value
        return cls(properties, Entries([("data", body)]))

    @classmethod
    def batch_of(cls, requests: list[Input]) -> Input:
        """Several requests as one batched Input (what `get_batches` takes apart)."""
        properties = {BATCH_SIZE: str(len(requests))}
        content = Entries()
        for index, request in enumerate(requests):
            for key, value in request.properties.items():
                properties[f"{_BATCH_PREFIX}{index:03d}_{key}"] = value
            for key, value in request.content.items():
                content.add(f"{_BATCH_PREFIX}{index:03d}_{key}", value)
        return cls(properties, content)

    @property
    def content_type(self) -> str | None:
        return self.get_property("content-type")

    def is_batch(self) -> bool:
        return BATCH_SIZE in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get(BATCH_SIZE, "1"))

    def get_batches(self) -> list[Input]:
        if not self.is_batch():
            return [self]
        batch = [Input() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            split = _split_batch_key(key)
            if split is not None:
                batch[split[0]].properties[split[1]] = value
        for key, value in self.content.items():
            split = _split_batch_key(key or "")
            if split is not None:
                batch[split[0]].content.add(split[1], value)
        return batch

    def get_function_name(self) -> str | None:
        return self.function_name

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        """Case-insensitive, as HTTP header names are."""
        return next((v for k, v in self.properties.items() if k.lower() == key.lower()), None)

    def get_content(self) -> Entries:
        return self.content

    def contains_key(self, key: str) -> bool:
        return self.content.get(key) is not None

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def get_as_bytes(self, key: str | None = None) -> bytes | None:
        if self.content.is_empty():
            return None
        if key:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"requested data for key:{key} is not found!")
            return bytes(value)
        value = self.content.get("data")
        return bytes(value if value is not None else self.content.value_at(0))

    def get_as_string(self, key: str | None = None) -> str:
        return (self.get_as_bytes(key) or b"").decode("utf-8")

    def get_as_json(self, key: str | None = None) -> Any:
        return json.loads(self.get_as_string(key))

    def get_data(self, key: str | None = None) -> Any:
        """JSON for JSON content types, text for text/*, else bytes (DJL's dispatch)."""
        content_type = self.content_type or ""
        if content_type.startswith("application/json"):
            return self.get_as_json(key)
        if content_type.startswith("text/"):
            return self.get_as_string(key)
        return self.get_as_bytes(key)


def _split_batch_key(key: str) -> tuple[int, str] | None:
    """`batch_001_inputs` -> (1, "inputs"); None for keys that are not per request."""
    if not key.startswith(_BATCH_PREFIX) or key == BATCH_SIZE:
        return None
    index, _, name = key[len(_BATCH_PREFIX) :].partition("_")
    return (int(index), name) if index.isdigit() else None


class Output:
    def __init__(self, code: int = 200, message: str = "OK"):
        self.code = code
        self.message = message
        self.properties: dict[str, str] = {}
        self.content = Entries()
        self.stream_content: Iterator[Any] | None = None

    def set_code(self, code: int) -> Output:
        self.code = code
        return self

    def set_message(self, message: str) -> Output:
        self.message = message
        return self

    def error(self, error: str, code: int = 424, message: str = "prediction failure") -> Output:
        self.code, self.message = code, message
        self.add_property("content-type", "application/json")
        return self.add_as_json({"code": code, "message": message, "error": error})

    def add_property(self, key: str, value: str) -> Output:
        self.properties[key] = value
        return self

    def add(self, value: Any, key: str | None = None, batch_index: int | None = None) -> Output:
        """str -> UTF-8, bytes as they are, anything else as JSON."""
        if key is not None and not isinstance(key, str):
            log.warning("Output key should be a str, got %s", type(key).__name__)
            key = str(key)
        if batch_index is not None:
            key = f"{_BATCH_PREFIX}{batch_index}.{key or ''}"
        self.content.add(key, encode_value(value))
        return self

    def add_as_json(self, value: Any, key: str | None = None, batch_index=None) -> Output:
        return self.add(encode_json(value), key, batch_index)

    def add_stream_content(self, stream: Iterable[Any], output_formatter: Any = None) -> Output:
        """The answer is `stream`'s pieces, each sent as soon as it is produced."""
        self.stream_content = iter(stream)
        return self


def encode_value(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return encode_json(value)


def encode_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, default=_to_json).encode()


def _to_json(value: Any) -> Any:
    """numpy scalars and arrays, which handlers often return (DJL's encoder does the same)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "isoformat"):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
