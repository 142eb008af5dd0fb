"""The generic path: a decoder-only model transformers ships, with no native module here, runs
in the rolling batch as its own HF module tree. lmserve's paged attention is registered with
transformers as an attention function (`lmserve_paged`): each layer's call writes the step's
K/V into the paged cache and attends over it, so continuous batching, prefix caching and
streaming work as on the native families. The packed step is one row of tokens with their
positions (transformers builds no mask for an attention function it has no mask for).

What it cannot run is refused before anything starts (`generic_refusal`, asked by the front
end through `python -m lmserve.rolling_batch.model.families.generic`): TP > 1,
option.quantize, LoRA, attention sinks, latent attention.
"""

from __future__ import annotations

import contextvars
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..layers.attention import AttentionMetadata
from ..layers.cpu_matmul import DenseWeight, try_pack

ATTENTION_NAME = "lmserve_paged"


@dataclass
class _Step:
    """What the registered attention function reads during one forward pass."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    meta: AttentionMetadata | None
    calls: dict[int, _LayerCall] | None = None  # the layout probe records each layer's call


@dataclass(frozen=True)
class _LayerCall:
    key: tuple[int, int]  # (KV heads, head_dim)
    value: tuple[int, int]
    extras: tuple[str, ...]  # keyword arguments with a value this function does not apply


# Keyword arguments models pass that change nothing here (positions are already applied), and
# those paged_attention takes (a layer's sliding window, Gemma 2's score soft-capping).
_HANDLED_ARGUMENTS = {
    "position_ids",
    "cache_position",
    "use_cache",
    "position_embeddings",
    "sliding_window",
    "softcap",
}


_STEP: contextvars.ContextVar[_Step] = contextvars.ContextVar("lmserve_generic_step")


def paged_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers' attention-function signature: query `[1, heads, T, head_dim]`, key and
    value `[1, kv_heads, T, head_dim]` (rotated already); returns `[1, T, heads, head_dim]`."""
    step = _STEP.get()
    layer = module.layer_idx
    query, key, value = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    if step.calls is not None:  # the layout probe: what each layer asks for, nothing computed
        extras = (k for k, v in kwargs.items() if v is not None and k not in _HANDLED_ARGUMENTS)
        step.calls[layer] = _LayerCall(
            tuple(key.shape[1:]), tuple(value.shape[1:]), tuple(sorted(extras))
        )
        return query.new_zeros(*query.shape[:2], value.shape[-1])[None], None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = step.meta.store_and_attend(
        query,
        key,
        value,
        step.kv_caches[layer],
        scale,
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
    )
    return out[None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


class _DecoderOutput:
    """What a causal-LM forward reads from its decoder's output: the hidden states, and None
    for whatever else the family's output type carries (router logits, cross attentions)."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str):
        return None  # only names not set above

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index] if isinstance(index, int) else None


class _HiddenStates(nn.Module):
    """Stands in for the HF model's decoder inside its own causal-LM forward, so that
    `compute_logits` gets the family's own head, scaling and soft-capping from the hidden states
    the step computed (whatever the family does after its last norm)."""

    def __init__(self):
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args, **kwargs) -> _DecoderOutput:
        return _DecoderOutput(self.hidden)


class _PackedLinear(nn.Module):
    """An HF nn.Linear multiplying through lmserve's packed CPU weight (the C++ panels, or
    oneDNN's layout): torch's plain matmul on a transposed weight took 4-5x the native step's
    time at decode batch sizes."""

    def __init__(self, linear: nn.Linear, packed: DenseWeight):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # read by some families' code
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self.bias)


class GenericCausalLM(nn.Module):
    """The ModelRunner's model interface over an HF causal LM (TP=1)."""

    def __init__(self, hf_model, tensor_parallel_degree: int = 1):
        super().__init__()
        refusal = generic_refusal(hf_model.config, tensor_parallel_degree)
        if refusal is not None:
            raise ValueError(f"{type(hf_model).__name__}: {refusal}")
        self.config = hf_model.config
        self.hf = hf_model
        # The decoder runs from here; the causal-LM forward sees the stand-in (compute_logits).
        self.decoder = hf_model.base_model
        self._head_input = _HiddenStates()
        setattr(hf_model, hf_model.base_model_prefix, self._head_input)
        self.greedy_head = None
        self.num_layers, self.num_kv_heads, self.head_dim = self._probe_kv_layout()

    @classmethod
    def from_pretrained(
        cls,
        model_path,
        dtype,
        device,
        tensor_parallel_degree=1,
        trust_remote_code=False,
        dummy=False,
    ):
        """`dummy`: transformers' own random initialization from config.json, on the device
        (option.load_format=dummy)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        _register()
        if dummy:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            torch.manual_seed(0)  # every rank draws the same model, then takes its shard
            with torch.device(device):
                hf_model = AutoModelForCausalLM.from_config(
                    config,
                    dtype=dtype,
                    attn_implementation=ATTENTION_NAME,
                    trust_remote_code=trust_remote_code,
                )
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(
                model_path,
                dtype=dtype,
                attn_implementation=ATTENTION_NAME,
                trust_remote_code=trust_remote_code,
            )
        return cls(hf_model.to(device).eval(), tensor_parallel_degree)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.decoder.parameters()).dtype

    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head_dim) of the paged cache."""
        return self.num_layers, self.num_kv_heads, self.head_dim

    @torch.inference_mode()
    def _probe_kv_layout(self) -> tuple[int, int, int]:
        """Each layer's attention call from one token through the model: configs name their
        head counts their own ways, the calls do not; and a call asking for what the paged
        kernels do not do (attention sinks) stops the load here."""
        calls: dict[int, _LayerCall] = {}
        device = next(self.decoder.parameters()).device
        one = torch.zeros((1, 1), dtype=torch.long, device=device)
        token = _STEP.set(_Step(None, None, calls))
        try:
            self.decoder(input_ids=one, position_ids=one, use_cache=False)
        finally:
            _STEP.reset(token)
        named = type(self.hf).__name__
        if not calls or sorted(calls) != list(range(len(calls))):
            raise ValueError(f"{named}: its attention does not go through transformers' interface")
        shapes = {(call.key, call.value) for call in calls.values()}
        if len(shapes) != 1 or calls[0].key != calls[0].value:
            raise ValueError(
                f"{named}: key and value heads differ in size or from layer to layer"
                f" ({sorted(shapes)}); the paged cache holds one shape for both"
            )
        for layer, call in calls.items():
            if call.extras:
                raise ValueError(
                    f"{named}: layer {layer}'s attention asks for {', '.join(call.extras)},"
                    " which lmserve's paged attention does not apply"
                )
        heads, dim = calls[0].key
        return len(calls), heads, dim

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        token = _STEP.set(_Step(kv_caches, meta))
        try:
            out = self.decoder(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        finally:
            _STEP.reset(token)
        hidden = out.last_hidden_state[0]
        return hidden if meta.output_rows is None else hidden[meta.output_rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._head_input.hidden = hidden[None]
        try:
            placeholder = torch.zeros((1, len(hidden)), dtype=torch.long, device=hidden.device)
            logits = self.hf(input_ids=placeholder, use_cache=False, logits_to_keep=0).logits
        finally:
            self._head_input.hidden = None
        return logits[0].float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden).argmax(dim=-1)

    def pack_weights(self) -> None:
        """On CPU every nn.Linear (the LM head too) multiplies through a packed copy of its
        weight, which then frees its own (unless the embedding shares it); a GPU keeps them."""
        embedding = self.decoder.get_input_embeddings().weight
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:  # subclasses may compute otherwise
                    continue
                packed = try_pack(child.weight.data)
                if packed is None:
                    continue
                setattr(parent, name, _PackedLinear(child, packed))
                if child.weight is not embedding:
                    child.weight.data = child.weight.data.new_empty(0)


# What the layout probe finds at load (its call asks for what the kernels do not do), known by
# model type so that start-up refuses it before any rank starts.
_REFUSED_TYPES = {
    "gpt_oss": "attention sinks (s_aux), which lmserve's paged attention does not apply",
    "deepseek_v2": "latent attention (key and value heads differ in size), not in the paged cache",
    "deepseek_v3": "latent attention (key and value heads differ in size), not in the paged cache",
}


def generic_refusal(config, tensor_parallel_degree: int) -> str | None:
    """Why the generic path cannot serve this config (None: it can), for a message that names
    the architecture first. It imports transformers (and with it torch): the front end asks
    through `python -m` (main below)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model; the rolling batch runs decoder-only models"
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None:
        return f"transformers has no causal LM for model_type {model_type!r}"
    import transformers

    model_class = getattr(transformers, class_name, None)
    if model_class is None or not getattr(model_class, "_supports_attention_backend", False):
        return (
            f"transformers' {class_name} does not route its attention through the"
            " attention interface the generic path plugs the paged KV cache into"
        )
    if model_type in _REFUSED_TYPES:
        return _REFUSED_TYPES[model_type]
    if tensor_parallel_degree > 1:
        return "the generic path runs TP=1 (set tensor_parallel_degree=1)"
    return None


def main(argv: list[str]) -> int:
    """`python -m lmserve.rolling_batch.model.families.generic MODEL_DIR TP TRUST`: prints a JSON
    `{"refusal": str | null}` for the front end, which stays torch-free."""
    from transformers import AutoConfig

    folder, tp, trust = argv
    try:
        config = AutoConfig.from_pretrained(Path(folder), trust_remote_code=trust == "1")
        refusal = generic_refusal(config, int(tp))
    except (OSError, ValueError, KeyError) as error:
        refusal = f"{folder}: transformers cannot read its config ({error})"
    print(json.dumps({"refusal": refusal}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
