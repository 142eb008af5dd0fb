"""One inference request, start to finish, on the front end: tokenize and check the prompt
against the context, send each input to the engine, wait for its final event, shape the reply.
Every accepted request ends in exactly one answer: the outputs, or one error."""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass
from pathlib import Path

from lmserve.handlers.outputs import complete, shape_response, to_json
from lmserve.handlers.request_parsing import BadRequest, TextRequest
from lmserve.handlers.tokenizer import Tokenizer
from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.runtime import Runtime

from .engine_client import EngineClient


@dataclass
class PredictionError(Exception):
    status: int
    message: str


def max_model_len(runtime: Runtime) -> int:
    """option.max_model_len, else the model's own context length."""
    if runtime.config.max_model_len is not None:
        return runtime.config.max_model_len
    model_config = json.loads((Path(runtime.model_path) / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(model_config.get(key), int):
            return model_config[key]
    return 2048  # what HF assumes for models that do not say


class Predictor:
    def __init__(self, runtime: Runtime, client: EngineClient):
        self.runtime = runtime
        self.client = client
        self.tokenizer = Tokenizer(runtime.model_path, runtime.config.trust_remote_code)
        self.max_model_len = max_model_len(runtime)

    def predict(self, request: TextRequest, request_id: str) -> dict | list:
        prompts = [self._prompt_ids(text, request) for text in request.inputs]
        events = self._generate(prompts, request, request_id)
        config = self.runtime.config
        outputs = []
        for text, event in zip(request.inputs, events):
            completion = complete(
                self.tokenizer,
                text,
                event["token_ids"],
                event["log_probs"],
                event["finish_reason"],
                request.stop_sequences,
            )
            outputs.append(
                to_json(
                    completion,
                    self.tokenizer,
                    request.details,
                    request.return_full_text,
                    config.tgi_compat,
                )
            )
        return shape_response(outputs, request.batched, config.tgi_compat)

    def _prompt_ids(self, text: str, request: TextRequest) -> list[int]:
        prompt_ids = self.tokenizer.encode(text)
        limit = self.max_model_len
        if not prompt_ids:
            raise BadRequest("inputs", "the prompt is empty (no tokens)")
        if len(prompt_ids) >= limit:
            raise BadRequest(
                "inputs", f"the prompt has {len(prompt_ids)} tokens; the context is {limit} tokens"
            )
        max_new_tokens = request.params.max_new_tokens
        if len(prompt_ids) + max_new_tokens > limit:
            raise BadRequest(
                "parameters.max_new_tokens",
                f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens exceed the"
                f" context of {limit} tokens; at most {limit - len(prompt_ids)} new tokens fit",
            )
        return prompt_ids

    def _generate(self, prompts: list[list[int]], request: TextRequest, request_id: str):
        ids = [f"{request_id}/{index}" for index in range(len(prompts))]
        queues = [
            self.client.submit(protocol.generate_message(i, p, request.params))
            for i, p in zip(ids, prompts)
        ]
        deadline = time.monotonic() + self.runtime.config.predict_timeout
        finished: set[str] = set()
        try:
            events = []
            for engine_id, events_queue in zip(ids, queues):
                event = self._wait(events_queue, deadline)
                finished.add(engine_id)
                if event["kind"] == protocol.KIND_ERROR:
                    raise PredictionError(event["status"], event["message"])
                events.append(event)
            return events
        finally:
            for engine_id in ids:
                self.client.finish(engine_id, abort=engine_id not in finished)

    def _wait(self, events_queue: queue.SimpleQueue, deadline: float) -> dict:
        try:
            return events_queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise PredictionError(
                424,
                f"prediction timed out after {self.runtime.config.predict_timeout} s"
                " (option.predict_timeout)",
            ) from None
