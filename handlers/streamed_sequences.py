"""A streamed request's sequences (OpenAI's `n` streams several) on the front end: each engine
event's tokens detokenized and shaped by a responder (`.token(...)`, `.done(...)`,
`.error(...)`), each sequence finished in the engine exactly once, and one error ending the
stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from lmserve.rolling_batch.ipc import protocol

from .interface import EngineConnection, PredictionError
from .outputs import Completion, Generation, TokenOutput
from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class StreamedSequence:
    """One sequence of a streamed request."""

    index: int
    prompt: str
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer
    generation: Generation = field(default_factory=Generation)
    completion: Completion | None = None  # once its last token is shaped

    def complete(self) -> Completion:
        """The text and tokens the detokenizer let through (up to a stop sequence)."""
        detokenizer, generation = self.detokenizer, self.generation
        num_tokens = len(detokenizer.token_ids)
        reason = "stop_sequence" if detokenizer.stopped else generation.finish_reason
        top = generation.top_logprobs
        return Completion(
            self.prompt,
            detokenizer.text,
            detokenizer.token_ids,
            generation.log_probs[:num_tokens],
            reason,
            None if top is None else top[:num_tokens],
            list(self.prompt_ids),
            generation.prompt_log_probs,
            generation.prompt_top_logprobs,
        )


def stream_events(
    sequences: dict[str, StreamedSequence],
    event: protocol.Event,
    next_event: Callable[[], protocol.Event],
    client: EngineConnection,
    responder,
    tokenizer: Tokenizer,
) -> Iterator[str]:
    """The responder's pieces for `event` and every later one (`next_event()`) until each of
    `sequences` (by engine id) has completed, then its trailer."""
    running = set(sequences)
    try:
        while True:
            if event.id in running:  # not one ended here by its stop sequence
                sequence = sequences[event.id]
                yield from shape_event(sequence, event, responder, tokenizer)
                if sequence.completion is not None:
                    running.discard(event.id)
                    client.finish(event.id, abort=sequence.detokenizer.stopped)
            if not running:
                break
            event = next_event()
        trailer = responder.done([sequence.completion for sequence in sequences.values()])
        if trailer:
            yield trailer
    except PredictionError as error:
        # The engine dropped the failed sequence; any other is dropped with it.
        if error.request_id in running:
            running.discard(error.request_id)
            client.finish(error.request_id, abort=False)
        yield responder.error(error.status, error.message)
    finally:
        # A client that went away ends the request in the engine too.
        for engine_id in running:
            client.finish(engine_id, abort=True)


def shape_event(
    sequence: StreamedSequence, event: protocol.Event, responder, tokenizer: Tokenizer
) -> Iterator[str]:
    """`responder`'s pieces for an event's tokens; the sequence's last one (the generation's
    final token, or the one that completed a stop sequence) sets its completion."""
    generation = sequence.generation
    generation.add(event)
    done = generation.finish_reason is not None
    tops = event.top_logprobs or [None] * len(event.token_ids)
    tokens = list(zip(event.token_ids, event.log_probs, tops))
    for index, (token, log_prob, top) in enumerate(tokens):
        detokenizer = sequence.detokenizer
        text = detokenizer.add(token)
        last = detokenizer.stopped or (done and index == len(tokens) - 1)
        if last:
            text += detokenizer.finish()
            sequence.completion = sequence.complete()
        special = token in tokenizer.special_ids
        shaped = TokenOutput(token, text, log_prob, special, top, sequence.index, sequence.prompt)
        yield responder.token(shaped, sequence.completion)
        if last:
            return
