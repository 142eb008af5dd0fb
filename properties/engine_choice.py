"""Which engine serves: `engine`, `option.rolling_batch`, `option.mpi_mode` and `batch_size`
decide each other, following the LMI container since 0.26, where `option.rolling_batch`
defaults to `auto` whatever the engine.

lmserve has one rolling batch (its own scheduler over MPI ranks), so every rolling-batch
backend name (`auto`, `vllm`, `lmi-dist`, `scheduler`) and `engine=Python` with any of them
(the LMI guides' starter configs) is served by it; dynamic batching is `engine=Python` with
`option.rolling_batch=disable`. The choice is said in one start-up line.
"""

from __future__ import annotations

from typing import Any

from .settings import INFERRED

DYNAMIC_BATCHING = "disable"
ROLLING_BATCH_LINE = "serving with lmserve's rolling batch over MPI ranks"
# Keys only one of the two batching modes reads; given to the other, they would do nothing.
ROLLING_ONLY_KEYS = (
    "option.max_rolling_batch_size",
    "option.max_rolling_batch_prefill_tokens",
    "option.scheduling_policy",
    "option.step_trace",
    "option.paged_attention",
    "option.block_size",
    "option.num_kv_blocks",
    "option.cpu_kv_cache_fraction",
    "option.gpu_memory_utilization",
    "option.speculative_draft_model",
    "option.speculative_length",
)
DYNAMIC_ONLY_KEYS = ("max_batch_delay",)


def choose_engine(
    values: dict[str, Any], sources: dict[str, str], user_handler: bool = False
) -> str | None:
    """Resolves `engine` and `rolling_batch` in `values` (and their sources); returns the
    start-up line that says what serves, or None where the configuration said it plainly
    (`engine=MPI` with `auto`, or `engine=Python` with `disable`). `user_handler`: the model
    dir brings its own `handle()` (model.py, option.entryPoint), which runs in engine=Python's
    process with dynamic batching, as in DJL."""
    given_engine = values["engine"]
    given_rolling = values["rolling_batch"]
    if user_handler and given_rolling is INFERRED:
        if given_engine != "MPI" and not values["mpi_mode"]:
            values["rolling_batch"] = DYNAMIC_BATCHING
            sources["option.rolling_batch"] = "inferred from the model's handler"
            if given_engine is INFERRED:
                values["engine"], sources["engine"] = "Python", "inferred from the model's handler"
            return (
                "the model's own handle() serves: engine=Python with dynamic batching"
                f" (batch_size={values['batch_size']}, max_batch_delay={values['max_batch_delay']}"
                " ms)"
            )
    if given_rolling is INFERRED:
        values["rolling_batch"], sources["option.rolling_batch"] = _default_rolling(values, sources)
    rolling = values["rolling_batch"]
    if rolling == DYNAMIC_BATCHING:
        if given_engine is INFERRED:
            values["engine"], sources["engine"] = "Python", "inferred from option.rolling_batch"
        return _dynamic_line(given_rolling, values)
    if given_engine != "MPI":
        values["engine"] = "MPI"
        sources["engine"] = (
            "inferred from option.rolling_batch"
            if given_engine is INFERRED
            else f"{sources['engine']}: Python, served as MPI for option.rolling_batch={rolling}"
        )
    return _rolling_line(given_engine, given_rolling, values)


def _default_rolling(values: dict[str, Any], sources: dict[str, str]) -> tuple[str, str]:
    if values["engine"] != "MPI" and not values["mpi_mode"]:
        # An old DJL dynamic-batching config (`engine=Python`, `batch_size=4`) names no
        # rolling_batch; its batch_size says what it wants.
        if sources["batch_size"] != "default" and values["batch_size"] > 1:
            return DYNAMIC_BATCHING, "inferred from batch_size"
    return "auto", "default (LMI's since 0.26)"


def _rolling_line(given_engine: Any, given_rolling: Any, values: dict[str, Any]) -> str | None:
    rolling = values["rolling_batch"]
    serving = f"{ROLLING_BATCH_LINE} (tensor_parallel_degree={values['tensor_parallel_degree']})"
    dynamic_hint = "engine=Python with option.rolling_batch=disable gives dynamic batching"
    if given_engine == "Python":
        if given_rolling is not INFERRED:
            return f"engine=Python with option.rolling_batch={rolling}: {serving}"
        asked = "option.mpi_mode=true" if values["mpi_mode"] else "option.rolling_batch=auto"
        default = "" if values["mpi_mode"] else " (the default)"
        return f"engine=Python with {asked}{default}: {serving}; {dynamic_hint}"
    if given_engine is INFERRED and given_rolling is INFERRED:
        return f"no engine configured: {serving}, LMI's default (auto); {dynamic_hint}"
    if rolling != "auto":  # a backend name from an LMI guide: say which engine answers it
        return f"option.rolling_batch={rolling}: {serving}"
    return None


def _dynamic_line(given_rolling: Any, values: dict[str, Any]) -> str | None:
    if given_rolling is INFERRED:
        return (
            f"batch_size={values['batch_size']} with no option.rolling_batch: dynamic batching"
            " (engine=Python, option.rolling_batch=disable)"
        )
    return None


def ignored_keys(values: dict[str, Any], sources: dict[str, str]) -> list[str]:
    """Keys the configuration sets that the chosen batching mode never reads: each a warning
    (DJL's configs often carry both kinds), never an error."""
    rolling = values["rolling_batch"] != DYNAMIC_BATCHING
    unread = DYNAMIC_ONLY_KEYS if rolling else ROLLING_ONLY_KEYS
    mode = "the rolling batch" if rolling else "dynamic batching (option.rolling_batch=disable)"
    return [
        f"{key} ({sources[key]}) is not read by {mode}: ignored"
        for key in unread
        if sources.get(key, "default") != "default"
    ]
