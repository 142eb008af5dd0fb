"""Benchmark workloads: how many requests, when they are sent, and prompts built to an exact
token count (random words, so no server can shortcut them with a prefix cache), unless the
workload shares prefixes on purpose: a fixed system prompt before every request's own words,
or conversations whose every turn resends the turns before it."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Lengths:
    """A fixed length (`"128"`) or a uniform range (`"uniform:16:256"`)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        if text.startswith("uniform:"):
            _, low, high = text.split(":")
            return cls(int(low), int(high))
        return cls(int(text), int(text))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True)
class PlannedRequest:
    prompt: str
    input_tokens: int
    output_tokens: int
    send_at: float  # seconds after the start
    adapter: str | None = None  # the LoRA adapter asked for (None: the base model)


class PromptBuilder:
    """Prompts of exactly N tokens for a given tokenizer: space-prefixed alphabetic vocabulary
    entries each stay one token when joined with spaces; every prompt is checked."""

    def __init__(self, tokenizer_json: str, seed: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_json)
        self.rng = random.Random(seed)
        vocab = self.tokenizer.get_vocab()
        # ASCII only: the vocabulary spells other characters in byte-level stand-ins (some of
        # them letters to isalpha) that are other tokens once written out as text.
        self.words = sorted(
            word
            for word in (token[1:] for token in vocab if token.startswith("\u0120"))
            if word.isascii() and word.isalpha()
        )

    def build(self, num_tokens: int, prefix: str = "") -> str:
        """`prefix` (text this builder made) and then new words, `num_tokens` in all."""
        num_prefix = self.count(prefix) if prefix else 0
        for _ in range(20):
            words = [self.rng.choice(self.words) for _ in range(num_tokens - num_prefix)]
            text = prefix + " " + " ".join(words)
            if self.count(text) == num_tokens:
                return text
        raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)


def plan(
    builder: PromptBuilder,
    num_requests: int,
    input_lengths: Lengths,
    output_lengths: Lengths,
    qps: float | None,
    seed: int,
    shared_prefix_tokens: int = 0,
    turns: int = 1,
) -> list[PlannedRequest]:
    """Requests with their send times: all at 0 (a burst) or a Poisson process at `qps`.

    `shared_prefix_tokens`: every prompt starts with the same system prompt of that many
    tokens, then its own `input_lengths` tokens. `turns` > 1: conversations of that many
    turns, each turn's prompt the previous prompt, an answer of `output_lengths` tokens (words
    standing for the model's answer) and `input_lengths` new tokens; turns are listed round by
    round, so with one request in flight per conversation a turn follows its previous one."""
    rng = random.Random(seed)
    system = builder.build(shared_prefix_tokens) if shared_prefix_tokens else ""
    planned = []
    clock = 0.0
    histories = [system] * max(1, num_requests // turns)
    for index in range(num_requests):
        conversation = index % len(histories)
        history = histories[conversation]
        input_tokens = (builder.count(history) if history else 0) + input_lengths.draw(rng)
        prompt = builder.build(input_tokens, history)
        output_tokens = output_lengths.draw(rng)
        planned.append(PlannedRequest(prompt, input_tokens, output_tokens, clock))
        if turns > 1:
            histories[conversation] = builder.build(input_tokens + output_tokens, prompt)
        if qps is not None:
            clock += rng.expovariate(qps)
    return planned


def spread_over_adapters(
    planned: list[PlannedRequest], adapters: list[str]
) -> list[PlannedRequest]:
    """The requests with the LoRA `adapters` taken in turn (none: as planned, the base model)."""
    if not adapters:
        return planned
    return [
        dataclasses.replace(request, adapter=adapters[index % len(adapters)])
        for index, request in enumerate(planned)
    ]
