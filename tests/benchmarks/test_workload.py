"""Workloads built to exact token counts with SmolLM2's tokenizer: plain prompts share nothing,
a shared system prompt starts every prompt, and a conversation's turns resend its history."""

from __future__ import annotations

import os

from lmserve.benchmarks.workload import Lengths, PromptBuilder, plan


def builder(smollm2_dir) -> PromptBuilder:
    return PromptBuilder(os.path.join(smollm2_dir, "tokenizer.json"), seed=0)


def test_every_prompt_has_its_exact_length_and_plain_prompts_share_nothing(smollm2_dir):
    made = builder(smollm2_dir)
    planned = plan(made, 6, Lengths(10, 40), Lengths(8, 8), None, seed=1)
    for request in planned:
        assert made.count(request.prompt) == request.input_tokens
    first_words = {request.prompt.split()[0] for request in planned}
    assert len(first_words) > 1


def test_a_shared_system_prompt_starts_every_prompt(smollm2_dir):
    made = builder(smollm2_dir)
    planned = plan(made, 5, Lengths(12, 12), Lengths(8, 8), None, 2, shared_prefix_tokens=64)
    system = planned[0].prompt.split()[:64]
    for request in planned:
        assert request.input_tokens == 64 + 12 == made.count(request.prompt)
        assert request.prompt.split()[:64] == system
    assert len({request.prompt for request in planned}) == 5


def test_conversation_turns_resend_their_history(smollm2_dir):
    made = builder(smollm2_dir)
    planned = plan(made, 6, Lengths(10, 10), Lengths(5, 5), None, 3, turns=3)
    # Two conversations, listed round by round: turn k of each, then turn k + 1.
    for index in range(2, 6):
        previous, turn = planned[index - 2], planned[index]
        assert turn.prompt.startswith(previous.prompt)
        assert turn.input_tokens == previous.input_tokens + 5 + 10 == made.count(turn.prompt)
    assert not planned[1].prompt.startswith(planned[0].prompt)


def test_long_prompts_come_out_exact_at_the_first_try(smollm2_dir):
    """Every word the builder picks is one token in text: 1,024-token system prompts (the
    shared-prefix workload's) never need a retry."""
    made = builder(smollm2_dir)
    words = made.rng.sample(made.words, 2000)
    special = made.count("")  # what the tokenizer adds to any text
    assert made.count(" " + " ".join(words)) == 2000 + special
