"""What the front end and an engine say to each other over the IPC socket.

Every engine (the dynamic-batching HF engine and the rolling-batch MPI engine) speaks this: token
ids in, token ids out. Frames are msgpack maps, never pickle. The front end talks through a
DEALER socket, the engine answers through a ROUTER, so replies find the gunicorn worker that
asked. The rolling engine sends each web worker one frame per step: its events of that step in
a KIND_BATCH frame (a single event goes alone). Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import msgpack

ENGINE_SOCKET = "engine.sock"
STATE_FILE = "state.json"

# front end -> engine
OP_GENERATE = "generate"
OP_ABORT = "abort"
OP_STATS = "stats"
OP_COUNT_RESPONSE = "count_response"  # the front end's HTTP status of a finished request

# engine -> front end
KIND_TOKEN = "token"  # one more token of a request still running (rolling engine)
KIND_FINAL = "final"
KIND_ERROR = "error"
KIND_STATS = "stats"
KIND_BATCH = "batch"  # {"kind": "batch", "events": [event, ...]}: one step's events for a worker

# engine states, written to STATE_FILE
STATE_LOADING = "loading"
STATE_READY = "ready"
STATE_FAILED = "failed"


@dataclass(frozen=True)
class GenerationParams:
    """The parameters an engine acts on. Requests with equal params can share a static batch."""

    max_new_tokens: int = 30
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def batch_key(self) -> tuple:
        """Requests that may run in one HF `generate` call: everything but the length, which
        each request cuts to its own. Greedy ignores the sampling knobs (as the contract says),
        so all greedy requests batch together."""
        if not self.do_sample:
            return (False, self.repetition_penalty, self.ignore_eos)
        return (
            True,
            self.temperature,
            self.top_k,
            self.top_p,
            self.repetition_penalty,
            self.seed,
            self.ignore_eos,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def generate_message(
    request_id: str, prompt_ids: list[int], params: GenerationParams, stream: bool = True
) -> dict:
    """`stream=False`: no token events, the final event carries every token (the rolling
    engine; the Python engine only ever sends final events)."""
    return {
        "op": OP_GENERATE,
        "id": request_id,
        "prompt_ids": prompt_ids,
        "params": params.to_dict(),
        "stream": stream,
    }


def final_event(
    request_id: str,
    token_ids: list[int],
    log_probs: list[float],
    finish_reason: str,
    batch_size: int,
) -> dict:
    return {
        "kind": KIND_FINAL,
        "id": request_id,
        "token_ids": token_ids,
        "log_probs": log_probs,
        "finish_reason": finish_reason,
        "batch_size": batch_size,
    }


def error_event(request_id: str, status: int, message: str) -> dict:
    return {"kind": KIND_ERROR, "id": request_id, "status": status, "message": message}


def queue_full_event(request_id: str, limit: int) -> dict:
    return error_event(
        request_id, 503, f"job queue full ({limit} requests waiting; job_queue_size)"
    )


def stats_event(request_id: str, stats: dict) -> dict:
    return {"kind": KIND_STATS, "id": request_id, "stats": stats}


def batch_event(events: list[dict]) -> dict:
    return {"kind": KIND_BATCH, "events": events}


def events_of(message: dict) -> list[dict]:
    """The events a frame from an engine carries: a batch's, or the frame itself."""
    if message.get("kind") == KIND_BATCH:
        events = message.get("events")
        if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
            raise ValueError("IPC batch frame without a list of events")
        return events
    return [message]


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict:
    message = msgpack.unpackb(frame, raw=False)
    if not isinstance(message, dict):
        raise ValueError("IPC frame is not a map")
    return message
