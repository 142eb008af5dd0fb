"""Speculative decoding with n-gram drafts (prompt lookup decoding). Torch-free.

A decode step reads every weight of the model to produce one token per sequence; on a CPU
(and a GPU at small batches) that read, not the arithmetic, is the step's time, so the model
can check several tokens of a sequence in one step for little more than the cost of one. The
tokens to check come for free from the sequence itself: where its last few tokens occurred
before (in the prompt or the output), the tokens that followed them then are the guess for
now. Text that quotes its input, code being edited, lists and loops all repeat themselves.

The step computes the logits after the newest token and after each drafted token; the draft
is kept up to its first token that differs from the greedy choice, and that choice is the
step's next token: the output is the greedy output token for token, one to `max_draft` + 1
tokens a step. Only greedy requests without a repetition penalty speculate (a sampled one
would need rejection sampling, which would also change what a seed gives).

Each request's draft length adapts as in HF transformers' assisted generation: two more
after a draft kept whole, one fewer after a miss. Whether a request drafts at all depends on
how often its drafts are kept and on the step's size: a drafted row costs the step about one
row's arithmetic, and a kept one saves a whole step's share of that sequence. With R rows in
the step and a step costing the weights' read plus a little per row (on the 2-core CPU,
SmolLM2 fp32: ~34 ms plus ~1 ms a row, so the read is worth `BREAK_EVEN_ROWS` = 32 rows), a
draft pays when the chance of keeping a drafted token exceeds R / (R + 32): anything at one
sequence, 20% at 8 rows, two thirds at 64. The chance is estimated per request from its
checked drafts, and while it drafts nothing, from whether its lookup's guess would have been
right (free: the guess is compared with the token the step produced).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request

# Rows of arithmetic a decode step's weight read is worth (see above).
BREAK_EVEN_ROWS = 32
# How fast a request's estimated chance of a kept draft token follows new evidence.
_ESTIMATE_WEIGHT = 0.3


@dataclass
class _Lookup:
    """The n-grams of one request's tokens: for each, where the latest earlier occurrence
    ends. Extended as tokens are appended, so a lookup costs O(new tokens). Also what the
    request's drafts have been worth."""

    draft_len: int
    ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)  # one per n
    num_indexed: int = 0  # n-grams ending before this position are in `ends`
    kept_share: float = 1.0  # estimated chance that a drafted token is kept; hopeful at first
    unsent_guess: int | None = None  # the first token of a draft not sent, to score it

    def learn(self, kept_share: float) -> None:
        self.kept_share += _ESTIMATE_WEIGHT * (kept_share - self.kept_share)


class NgramDrafter:
    def __init__(self, max_draft: int, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}")
        self.max_draft = max_draft
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # the longest match first
        self._lookups: dict[Request, _Lookup] = {}
        self.num_drafted = 0  # draft tokens checked by the model
        self.num_accepted = 0  # of those, kept

    @staticmethod
    def speculates(request: Request) -> bool:
        params = request.params
        return not params.do_sample and params.repetition_penalty == 1.0

    def propose(self, request: Request, limit: int, step_rows: int = 1) -> tuple[int, ...]:
        """Up to `limit` (and the request's current draft length) tokens to follow the
        request's tokens; () when its last tokens never occurred before, or when its drafts
        are kept too rarely to pay in a step of `step_rows` rows."""
        lookup = self._lookups.get(request)
        if lookup is None:
            lookup = self._lookups[request] = _Lookup(self.max_draft)
            lookup.ends = [{} for _ in self.sizes]
        lookup.unsent_guess = None
        count = min(limit, lookup.draft_len)
        if count <= 0:
            return ()
        draft = self._look_up(lookup, request.all_token_ids, count)
        if draft and lookup.kept_share <= step_rows / (step_rows + BREAK_EVEN_ROWS):
            lookup.unsent_guess = draft[0]
            return ()
        return draft

    def _look_up(self, lookup: _Lookup, tokens: list[int], count: int) -> tuple[int, ...]:
        self._index(lookup, tokens)
        for n, ends in zip(self.sizes, lookup.ends):
            if len(tokens) <= n:
                continue
            end = ends.get(tuple(tokens[-n:]))
            if end is not None:
                return _copy_on(tokens, end, count)
        return ()

    def _index(self, lookup: _Lookup, tokens: list[int]) -> None:
        """Adds the n-grams ending at positions num_indexed .. len(tokens) - 1 (the one ending
        at the last token is the key looked up, not a place to find it)."""
        for stop in range(max(lookup.num_indexed, 1), len(tokens)):
            for n, ends in zip(self.sizes, lookup.ends):
                if stop >= n:
                    ends[tuple(tokens[stop - n : stop])] = stop  # later occurrences win
        lookup.num_indexed = max(lookup.num_indexed, len(tokens))

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A draft of `num_drafted` tokens was checked and its first `num_accepted` kept."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        lookup = self._lookups.get(request)
        if lookup is None or num_drafted == 0:
            return
        lookup.learn(num_accepted / num_drafted)
        if num_accepted == num_drafted:
            lookup.draft_len = min(self.max_draft, lookup.draft_len + 2)
        else:
            lookup.draft_len = max(1, lookup.draft_len - 1)

    def observe(self, request: Request, token: int) -> None:
        """The token a step produced for a request that sent no draft: scores the guess it
        held back, if any."""
        lookup = self._lookups.get(request)
        if lookup is not None and lookup.unsent_guess is not None:
            lookup.learn(float(token == lookup.unsent_guess))
            lookup.unsent_guess = None

    def forget(self, request: Request) -> None:
        self._lookups.pop(request, None)


def _copy_on(tokens: list[int], start: int, count: int) -> tuple[int, ...]:
    """`count` tokens copied from `start` on, the copy reading its own tokens where it runs
    past the end: after "a b a b" the match ending two tokens back drafts "a b a b ...", as
    the loop would go on, rather than stopping after "a b"."""
    draft: list[int] = []
    for position in range(start, start + count):
        draft.append(tokens[position] if position < len(tokens) else draft[position - len(tokens)])
    return tuple(draft)


def accepted_prefix(draft: tuple[int, ...], chosen: list[int]) -> int:
    """How many draft tokens the model agrees with: `chosen[i]` is its choice after the
    draft's first i tokens (len(draft) + 1 choices)."""
    count = 0
    while count < len(draft) and draft[count] == chosen[count]:
        count += 1
    return count
