"""One inference request, start to finish, on the front end: tokenize and check the prompt
against the context, send each input to the engine, follow its events (token events from the
rolling engine, one final event from either engine), shape the reply or the stream. Every
accepted request ends in exactly one answer: the outputs, or one error."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import msgspec

from lmserve.rolling_batch import protocol
from lmserve.rolling_batch.context_length import context_length_of
from lmserve.rolling_batch.runtime import Runtime

from .chat import ChatRequest, ChatResponder
from .chat_template import ChatTemplate
from .detokenizer import IncrementalDetokenizer
from .engine_events import PredictionError, next_event
from .interface import EngineConnection
from .outputs import Completion, Generation, complete, shape_response, to_json
from .request_parsing import BadRequest, TextRequest
from .streamed_sequences import StreamedSequence, shape_event, stream_events
from .tokenizer import Tokenizer
from .truncation import keep_last_tokens


class Predictor:
    def __init__(self, runtime: Runtime, client: EngineConnection):
        self.runtime = runtime
        self.client = client
        self.tokenizer = Tokenizer(runtime.model_path, runtime.config.trust_remote_code)
        self.max_model_len = context_length_of(runtime.model_path, runtime.config.max_model_len)
        self.chat_template = ChatTemplate(runtime.model_path)

    def predict(self, request: TextRequest, request_id: str, client_gone=None) -> dict | list:
        """The answer to every input; an input asking for several sequences (`n`, `best_of`)
        gets the most likely one, and the next `n - 1` as `details.best_of_sequences`."""
        prompts = [
            self.prompt_ids(text, request.params.max_new_tokens, truncate=request.truncate)
            for text in request.inputs
        ]
        each = request.num_sequences
        generations = self._generate_all(
            [ids for ids in prompts for _ in range(each)],
            [
                params
                for index in range(len(prompts))
                for params in sequence_params(request.params_of_input(index), each)
            ],
            request_id,
            client_gone,
            request.stop_sequences,
        )
        outputs = []
        for index, (text, ids) in enumerate(zip(request.inputs, prompts)):
            completions = [
                complete(self.tokenizer, text, generation, request.stop_sequences, ids)
                for generation in generations[index * each : (index + 1) * each]
            ]
            if each > 1:
                completions.sort(key=lambda c: c.cumulative_log_prob, reverse=True)
            best, others = completions[0], completions[1 : request.n]
            outputs.append(
                to_json(
                    best,
                    self.tokenizer,
                    request.details,
                    request.return_full_text,
                    self.runtime.config.tgi_compat,
                    others,
                )
            )
        return shape_response(outputs, request.batched, self.runtime.config.tgi_compat)

    def stream(self, request: TextRequest, request_id: str, fmt) -> Iterator[str]:
        if request.batched:
            raise BadRequest("inputs", "streaming takes one input, not a list")
        # As in LMI: the best of several sequences is known only at the end.
        if request.num_sequences > 1:
            name = "best_of" if request.best_of > request.n else "n"
            raise BadRequest(f"parameters.{name}", "several sequences are not streamed")
        if request.params.prompt_logprobs:
            raise BadRequest("parameters.decoder_input_details", "not with streaming")
        prompt_ids = self.prompt_ids(
            request.inputs[0], request.params.max_new_tokens, truncate=request.truncate
        )
        return self.stream_prompt(
            request.inputs[0], prompt_ids, request.params, request.stop_sequences, request_id, fmt
        )

    def stream_prompt(
        self, prompt, prompt_ids, params, stop_sequences, request_id, responder, n: int = 1
    ):
        """Submits `n` sequences of one prompt and waits for the first event, so that a
        refusal (queue full, too long) is still an ordinary error response; then returns the
        event stream, shaped by `responder` (`.token(...)`, `.done(...)`, `.error(...)`)."""
        engine_ids = [f"{request_id}/{index}" for index in range(n)]
        events: queue.SimpleQueue = queue.SimpleQueue()  # every sequence's, in arrival order
        for engine_id, sequence in zip(engine_ids, sequence_params(params, n)):
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

    def predict_shaped(self, request: TextRequest, request_id: str, responder, client_gone=None):
        """One input's whole answer as `responder` shapes it token by token (a model.py's
        output formatter): its pieces joined, as DJL joins a formatter's strings."""
        if request.batched:
            raise BadRequest("inputs", "a custom output formatter answers one input per request")
        prompt = request.inputs[0]
        prompt_ids = self.prompt_ids(
            prompt, request.params.max_new_tokens, truncate=request.truncate
        )
        (generation,) = self._generate_all(
            [prompt_ids], request.params, request_id, client_gone, request.stop_sequences
        )
        # The whole generation replayed as one final event through the streaming path.
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.stop_sequences)
        sequence = StreamedSequence(0, prompt, prompt_ids, detokenizer)
        replay = protocol.FinalEvent(
            "", generation.token_ids, generation.log_probs, generation.finish_reason, 1,
            generation.top_logprobs, generation.prompt_log_probs, generation.prompt_top_logprobs,
        )  # fmt: skip
        return "".join(shape_event(sequence, replay, responder, self.tokenizer))

    def chat(self, chat: ChatRequest, request_id: str, client_gone=None):
        """A `chat.completion`, or (streaming) the iterator of its chunks."""
        prompt = self.chat_template.render(chat.messages, chat.tools)
        prompt_ids = self.prompt_ids(
            prompt,
            chat.params.max_new_tokens,
            field="messages",
            limit_field="max_tokens",
            add_special_tokens=False,
        )
        model = chat.model or self.runtime.model_name
        responder = ChatResponder(self.tokenizer, model, len(prompt_ids), chat)
        if chat.stream:
            return self.stream_prompt(
                prompt, prompt_ids, chat.params, chat.stop_sequences, request_id, responder, chat.n
            )
        generations = self._generate_all(
            [prompt_ids] * chat.n,
            sequence_params(chat.params, chat.n),
            request_id,
            client_gone,
            chat.stop_sequences,
        )
        completions = [
            complete(self.tokenizer, prompt, generation, chat.stop_sequences, prompt_ids)
            for generation in generations
        ]
        return responder.completion(completions)

    def complete_prompts(
        self, texts, params, stop_sequences, request_id: str, client_gone=None, n: int = 1
    ) -> list[Completion]:
        """OpenAI completions: `n` Completions (stop sequences applied) of each prompt, prompt
        by prompt."""
        each_prompt = [
            self.prompt_ids(text, params.max_new_tokens, "prompt", "max_tokens") for text in texts
        ]
        prompt_ids = [ids for ids in each_prompt for _ in range(n)]
        texts = [text for text in texts for _ in range(n)]
        generations = self._generate_all(
            prompt_ids,
            sequence_params(params, n) * len(each_prompt),
            request_id,
            client_gone,
            stop_sequences,
        )
        return [
            complete(self.tokenizer, text, generation, stop_sequences, ids)
            for text, generation, ids in zip(texts, generations, prompt_ids)
        ]

    def _generate_all(
        self, prompts, params, request_id: str, client_gone, stop_sequences=()
    ) -> list[Generation]:
        """Every prompt's whole generation (not streamed to the client). `client_gone()` says
        whether the HTTP client hung up meanwhile: then the engine drops the requests at once.
        With stop sequences the engine streams the tokens here, and a prompt whose text reaches
        one is ended in the engine there, instead of running on to max_new_tokens."""
        watch = bool(stop_sequences)
        engine_ids = [f"{request_id}/{index}" for index in range(len(prompts))]
        each = params if isinstance(params, list) else [params] * len(prompts)
        queues = [
            self.client.submit(protocol.GenerateRequest(i, p, q, stream=watch))
            for i, p, q in zip(engine_ids, prompts, each)
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
