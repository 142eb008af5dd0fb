"""Which models the rolling batch serves, decided before anything starts. Torch-free: the
front end refuses a model the engine could not load before it converts, loads or starts
anything, with the architecture named and the alternative.

A model's architecture comes from its config.json (`architectures`, else `model_type`), or for
a GGUF file from its header's `general.architecture`, read without loading the file. A family
with a module of its own under rolling_batch/model/families/ is served natively; any other
decoder-only model transformers ships goes the generic path (families/generic.py), which the
front end asks about in a child process (transformers imports torch; the front end stays
without it).
"""

from __future__ import annotations

import json
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lmserve.properties.python_command import python_command


@dataclass(frozen=True)
class NativeFamily:
    """A family with a module of its own under rolling_batch/model/families/ (docs/models.md's
    table of supported models is written from these:
    `python -m lmserve.rolling_batch.model.architectures`)."""

    family: str  # as users call it
    architectures: tuple[str, ...]  # config.json's names
    location: str  # "module:class" under rolling_batch/model/families/
    gguf: tuple[str, ...] = ()  # GGUF `general.architecture` values served (see below)
    lora: str = "yes"  # "yes", or why not / what not (refused at start-up when "no ...")
    notes: str = ""
    # option.quantize at load; AWQ/GPTQ checkpoints where their names are Llama's.
    quantize: str = "int4, int8"


_CHECKPOINT_QUANTIZED = "int4, int8, AWQ, GPTQ"
# Quantized checkpoints served (4-bit; model/weights/quantized_checkpoint.py reads them).
CHECKPOINT_METHODS = ("awq", "gptq")
_WINDOW_NOTE = "sliding windows served past the window"
_MOE_LORA = "no (refused at start-up)"
_MOE_NOTE = "experts split across TP ranks (each expert's columns)"
# GGUF files are served for the families whose GGUF tensors lmserve also reads as codes
# (option.quantize takes them from the file under Llama's names): Phi-3's fused and Falcon's
# tensors are not, so their GGUF files are refused by name (their safetensors are served).
NATIVE_FAMILIES = (
    NativeFamily(
        "Llama (1-3.x), SmolLM",
        ("LlamaForCausalLM",),
        "llama:LlamaForCausalLM",
        gguf=("llama",),
        quantize=_CHECKPOINT_QUANTIZED,
    ),
    NativeFamily(
        "Mistral",
        ("MistralForCausalLM",),
        "llama:LlamaForCausalLM",
        gguf=("mistral",),
        quantize=_CHECKPOINT_QUANTIZED,
        notes=_WINDOW_NOTE,
    ),
    NativeFamily(
        "Qwen2, Qwen2.5",
        ("Qwen2ForCausalLM",),
        "llama:LlamaForCausalLM",
        gguf=("qwen2",),
        quantize=_CHECKPOINT_QUANTIZED,
        notes=_WINDOW_NOTE,
    ),
    NativeFamily(
        "Qwen3", ("Qwen3ForCausalLM",), "qwen3:Qwen3ForCausalLM", gguf=("qwen3",), notes=""
    ),
    NativeFamily(
        "Phi-3, Phi-3.5, Phi-4-mini",
        ("Phi3ForCausalLM",),
        "phi3:Phi3ForCausalLM",
        lora="o_proj, down_proj (fused qkv_proj, gate_up_proj refused)",
        notes="LongRoPE (128k context, Phi-4-mini): the long factors where option.max_model_len"
        " exceeds the original context, else the short; " + _WINDOW_NOTE,
    ),
    NativeFamily("Gemma", ("GemmaForCausalLM",), "gemma:GemmaForCausalLM"),
    NativeFamily(
        "Gemma 2",
        ("Gemma2ForCausalLM",),
        "gemma:Gemma2ForCausalLM",
        notes="local (sliding-window) and global layers; soft-capped scores and logits",
    ),
    NativeFamily(
        "Gemma 3 (text)",
        ("Gemma3ForCausalLM",),
        "gemma:Gemma3ForCausalLM",
        notes="local and global layers, each with its rotary base",
    ),
    NativeFamily(
        "Falcon (7B, 40B, 180B, Falcon2)",
        ("FalconForCausalLM", "RWForCausalLM"),
        "falcon:FalconForCausalLM",
        lora="no (refused at start-up)",
        notes="ALiBi variants refused",
    ),
    NativeFamily(
        "GPT-NeoX, Pythia",
        ("GPTNeoXForCausalLM",),
        "gpt_neox:GPTNeoXForCausalLM",
        lora="no (refused at start-up)",
        notes="parallel or sequential residual; partial rotary",
    ),
    NativeFamily(
        "Mixtral (MoE)",
        ("MixtralForCausalLM",),
        "moe:MixtralForCausalLM",
        lora=_MOE_LORA,
        notes=_MOE_NOTE,
    ),
    NativeFamily(
        "Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B)",
        ("Qwen2MoeForCausalLM",),
        "moe:Qwen2MoeForCausalLM",
        lora=_MOE_LORA,
        notes=_MOE_NOTE + "; shared expert",
    ),
    NativeFamily(
        "Qwen3-MoE",
        ("Qwen3MoeForCausalLM",),
        "moe:Qwen3MoeForCausalLM",
        lora=_MOE_LORA,
        notes=_MOE_NOTE,
    ),
)
# Families with no native module that the generic path is tested on against HF
# (tests/rolling_batch/test_generic_path.py): architecture -> family.
GENERIC_TESTED = {
    "Olmo2ForCausalLM": "OLMo 2",
    "GraniteForCausalLM": "Granite",
    "Starcoder2ForCausalLM": "StarCoder2",
    "CohereForCausalLM": "Command R (Cohere)",
}
# HF architecture name -> "module:class" that serves it natively.
NATIVE_ARCHITECTURES = {
    name: family.location for family in NATIVE_FAMILIES for name in family.architectures
}
# GGUF's general.architecture -> the HF architecture transformers converts it to.
GGUF_ARCHITECTURES = {
    gguf: family.architectures[0] for family in NATIVE_FAMILIES for gguf in family.gguf
}
# Rope scalings whose frequencies are fixed for a served model: LongRoPE's long factors where
# option.max_model_len exceeds the checkpoint's original context, else its short ones (vLLM's
# choice too: HF switches per forward, so one sequence's keys could mix both). "dynamic" NTK,
# whose frequencies change with each sequence's length, is refused by name before anything
# starts.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional", "longrope")
ALTERNATIVE = (
    "engine=Python with option.rolling_batch=disable serves any causal LM transformers loads"
    " (HF generate, dynamic batching)"
)


class UnservableModel(ValueError):
    """A model the rolling batch cannot run; the message names why and the alternative."""


def native_class(architectures: list[str]) -> tuple[str, str] | None:
    """(the first architecture served natively, its "module:class"), or None."""
    for name in architectures:
        if name in NATIVE_ARCHITECTURES:
            return name, NATIVE_ARCHITECTURES[name]
    return None


@dataclass(frozen=True)
class ServingPath:
    """How the rolling batch runs a model, decided before anything starts."""

    architecture: str
    native: str | None  # "module:class" under rolling_batch/model/families/; None: the generic path

    def describe(self) -> str:
        if self.native is not None:
            return (
                f"model architecture {self.architecture}: the rolling batch's native {self.native}"
            )
        return (
            f"model architecture {self.architecture}: the rolling batch's generic path (the"
            " model's transformers modules over lmserve's paged attention)"
        )


@dataclass(frozen=True)
class EngineRequest:
    """The settings that decide whether a path can serve a model (the serving.properties')."""

    tensor_parallel_degree: int = 1
    trust_remote_code: bool = False
    quantize: str | None = None
    enable_lora: bool = False
    model_impl: str = "auto"  # option.model_impl
    load_format: str = "auto"  # option.load_format


def serving_path(path: Path, wanted: EngineRequest = EngineRequest()) -> ServingPath:
    """The path that serves the model at `path` (an HF directory or a .gguf file) with the
    settings in `wanted`, or UnservableModel naming the architecture, why, and the alternative."""
    names = architectures_of(path)
    native = native_class(names) if wanted.model_impl != "transformers" else None
    if native is None and wanted.model_impl == "native":
        supported = ", ".join(sorted(NATIVE_ARCHITECTURES))
        raise UnservableModel(
            f"architecture {', '.join(names) or 'none named'}: option.model_impl=native, and"
            f" lmserve has native modules for {supported}; set option.model_impl=auto to take"
            " the generic path"
        )
    method = _checkpoint_quantization(path)
    if method is not None and wanted.load_format == "dummy":
        raise UnservableModel(
            f"architecture {', '.join(names) or 'none named'}: option.load_format=dummy fills"
            f" dense weights, and config.json names a {method} checkpoint; drop its"
            " quantization_config (option.quantize=int4 quantizes the random weights)"
        )
    if native is not None:
        family = next(f for f in NATIVE_FAMILIES if native[0] in f.architectures)
        if method is not None and not (method in CHECKPOINT_METHODS and "AWQ" in family.quantize):
            raise UnservableModel(
                f"architecture {native[0]}: {_quantized_checkpoints(method)};"
                f" {family.family} takes option.quantize=int4 or int8 on its dense checkpoint"
            )
        if wanted.enable_lora and family.lora.startswith("no"):
            raise UnservableModel(
                f"architecture {native[0]}: option.enable_lora is not served on {family.family};"
                " unset it (or merge the adapter into the weights)"
            )
        return ServingPath(*native)
    named = ", ".join(names) or "none named"
    if path.suffix == ".gguf" or any(name.endswith(")") for name in names):
        # A GGUF of another family, or a variant the native modules refuse ("(alibi)").
        supported = ", ".join(sorted(NATIVE_ARCHITECTURES))
        raise UnservableModel(
            f"architecture {named}: the rolling batch (engine=MPI) serves {supported} natively"
            f" and other HF checkpoints (not GGUF files) on its generic path; {ALTERNATIVE}"
        )
    refusal = _generic_refusal(path, wanted)
    if refusal is None and method is not None:
        refusal = _quantized_checkpoints(method)
    if refusal is None and wanted.quantize is not None:
        refusal = f"option.quantize={wanted.quantize} is served on the native families only"
    if refusal is None and wanted.enable_lora:
        refusal = "option.enable_lora is served on the native families only"
    if refusal is not None:
        raise UnservableModel(f"architecture {named} (generic path): {refusal}; {ALTERNATIVE}")
    return ServingPath(names[0] if names else "unnamed", None)


def _checkpoint_quantization(path: Path) -> str | None:
    """config.json's quantization_config.quant_method ("awq", "gptq"), None for a dense
    checkpoint (or a GGUF file, whose codes lmserve reads itself)."""
    if path.suffix == ".gguf":
        return None
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    method = (config.get("quantization_config") or {}).get("quant_method")
    return None if method is None else str(method).lower()


def _quantized_checkpoints(method: str) -> str:
    """What a refusal of a checkpoint quantized with `method` says is served."""
    families = ", ".join(
        name for f in NATIVE_FAMILIES if "AWQ" in f.quantize for name in f.architectures
    )
    return (
        f"a checkpoint quantized with {method} (config.json quantization_config); 4-bit AWQ"
        f" and GPTQ checkpoints are served on {families}"
    )


def _generic_refusal(path: Path, wanted: EngineRequest) -> str | None:
    args = python_command(
        "-m",
        "lmserve.rolling_batch.model.families.generic",
        str(path),
        str(wanted.tensor_parallel_degree),
        "1" if wanted.trust_remote_code else "0",
    )
    try:  # reading a config takes seconds; the bound only keeps start-up from hanging
        done = subprocess.run(args, capture_output=True, text=True, check=False, timeout=300)
    except subprocess.TimeoutExpired:
        return "transformers did not read its config within 300 s"
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])["refusal"]
    except (IndexError, ValueError, KeyError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"transformers could not inspect it ({tail})"


# The model types of Falcon's original remote-code checkpoints (RWForCausalLM), which
# transformers reads only with their code; as its Falcon conversion does, they are read as
# FalconConfig: the 40B/180B layout is the one with a KV head count.
REFINED_WEB_TYPES = ("RefinedWeb", "RefinedWebModel")


def refined_web_as_falcon(config: dict) -> dict:
    """A RefinedWeb config.json's fields under FalconConfig's names."""
    renamed = {k: v for k, v in config.items() if k not in ("auto_map", "n_head_kv")}
    renamed["num_attention_heads"] = renamed.pop("n_head", config.get("num_attention_heads"))
    renamed["num_hidden_layers"] = renamed.pop("n_layer", config.get("num_hidden_layers"))
    if "n_head_kv" in config:
        renamed["num_kv_heads"] = config["n_head_kv"]
        renamed["new_decoder_architecture"] = True
    renamed["model_type"] = "falcon"
    renamed["architectures"] = ["FalconForCausalLM"]
    return renamed


def architectures_of(path: Path) -> list[str]:
    """The architectures of an HF directory (config.json) or a .gguf file (its header)."""
    if path.suffix == ".gguf":
        found = gguf_architecture(path)
        return [GGUF_ARCHITECTURES.get(found, f"{found} (GGUF)")]
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UnservableModel(f"{path / 'config.json'}: unreadable ({error})") from None
    if not isinstance(config, dict):
        raise UnservableModel(f"{path / 'config.json'}: not a JSON object")
    names = config.get("architectures") or []
    if not names and config.get("model_type"):
        names = [f"{config['model_type']} (model_type)"]
    # A variant the family modules refuse is its own name here, refused before anything starts.
    variant = _refused_variant(config)
    return [f"{name} ({variant})" if variant else str(name) for name in names]


def _refused_variant(config: dict) -> str | None:
    if config.get("alibi"):
        return "alibi"
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type={rope_type}"
    return None


# GGUF value types: struct formats of the fixed-size ones, and the two others.
_GGUF_SCALARS = {
    **{0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"},
    **{10: "Q", 11: "q", 12: "d"},
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_MAX_STRING = 1 << 20  # bytes: keys and architecture names are short


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from a GGUF file's header (gguf's own reader parses every
    tensor's entry first: seconds for a model; this reads the key-values up to that one)."""
    try:
        with path.open("rb") as file:
            magic, version, _num_tensors, num_keys = struct.unpack("<4sIQQ", file.read(24))
            if magic != b"GGUF":
                raise UnservableModel(f"{path}: not a GGUF file")
            if version not in (2, 3):  # version 1's counts are 32-bit: another layout
                raise UnservableModel(f"{path}: GGUF version {version}; lmserve reads 2 and 3")
            for _ in range(num_keys):
                key = _read_string(file)
                (kind,) = struct.unpack("<I", file.read(4))
                if key == "general.architecture" and kind == _GGUF_STRING:
                    return _read_string(file)
                _skip_value(file, kind)
    except (OSError, struct.error) as error:
        raise UnservableModel(f"{path}: unreadable GGUF header ({error})") from None
    raise UnservableModel(f"{path}: its GGUF header names no general.architecture")


def _read_string(file) -> str:
    (length,) = struct.unpack("<Q", file.read(8))
    if length > _MAX_STRING:  # a corrupt header: never allocate what it says
        raise UnservableModel(f"{file.name}: a GGUF header string of {length} bytes")
    return file.read(length).decode("utf-8", errors="replace")


def _skip_value(file, kind: int) -> None:
    if kind == _GGUF_STRING:
        _read_string(file)
    elif kind == _GGUF_ARRAY:
        element, count = struct.unpack("<IQ", file.read(12))
        if element in _GGUF_SCALARS:
            file.seek(count * struct.calcsize("<" + _GGUF_SCALARS[element]), 1)
        else:
            for _ in range(count):
                _skip_value(file, element)
    elif kind in _GGUF_SCALARS:
        file.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), 1)
    else:
        raise UnservableModel(f"GGUF header: unknown value type {kind}")


def supported_models_table() -> str:
    """docs/models.md's table of supported models, in Markdown, from the tables above."""
    rows = [
        "| Family | Architectures | Path | TP | option.quantize | LoRA | GGUF | Notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family in NATIVE_FAMILIES:
        names = ", ".join(f"`{name}`" for name in family.architectures)
        gguf = "yes" if family.gguf else "no"
        rows.append(
            f"| {family.family} | {names} | native | any | {family.quantize} | {family.lora}"
            f" | {gguf} | {family.notes} |"
        )
    for name, family in GENERIC_TESTED.items():
        rows.append(f"| {family} | `{name}` | generic | 1 | no | no | no | |")
    rows.append(
        "| any other decoder-only model transformers ships | (its own) | generic | 1 | no | no"
        " | no | its attention must go through transformers' attention interface; no"
        " attention sinks or latent attention |"
    )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(supported_models_table(), end="")
