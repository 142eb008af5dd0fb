"""A Llama decoder stack run by one C++ call a step (`DecoderStack`, kernels/csrc/decoder_stack.h)
where every op of its layers is native (fp32 linears in the C++ panels, bf16 ones too where
the CPU has AVX512-BF16, others through oneDNN): the same ops as `LlamaModel.forward`'s
layers, in the same order, so the same bits, without Python between them. A step's weight
stream evicts the interpreter's working set every layer, so its ~10 calls a layer cost 4.5 ms
of a 25 ms batch-1 decode step on a 2-core Xeon (1.5 ms with warm caches; the
performance log in benchmarks/log/). A step of enough decodes runs as runs of sequences,
one a thread, each through every layer alone (`sequence_parts`): no wait between the threads
from op to op.
"""

from __future__ import annotations

import logging

from lmserve.kernels import cpu_native

from ..layers.cpu_matmul import NativeGatedWeight, NativeLinearWeight, PackedWeight
from ..layers.mlp import GatedMLP

log = logging.getLogger(__name__)


def native_stack(model):
    """The C++ stack over `model`'s (a LlamaModel's) layers, or None where its layers need
    Python: weights neither in the C++ panels (fp32, bf16) nor in oneDNN's layout (bf16, fp16), as
    quantized ones and a GPU's are, tensor parallel (all-reduces between the ops), per-head
    query and key norms (Qwen3's), a partial rotation (Phi-3's), GELU or scaled embeddings
    (Gemma's), or a mixture of experts. Sliding windows run: each layer's is the C++
    attention's."""
    native = cpu_native.ops_for(model.norm.weight)
    if not model.native_stack_layers or native is None:
        return None
    if model.rotary.partial or model.embed_scale is not None:
        return None
    layers = list(model.layers)
    kinds = set()
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, GatedMLP):
            return None
        others = (attention.qkv_proj, attention.o_proj, mlp.down_proj)
        kinds.add((type(mlp.gate_up_proj.packed), *{type(linear.packed) for linear in others}))
        if attention.o_proj.group.world_size > 1 or mlp.down_proj.group.world_size > 1:
            return None
        if attention.q_norm is not None or mlp.activation != "silu":
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(norm.eps != model.norm.eps for norm in norms):
            return None
    # gate and up in the C++ panels are paired (NativeGatedWeight); oneDNN's are one weight
    if kinds == {(NativeGatedWeight, NativeLinearWeight)}:
        panels = True
    elif kinds == {(PackedWeight, PackedWeight)}:
        panels = False
    else:
        return None
    first = layers[0].self_attn
    stack = native.DecoderStack(
        first.heads.num_q,
        first.heads.num_kv,
        first.head_dim,
        model.norm.weight.shape[0],
        layers[0].mlp.local,
        model.norm.eps,
        first.scale,
        model.norm.weight,
        panels,
    )
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        stack.add_layer(
            layer.input_layernorm.weight,
            attention.qkv_proj.packed.packed,
            attention.qkv_proj.bias,
            attention.o_proj.packed.packed,
            attention.o_proj.bias,
            layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.packed.packed,
            mlp.gate_up_proj.bias,
            mlp.down_proj.packed.packed,
            mlp.down_proj.bias,
            attention.sliding_window or 0,
        )
    log.info("decoder stack: one C++ call a step over %d layers", len(layers))
    return stack
