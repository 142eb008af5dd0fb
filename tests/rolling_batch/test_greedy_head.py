"""The greedy token without the fp32 logits (layers/greedy_head.py): always the fp32 logits'
argmax (the first of equal maxima), and only for requests that need nothing else."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmserve.kernels import cpu_native
from lmserve.rolling_batch.core.block_manager import BlockManager
from lmserve.rolling_batch.core.request import Request
from lmserve.rolling_batch.core.scheduler import Scheduler
from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.ipc.protocol import GenerationParams
from lmserve.rolling_batch.model.layers.cpu_matmul import NativeLinearWeight
from lmserve.rolling_batch.model.layers.greedy_head import GreedyHead
from lmserve.rolling_batch.model.layers.parallel import TensorParallelGroup
from lmserve.rolling_batch.model.runner_setup import RuntimeOptions, build_runner

from .test_model_logits import PROMPTS


def bf16_panels():
    native = cpu_native.native_ops()
    if native is None or not native.bf16_panels():
        pytest.skip("the greedy head needs AVX512-BF16 (bf16 panels)")
    return native


def fp32_argmax(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """What the sampler picks from the fp32 panels' logits."""
    native = bf16_panels()
    logits = NativeLinearWeight(weight, native)(hidden)
    return native.greedy_pick(logits)[0]


def test_picks_the_fp32_argmax_on_flat_and_peaked_logits():
    torch.manual_seed(0)
    weight = torch.randn(1000, 64) * 0.1  # a vocabulary of 62.5 vectors: the tail is masked
    head = GreedyHead(weight, bf16_panels())
    for scale in (0.01, 1.0, 30.0, 1000.0):  # near-uniform logits to one far ahead
        hidden = torch.randn(37, 64) * scale
        assert torch.equal(head(hidden), fp32_argmax(weight, hidden))


def test_equal_and_nearly_equal_maxima_go_as_the_fp32_logits_say():
    torch.manual_seed(1)
    weight = torch.randn(512, 64) * 0.05
    top = torch.randn(64)
    weight[300] = top
    weight[40] = top  # the same logit: the first one wins
    weight[450] = top
    weight[450, 7] = torch.nextafter(top[7], torch.tensor(float("inf")))  # one ulp apart
    hidden = torch.stack([top, -top, top * 1e-3])
    head = GreedyHead(weight, bf16_panels())
    picked = head(hidden)
    assert torch.equal(picked, fp32_argmax(weight, hidden))
    assert picked[0].item() in (40, 450)  # which of them the fp32 sums rank first


def test_a_token_the_bf16_logits_rank_lower_still_wins_on_its_fp32_logit():
    """Token 3's inputs all round up to bf16, token 10's all round down (the coherent errors
    the bound covers): token 3's bf16 logit is the larger, token 10's fp32 logit is."""
    torch.manual_seed(3)
    weight = torch.randn(16, 64) * 0.01
    weight[3] = 1 + 2**-8 + 2**-20  # just above the midpoint of 1 and 1 + 2^-7: up
    weight[10, :32] = 1 + 2**-7 + 2**-8 - 2**-20  # just below the next midpoint: down
    weight[10, 32:] = 1 + 2**-8 - 2**-20  # down to 1
    hidden = torch.ones(2, 64)
    hidden[1] *= 1000.0
    head = GreedyHead(weight, bf16_panels())
    approx = head.approx(hidden.bfloat16()).float()
    assert (approx[:, 3] > approx[:, 10]).all()
    assert head(hidden).tolist() == [10, 10] == fp32_argmax(weight, hidden).tolist()


def test_rows_that_are_not_finite_are_left_to_the_fp32_logits():
    torch.manual_seed(2)
    weight = torch.randn(256, 32)
    head = GreedyHead(weight, bf16_panels())
    hidden = torch.randn(3, 32)
    hidden[1, 4] = float("nan")
    hidden[2, 0] = float("inf")
    picked = head(hidden)
    assert picked[1] == -1 and picked[2] == -1
    assert picked[0] == fp32_argmax(weight, hidden[:1])[0]


def test_only_finite_fp32_heads_on_cpu_get_one():
    bf16_panels()
    assert GreedyHead.try_build(torch.randn(64, 16)) is not None
    assert GreedyHead.try_build(torch.randn(64, 16, dtype=torch.bfloat16)) is None
    assert GreedyHead.try_build(torch.randn(64, 15)) is None  # bf16 panels pair the inputs
    broken = torch.randn(64, 16)
    broken[3, 3] = float("inf")
    assert GreedyHead.try_build(broken) is None


@pytest.mark.parametrize("head", ["built", "none"])
@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_argmax_only_chunks_give_the_argmax_of_the_logits_beside_other_chunks(
    name, head, tiny_model_dir, smollm2_dir
):
    """One step: a prompt and a decode whose logits are asked for, and the same two as
    argmax_only chunks of other sequences: the logits keep their rows, the tokens theirs.
    Without a greedy head (a CPU with no bf16 panels, a replayed trace) such chunks still get
    their token, from the logits."""
    if head == "built":
        bf16_panels()
    model_dir = tiny_model_dir if name == "tiny" else smollm2_dir
    options = RuntimeOptions(dtype="fp32", max_model_len=64, block_size=8, max_rolling_batch_size=4)
    runner, _, _ = build_runner(model_dir, options, TensorParallelGroup())
    if head == "none":
        runner.model.greedy_head = None
    assert runner.argmax_head == (head == "built")
    vocab = runner.model.config.vocab_size
    prompt, decode = [t % vocab for t in PROMPTS["b"]], [t % vocab for t in PROMPTS["a"]]
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(4)]
    runner.execute([SequenceChunk(tuple(decode), 0, tables[1], False)])
    runner.execute([SequenceChunk(tuple(decode), 0, tables[3], False)])
    step = runner.execute_step(
        [
            SequenceChunk(tuple(prompt), 0, tables[0], True),
            SequenceChunk((7,), len(decode), tables[1], True, argmax_only=True),
            SequenceChunk(tuple(prompt), 0, tables[2], True, argmax_only=True),
            SequenceChunk((7,), len(decode), tables[3], True),
        ]
    )
    assert step.logits.shape == (2, vocab)  # rows for the two that asked, in chunk order
    expected = step.logits.argmax(dim=-1).tolist()
    assert list(step.greedy_tokens) == [expected[1], expected[0]]


class GreedyCountingStack:
    """Hands every call to the real stack and counts its forward_greedy calls, and those it
    splits by sequences (args 8 and 9 are seq_lens and query_start_loc)."""

    def __init__(self, stack):
        self.stack = stack
        self.greedy_calls = self.split_greedy_calls = 0

    def forward(self, *args):
        return self.stack.forward(*args)

    def forward_greedy(self, *args):
        self.greedy_calls += 1
        self.split_greedy_calls += len(self.stack.sequence_parts(args[8], args[9], None)) > 2
        return self.stack.forward_greedy(*args)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_of_greedy_decodes_picks_its_tokens_in_the_stack(threads, smollm2_dir):
    """A step of argmax_only decodes alone takes its tokens from the C++ stack's call (with two
    threads split in two runs, each thread going on to the head's work as its run ends): the
    argmax of the same step's fp32 logits, for contexts of 2-10 random tokens (flat logits,
    many tokens near the top)."""
    native = bf16_panels()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        options = RuntimeOptions(
            dtype="fp32", max_model_len=64, block_size=8, max_rolling_batch_size=32
        )
        runner, _, _ = build_runner(smollm2_dir, options, TensorParallelGroup())
        stack = GreedyCountingStack(runner.model.model.native_stack)
        runner.model.model.native_stack = stack
        generator = torch.Generator().manual_seed(5)
        prompts = [torch.randint(100, 40000, (1 + s % 9,), generator=generator) for s in range(32)]
        tables = [(2 * s, 2 * s + 1) for s in range(32)]
        runner.execute(
            [SequenceChunk(tuple(p.tolist()), 0, tables[s], False) for s, p in enumerate(prompts)]
        )
        decodes = [
            SequenceChunk((int(p[0]),), len(p), tables[s], True, argmax_only=True)
            for s, p in enumerate(prompts)
        ]
        tokens = runner.execute_step(decodes).greedy_tokens
        logits = runner.execute([dataclasses.replace(d, argmax_only=False) for d in decodes])
    finally:
        torch.set_num_threads(before)
    assert list(tokens) == native.greedy_pick(logits)[0].tolist()
    assert stack.greedy_calls == 1
    assert stack.split_greedy_calls == (1 if threads == 2 else 0)


def test_rows_left_by_the_head_get_the_argmax_of_their_fp32_logits(smollm2_dir):
    bf16_panels()
    options = RuntimeOptions(dtype="fp32", max_model_len=64, block_size=8, max_rolling_batch_size=2)
    model = build_runner(smollm2_dir, options, TensorParallelGroup())[0].model
    hidden = torch.randn(3, model.config.hidden_size)
    hidden[1, 0] = float("nan")
    logits = model.compute_logits(hidden)
    expected = cpu_native.native_ops().greedy_pick(logits)[0]
    assert torch.equal(model.greedy_tokens(hidden), expected)


def test_the_scheduler_asks_for_the_token_alone_only_where_nothing_else_is_read():
    params = {
        "plain": {"log_probs": False},
        "reports log-probs": {},  # DJL's and TGI's token details
        "sampled": {"log_probs": False, "do_sample": True},
        "penalized": {"log_probs": False, "repetition_penalty": 1.2},
        "alternatives": {"log_probs": False, "top_logprobs": 2},
    }
    for argmax_head in (True, False):
        scheduler = Scheduler(BlockManager(64, 4), 8, 64, 32, argmax_head=argmax_head)
        for name, given in params.items():
            scheduler.add(Request(name, [5, 6, 7], GenerationParams(4, **given), 0.0))
        out = scheduler.schedule()
        flags = {r.request_id: c.argmax_only for r, c in zip(out.requests, out.chunks)}
        assert flags == {name: argmax_head and name == "plain" for name in params}
        assert [r.request_id for r in out.argmax_requests] == (["plain"] if argmax_head else [])
        plain, rows, _, _ = out.logit_rows()
        assert [r.request_id for r in plain] == [n for n in params if not flags[n]]
        assert rows == list(range(len(plain)))
