"""Benchmark workloads: how many requests, when they are sent, and prompts built to an exact
token count (random words, so no server can shortcut them with a prefix cache)."""

from __future__ import annotations

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


class PromptBuilder:
    """Prompts of exactly N tokens for a given tokenizer: space-prefixed alphabetic vocabulary
    entries each stay one token when joined with spaces; every prompt is checked."""

    def __init__(self, tokenizer_json: str, seed: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_json)
        self.rng = random.Random(seed)
        vocab = self.tokenizer.get_vocab()
        self.words = sorted(
            token[1:] for token in vocab if token.startswith("\u0120") and token[1:].isalpha()
        )

    def build(self, num_tokens: int) -> str:
        for _ in range(20):
            words = [self.rng.choice(self.words) for _ in range(num_tokens)]
            text = " " + " ".join(words)
            if len(self.tokenizer.encode(text, add_special_tokens=True).ids) == num_tokens:
                return text
        raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens")


def plan(
    builder: PromptBuilder,
    num_requests: int,
    input_lengths: Lengths,
    output_lengths: Lengths,
    qps: float | None,
    seed: int,
) -> list[PlannedRequest]:
    """Requests with their send times: all at 0 (a burst) or a Poisson process at `qps`."""
    rng = random.Random(seed)
    planned = []
    clock = 0.0
    for _ in range(num_requests):
        input_tokens = input_lengths.draw(rng)
        planned.append(
            PlannedRequest(
                builder.build(input_tokens), input_tokens, output_lengths.draw(rng), clock
            )
        )
        if qps is not None:
            clock += rng.expovariate(qps)
    return planned
