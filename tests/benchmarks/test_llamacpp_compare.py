"""The lmserve servers `llamacpp_compare --variants` starts: a dtype, or a quantization with
fp32 activations unless a dtype follows it."""

from __future__ import annotations

import pytest

from lmserve.benchmarks.llamacpp_compare import lmserve_properties


@pytest.mark.parametrize(
    ("variant", "dtype", "quantize"),
    [("fp32", "fp32", None), ("bf16", "bf16", None), ("int8", "fp32", "int8"),
     ("int4", "fp32", "int4"), ("int4-bf16", "bf16", "int4")],
)  # fmt: skip
def test_a_variant_names_the_dtype_and_quantization_served(variant, dtype, quantize):
    properties = lmserve_properties(variant)
    assert properties["option.dtype"] == dtype
    assert properties.get("option.quantize") == quantize
    assert properties["engine"] == "MPI"
