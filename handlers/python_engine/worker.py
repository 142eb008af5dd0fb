"""engine=Python: the engine process.
`python -m lmserve.handlers.python_engine.worker RUNTIME_JSON`.

Loads the model (or the user's handler), binds the engine socket, then loops: take requests from
the front ends into the dynamic batcher, run whichever batch is due, answer every request in it.
What a batch is depends on the work: token ids through HF `generate` (hf_work.py), or raw
requests through a model.py's `handle` (user_handler_work.py).

The LoRA adapter management API is answered as the rolling engine answers it (the HF work's
`adapters`, rolling_batch/adapter_registry.py), between batches: an unregistered adapter is
refused to new requests at once and dropped once no queued request names it. Requests admitted
and tokens generated are counted per adapter, under the rolling engine's stats keys.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Protocol

import zmq

from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.adapter_registry import lora_off_answer
from lmserve.rolling_batch.ipc import drain_router
from lmserve.rolling_batch.runtime import Runtime, write_state

from .dynamic_batcher import DynamicBatcher, PendingRequest

log = logging.getLogger("lmserve.engine")

_IDLE_POLL_MS = 1000


class BatchWork(Protocol):
    """What a batch is. A work that serves LoRA adapters (HF generate) also has `adapters`, a
    rolling_batch.adapter_registry.ServedAdapters (None: LoRA is off); a model.py's has none,
    and is told it takes no adapter commands."""

    request_type: type  # the request message this work takes
    num_failed: int

    def batch_key(self, message) -> tuple: ...

    def refusal(self, message) -> protocol.ErrorEvent | None:
        """The answer to a request this work will not run (None: it will), given before the
        request is queued."""
        ...

    def run(self, batch: list[PendingRequest], send) -> int:
        """Answers every request of `batch` through `send(identity, event)`; returns how many
        requests ran in a batch (for the batch-size stats)."""
        ...


class PythonEngineLoop:
    def __init__(self, runtime: Runtime, work: BatchWork, socket: zmq.Socket):
        config = runtime.config
        self.work = work
        self.socket = socket
        self.batcher = DynamicBatcher(
            config.batch_size, config.max_batch_delay / 1000.0, config.job_queue_size
        )
        self.batch_sizes: Counter[int] = Counter()
        self.http_responses: Counter[int] = Counter()  # counted here so all web workers agree
        self.slot_timeout_s = config.predict_timeout
        # LoRA: requests admitted and tokens generated per adapter (the base model's are not
        # here), and the adapter of each request in the engine that names one: a batch runs to
        # completion within a turn of the loop, so between batches these are the queued ones.
        self.adapter_requests: Counter[str] = Counter()
        self.adapter_tokens: Counter[str] = Counter()
        self.adapter_of: dict[str, str] = {}

    def run_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            wait = self.batcher.seconds_until_due(time.monotonic())
            timeout_ms = _IDLE_POLL_MS if wait is None else int(wait * 1000) + 1
            if poller.poll(timeout_ms):
                drain_router(self.socket, self._handle)
            self.expire_waiting(time.monotonic())
            batch = self.batcher.next_batch(time.monotonic())
            if batch:
                self.run_batch(batch)
            self.retire_unused_adapters()

    def expire_waiting(self, now: float) -> None:
        """option.predict_timeout bounds the wait for a batch: requests queued longer (behind
        long batches) are answered instead of waiting on."""
        for request in self.batcher.pop_expired(now - self.slot_timeout_s):
            message = (
                f"no batch started within {self.slot_timeout_s:g} s (option.predict_timeout);"
                " the server is busy, retry later"
            )
            self._send(request.reply_to, protocol.ErrorEvent(request.request_id, 503, message))

    def run_batch(self, batch: list[PendingRequest]) -> None:
        if self.work.run(batch, self._send):
            self.batch_sizes[len(batch)] += 1

    def retire_unused_adapters(self) -> None:
        """Drops the unregistered adapters no queued request names anymore."""
        adapters = getattr(self.work, "adapters", None)
        if adapters is not None and adapters.retiring:
            adapters.retire_unused(set(self.adapter_of.values()))

    def _handle(self, identity: bytes, message: protocol.ToEngine) -> None:
        if isinstance(message, self.work.request_type):
            self._admit(identity, message)
        elif isinstance(message, (protocol.GenerateRequest, protocol.HandleRequest)):
            # A front end that disagrees with this engine about the handler: answer, never hang.
            reason = f"this engine takes {self.work.request_type.__name__}s only"
            self._send(identity, protocol.ErrorEvent(message.id, 500, reason))
        elif isinstance(message, protocol.AbortRequest):
            if self.batcher.remove(message.id) is not None:
                self.adapter_of.pop(message.id, None)
        elif isinstance(message, protocol.CountResponse):
            self.http_responses[message.status] += 1
        elif isinstance(message, protocol.StatsRequest):
            self._send(identity, protocol.StatsEvent(message.id, self.stats()))
        elif isinstance(message, protocol.AdapterCommand) and hasattr(self.work, "adapters"):
            self._send(identity, self._answer_adapters(message))
        elif isinstance(getattr(message, "id", None), str):
            # A request of a kind only the other engine takes: answered, never left to hang.
            reason = f"engine=Python does not take {type(message).__name__} messages"
            self._send(identity, protocol.ErrorEvent(message.id, 501, reason))

    def _admit(self, identity: bytes, message) -> None:
        # Before the queue check: a request that can never run is not told to retry.
        refusal = self.work.refusal(message)
        if refusal is not None:
            self._send(identity, refusal)
            return
        if not self.batcher.can_add():
            limit = self.batcher.max_queued
            self._send(identity, protocol.queue_full_event(message.id, limit))
            return
        key = self.work.batch_key(message)
        self.batcher.add(PendingRequest(message.id, identity, message, key, time.monotonic()))
        adapter = message.params.adapter if isinstance(message, protocol.GenerateRequest) else None
        if adapter is not None:
            self.adapter_requests[adapter] += 1
            self.adapter_of[message.id] = adapter

    def _answer_adapters(self, command: protocol.AdapterCommand) -> protocol.Event:
        if self.work.adapters is None:
            return lora_off_answer(command)
        return self.work.adapters.answer(command, set(self.adapter_of.values()))

    def stats(self) -> dict:
        return {
            "batch_sizes": {str(size): count for size, count in sorted(self.batch_sizes.items())},
            "num_queued": self.batcher.num_queued,
            "num_failed": self.work.num_failed,
            "http_responses": {str(k): v for k, v in self.http_responses.items()},
            "adapter_requests": dict(self.adapter_requests),
            "adapter_tokens": dict(self.adapter_tokens),
        }

    def _send(self, identity: bytes, event: protocol.FromEngine) -> None:
        if isinstance(event, (protocol.FinalEvent, protocol.ErrorEvent)):
            # Its last event: the request leaves the engine.
            adapter = self.adapter_of.pop(event.id, None)
            if adapter is not None and isinstance(event, protocol.FinalEvent):
                self.adapter_tokens[adapter] += len(event.token_ids)
        self.socket.send_multipart([identity, protocol.encode(event)])


def load_hf_work(runtime: Runtime) -> tuple[BatchWork, dict]:
    from .hf_engine import HFEngine
    from .hf_work import HFGenerateWork

    config = runtime.config
    started = time.monotonic()
    engine = HFEngine.load(
        runtime.model_path,
        config.dtype,
        config.trust_remote_code,
        enable_lora=config.enable_lora,
        max_lora_rank=config.max_lora_rank,
        adapters_dir=runtime.adapters_dir,
    )
    dtype = str(engine.dtype).removeprefix("torch.")
    log.info(
        "engine=Python model %s loaded in %.1f s: dtype=%s device=%s",
        runtime.model_name,
        time.monotonic() - started,
        dtype,
        engine.device,
    )
    return HFGenerateWork(engine), {"dtype": dtype, "device": engine.device}


def load_user_handler_work(runtime: Runtime, entry_point: str) -> tuple[BatchWork, dict]:
    """The model.py's module, and DJL's load-time `handle` call with the model's options."""
    from ..user_code import EntryPoint, load
    from .custom_service import UserHandlerService
    from .user_handler_work import UserHandlerWork

    model_dir = Path(runtime.model_path)
    entry = EntryPoint.from_location(entry_point)
    started = time.monotonic()
    service = UserHandlerService(load(entry, model_dir), entry_point)
    service.initialize(handler_properties(runtime))
    log.info("engine=Python handler %s loaded in %.1f s", entry_point, time.monotonic() - started)
    return UserHandlerWork(service), {"handler": entry_point}


def handler_properties(runtime: Runtime) -> dict[str, str]:
    """What DJL's load-time Input carries: the options (unknown option.* keys included: they
    are kept for custom handlers) and the model directory."""
    config = runtime.config.to_dict()
    properties = {
        key: str(value)
        for key, value in config.items()
        if value is not None and not isinstance(value, dict)
    }
    properties.update(runtime.config.extra_options)
    properties["model_dir"] = runtime.model_path
    return properties


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runtime", help="runtime.json written by `lmserve serve`")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    runtime = Runtime.read(args.runtime)
    config = runtime.config
    try:
        if runtime.entry_point is None:
            work, details = load_hf_work(runtime)
        else:
            work, details = load_user_handler_work(runtime, runtime.entry_point)
    except Exception as error:
        # /ping and the supervisor show why, not just an exit code; the traceback goes to the log.
        log.exception("the model failed to load")
        write_state(runtime, protocol.EngineState.FAILED, f"model failed to load: {error!r}"[:2000])
        raise SystemExit(1) from None
    log.info(
        "batch_size=%d max_batch_delay=%d ms job_queue_size=%d",
        config.batch_size,
        config.max_batch_delay,
        config.job_queue_size,
    )
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(runtime.engine_address)
    write_state(runtime, protocol.EngineState.READY, **details)
    PythonEngineLoop(runtime, work, socket).run_forever()


if __name__ == "__main__":
    main()
