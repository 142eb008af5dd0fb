"""The engine=Python model: HF transformers `generate` over one static batch of token-id prompts.

Prompts are left-padded so every row's next token sits in the last column; each row is then cut
to its own `max_new_tokens` and its first EOS, so requests of different lengths share a batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from lmserve.rolling_batch.eos_tokens import eos_token_ids
from lmserve.rolling_batch.model_loader import resolve_dtype
from lmserve.rolling_batch.protocol import GenerationParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "length" | "eos_token"


class HFEngine:
    def __init__(self, model, device: str, eos_token_ids: set[int]):
        self.model = model
        self.device = device
        self.dtype = model.dtype
        self.eos_token_ids = eos_token_ids
        pad = model.generation_config.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids, default=0)

    @classmethod
    def load(cls, model_path: str, dtype: str, trust_remote_code: bool = False) -> HFEngine:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype="auto", trust_remote_code=trust_remote_code
        )
        torch_dtype = resolve_dtype(dtype, model.dtype, device)
        model = model.to(device=device, dtype=torch_dtype).eval()
        return cls(model, device, eos_token_ids(model_path, trust_remote_code=trust_remote_code))

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: list[GenerationParams]
    ) -> list[Generation]:
        """`params` share one `batch_key()`; only max_new_tokens may differ."""
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor(
            [[self.pad_token_id] * (width - len(p)) + p for p in prompts], device=self.device
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        first = params[0]
        if first.do_sample and first.seed is not None:
            torch.manual_seed(first.seed)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(first, max(p.max_new_tokens for p in params)),
        )
        # scores: one (batch, vocab) tensor per step, after repetition penalty/temperature/top-k.
        log_probs = torch.stack(out.scores, dim=1).float().log_softmax(dim=-1)
        new_tokens = out.sequences[:, width:]
        chosen = log_probs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        return [
            self._cut(new_tokens[row].tolist(), chosen[row].tolist(), row_params)
            for row, row_params in enumerate(params)
        ]

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

    def _cut(self, tokens: list[int], log_probs: list[float], params: GenerationParams):
        tokens = tokens[: params.max_new_tokens]
        if not params.ignore_eos:
            for index, token in enumerate(tokens):
                if token in self.eos_token_ids:
                    n = index + 1
                    return Generation(tokens[:n], log_probs[:n], "eos_token")
        return Generation(tokens, log_probs[: len(tokens)], "length")
