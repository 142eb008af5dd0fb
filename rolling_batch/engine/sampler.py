"""Batched sampling on rank 0: repetition penalty, then greedy or temperature/top-k/top-p
sampling, with HF transformers' semantics, in a few whole-batch tensor ops per step (per-row
ops cost 1-5 ms per sampled row at SmolLM2's 49k vocabulary). Log-probs are of the chosen
token under the processed distribution (as HF's `scores`); a request asking for `top_logprobs`
gets that many alternatives from the same distribution, most likely first, leaving out tokens
the filters removed (log-prob -inf).

Each request draws from its own generator, seeded by its `seed`: one uniform per step, which
picks the token by inverting the row's cumulative distribution. Every batched op here works
row by row, so the same seed and prompt give the same text whatever else is in the batch.
"""

from __future__ import annotations

import random

import torch

from lmserve.kernels import cpu_native

from ..core.grammar import GrammarState, fill_masks
from ..core.request import Request
from ..core.speculation import accepted_prefix
from ..core.step import Sample

# Top-p looks for the nucleus among the most likely tokens first (torch.topk), and sorts the
# whole vocabulary only for rows whose nucleus is wider: a full sort of 32 x 49k logits took
# 120-180 ms on the 2-core CPU, topk(256) 4 ms.
_NUCLEUS_CANDIDATES = (256, 4096)
# What a row's data can make torch raise (say a token id beyond the logits' vocabulary), and out
# of memory (torch's is a RuntimeError): the rows alone need a fraction of the batch's memory.
_ROW_ERRORS = (RuntimeError, IndexError, ValueError, MemoryError)


class _RowState:
    """What the sampler keeps about a request between steps."""

    def __init__(self, request: Request, device: torch.device):
        self.request = request
        self.device = device
        self.generator: torch.Generator | None = None
        self._seen: set[int] = set()
        self._seen_ids: torch.Tensor | None = None  # _seen, in order of appearance
        self._num_read = 0  # tokens of the request already added to _seen

    def draw(self) -> torch.Tensor:
        if self.generator is None:
            seed = self.request.params.seed
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))
        return torch.rand(1, generator=self.generator, device=self.device)

    def seen_ids(self, vocab: int) -> torch.Tensor:
        """The distinct token ids of prompt and output, read incrementally (one new per step)."""
        prompt, output = self.request.prompt_ids, self.request.output_ids
        start = self._num_read
        new = prompt[start:] + output if start < len(prompt) else output[start - len(prompt) :]
        fresh = [token for token in dict.fromkeys(new) if token not in self._seen]
        if any(not 0 <= token < vocab for token in fresh):
            # Checked here: the batched penalty indexes all rows as one, so a stray id would
            # land in a neighbour's row.
            raise IndexError(f"a token id is outside the vocabulary of {vocab}")
        self._num_read = len(prompt) + len(output)
        self._seen.update(fresh)
        if fresh or self._seen_ids is None:
            fresh_ids = torch.tensor(fresh, dtype=torch.int64, device=self.device)
            known = self._seen_ids
            self._seen_ids = fresh_ids if known is None else torch.cat([known, fresh_ids])
        return self._seen_ids


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._states: dict[str, _RowState] = {}

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]):
        """`logits`: fp32 `[len(requests), vocab]`, row i for requests[i] (left unchanged).
        Returns ({request: Sample}, [(request, error)]): a row that cannot be sampled (say
        its temperature overflows the logits) fails alone."""
        if not requests:
            return {}, []
        try:
            results = self._sample_batch(logits, requests)
        except _ROW_ERRORS:
            results = None
        if results is None:
            # An op failed for the whole batch: find the row(s) to blame by sampling each alone.
            # Out of the except block, so the batch's tensors (held by the traceback's frames)
            # are freed first.
            results = []
            for row, request in enumerate(requests):
                try:
                    results += self._sample_batch(logits[row : row + 1], [request])
                except _ROW_ERRORS as error:
                    results.append(error)
        sampled: dict[Request, Sample] = {}
        failed: list[tuple[Request, Exception]] = []
        for request, result in zip(requests, results):
            if isinstance(result, Exception):
                failed.append((request, result))
            else:
                sampled[request] = result
        return sampled, failed

    def verify(
        self, logits: torch.Tensor, drafts: list[tuple[Request, tuple[int, ...]]]
    ) -> dict[Request, list[Sample]]:
        """Greedy choices for speculating requests (speculation.py): `logits` holds, for each
        (request, draft) in order, len(draft) + 1 rows: after the request's newest token and
        after each drafted one. Each request gets its agreed draft tokens and the model's
        choice after them: what greedy decoding would have produced one step at a time."""
        if not drafts:
            return {}
        requests = [request for request, draft in drafts for _ in range(len(draft) + 1)]
        if any(request.grammar is not None for request, _ in drafts):
            logits = mask_disallowed(logits, _draft_masks(drafts))
        samples = _greedy(logits, requests)
        verified: dict[Request, list[Sample]] = {}
        row = 0
        for request, draft in drafts:
            rows = samples[row : row + len(draft) + 1]
            row += len(rows)
            kept = accepted_prefix(draft, [sample.token for sample in rows])
            verified[request] = rows[: kept + 1]
        return verified

    def _state(self, request: Request) -> _RowState:
        state = self._states.get(request.request_id)
        if state is None or state.request is not request:  # an id reused by a new request
            state = self._states[request.request_id] = _RowState(request, self.device)
        return state

    def _sample_batch(self, logits: torch.Tensor, requests: list[Request]) -> list:
        """A Sample or an exception for each row."""
        states = [self._state(request) for request in requests]
        scores = _penalize_rows(logits, requests, states)
        if any(request.grammar is not None for request in requests):
            scores = mask_disallowed(scores, grammar_masks([r.grammar for r in requests]))
        results: list = [None] * len(requests)
        greedy = [i for i, r in enumerate(requests) if not r.params.do_sample]
        drawn = [i for i, r in enumerate(requests) if r.params.do_sample]
        if greedy:
            samples = _greedy(_select(scores, greedy), [requests[i] for i in greedy])
            for i, sample in zip(greedy, samples):
                results[i] = sample
        if drawn:
            params = [requests[i].params for i in drawn]
            _, probs = _filter_rows(
                _select(scores, drawn),
                [p.temperature for p in params],
                [p.top_k for p in params],
                [p.top_p for p in params],
            )
            uniforms = torch.cat([states[i].draw() for i in drawn]).to(probs.dtype)
            chosen, log_probs, valid = _invert_cdf(probs, uniforms)
            tops = _top_logprobs(probs, [requests[i] for i in drawn], normalize=True)
            for i, token, log_prob, ok, top in zip(
                drawn, chosen.tolist(), log_probs.tolist(), valid.tolist(), tops
            ):
                results[i] = Sample(token, log_prob, top) if ok else RuntimeError(_NOT_FINITE)
        return results


_NOT_FINITE = "the row's probabilities are not finite (temperature too low for its logits?)"


def _greedy(rows: torch.Tensor, requests: list[Request]) -> list[Sample]:
    """The most likely token of each row (the first of equal maxima, as argmax), its log-prob,
    and the alternatives its request asks for."""
    native = cpu_native.ops_for(rows)
    wants_tops = any(request.params.top_logprobs > 0 for request in requests)
    if native is not None and rows.dtype == torch.float32 and not wants_tops:
        # One pass for the maximum, one for its log-prob, no distribution written out: a
        # step's sampling of 32 rows of SmolLM2's 49k vocabulary 1.0 -> 0.55 ms.
        chosen, log_probs = native.greedy_pick(rows)
        return [
            Sample(token, log_prob, None)
            for token, log_prob in zip(chosen.tolist(), log_probs.tolist())
        ]
    chosen = torch.max(rows, dim=-1).indices
    distribution = torch.log_softmax(rows, dim=-1)
    log_probs = distribution.gather(1, chosen[:, None])[:, 0]
    tops = _top_logprobs(distribution, requests)
    return [Sample(*sample) for sample in zip(chosen.tolist(), log_probs.tolist(), tops)]


def _top_logprobs(rows: torch.Tensor, requests: list[Request], normalize: bool = False) -> list:
    """Each request's `top_logprobs` most likely tokens of its row, [(token, log_prob)], or None
    where it asked for none. `rows` are log-probs, or with `normalize` unnormalized
    probabilities (the drawn rows' filtered distribution)."""
    wanted = [i for i, r in enumerate(requests) if r.params.top_logprobs > 0]
    tops: list = [None] * len(requests)
    if not wanted:
        return tops
    selected = _select(rows, wanted)
    k = min(max(requests[i].params.top_logprobs for i in wanted), rows.shape[-1])
    values, tokens = torch.topk(selected, k, dim=-1)
    if normalize:  # the order of probabilities is the order of their logs
        values = torch.log(values / selected.sum(dim=-1, keepdim=True))
    for i, row_values, row_tokens in zip(wanted, values.tolist(), tokens.tolist()):
        count = requests[i].params.top_logprobs
        pairs = zip(row_tokens[:count], row_values[:count])
        tops[i] = [(token, value) for token, value in pairs if value != float("-inf")]
    return tops


def top_logprobs_of(log_probs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The `k` most likely (token, log_prob) of each row of `log_probs`, most likely first."""
    values, tokens = torch.topk(log_probs, min(k, log_probs.shape[-1]), dim=-1)
    return [list(zip(t, v)) for t, v in zip(tokens.tolist(), values.tolist())]


def _select(scores: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return scores if len(rows) == len(scores) else scores[rows]


def _invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor):
    """One token per row of unnormalized `probs`, drawn by the row's uniform in [0, 1):
    (tokens, their log-probabilities, rows whose distribution is finite)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    valid = torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
    if not bool(valid.all()):
        cdf[~valid] = 1.0  # sorted, for searchsorted; these rows fail
        total = torch.where(valid[:, None], total, torch.ones_like(total))
    chosen = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)
    # Rounding can carry u * total up to total: the last token with probability left wins.
    chosen = torch.minimum(chosen, torch.searchsorted(cdf, total, right=False))
    log_probs = torch.log(probs.gather(1, chosen) / total)
    return chosen[:, 0], log_probs[:, 0], valid


def _penalize_rows(logits: torch.Tensor, requests: list[Request], states) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor on the rows that ask for it: each row's seen
    tokens' logits shrink towards zero. Returns new scores where any row changes."""
    rows = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0]
    if not rows:
        return logits
    scores = logits.clone(memory_format=torch.contiguous_format)
    vocab = scores.shape[-1]
    seen = [states[i].seen_ids(vocab) for i in rows]
    flat = torch.cat([ids + row * vocab for ids, row in zip(seen, rows)])
    penalty = torch.tensor(
        [requests[i].params.repetition_penalty for i in rows], dtype=scores.dtype
    ).to(scores.device)
    penalty = torch.repeat_interleave(
        penalty, torch.tensor([len(ids) for ids in seen], device=scores.device)
    )
    values = scores.view(-1)[flat]
    scores.view(-1)[flat] = torch.where(values < 0, values * penalty, values / penalty)
    return scores


def grammar_masks(grammars: list[GrammarState | None]) -> tuple[list[int], torch.Tensor]:
    """(the rows with a grammar, their allowed next tokens as bitmasks, a row each)."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return rows, torch.empty(0, 0, dtype=torch.int32)
    constrained = [grammars[row] for row in rows]
    words = torch.empty(len(rows), constrained[0].num_mask_words, dtype=torch.int32)
    fill_masks(constrained, words.data_ptr())
    return rows, words


def _draft_masks(drafts: list[tuple[Request, tuple[int, ...]]]) -> tuple[list[int], torch.Tensor]:
    """The bitmasks of a speculating request's rows with a grammar: after its newest token,
    then after each drafted one (the drafts hold only tokens the grammar allows)."""
    rows, masks, row = [], [], 0
    for request, draft in drafts:
        grammar = request.grammar
        if grammar is not None:
            for position in range(len(draft) + 1):
                masks.append(mask := torch.empty(grammar.num_mask_words, dtype=torch.int32))
                grammar.fill_mask(mask.data_ptr())
                rows.append(row + position)
                if position < len(draft):
                    grammar.advance(draft[position : position + 1])
            grammar.rollback(len(draft))
        row += len(draft) + 1
    return rows, torch.stack(masks)


# A byte of a bitmask -> what its 8 tokens add to their logits: 0 where allowed, -inf where not.
# Read through a table: torch's masked_fill with a bool mask took 7-13 ms for 32 rows of a
# 49k vocabulary on the 2-core CPU, this 2 ms.
_BYTE_BIAS = torch.where(
    (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1, 0.0, float("-inf")
).to(torch.float32)


def mask_disallowed(scores: torch.Tensor, masks: tuple[list[int], torch.Tensor]) -> torch.Tensor:
    """`scores` (a new tensor) with the tokens each masked row's grammar forbids at -inf: bit
    i of word w of a row's mask allows token 32 * w + i; ids past the grammar's vocabulary
    (the model's padding rows) are never allowed."""
    rows, words = masks
    if not rows:
        return scores
    vocab = scores.shape[-1]
    index = words.view(torch.uint8).to(torch.int32).view(-1)
    bias = _BYTE_BIAS.to(scores.device).index_select(0, index.to(scores.device))
    bias = bias.view(len(rows), -1)
    if bias.shape[1] < vocab:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    bias = bias[:, :vocab].to(scores.dtype)
    if len(rows) == len(scores):
        return bias.add_(scores)
    selected = torch.tensor(rows, device=scores.device)
    return scores.index_copy(0, selected, bias.add_(scores.index_select(0, selected)))


def _filter_rows(rows: torch.Tensor, temperatures, top_ks, top_ps):
    """Temperature, then top-k, then top-p (nucleus), per row: (scores with the filtered
    entries at -inf, as HF's warpers leave them; the probabilities the sampler draws from,
    filtered entries 0, not renormalized)."""
    device, vocab, num_rows = rows.device, rows.shape[-1], len(rows)
    scores = rows / torch.tensor(temperatures, dtype=rows.dtype).to(device)[:, None]
    k_rows = [i for i, k in enumerate(top_ks) if 0 < k < vocab]
    if k_rows:
        ks = torch.tensor([top_ks[i] for i in k_rows], device=device)
        kth = torch.topk(_select(scores, k_rows), int(ks.max()), dim=-1).values
        floor = torch.full((num_rows, 1), float("-inf"), dtype=rows.dtype, device=device)
        floor[k_rows] = kth.gather(1, ks[:, None] - 1)
        scores.masked_fill_(scores < floor, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    p_rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if p_rows:
        top_p = torch.tensor([top_ps[i] for i in p_rows], dtype=rows.dtype).to(device)
        floor = torch.zeros((num_rows, 1), dtype=rows.dtype, device=device)
        floor[p_rows] = _nucleus_floor(_select(probs, p_rows), top_p)[:, None]
        removed = probs < floor
        probs.masked_fill_(removed, 0.0)
        scores.masked_fill_(removed, float("-inf"))
    return scores, probs


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF's TopPLogitsWarper as the smallest probability it keeps in each row: the most likely
    tokens while the probability of those before them stays under top_p (always the first)."""
    floor = torch.empty(len(probs), dtype=probs.dtype, device=probs.device)
    vocab = probs.shape[-1]
    pending = torch.arange(len(probs), device=probs.device)
    for size in (*(k for k in _NUCLEUS_CANDIDATES if k < vocab), vocab):
        rows = probs if len(pending) == len(probs) else probs[pending]
        values = torch.topk(rows, size, dim=-1).values
        cumulative = values.cumsum(dim=-1)
        kept = ((cumulative - values) < top_p[pending, None]).sum(dim=-1).clamp_(min=1)
        # The nucleus lies among the candidates once they hold top_p of the mass; with every
        # token a candidate it is found, whatever rounding did to the sum.
        found = cumulative[:, -1] >= top_p[pending]
        if size == vocab:
            found[:] = True
        floor[pending[found]] = values[found].gather(1, kept[found, None] - 1)[:, 0]
        pending = pending[~found]
        if len(pending) == 0:
            break
    return floor
