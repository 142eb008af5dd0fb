"""One inference request, start to finish, on the front end, whatever its route: a
GenerationJob (job.py) in; render a chat, tokenize and check each prompt against the context,
send each sequence to the engine, follow its events (token events from the rolling engine, one
final event from either engine), detokenize and apply stop sequences, and hand the result to
the job's Responder for its dialect's answer or stream. Every accepted request ends in exactly
one answer: the outputs, or one error."""

from __future__ import annotations

import dataclasses
import queue
import time

import msgspec

from lmserve.rolling_batch.ipc import protocol
from lmserve.rolling_batch.ipc.runtime import Runtime
from lmserve.rolling_batch.model.context_length import context_length_of

from .agents.reasoning import reasoning_format
from .interface import EngineConnection, PredictionError, next_event
from .job import BadRequest, GenerationJob
from .outputs import Generation, complete
from .responder import Responder
from .streamed_sequences import StreamedSequence, stream_events
from .tokenizer import ChatTemplate, IncrementalDetokenizer, Tokenizer
from .truncation import keep_last_tokens


class Predictor:
    def __init__(self, runtime: Runtime, client: EngineConnection):
        self.runtime = runtime
        self.client = client
        self.tokenizer = Tokenizer(runtime.model_path, runtime.config.trust_remote_code)
        self.max_model_len = context_length_of(runtime.model_path, runtime.config.max_model_len)
        self.chat_template = ChatTemplate(runtime.model_path)
        self.reasoning = reasoning_format(runtime.config.reasoning_parser)

    def run(self, job: GenerationJob, request_id: str, responder: Responder, client_gone=None):
        """The job's answer as `responder` shapes it: the whole answer (`responder.answer`),
        or for a streamed job the iterator of its pieces, returned once the engine accepted
        the sequences (a refusal is still an ordinary error). `client_gone()` says whether
        the HTTP client hung up meanwhile."""
        fields = job.prompt_fields
        texts = job.prompts
        if job.messages is not None:
            texts = [self.chat_template.render(job.messages, job.tools)]
            if self.reasoning is not None and job.params.grammar is not None:
                # The grammar is the answer's: a reasoning model thinks first.
                grammar = self.reasoning.after_thinking(job.params.grammar, texts[0])
                job = dataclasses.replace(
                    job, params=msgspec.structs.replace(job.params, grammar=grammar)
                )
        prompts = [
            self.prompt_ids(
                text,
                job.params.max_new_tokens,
                fields.prompt,
                fields.max_new_tokens,
                fields.add_special_tokens,
                job.truncate,
            )
            for text in texts
        ]
        each = job.best_of
        params = [
            sequence
            for index in range(len(prompts))
            for sequence in sequence_params(job.params_of_prompt(index), each)
        ]
        if job.stream:
            (text,), (ids,) = texts, prompts
            return self._stream(text, ids, params, job.stop_sequences, request_id, responder)
        sequences = [(text, ids) for text, ids in zip(texts, prompts) for _ in range(each)]
        generations = self._generate_all(
            [ids for _, ids in sequences], params, request_id, client_gone, job.stop_sequences
        )
        completions = [
            complete(self.tokenizer, text, generation, job.stop_sequences, ids)
            for (text, ids), generation in zip(sequences, generations)
        ]
        return responder.answer(
            [completions[start : start + each] for start in range(0, len(completions), each)]
        )

    def _stream(self, prompt, prompt_ids, params, stop_sequences, request_id, responder):
        """Submits the sequences of one prompt (`params`, one each) and waits for the first
        event, so that a refusal (queue full, too long) is still an ordinary error response;
        then returns the event stream, shaped by `responder`."""
        engine_ids = [f"{request_id}/{index}" for index in range(len(params))]
        events: queue.SimpleQueue = queue.SimpleQueue()  # every sequence's, in arrival order
        for engine_id, sequence in zip(engine_ids, params):
            self.client.submit(protocol.GenerateRequest(engine_id, prompt_ids, sequence), events)
        submitted = time.monotonic()
        try:
            first = self._next_event(events, submitted)
        except PredictionError:
            for engine_id in engine_ids:
                self.client.finish(engine_id, abort=True)
            raise
        sequences = {
            engine_id: StreamedSequence(
                index, prompt, prompt_ids, IncrementalDetokenizer(self.tokenizer, stop_sequences)
            )
            for index, engine_id in enumerate(engine_ids)
        }
        following = lambda: self._next_event(events, submitted)  # noqa: E731
        return stream_events(sequences, first, following, self.client, responder, self.tokenizer)

    def _generate_all(
        self, prompts, params, request_id: str, client_gone, stop_sequences=()
    ) -> list[Generation]:
        """Each sequence's whole generation (`prompts` and `params` one per sequence; not
        streamed to the client). `client_gone()` says
        whether the HTTP client hung up meanwhile: then the engine drops the requests at once.
        With stop sequences the engine streams the tokens here, and a prompt whose text reaches
        one is ended in the engine there, instead of running on to max_new_tokens."""
        watch = bool(stop_sequences)
        engine_ids = [f"{request_id}/{index}" for index in range(len(prompts))]
        queues = [
            self.client.submit(protocol.GenerateRequest(i, p, q, stream=watch))
            for i, p, q in zip(engine_ids, prompts, params)
        ]
        submitted = time.monotonic()
        finished: set[str] = set()  # each engine request is finished exactly once
        try:
            generations = []
            for engine_id, events in zip(engine_ids, queues):
                generation = Generation()
                watcher = IncrementalDetokenizer(self.tokenizer, stop_sequences)
                while generation.finish_reason is None:
                    event = self._next_event(events, submitted, client_gone)
                    generation.add(event)
                    still_running = generation.finish_reason is None
                    if watch and still_running and _reaches_stop(watcher, event):
                        generation.finish_reason = protocol.FinishReason.STOP_SEQUENCE
                # A request ended by its stop sequence is still running in the engine.
                stopped_here = generation.finish_reason == protocol.FinishReason.STOP_SEQUENCE
                self.client.finish(engine_id, abort=stopped_here)
                finished.add(engine_id)
                generations.append(generation)
            return generations
        finally:
            for engine_id in engine_ids:
                if engine_id not in finished:
                    self.client.finish(engine_id, abort=True)

    def prompt_ids(
        self,
        text: str,
        max_new_tokens: int,
        field: str = "inputs",
        limit_field: str = "parameters.max_new_tokens",
        add_special_tokens: bool = True,
        truncate: int | None = None,
    ) -> list[int]:
        """The prompt's token ids (only the last `truncate` of them, TGI's `truncate`), checked
        against the context; errors name `field` (the prompt) or `limit_field` (the request's
        cap on new tokens)."""
        prompt_ids = self.tokenizer.encode(text, add_special_tokens)
        limit = self.max_model_len
        if truncate is not None:
            prompt_ids = keep_last_tokens(prompt_ids, truncate, limit)
        if not prompt_ids:
            raise BadRequest(field, "the prompt is empty (no tokens)")
        if len(prompt_ids) >= limit:
            raise BadRequest(
                field, f"the prompt has {len(prompt_ids)} tokens; the context is {limit} tokens"
            )
        if len(prompt_ids) + max_new_tokens > limit:
            raise BadRequest(
                limit_field,
                f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens exceed the"
                f" context of {limit} tokens; at most {limit - len(prompt_ids)} new tokens fit",
            )
        return prompt_ids

    def _next_event(self, events: queue.SimpleQueue, since: float, client_gone=None):
        timeout_s = self.runtime.config.predict_timeout
        return next_event(events, self.client, since, timeout_s, client_gone)


def sequence_params(params: protocol.GenerationParams, n: int) -> list[protocol.GenerationParams]:
    """The parameters of `n` sequences of one prompt (OpenAI's `n`): a seeded request's
    sequences get seeds seed, seed + 1, ... (reproducible, and different from each other);
    unseeded ones each draw their own."""
    if params.seed is None:
        return [params] * n
    return [msgspec.structs.replace(params, seed=params.seed + i) for i in range(n)]


def _reaches_stop(watcher: IncrementalDetokenizer, event: protocol.Event) -> bool:
    for token in event.token_ids:
        watcher.add(token)
        if watcher.stopped:
            return True
    return False
