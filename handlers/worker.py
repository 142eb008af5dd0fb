"""engine=Python: the engine process. `python -m lmserve.handlers.worker RUNTIME_JSON`.

Loads the model, binds the engine socket, then loops: take requests from the front ends into
the dynamic batcher, run whichever batch is due, send one final event per request. A failing
batch is retried request by request so one bad request cannot fail its neighbours.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter

import torch
import zmq

from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.ipc import drain_router
from lmserve.rolling_batch.runtime import Runtime, write_state

from .dynamic_batcher import DynamicBatcher, PendingRequest
from .hf_engine import HFEngine

log = logging.getLogger("lmserve.engine")

_IDLE_POLL_MS = 1000


class PythonEngineLoop:
    def __init__(self, runtime: Runtime, engine: HFEngine, socket: zmq.Socket):
        config = runtime.config
        self.engine = engine
        self.socket = socket
        self.batcher = DynamicBatcher(
            config.batch_size, config.max_batch_delay / 1000.0, config.job_queue_size
        )
        self.batch_sizes: Counter[int] = Counter()
        self.http_responses: Counter[int] = Counter()  # counted here so all web workers agree
        self.num_failed = 0

    def run_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            wait = self.batcher.seconds_until_due(time.monotonic())
            timeout_ms = _IDLE_POLL_MS if wait is None else int(wait * 1000) + 1
            if poller.poll(timeout_ms):
                drain_router(self.socket, self._handle)
            batch = self.batcher.next_batch(time.monotonic())
            if batch:
                self._run_batch(batch)

    def _handle(self, identity: bytes, message: protocol.ToEngine) -> None:
        if isinstance(message, protocol.GenerateRequest):
            if not self.batcher.can_add():
                limit = self.batcher.max_queued
                self._send(identity, protocol.queue_full_event(message.id, limit))
                return
            self.batcher.add(
                PendingRequest(
                    message.id, identity, message.prompt_ids, message.params, time.monotonic()
                )
            )
        elif isinstance(message, protocol.AbortRequest):
            self.batcher.remove(message.id)
        elif isinstance(message, protocol.CountResponse):
            self.http_responses[message.status] += 1
        elif isinstance(message, protocol.StatsRequest):
            self._send(identity, protocol.StatsEvent(message.id, self.stats()))

    def stats(self) -> dict:
        return {
            "batch_sizes": {str(size): count for size, count in sorted(self.batch_sizes.items())},
            "num_queued": self.batcher.num_queued,
            "num_failed": self.num_failed,
            "http_responses": {str(k): v for k, v in self.http_responses.items()},
        }

    def _run_batch(self, batch: list[PendingRequest]) -> None:
        try:
            results = self.engine.generate([r.prompt_ids for r in batch], [r.params for r in batch])
        except Exception as error:  # noqa: BLE001 - any model failure answers, never crashes
            if len(batch) == 1:
                self._fail(batch[0], error)
                return
            log.warning("batch of %d failed (%s); retrying one by one", len(batch), error)
            for request in batch:
                self._run_batch([request])
            return
        self.batch_sizes[len(batch)] += 1
        for request, result in zip(batch, results):
            self._send(
                request.reply_to,
                protocol.FinalEvent(
                    request.request_id,
                    result.token_ids,
                    result.log_probs,
                    result.finish_reason,
                    len(batch),
                ),
            )

    def _fail(self, request: PendingRequest, error: Exception) -> None:
        self.num_failed += 1
        out_of_memory = isinstance(error, (torch.OutOfMemoryError, MemoryError))
        log.error("request %s failed: %r", request.request_id, error)
        status = 507 if out_of_memory else 424
        message = f"{type(error).__name__}: {error}"
        self._send(request.reply_to, protocol.ErrorEvent(request.request_id, status, message))

    def _send(self, identity: bytes, event: protocol.FromEngine) -> None:
        self.socket.send_multipart([identity, protocol.encode(event)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runtime", help="runtime.json written by `lmserve serve`")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    runtime = Runtime.read(args.runtime)
    config = runtime.config
    started = time.monotonic()
    try:
        engine = HFEngine.load(runtime.model_path, config.dtype, config.trust_remote_code)
    except Exception as error:
        # /ping and the supervisor show why, not just an exit code.
        write_state(runtime, protocol.EngineState.FAILED, f"model failed to load: {error!r}"[:2000])
        raise
    log.info(
        "engine=Python model %s loaded in %.1f s: dtype=%s device=%s batch_size=%d"
        " max_batch_delay=%d ms job_queue_size=%d",
        runtime.model_name,
        time.monotonic() - started,
        str(engine.dtype).removeprefix("torch."),
        engine.device,
        config.batch_size,
        config.max_batch_delay,
        config.job_queue_size,
    )
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.bind(runtime.engine_address)
    write_state(
        runtime,
        protocol.EngineState.READY,
        dtype=str(engine.dtype).removeprefix("torch."),
        device=engine.device,
    )
    PythonEngineLoop(runtime, engine, socket).run_forever()


if __name__ == "__main__":
    main()
