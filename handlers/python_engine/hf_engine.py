"""The engine=Python model: HF transformers `generate` over one static batch of token-id prompts.

Prompts are left-padded so every row's next token sits in the last column; each row is then cut
to its own `max_new_tokens` and its first EOS, so requests of different lengths share a batch.

Log-probs of generated tokens (and their top alternatives) come from HF's `scores`: the
distribution after repetition penalty, temperature, top-k and top-p. A prompt's log-probs come
from the model's raw distribution, in one extra forward pass run only when some row asks.

With option.enable_lora the model carries PEFT LoRA adapters (hf_lora.py beside this); a
batch's requests share one adapter, active for its `generate` and its prompt log-probs alike.
Adapters are added and removed between batches (the management API; hf_work.py).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from lmserve.rolling_batch.core.grammar import GrammarCompiler
from lmserve.rolling_batch.ipc.protocol import GenerationParams, TopLogprobs, adapter_refusal
from lmserve.rolling_batch.lora.adapters import ADAPTERS_DIR, find_adapters
from lmserve.rolling_batch.model.eos_tokens import eos_token_ids
from lmserve.rolling_batch.model.weights.loader import load_hf_config, resolve_dtype
from lmserve.rolling_batch.model.weights.quantized_checkpoint import quantization_config

from . import hf_lora
from .hf_grammar import GrammarLogitsProcessor, GrammarRows, GrammarStoppingCriteria

log = logging.getLogger(__name__)

# Prompt positions whose fp32 log-softmax is taken at once: the extra memory stays at this many
# rows of the vocabulary (256 x 49k floats: 50 MB) however long the prompts are.
_PROMPT_ROWS = 256


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "length" | "eos_token"
    # Only for a request that asked (None otherwise); see protocol.FinalEvent.
    top_logprobs: list[TopLogprobs] | None = None
    prompt_log_probs: list[float] | None = None  # len(prompt) - 1 values
    prompt_top_logprobs: list[TopLogprobs] | None = None


class HFEngine:
    def __init__(
        self,
        model,
        device: str,
        eos_token_ids: set[int],
        adapters: Mapping[str, str] | None = None,
        max_lora_rank: int = 16,
        adapter_folders: Mapping[str, Path] | None = None,
        grammars: GrammarCompiler | None = None,
    ):
        self.model = model
        self.device = device
        self.dtype = model.dtype
        self.eos_token_ids = eos_token_ids
        pad = model.generation_config.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids, default=0)
        # The LoRA adapters on the model, {name: PEFT's name for it}; None: LoRA is off.
        self.adapters = None if adapters is None else dict(adapters)
        self.adapter_folders = dict(adapter_folders or {})  # {name: the folder it came from}
        self.max_lora_rank = max_lora_rank
        self._peft_numbers = itertools.count(len(self.adapters or ()))
        self.grammars = grammars  # builds structured outputs' grammars; None: refused

    @classmethod
    def load(
        cls,
        model_path: str,
        dtype: str,
        trust_remote_code: bool = False,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        adapters_dir: str | None = None,
    ) -> HFEngine:
        """The model in `model_path`; with `enable_lora`, and every LoRA adapter in
        `adapters_dir` (None: `<model_path>/adapters`) on it."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        refuse_quantized_checkpoint(load_hf_config(model_path, trust_remote_code))
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype="auto", trust_remote_code=trust_remote_code
        )
        torch_dtype = resolve_dtype(dtype, model.dtype, device)
        model = model.to(device=device, dtype=torch_dtype).eval()
        adapters, folders = None, {}
        if enable_lora:
            folders = find_adapters(adapters_dir or Path(model_path) / ADAPTERS_DIR)
            model, adapters = hf_lora.attach_adapters(model, folders, max_lora_rank)
        eos = eos_token_ids(model_path, trust_remote_code=trust_remote_code)
        grammars = GrammarCompiler(model_path, eos, trust_remote_code)
        return cls(model, device, eos, adapters, max_lora_rank, folders, grammars)

    def add_adapter(self, name: str, folder: Path) -> None:
        """Serves the adapter in `folder` as `name` from the next batch on; raises
        AdapterError, nothing changed, when it cannot be served. Only between batches."""
        peft_name = hf_lora.peft_adapter_name(next(self._peft_numbers))
        self.model = hf_lora.add_adapter(self.model, name, folder, self.max_lora_rank, peft_name)
        self.adapters[name] = peft_name
        self.adapter_folders[name] = folder

    def remove_adapter(self, name: str) -> None:
        """Takes the adapter `name` off the model. Only between batches."""
        self.model = hf_lora.remove_adapter(self.model, self.adapters.pop(name))
        del self.adapter_folders[name]

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: list[GenerationParams]
    ) -> list[Generation]:
        """`params` share one `batch_key()`; max_new_tokens and the log-probs asked for (which
        are not part of the key) may differ."""
        with self._adapter(params[0].adapter):
            return self._generate(prompts, params)

    def _adapter(self, name: str | None) -> AbstractContextManager:
        """The context a batch for adapter `name` (None: the base model) runs in."""
        refusal = adapter_refusal("", name, self.adapters)
        if refusal is not None:
            # The worker refuses these before batching; never answer with the base model.
            raise ValueError(refusal.message)
        if not self.adapters:
            return nullcontext()  # no PEFT: the model is the base model
        return hf_lora.active_adapter(self.model, None if name is None else self.adapters[name])

    def _generate(
        self, prompts: list[list[int]], params: list[GenerationParams]
    ) -> list[Generation]:
        input_ids, attention_mask = self._left_pad(prompts)
        first = params[0]
        if first.do_sample and first.seed is not None:
            torch.manual_seed(first.seed)
        rows = self._grammar_rows(params)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(first, max(p.max_new_tokens for p in params)),
            logits_processor=None if rows is None else [GrammarLogitsProcessor(rows)],
            stopping_criteria=(
                None if rows is None else [GrammarStoppingCriteria(rows, input_ids.shape[1])]
            ),
        )
        grammar_ends = {} if rows is None else rows.ended_at
        # scores: one (batch, vocab) tensor per step, after repetition penalty/temperature/top-k.
        log_probs = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        chosen = log_probs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        # One topk at the batch's largest k; each row keeps its own k of it.
        top = _top_k(log_probs, max(p.top_logprobs for p in params))
        prompt_scores = self._prompt_scores(prompts, params)
        generations = []
        for row, row_params in enumerate(params):
            tokens = new_tokens[row].tolist()
            length, reason = self._cut(tokens, row_params, grammar_ends.get(row))
            top_lists = None
            if row_params.top_logprobs > 0:
                values, ids = top[0][row, :length], top[1][row, :length]
                top_lists = _top_lists(values, ids, row_params.top_logprobs)
            row_log_probs = chosen[row, :length].tolist()
            prompt_lists = prompt_scores.get(row, (None, None))
            generations.append(
                Generation(tokens[:length], row_log_probs, reason, top_lists, *prompt_lists)
            )
        return generations

    def _grammar_rows(self, params: list[GenerationParams]) -> GrammarRows | None:
        """The rows' structured outputs; None when no row has one."""
        if all(p.grammar is None for p in params):
            return None
        if self.grammars is None:
            raise ValueError("this engine does not serve structured outputs")
        states = [None if p.grammar is None else self.grammars.state_for(p.grammar) for p in params]
        grammars = [None if state is None else state.result() for state in states]
        return GrammarRows(grammars, self.eos_token_ids)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) with every row's last token in the last column."""
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor(
            [[self.pad_token_id] * (width - len(p)) + p for p in prompts], device=self.device
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        return input_ids, attention_mask

    def _prompt_scores(self, prompts: list[list[int]], params: list[GenerationParams]) -> dict:
        """{row: (prompt log-probs, their top alternatives or None)} for the rows that ask for
        prompt log-probs, from one forward pass over those rows alone."""
        rows = [row for row, p in enumerate(params) if p.prompt_logprobs]
        if not rows:
            return {}
        input_ids, attention_mask = self._left_pad([prompts[row] for row in rows])
        # Numbered as generate numbers left-padded rows, so the values are the ones its prefill
        # saw: real tokens count from 0, padding sits at 0.
        position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).logits
        width = input_ids.shape[1]
        scores = {}
        for index, row in enumerate(rows):
            # Position j predicts token j + 1: every real position but the last one.
            start = width - len(prompts[row])
            scores[row] = _score_positions(
                logits[index, start : width - 1],
                input_ids[index, start + 1 :],
                params[row].top_logprobs,
            )
        return scores

    def _generation_config(self, params: GenerationParams, max_new_tokens: int) -> GenerationConfig:
        sampling = (
            {
                "temperature": params.temperature,
                # 0 (off) must be explicit: a None is filled with HF's default of 50.
                "top_k": params.top_k,
                "top_p": params.top_p,
            }
            if params.do_sample
            else {"temperature": None, "top_k": None, "top_p": None}
        )
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=params.do_sample,
            repetition_penalty=params.repetition_penalty,
            # [] rather than None: None is filled from the model's generation config.
            eos_token_id=[] if params.ignore_eos else sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )

    def _cut(
        self, tokens: list[int], params: GenerationParams, grammar_end: int | None = None
    ) -> tuple[int, str]:
        """How many of `tokens` the request keeps, and why it ended there; `grammar_end`: the
        tokens after which its grammar allowed nothing more (the rolling batch ends there as
        at an EOS token)."""
        length = min(len(tokens), params.max_new_tokens)
        if grammar_end is not None and grammar_end <= length:
            return grammar_end, "eos_token"  # no EOS comes before it: the grammar forbids one
        if not params.ignore_eos:
            for index, token in enumerate(tokens[:length]):
                if token in self.eos_token_ids:
                    return index + 1, "eos_token"
        return length, "length"


def _top_k(log_probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, token ids) of the `k` largest along the last dimension, or None for k = 0."""
    if k <= 0:
        return None
    return log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)


def _score_positions(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[list[float], list[TopLogprobs] | None]:
    """Each position's fp32 log-prob of its target token, and its `k` most likely tokens (None
    for k = 0), taking the log-softmax a slice of positions at a time."""
    chosen: list[float] = []
    tops: list[TopLogprobs] | None = [] if k > 0 else None
    for begin in range(0, len(targets), _PROMPT_ROWS):
        log_probs = logits[begin : begin + _PROMPT_ROWS].float().log_softmax(dim=-1)
        wanted = targets[begin : begin + _PROMPT_ROWS].unsqueeze(-1)
        chosen += log_probs.gather(-1, wanted).squeeze(-1).tolist()
        if tops is not None:
            tops += _top_lists(*_top_k(log_probs, k), k)
    return chosen, tops


def _top_lists(values: torch.Tensor, ids: torch.Tensor, k: int) -> list[TopLogprobs]:
    """[positions, >= k] tensors -> per position the `k` most likely (token id, log-prob), less
    the -inf ones (tokens top-k/top-p filtered out), so a list may be shorter than k."""
    return [
        [(token, value) for token, value in zip(row_ids, row_values) if value != -math.inf]
        for row_ids, row_values in zip(ids[:, :k].tolist(), values[:, :k].tolist())
    ]


def refuse_quantized_checkpoint(hf_config) -> None:
    """HF transformers loads AWQ and GPTQ checkpoints only through their own GPU kernel
    packages; the rolling batch serves them
    (rolling_batch/model/weights/quantized_checkpoint.py)."""
    method = quantization_config(hf_config).get("quant_method")
    if method is None:
        return
    raise ValueError(
        f"the checkpoint is quantized with {method} (config.json quantization_config):"
        " engine=Python cannot serve it; use engine=MPI with option.rolling_batch=auto"
    )
