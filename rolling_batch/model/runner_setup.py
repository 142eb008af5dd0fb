"""From a model directory and options to a ready ModelRunner: device, dtype, weights (this
rank's shards), KV cache sized from the memory budget. Shared by the offline `LLM` and the MPI
ranks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..lora.adapters import ADAPTERS_DIR, find_adapters
from ..lora.manager import LoraManager
from . import kv_cache
from .context_length import context_length
from .cuda_graphs import capture_decode_graphs
from .layers.parallel import TensorParallelGroup
from .runner import ModelRunner
from .weights.loader import load_hf_config, load_model, resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeOptions:
    dtype: str = "auto"  # fp32 | fp16 | bf16 | auto
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    paged_attention: bool = True
    block_size: int = 16  # with paged_attention=False a block is max_model_len long
    max_rolling_batch_size: int = 32  # sequences in flight, whose KV the cache must hold at once
    cpu_kv_cache_fraction: float = 0.25  # share of available RAM for the KV cache on CPU
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # pins the pool instead of the memory budget
    trust_remote_code: bool = False
    quantize: str | None = None  # option.quantize (model/weights/loader.py: load_model)
    model_impl: str = "auto"  # option.model_impl: "transformers" takes the generic path
    load_format: str = "auto"  # option.load_format: "dummy" draws random weights
    enforce_eager: bool = True  # option.enforce_eager: False captures CUDA decode graphs
    # LoRA adapters from <model dir>/adapters/ (lora/manager.py); the option.* names.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 4
    adapters_dir: str | None = None  # None: <model dir>/adapters

    @classmethod
    def from_config(cls, config, adapters_dir: str | None = None) -> RuntimeOptions:
        """The engine options of a ServingConfig (and where its LoRA adapters are)."""
        return cls(
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            paged_attention=config.paged_attention,
            block_size=config.block_size,
            max_rolling_batch_size=config.max_rolling_batch_size,
            cpu_kv_cache_fraction=config.cpu_kv_cache_fraction,
            gpu_memory_utilization=config.gpu_memory_utilization,
            num_kv_blocks=config.num_kv_blocks,
            trust_remote_code=config.trust_remote_code,
            quantize=config.quantize,
            model_impl=config.model_impl,
            load_format=config.load_format,
            enforce_eager=config.enforce_eager,
            enable_lora=config.enable_lora,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            adapters_dir=adapters_dir,
        )


def pick_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_runner(
    model_path: str | Path,
    options: RuntimeOptions,
    group: TensorParallelGroup,
    ranks_here: int = 1,
) -> tuple[ModelRunner, object, int]:
    """(runner, HF config, max_model_len)."""
    hf_config = load_hf_config(model_path, options.trust_remote_code)
    device = pick_device(group.rank)
    checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
    dtype = resolve_dtype(options.dtype, checkpoint_dtype, device.type)
    max_model_len = context_length(hf_config.to_dict(), options.max_model_len)
    model = load_model(
        model_path,
        hf_config,
        dtype,
        device,
        group,
        max_model_len,
        options.quantize,
        options.trust_remote_code,
        options.model_impl,
        options.load_format,
    )
    lora = None
    if options.enable_lora:
        lora = _lora_manager(model_path, options, model, hf_config, dtype)

    block_size = options.block_size if options.paged_attention else max_model_len
    shape = kv_cache.CacheShape(*model.kv_layout(), block_size, dtype)
    budget = kv_cache.memory_budget(
        device, options.gpu_memory_utilization, options.cpu_kv_cache_fraction, ranks_here
    )
    if lora is not None and device.type == "cpu":
        budget = max(0, budget - lora.cache_bytes)  # adapters load into RAM as they are asked for
    useful = options.max_rolling_batch_size * -(-max_model_len // block_size)
    if options.num_kv_blocks is not None:
        budget = options.num_kv_blocks * shape.bytes_per_block
        useful = options.num_kv_blocks
    num_blocks = kv_cache.plan_num_blocks(shape, budget, useful)
    log.info(
        "rank %d: %s on %s, KV cache %d blocks x %d tokens (%.0f MiB of a %.0f MiB budget)",
        group.rank,
        str(dtype).removeprefix("torch."),
        device,
        num_blocks,
        block_size,
        num_blocks * shape.bytes_per_block / 2**20,
        budget / 2**20,
    )
    kv_caches = kv_cache.allocate(shape, num_blocks, device)
    runner = ModelRunner(model, kv_caches, block_size, device, lora)
    # Graphs hold no collectives and no adapters: one rank, no LoRA (cuda_graphs.py).
    capturable = group.world_size == 1 and lora is None
    if device.type == "cuda" and not options.enforce_eager and capturable:
        runner.graphs = capture_decode_graphs(runner, options.max_rolling_batch_size, max_model_len)
    return runner, hf_config, max_model_len


def _lora_manager(model_path, options: RuntimeOptions, model, hf_config, dtype) -> LoraManager:
    folder = Path(options.adapters_dir or Path(model_path) / ADAPTERS_DIR)
    lora = LoraManager(
        model,
        hf_config,
        find_adapters(folder),
        options.max_loras,
        options.max_lora_rank,
        options.max_cpu_loras,
        dtype,
    )
    lora.load_all()
    log.info(
        "LoRA: %d adapter(s) in %s (%s); %d slots of rank %d take %.1f MiB, up to %.1f MiB"
        " kept for option.max_cpu_loras=%d",
        len(lora.sources),
        folder,
        ", ".join(lora.sources) or "none yet",
        options.max_loras,
        options.max_lora_rank,
        lora.slot_bytes / 2**20,
        lora.cache_bytes / 2**20,
        options.max_cpu_loras,
    )
    return lora
