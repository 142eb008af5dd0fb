"""engine=Python's built-in work: batches of token ids through HF transformers' `generate`.

Requests batch by their generation parameters, the LoRA adapter among them; one naming an
adapter that is not served (or unregistered) is refused before it is queued. The adapters are
the management API's to change, as in the rolling batch (rolling_batch/lora/registry.py);
the engine loop answers its commands between batches, so the model changes only then. A failing
batch is retried request by request, so one bad request cannot fail its neighbours; a request
that fails alone gets 424 (507 when out of memory)."""

from __future__ import annotations

import logging
from pathlib import Path

from lmserve.rolling_batch.engine.out_of_memory import failure_status
from lmserve.rolling_batch.engine.shell import Outbox
from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.lora.registry import ServedAdapters

from .dynamic_batcher import PendingRequest
from .hf_engine import HFEngine

log = logging.getLogger("lmserve.engine")


class HFGenerateWork:
    request_type = protocol.GenerateRequest

    def __init__(self, engine: HFEngine):
        self.engine = engine
        self.num_failed = 0
        # The LoRA adapters served; None: LoRA is off.
        self.adapters = None if engine.adapters is None else PeftAdapters(engine)

    def batch_key(self, message: protocol.GenerateRequest) -> tuple:
        return message.params.batch_key()

    def refusal(self, message: protocol.GenerateRequest) -> protocol.ErrorEvent | None:
        # A LoRA adapter that is not served (or LoRA off) is refused, never answered by the
        # base model.
        return protocol.adapter_refusal(message.id, message.params.adapter, self.adapters)

    def run(self, batch: list[PendingRequest], outbox: Outbox) -> int:
        """Answers every request of `batch`; the sizes of the batches that ran, summed."""
        try:
            results = self.engine.generate(
                [r.message.prompt_ids for r in batch], [r.message.params for r in batch]
            )
        except Exception as error:  # noqa: BLE001 - any model failure answers, never crashes
            if len(batch) == 1:
                self._fail(batch[0], error, outbox)
                return 0
            log.warning("batch of %d failed (%s); retrying one by one", len(batch), error)
            results = None
        if results is None:
            # Out of the except block: the failed batch's tensors, held by the traceback's
            # frames, are freed before the retries (after out of memory they need the room).
            return sum(self.run([request], outbox) for request in batch)
        for request, result in zip(batch, results):
            final = protocol.FinalEvent(
                request.request_id,
                result.token_ids,
                result.log_probs,
                result.finish_reason,
                len(batch),
                # None unless the request asked for them.
                top_logprobs=result.top_logprobs,
                prompt_log_probs=result.prompt_log_probs,
                prompt_top_logprobs=result.prompt_top_logprobs,
            )
            outbox.send(request.reply_to, final)
        return len(batch)

    def _fail(self, request: PendingRequest, error: Exception, outbox: Outbox) -> None:
        self.num_failed += 1
        log.error("request %s failed: %r", request.request_id, error)
        outbox.send(
            request.reply_to,
            protocol.ErrorEvent(
                request.request_id, failure_status(error), f"{type(error).__name__}: {error}"
            ),
        )


class PeftAdapters(ServedAdapters):
    """engine=Python's adapters: put on the model through PEFT when registered, taken off when
    unregistered and no queued request uses them anymore."""

    def __init__(self, engine: HFEngine):
        super().__init__({name: str(folder) for name, folder in engine.adapter_folders.items()})
        self.engine = engine

    def _load(self, name: str, folder: Path) -> None:
        self.engine.add_adapter(name, folder)
        log.info("LoRA adapter %s registered from %s", name, folder)

    def _drop(self, names: set[str]) -> None:
        for name in sorted(names):
            self.engine.remove_adapter(name)
            log.info("LoRA adapter %s unregistered and taken off the model", name)
