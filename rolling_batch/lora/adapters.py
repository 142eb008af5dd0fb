"""LoRA adapters as PEFT saves them: a folder with `adapter_config.json` and
`adapter_model.safetensors` (or `.bin`), found under `<model dir>/adapters/<name>/`.

An adapter changes a linear `W` into `W + s * B @ A` (A: [r, in], B: [out, r], s = lora_alpha / r,
or lora_alpha / sqrt(r) with rsLoRA). Read here into plain tensors, B already scaled by s, keyed
by the module's name in the HF model ("model.layers.3.self_attn.q_proj"); the serving layers
shard and stack them (layers/lora.py). What lmserve does not apply is refused by name: DoRA,
trained biases, whole modules saved beside the adapter, adapters on the embedding or the LM head,
per-module alphas, ranks above option.max_lora_rank.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are read: the CLI finds adapters without it
    import torch

ADAPTERS_DIR = "adapters"
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The linears an adapter may modify: the decoder's projections.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter lmserve cannot serve; the message names it and says why."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"adapter {name!r}: {problem}")


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the largest of its modules' ranks
    # HF module name -> (A [r, in], B [out, r] times the scaling), in the model's dtype.
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of the config and weights bytes read

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def adapters_dir(*model_dirs: str | Path | None) -> Path | None:
    """The first of the model dirs (the one serving.properties is in, the model's own) that
    has an `adapters/` folder: DJL looks in both."""
    for model_dir in model_dirs:
        if model_dir is not None and (Path(model_dir) / ADAPTERS_DIR).is_dir():
            return Path(model_dir) / ADAPTERS_DIR
    return None


def find_adapters(root: str | Path | None) -> dict[str, Path]:
    """name -> folder of every adapter in the `adapters/` folder `root` (its folders holding
    an adapter_config.json), by name."""
    if root is None or not Path(root).is_dir():
        return {}
    return {
        folder.name: folder
        for folder in sorted(Path(root).iterdir())
        if folder.is_dir() and (folder / CONFIG_FILE).is_file()
    }


def load_adapter(
    name: str,
    folder: str | Path,
    max_rank: int,
    shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype,
) -> LoraAdapter:
    """The adapter in `folder`, checked against `shapes` ({HF module name: (out, in)} of the
    model's linears that adapters may modify) and option.max_lora_rank. Its `digest` is of
    the very bytes read: the prefix cache tells K/V computed through one set of weights from
    another's by it, even when the files change between two reads."""
    folder = Path(folder)
    digest = hashlib.sha256()
    config = _read_config(name, folder, digest)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in _read_tensors(name, folder, digest).items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise AdapterError(
                name, f"tensor {tensor_name!r} is not a LoRA A or B matrix of a linear"
            )
        module, which = match.groups()
        pairs.setdefault(module, {})[which] = tensor
    if not pairs:
        raise AdapterError(name, "its weights file holds no LoRA matrices")
    modules = {}
    rank = 0
    for module, pair in sorted(pairs.items()):
        a, b = _checked_pair(name, module, pair, shapes, max_rank)
        scaling = config["lora_alpha"] / (math.sqrt(a.shape[0]) if config["rsLoRA"] else a.shape[0])
        modules[module] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
        rank = max(rank, a.shape[0])
    return LoraAdapter(name, rank, modules, digest.hexdigest()[:32])


def _read_config(name: str, folder: Path, digest: hashlib._Hash) -> dict:
    try:
        raw = (folder / CONFIG_FILE).read_bytes()
        digest.update(raw)
        config = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as error:  # JSON and UTF-8 errors are ValueErrors
        raise AdapterError(name, f"unreadable {CONFIG_FILE}: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(name, f"{CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type {peft_type!r}: only LORA adapters are served")
    refused = {
        "use_dora": "DoRA (use_dora) is not served",
        "modules_to_save": "modules_to_save (whole modules saved beside it) are not served",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not served",
        "lora_bias": "trained LoRA biases (lora_bias) are not served",
        "layer_replication": "layer_replication is not served",
        "trainable_token_indices": "trained token embeddings (trainable_token_indices) are not"
        " served",
        "target_parameters": "LoRA on parameters (target_parameters) is not served",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not served",
    }
    for key, problem in refused.items():
        if config.get(key):
            raise AdapterError(name, problem)
    if config.get("bias", "none") != "none":
        raise AdapterError(name, f"bias={config['bias']!r}: trained biases are not served")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(name, f"lora_alpha {alpha!r}: expected a positive number")
    return {"lora_alpha": float(alpha), "rsLoRA": bool(config.get("use_rslora", False))}


def _read_tensors(name: str, folder: Path, digest: hashlib._Hash) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        path = folder / file_name
        if not path.is_file():
            continue
        try:
            data = path.read_bytes()
            digest.update(file_name.encode() + b"\0" + data)
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load

                return load(data)
            import torch

            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is the adapter's fault
            raise AdapterError(name, f"unreadable {file_name}: {error}") from None
    raise AdapterError(name, f"no {' or '.join(WEIGHT_FILES)} in {folder}")


def _checked_pair(name, module, pair, shapes, max_rank) -> tuple[torch.Tensor, torch.Tensor]:
    if module.rsplit(".", 1)[-1] not in TARGETS:
        raise AdapterError(
            name, f"modifies {module}: adapters may modify the {', '.join(TARGETS)} linears"
        )
    if module not in shapes:
        raise AdapterError(name, f"modifies {module}, which the model does not have")
    if set(pair) != {"A", "B"}:
        raise AdapterError(name, f"{module} lacks its lora_{'B' if 'A' in pair else 'A'} matrix")
    a, b = pair["A"], pair["B"]
    out_features, in_features = shapes[module]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
        raise AdapterError(
            name,
            f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a"
            f" {in_features} -> {out_features} linear",
        )
    if rank > max_rank:
        raise AdapterError(name, f"{module} has rank {rank}: above option.max_lora_rank={max_rank}")
    return a, b


def linear_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """{HF module name: (out, in)} of every linear a Llama-family adapter may modify."""
    hidden = hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q = hf_config.num_attention_heads * head_dim
    kv = hf_config.num_key_value_heads * head_dim
    inner = hf_config.intermediate_size
    per_layer = {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inner, hidden),
        "mlp.up_proj": (inner, hidden),
        "mlp.down_proj": (hidden, inner),
    }
    return {
        f"model.layers.{layer}.{module}": shape
        for layer in range(hf_config.num_hidden_layers)
        for module, shape in per_layer.items()
    }
