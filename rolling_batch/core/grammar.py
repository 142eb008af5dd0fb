"""Structured output in an engine: each constrained request's grammar state over the model's
vocabulary, built off the step loop's thread.

A request's `params.grammar` is an llguidance grammar (handlers/agents/structured_output.py checked
it). llguidance needs the model's tokenizer to map the grammar's bytes onto token ids; it is
read on the first constrained request (about half a second for a 49k vocabulary), and each
distinct grammar is built once (a millisecond for typical JSON schemas, up to a second for
huge grammars, with the GIL released) and copied for every request that names it. Both happen
in one background thread: a request waits for its grammar, the batch does not. Each step the
sampler asks every constrained row for its mask of allowed tokens, and the scheduler feeds the
matcher every token appended. Torch-free.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance

log = logging.getLogger(__name__)

_CACHED_GRAMMARS = 128  # distinct grammars kept built (a schema per endpoint is typical)


class GrammarError(ValueError):
    """A grammar that does not build against this model's vocabulary."""


class GrammarState:
    """One request's place in its grammar: which tokens may come next, and the tokens taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's: masks have a bit per token id below it

    @property
    def num_mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def fill_mask(self, address: int) -> None:
        """Writes the allowed next tokens as a bitmask (int32 words, bit i of word w: token
        32 * w + i) to `num_mask_words` words at memory `address`."""
        self.matcher.unsafe_compute_mask_ptr(address, self.num_mask_words * 4)
        self.check()

    def check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"structured output failed: {self.matcher.get_error()}")

    def accept(self, token: int) -> None:
        """Moves past a sampled token. A token the mask did not allow leaves the matcher in
        error, which the next mask reports."""
        self.matcher.consume_token(token)

    def valid_prefix(self, tokens: tuple[int, ...]) -> int:
        """How many of `tokens` the grammar allows in a row from here (drafts are cut there)."""
        return self.matcher.validate_tokens(list(tokens))

    def advance(self, tokens: tuple[int, ...]) -> None:
        """Tentatively takes `tokens` (allowed ones), to read the masks after them."""
        self.matcher.consume_tokens(list(tokens))

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more: the answer ends here."""
        return self.matcher.is_stopped()


def fill_masks(states: list[GrammarState], address: int) -> None:
    """Each state's mask (GrammarState.fill_mask) into row i of an int32 array of
    [len(states), num_mask_words] at `address`. One after the other, on this thread:
    llguidance's thread pool (LLExecutor) was no faster on the 2-core CPU (a served step of 32
    constrained rows sampled in 15.7 ms with it, 12.6 ms without)."""
    row_bytes = states[0].num_mask_words * 4
    for row, state in enumerate(states):
        state.fill_mask(address + row * row_bytes)


class GrammarCompiler:
    """Builds GrammarStates in a background thread, each distinct grammar once."""

    def __init__(self, model_path: str | Path, eos_token_ids: set[int], trust_remote_code=False):
        self.model_path = Path(model_path)
        self.eos_token_ids = sorted(eos_token_ids)
        self.trust_remote_code = trust_remote_code
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._built: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def state_for(self, grammar: str) -> Future:
        """A future GrammarState for a new request; it raises GrammarError if the grammar does
        not build."""
        return self._pool.submit(self._state_for, grammar)

    def _state_for(self, grammar: str) -> GrammarState:
        tokenizer = self._load_tokenizer()
        template = self._built.pop(grammar, None)
        if template is None:
            template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(template.get_error())
        self._built[grammar] = template  # the newest last
        while len(self._built) > _CACHED_GRAMMARS:
            self._built.popitem(last=False)
        return GrammarState(template.deep_copy(), tokenizer.vocab_size)

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                _tokenizer_json(self.model_path, self.trust_remote_code),
                eos_token=self.eos_token_ids or None,
            )
            log.info(
                "structured output: read the tokenizer (%d tokens)", self._tokenizer.vocab_size
            )
        return self._tokenizer


def _tokenizer_json(model_path: Path, trust_remote_code: bool) -> str:
    """The model's tokenizer as HF tokenizers' JSON: its tokenizer.json, or the fast tokenizer
    transformers converts a sentencepiece model into."""
    path = model_path / "tokenizer.json"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("structured output needs a fast tokenizer (tokenizer.json)")
    return backend.to_str()
