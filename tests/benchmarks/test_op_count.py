"""op_count's counter: a custom op counts once, whatever it runs inside; so does a call into a
C extension's function, which the dispatcher never sees (numpy's stands in for pybind11's);
one decode step of a tiny model is split into its sections and layers without losing an op."""

from __future__ import annotations

from collections import Counter

import numpy
import pytest
import torch

from lmserve.benchmarks.op_count import AFTER, BEFORE, INPUTS, OpCounter, layer_summary, measure


@torch.library.custom_op("lmserve_test::twice_plus_one", mutates_args=())
def twice_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_custom_op_counts_once_and_plain_ops_each_count():
    x = torch.ones(3)
    with OpCounter() as counter:
        twice_plus_one(x)
        (x * 2).add_(1)
    assert counter.total() == Counter(
        {"lmserve_test::twice_plus_one": 1, "aten::mul.Tensor": 1, "aten::add_.Tensor": 1}
    )


def test_a_c_extension_call_counts_once_and_python_builtins_not_at_all():
    with OpCounter() as counter:
        numpy.zeros(3)
        len([1, 2])
        torch.ones(2)
    assert counter.total() == Counter({"numpy.zeros": 1, "aten::ones": 1})


def test_a_decode_step_is_counted_by_section_and_layer(tiny_model_dir):
    result = measure(tiny_model_dir, "fp32", batch=2, prompt_len=8, repeats=1, python_layers=True)
    assert len(result["layers"]) == 2  # the tiny Llama's
    assert all(sum(layer.values()) > 0 for layer in result["layers"])
    in_layers = sum(sum(layer.values()) for layer in result["layers"])
    outside = sum(result["sections"][s] for s in (INPUTS, BEFORE, AFTER))
    assert sum(result["total"].values()) == in_layers + outside
    assert result["sections"][BEFORE] > 0 and result["sections"][AFTER] > 0
    assert result["step_s"] > 0


def test_layer_summary_names_the_odd_layers():
    typical, odd = Counter({"aten::mm": 3}), Counter({"aten::mm": 3, "aten::arange": 2})
    text, ops = layer_summary([odd, typical, typical])
    assert text == "3 (layer 0: 5)" and ops == typical
    assert layer_summary([])[0] == "-"


def test_the_decoder_stack_counts_its_ops_before_the_lm_head(tiny_model_dir):
    """Where the layers run as one C++ call (fp32 with the C++ kernels), the ops it calls count
    before the LM head and no layer has a count of its own."""
    result = measure(tiny_model_dir, "fp32", batch=2, prompt_len=8, repeats=1)
    if not any(name.endswith(".forward") for name in result["total"]):
        pytest.skip("no decoder stack here (no C++ CPU kernels)")
    assert not any(result["layers"])
    python = measure(tiny_model_dir, "fp32", batch=2, prompt_len=8, repeats=1, python_layers=True)
    assert result["sections"][BEFORE] > python["sections"][BEFORE]
    assert result["sections"][AFTER] > 0  # the LM head
    assert sum(result["total"].values()) == sum(result["sections"].values())
