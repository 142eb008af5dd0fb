"""The C++ decoder stack (rolling_batch/model/families/native_stack.py) serves fp32 models on
one rank and gives exactly the bits the Python layers give, step after step over the caches it
fills; models whose layers need Python keep the Python layers. Its agreement with HF is
test_model_logits' and test_architectures' (they run through it)."""

from __future__ import annotations

import pytest
import torch

from lmserve.kernels import cpu_native
from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.model import step_inputs
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

from .test_architectures import VARIANTS, save_tiny
from .test_model_logits import MAX_MODEL_LEN, run_steps

pytestmark = pytest.mark.skipif(
    cpu_native.native_ops() is None, reason="no C++ CPU kernels on this machine"
)


class CountingStack:
    """Hands every call to the real stack and counts them."""

    def __init__(self, stack):
        self.stack = stack
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def runner_for(model_dir, **options):
    defaults = dict(
        dtype="fp32", max_model_len=MAX_MODEL_LEN, block_size=4, max_rolling_batch_size=4
    )
    options = RuntimeOptions(**{**defaults, **options})
    runner, _, _ = build_runner(model_dir, options, TensorParallelGroup())
    return runner


@pytest.fixture(scope="module")
def biased_model_dir(tmp_path_factory):
    """Llama with Q/K/V, O and MLP biases: every optional input of the stack is given."""
    folder = tmp_path_factory.mktemp("biased")
    save_tiny(folder, *VARIANTS["llama-biases-untied-llama3-rope"])
    return folder


@pytest.fixture(scope="module")
def windowed_model_dir(tmp_path_factory):
    """Mistral with a sliding window of 4 keys, which run_steps' contexts outgrow."""
    folder = tmp_path_factory.mktemp("windowed")
    save_tiny(folder, "MistralConfig", "MistralForCausalLM", dict(sliding_window=4))
    return folder


@pytest.mark.parametrize(
    ("model", "dtype"),
    [
        *[("tiny", "fp32"), ("biased", "fp32"), ("windowed", "fp32")],
        ("tiny", "bf16"),
        ("biased", "bf16"),
    ],
)
def test_stack_gives_the_python_layers_bits(
    model, dtype, tiny_model_dir, biased_model_dir, windowed_model_dir
):
    """Mixed steps (a prompt in chunks beside decodes, contexts over several blocks) through
    two runners of one model, one with the stack and one without: equal logits, bit for bit.
    fp32 linears run on the C++ panels, bf16 ones too where the CPU has AVX512-BF16, else on
    oneDNN (the biases of O and down added after the matmul, a rounding of their own)."""
    dirs = {"tiny": tiny_model_dir, "biased": biased_model_dir, "windowed": windowed_model_dir}
    model_dir = dirs[model]
    with_stack, without = runner_for(model_dir, dtype=dtype), runner_for(model_dir, dtype=dtype)
    if with_stack.model.model.native_stack is None:
        pytest.skip(f"{dtype} linears are not packed on this CPU")
    counting = CountingStack(with_stack.model.model.native_stack)
    with_stack.model.model.native_stack = counting
    without.model.model.native_stack = None
    vocab_size = with_stack.model.config.vocab_size
    stacked = run_steps(with_stack, with_stack.block_size, vocab_size)
    python = run_steps(without, without.block_size, vocab_size)
    assert counting.calls == 4  # every step of run_steps went through it
    for (sequence, got), (_, expected) in zip(stacked, python, strict=True):
        assert torch.equal(got, expected), f"after {len(sequence)} tokens"


@pytest.mark.parametrize("stack", [True, False])
def test_steps_that_read_few_outputs_give_the_bits_of_steps_that_read_all(
    stack, tiny_model_dir, monkeypatch
):
    """A prompt chunk's tokens before its last are never read: the last layer's O, MLP and
    final norm run for the read rows only (the stack's and the Python layers' alike), and
    those rows' logits are the bits of a step that computes every row."""
    pruned, full = runner_for(tiny_model_dir), runner_for(tiny_model_dir)
    if not stack:
        pruned.model.model.native_stack = full.model.model.native_stack = None
    read_rows = step_inputs._read_rows
    pruned_steps = []

    def recording(chunks, *args):
        output_rows, *rows = read_rows(chunks, *args)
        pruned_steps.append(output_rows is not None)
        return output_rows, *rows

    monkeypatch.setattr(step_inputs, "_read_rows", recording)
    vocab_size = pruned.model.config.vocab_size
    got = run_steps(pruned, pruned.block_size, vocab_size)
    assert any(pruned_steps) and not all(pruned_steps)  # the prompt steps, not the decodes

    monkeypatch.setattr(step_inputs, "_read_rows", lambda _, __, *rows: (None, *rows))
    expected = run_steps(full, full.block_size, vocab_size)
    for (sequence, row), (_, expected_row) in zip(got, expected, strict=True):
        assert torch.equal(row, expected_row), f"after {len(sequence)} tokens"


def test_quantized_layers_keep_python(tiny_model_dir):
    """int8 linears run the quantized kernels: the Python layers serve."""
    runner = runner_for(tiny_model_dir, quantize="int8")
    assert runner.model.model.native_stack is None
    (logits,) = runner.execute([SequenceChunk((5, 6, 7), 0, (0, 1), True)])
    assert torch.isfinite(logits).all()


class SplitCountingStack(CountingStack):
    """Counts the calls the real stack splits by sequences (its forward's args 8-10 are
    seq_lens, query_start_loc and output_rows)."""

    def __init__(self, stack):
        super().__init__(stack)
        self.split_calls = 0

    def forward(self, *args):
        self.split_calls += len(self.stack.sequence_parts(*args[8:11])) > 2
        return super().forward(*args)


def split_steps(num_seqs: int, block_size: int):
    """Prompts of 1-9 tokens in one step, then two steps of their decodes."""
    assert 4 * block_size >= 9 + 2  # four blocks a sequence hold its longest context
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(1, 200, (1 + s % 9,), generator=generator).tolist() for s in range(num_seqs)
    ]
    blocks = [tuple(range(s * 4, (s + 1) * 4)) for s in range(num_seqs)]
    first = [SequenceChunk(tuple(p), 0, blocks[s], True) for s, p in enumerate(prompts)]
    second = [SequenceChunk((7,), len(p), blocks[s], True) for s, p in enumerate(prompts)]
    third = [SequenceChunk((9,), len(p) + 1, blocks[s], True) for s, p in enumerate(prompts)]
    return [first, second, third]


def test_steps_split_by_sequences_give_the_bits_of_whole_steps(tiny_model_dir):
    """With two threads a step of enough decodes runs as two runs of sequences, a thread each
    through every layer: their logits are the bits of the same steps run whole (the prompt
    step stays whole either way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        split, whole = (runner_for(tiny_model_dir, max_rolling_batch_size=40) for _ in range(2))
        counting = SplitCountingStack(split.model.model.native_stack)
        split.model.model.native_stack = counting
        whole.model.model.native_stack.set_split_sequences(False)
        for step in split_steps(40, split.block_size):
            assert torch.equal(split.execute(step), whole.execute(step))
    finally:
        torch.set_num_threads(threads)
    assert counting.split_calls == 2


def parts(stack, q_lens, seq_lens, output_rows=None):
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return stack.sequence_parts(lens, starts, output_rows)


def test_steps_split_where_the_runs_cost_alike(tiny_model_dir):
    """Runs of decodes are cut at an even share of the step's cost (rows' linears and the keys
    they read); a step stays whole with one thread, with too few decodes for a run to be worth
    its weight stream, with a prompt chunk in it, or with rows left unread."""
    stack = runner_for(tiny_model_dir).model.model.native_stack
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert parts(stack, [1] * 32, [100] * 32) == [0, 16, 32]
        # the first half's contexts are far longer: fewer of them fill a share
        cut = parts(stack, [1] * 64, [1000] * 32 + [10] * 32)[1]
        assert 12 < cut < 32
        assert parts(stack, [1] * 16, [100] * 16) == []  # 8 rows a run
        assert parts(stack, [1] * 32 + [2], [100] * 32 + [2]) == []  # a prompt chunk
        some_rows = torch.arange(0, 39, dtype=torch.int64)
        assert parts(stack, [1] * 40, [50] * 40, some_rows) == []
        stack.set_split_sequences(False)
        assert parts(stack, [1] * 32, [100] * 32) == []
        stack.set_split_sequences(True)
        torch.set_num_threads(1)
        assert parts(stack, [1] * 32, [100] * 32) == []
    finally:
        torch.set_num_threads(threads)
