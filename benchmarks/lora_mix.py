"""What serving LoRA adapters costs: one burst spread over 1, 4 and 16 adapters against the base
model alone, on the embedded SmolLM2-135M, through HTTP, in one run on one machine:

    .venv/bin/python -m lmserve.benchmarks.lora_mix [--rounds 2] [--rank 16]

The adapters are real PEFT adapters on every decoder linear (q/k/v/o, gate/up/down) with random
weights, made once into a folder beside the model's files. Two servers run side by side, their
runs interleaved round by round (this machine's speed drifts by 10-30% over minutes):
- LoRA on (option.max_loras=16: every adapter of the burst can share a step), serving the
  base-model run and the 1-, 4- and 16-adapter runs;
- LoRA off, the same base-model run: what turning LoRA on costs requests that use none.
Results go to benchmarks/results/lora/<workload>/.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from lmserve.properties.config import default_cache_dir

from . import report
from .bench_cli import measure
from .serving import running_server
from .vllm_compare import WORKLOADS, lmserve_properties
from .workload import PromptBuilder, spread_over_adapters

HERE = Path(__file__).resolve().parent
SPREADS = (1, 4, 16)


def make_model_dir(model_dir: Path, count: int, rank: int) -> Path:
    """A folder with the model's files linked and `count` random PEFT adapters of `rank` on
    every decoder linear in its adapters/."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="lmserve-lora-bench-")) / "model"
    folder.mkdir()
    for path in model_dir.iterdir():
        (folder / path.name).symlink_to(path.resolve())
    for index in range(count):
        torch.manual_seed(index)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear")
        config.init_lora_weights = False  # random B too: the adapter does work
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
        model.save_pretrained(folder / "adapters" / f"adapter{index}")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per setting")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's LoRA rank")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lora")
    parser.add_argument(
        "--workload",
        choices=[w.name for w in WORKLOADS],
        default="burst64-uniform16-256",
    )
    options = parser.parse_args()
    workload = next(w for w in WORKLOADS if w.name == options.workload)

    from lmserve.rolling_batch.model.source import local_model_path

    model_dir = local_model_path(None, default_cache_dir())
    folder = make_model_dir(model_dir, max(SPREADS), options.rank)
    names = [f"adapter{index}" for index in range(max(SPREADS))]
    builder = PromptBuilder(str(model_dir / "tokenizer.json"), seed=0)
    base = {**lmserve_properties("fp32"), "option.model_id": folder}
    lora = {
        **base,
        "option.enable_lora": "true",
        "option.max_loras": max(SPREADS),
        "option.max_cpu_loras": max(SPREADS),
        "option.max_lora_rank": options.rank,
    }
    runs: dict[str, dict] = {}
    with (
        running_server(lora, options.port) as (with_lora, _),
        running_server(base, options.port + 1) as (without_lora, _),
    ):
        for round_ in range(1, options.rounds + 1):
            requests = workload.plan(builder, round_)  # fresh prompts every round
            suffix = f", round {round_}" if options.rounds > 1 else ""
            runs[f"LoRA off, base model{suffix}"] = measure(without_lora, "lmserve", requests, None)
            runs[f"LoRA on, base model{suffix}"] = measure(with_lora, "lmserve", requests, None)
            for spread in SPREADS:
                mixed = spread_over_adapters(requests, names[:spread])
                label = f"LoRA on, {spread} adapter{'s' if spread > 1 else ''}{suffix}"
                runs[label] = measure(with_lora, "lmserve", mixed, None)
    title = (
        f"LoRA adapters (rank {options.rank}, all linears), {workload.describe()},"
        " SmolLM2-135M fp32, 2-core CPU"
    )
    report.write(runs, options.out / workload.name, title)
    print(f"\n{title}\n{report.markdown(runs)}")


if __name__ == "__main__":
    main()
