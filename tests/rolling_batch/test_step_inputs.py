"""A step's input tensors built over whole arrays equal the ones a plain loop over every token
builds, for any mix of prompt chunks, decodes, drafts and greedy rows; and packed into one
staging buffer (one copy to a GPU) they come out the same again."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lmserve.rolling_batch.core.step import SequenceChunk
from lmserve.rolling_batch.model.step_inputs import DeviceCopier, step_arrays

BLOCK_SIZE = 4


def random_chunks(
    rng: random.Random, num_seqs: int, kinds=("prompt", "decode", "draft", "greedy")
) -> list[SequenceChunk]:
    chunks, next_block = [], 0
    for _ in range(num_seqs):
        kind = rng.choice(kinds)
        computed = 0 if kind == "prompt" else rng.randrange(1, 40)
        new = rng.randrange(1, 30) if kind == "prompt" else 1
        drafts = rng.randrange(1, 4) if kind == "draft" else 0
        needed = -(-(computed + new + drafts) // BLOCK_SIZE)
        blocks = rng.sample(range(next_block, next_block + 2 * needed), needed)
        next_block += 2 * needed
        chunks.append(
            SequenceChunk(
                token_ids=tuple(rng.randrange(1000) for _ in range(new + drafts)),
                num_computed=computed,
                block_ids=tuple(blocks),
                needs_logits=kind != "prompt" or rng.random() < 0.5,
                num_drafts=drafts,
                argmax_only=kind == "greedy",
            )
        )
    return chunks


def per_token(chunks: list[SequenceChunk]) -> dict:
    """The plain loop over every token (what the arrays must equal)."""
    ids, positions, slots, logits, argmax = [], [], [], [], []
    for chunk in chunks:
        for offset, token in enumerate(chunk.token_ids):
            position = chunk.num_computed + offset
            ids.append(token)
            positions.append(position)
            block = chunk.block_ids[position // BLOCK_SIZE]
            slots.append(block * BLOCK_SIZE + position % BLOCK_SIZE)
        logits += range(len(ids) - chunk.num_logits, len(ids))
        argmax += range(len(ids) - chunk.num_argmax, len(ids))
    return {"ids": ids, "positions": positions, "slots": slots, "logits": logits, "argmax": argmax}


@pytest.mark.parametrize("seed", range(24))
def test_arrays_equal_the_per_token_loop(seed):
    rng = random.Random(seed)
    # A third of the steps are decodes alone (their own shorter path).
    kinds = ("decode", "greedy") if seed % 3 == 0 else ("prompt", "decode", "draft", "greedy")
    chunks = random_chunks(rng, rng.randrange(1, 12), kinds)
    arrays, expected = step_arrays(chunks, BLOCK_SIZE), per_token(chunks)
    assert arrays.token_ids.tolist() == expected["ids"]
    assert arrays.positions.tolist() == expected["positions"]
    assert arrays.slots.tolist() == expected["slots"]
    assert arrays.seq_lens.tolist() == [c.num_computed + len(c.token_ids) for c in chunks]
    assert arrays.query_start_loc[-1] == len(expected["ids"])
    for row, chunk in enumerate(chunks):
        table = arrays.block_tables[row].tolist()
        assert table[: len(chunk.block_ids)] == list(chunk.block_ids)
        assert set(table[len(chunk.block_ids) :]) <= {0}
    # The model outputs only the rows read (all rows when every one is); each logits or
    # argmax row names its place among them.
    read = arrays.output_rows
    outputs = np.arange(len(expected["ids"])) if read is None else read
    assert outputs[arrays.logits_rows].tolist() == expected["logits"]
    assert outputs[arrays.argmax_rows].tolist() == expected["argmax"]


def test_one_packed_copy_gives_the_same_tensors():
    rng = random.Random(7)
    copy_each, copy_packed = (
        DeviceCopier(torch.device("cpu")),
        DeviceCopier(torch.device("cpu"), packed=True),
    )
    kept = []
    for size in (3, 40, 5):
        arrays = step_arrays(random_chunks(rng, size), BLOCK_SIZE)
        fields = [a for a in arrays if a is not None]
        each, packed = copy_each(fields), copy_packed(fields)
        kept.append((each, packed))
    for each, packed in kept:  # a later step's inputs overwrote no earlier one's
        for plain, one in zip(each, packed, strict=True):
            assert one.dtype == plain.dtype and torch.equal(one, plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu_check.sh)")
def test_steps_copied_back_to_back_reach_the_gpu_intact():
    """Prompt steps read nothing back: the host builds the next step's inputs while the GPU
    may not yet have copied this one's. Nothing syncs here until every copy is queued."""
    rng = random.Random(8)
    copy = DeviceCopier(torch.device("cuda"))
    hold = torch.randn(4096, 4096, device="cuda")
    steps = []
    for size in (3, 40, 5, 17, 2):
        hold = hold @ hold  # keeps the stream busy, so the copies wait behind it
        fields = [a for a in step_arrays(random_chunks(rng, size), BLOCK_SIZE) if a is not None]
        steps.append((fields, copy(fields)))
    torch.cuda.synchronize()
    for fields, on_gpu in steps:
        for array, tensor in zip(fields, on_gpu, strict=True):
            assert tensor.is_cuda and tensor.cpu().tolist() == array.tolist()
