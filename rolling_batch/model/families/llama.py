"""The Llama family (Llama, Mistral, Qwen2, SmolLM): RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, tied or untied embeddings. Reads like single-device code: the parallel
layers hold and load their own shards."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lmserve.kernels import cpu_native

from ...lora.adapters import linear_shapes
from ..layers.attention import Attention, AttentionMetadata
from ..layers.cpu_matmul import (
    DenseWeight,
    NativeLinearWeight,
    PackableLinear,
    try_pack,
)
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding, take_int8
from ..layers.greedy_head import GreedyHead
from ..layers.lora import LoraSlots, LoraStep
from ..layers.mlp import GatedMLP
from ..layers.norm_and_rotary import RMSNorm, RotaryEmbedding, StepRope
from ..layers.parallel import TensorParallelGroup, shard_heads
from ..layers.quantized import GROUP_SIZE, QuantizedWeight
from .native_stack import native_stack

log = logging.getLogger(__name__)

# checkpoint name fragment -> (fused parameter fragment, shard id)
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


@dataclass(frozen=True)
class BlockVariant:
    """How a family's decoder differs from Llama's by a switch (set on its ForCausalLM)."""

    qk_norm: bool = False  # each query and key head RMS-normed before the rotation (Qwen3)
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    scaled_embedding: bool = False  # embeddings times sqrt(hidden_size) (Gemma)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, head_dim, group, qkv_bias: bool, o_bias: bool, variant, mlp):
        super().__init__()
        heads = shard_heads(
            config.num_attention_heads, config.num_key_value_heads, group.world_size, group.rank
        )
        self.self_attn = Attention(
            config.hidden_size,
            head_dim,
            heads,
            group,
            qkv_bias,
            o_bias,
            qk_norm_eps=config.rms_norm_eps if variant.qk_norm else None,
        )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta: AttentionMetadata):
        """(this layer's MLP output, the residual stream before it): each layer adds the
        previous one's output to the stream inside its first norm (one fused op on CPU)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    native_stack_layers = True  # layers the one-call C++ stack may run (native_stack.py)
    layer_class: type[nn.Module] = LlamaDecoderLayer  # a family's own (models/gemma.py)

    def __init__(self, config, group, max_positions: int, variant: BlockVariant):
        super().__init__()
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        # Qwen2 biases Q/K/V but not O (Qwen2-MoE says so: qkv_bias); Llama's attention_bias
        # covers both.
        is_qwen2 = "Qwen2ForCausalLM" in (config.architectures or [])
        o_bias = getattr(config, "attention_bias", False)
        qkv_bias = o_bias or is_qwen2 or getattr(config, "qkv_bias", False)
        self.rotary = self.make_rotary(config, head_dim, max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            self.layer_class(
                config,
                head_dim,
                group,
                qkv_bias,
                o_bias,
                variant,
                self.make_mlp(config, group, variant, i),
            )
            for i in range(config.num_hidden_layers)
        )
        for layer, window in zip(self.layers, sliding_windows(config, max_positions)):
            layer.self_attn.sliding_window = window
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the model dtype first.
        self.embed_scale = config.hidden_size**0.5 if variant.scaled_embedding else None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.native_stack = None  # set by LlamaForCausalLM.pack_weights where it applies
        self.lora_step: LoraStep | None = None  # LoRA: the stack serves steps without adapters

    def make_rotary(self, config, head_dim: int, max_positions: int) -> RotaryEmbedding:
        """The rotary table `step_ropes` hands the layers (Gemma 3 builds a second)."""
        return RotaryEmbedding(config, head_dim, max_positions)

    def make_mlp(self, config, group, variant: BlockVariant, layer_index: int) -> nn.Module:
        """Layer `layer_index`'s MLP (a mixture of experts in the families with one:
        models/moe.py)."""
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        return GatedMLP(config.hidden_size, size, group, variant.activation, bias)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        if self._stack_serves():
            return self.native_stack.forward(
                *self._stack_inputs(input_ids, positions, kv_caches, meta), meta.output_rows
            )
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        ropes = self.step_ropes(positions, hidden.dtype)
        residual = None
        for layer, rope, kv_cache in zip(self.layers, ropes, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        if meta.output_rows is not None:
            hidden, residual = hidden[meta.output_rows], residual[meta.output_rows]
        return self.norm(hidden, residual)[0]

    def step_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[StepRope]:
        """Each layer's rotation of the step: one for all (Gemma 3's local layers have a base
        of their own)."""
        return [self.rotary.for_step(positions, dtype)] * len(self.layers)

    def forward_greedy(self, input_ids, positions, kv_caches, meta):
        """(forward's outputs for every token, each one's greedy token or -1) from one C++ call,
        for a caller that gave the stack the greedy head (`set_greedy_head`): a split step's
        threads share the head's work as their runs end. None where the stack does not serve."""
        if not self._stack_serves() or meta.output_rows is not None:
            return None
        return self.native_stack.forward_greedy(
            *self._stack_inputs(input_ids, positions, kv_caches, meta)
        )

    def _stack_serves(self) -> bool:
        return self.native_stack is not None and not (self.lora_step and self.lora_step.slots)

    def _stack_inputs(self, input_ids, positions, kv_caches, meta) -> tuple:
        return (
            self.embed_tokens(input_ids),
            positions,
            self.rotary.cos,
            self.rotary.sin_signed,
            [k_cache for k_cache, _ in kv_caches],
            [v_cache for _, v_cache in kv_caches],
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
        )


def sliding_windows(config, max_positions: int) -> list[int | None]:
    """Each layer's sliding window as HF applies it: on the layers `layer_types` calls
    "sliding_attention" where the config has them (Qwen2, Qwen3), else on every layer (Mistral,
    Phi-3); None where there is none or it is no shorter than the context."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True) or window >= max_positions:
        return [None] * config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


class LlamaForCausalLM(nn.Module):
    variant = BlockVariant()  # families that differ by a switch set theirs (models/qwen3.py)
    model_class: type[nn.Module] = LlamaModel  # a family with other layers (models/falcon.py)
    # (pattern, replacement) pairs applied in order to each checkpoint tensor's name
    renamed_tensors: tuple[tuple[re.Pattern, str], ...] = ()
    # Final logits squashed into (-cap, cap) by cap * tanh(logit / cap) (Gemma 2), None: not.
    final_softcap: float | None = None

    def __init__(self, config, group: TensorParallelGroup, max_positions: int):
        super().__init__()
        self.config = config
        self.model = self.model_class(config, group, max_positions, self.variant)
        self.tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head_packed: DenseWeight | QuantizedWeight | None = None
        self.greedy_head: GreedyHead | None = None  # fp32 on CPUs with AVX512-BF16, TP=1
        if not self.tied:
            self.lm_head = ParallelLMHead(self.model.embed_tokens, config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        """What the model computes in (quantized weights hold other types)."""
        return self.model.norm.weight.dtype

    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, this rank's KV heads, head_dim) of the paged cache, as the attention holds
        them: each family names and counts them in its config its own way (Falcon:
        multi_query, num_kv_heads)."""
        attention = self.model.layers[0].self_attn
        return len(self.model.layers), attention.heads.num_kv, attention.head_dim

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_packed is not None:
            local = self.lm_head_packed(hidden)
        else:
            local = nn.functional.linear(hidden, self._lm_head_weight())
        logits = self.model.embed_tokens.gather_logits(local).float()
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token, the argmax of its fp32 logits, through the GreedyHead; the
        fp32 logits only for the rows it leaves (not finite), or for every row on a CPU that
        built no head (an `argmax_only` chunk is still answered there)."""
        if self.greedy_head is None:
            left = torch.full((len(hidden),), -1, dtype=torch.long, device=hidden.device)
            return self._complete_greedy(hidden, left)
        return self._complete_greedy(hidden, self.greedy_head(hidden))

    def forward_greedy(self, input_ids, positions, kv_caches, meta):
        """(the outputs of every token, each one's greedy token) from the stack's one call
        (LlamaModel.forward_greedy), or None where it does not apply. pack_weights hands the
        stack the greedy head wherever both exist."""
        if self.greedy_head is None:
            return None
        out = self.model.forward_greedy(input_ids, positions, kv_caches, meta)
        return None if out is None else (out[0], self._complete_greedy(*out))

    def _complete_greedy(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens` with the rows the greedy head left (-1) picked from their fp32 logits."""
        left = (tokens < 0).nonzero()[:, 0]
        if len(left):
            logits = self.compute_logits(hidden[left])
            tokens[left] = cpu_native.ops_for(logits).greedy_pick(logits)[0]
        return tokens

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def pack_weights(self, quantize: str | None = None) -> None:
        """On CPU packed weights for every linear and the LM head (layers/cpu_matmul.py;
        a GPU keeps them as they are). A tied LM head is packed as a copy: the embedding lookup
        still reads its rows.
        `quantize="int4"` or `"int8"` quantizes the decoder's linears so, and the embedding
        and LM head to int8 either way (an error there lands on every logit directly;
        llama.cpp's 4-bit files keep them at 8 bits too), one int8 copy serving both when
        they are tied. Linears loaded as int4 codes (`expect_int4`) stay so."""
        for module in self.modules():
            if isinstance(module, PackableLinear):
                module.pack(quantize)
        # (the hidden size, not the weight's shape: int8 codes from a GGUF left it empty)
        groups_fit = self.config.hidden_size % GROUP_SIZE == 0
        if quantize is not None and not groups_fit:
            log.warning(
                "%s: the embedding and LM head stay dense (hidden size %d no multiple of %d)",
                quantize,
                self.config.hidden_size,
                GROUP_SIZE,
            )
        if quantize is None or not groups_fit:
            self.lm_head_packed = try_pack(self._lm_head_weight().data)
            # Its exact logits are the fp32 panels' bits; with TP each rank holds a slice.
            whole = self.model.embed_tokens.group.world_size == 1
            # The greedy head picks the largest raw logit; capped logits that round to one
            # value tie in HF's argmax, which then takes the first: capped ones decide.
            uncapped = self.final_softcap is None
            if isinstance(self.lm_head_packed, NativeLinearWeight) and whole and uncapped:
                self.greedy_head = GreedyHead.try_build(self._lm_head_weight().data)
            self.model.native_stack = stack = native_stack(self.model)
            if stack is not None and self.greedy_head is not None:
                head = self.greedy_head
                stack.set_greedy_head(head.approx.packed, head.weight, head.norms)
            return
        embedding = self.model.embed_tokens.quantize()
        if self.tied:
            self.lm_head_packed = embedding
        else:
            self.lm_head_packed = take_int8(self.lm_head)

    def expect_int4(self, group_size: int, linears: Iterable[str] | None = None) -> None:
        """The checkpoint's decoder linears (all, or those named as the checkpoint names them)
        are int4 codes in groups of `group_size` inputs (AWQ, GPTQ, GGUF's Q4); the embedding,
        norms and LM head stay as the checkpoint has them."""
        fused = None if linears is None else {_fused_name(f"{name}.")[0] for name in linears}
        for name, module in self.named_modules():
            if isinstance(module, PackableLinear) and (fused is None or f"{name}." in fused):
                try:
                    module.expect_int4(group_size)
                except ValueError as error:
                    raise ValueError(f"{name}: {error}") from None

    def expect_int8(self, names: Iterable[str]) -> set[str]:
        """Of the matrices `names` (as the checkpoint names them: decoder linears,
        `model.embed_tokens`, `lm_head`), those that load as int8 codes with a scale a group
        (GGUF's Q8_0). A row-parallel shard that would split the groups takes the checkpoint's
        dense weight instead (quantized again at `pack_weights`): returns the names taken."""
        modules = dict(self.named_modules())
        members: dict[str, list[str]] = {}
        for name in names:
            members.setdefault(_fused_name(f"{name}.")[0].removesuffix("."), []).append(name)
        taken = set()
        for target, checkpoint_names in members.items():
            try:
                modules[target].expect_int8()
            except ValueError as error:
                log.info("%s: %s; quantized from the dense weight instead", target, error)
                continue
            taken.update(checkpoint_names)
        return taken

    def enable_lora(self, num_slots: int, max_rank: int, step: LoraStep) -> dict:
        """LoRA slots (layers/lora.py) on every decoder linear. Returns {HF module name:
        (the slots of the linear that holds it, its projection's shard id there)}."""
        modules = dict(self.named_modules())
        weight = self.model.embed_tokens.weight
        self.model.lora_step = step
        targets = {}
        for name in linear_shapes(self.config):
            fused, projection = _fused_name(f"{name}.")
            linear = modules[fused.removesuffix(".")]
            if linear.lora is None:
                linear.lora = LoraSlots(
                    linear, num_slots, max_rank, step, weight.dtype, weight.device
                )
            targets[name] = (linear.lora, projection)
        return targets

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under Llama's names: a family whose checkpoints name
        them otherwise lists the renames in `renamed_tensors`; one that fuses them splits them
        here (models/phi3.py)."""
        return ((self.checkpoint_name(name), tensor) for name, tensor in weights)

    def checkpoint_name(self, name: str) -> str:
        for pattern, replacement in self.renamed_tensors:
            name = pattern.sub(replacement, name)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_tensors(weights):
            if "rotary_emb" in name or (self.tied and name == "lm_head.weight"):
                continue
            target, shard = _fused_name(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            module = modules[target.rsplit(".", 1)[0]]
            param = params[target]
            loader = getattr(module, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")


def _fused_name(name: str) -> tuple[str, str | int | None]:
    """(the native model's name for checkpoint tensor `name`, its shard in a fused linear)."""
    for fragment, (fused, shard) in _FUSED.items():
        if fragment in name:
            return name.replace(fragment, fused), shard
    return name, None
