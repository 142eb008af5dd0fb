// lmserve's CPU kernels: the hot ops of a Llama-family step, vectorised with ATen's at::vec
// (one source: the build defines CPU_CAPABILITY_AVX2 or CPU_CAPABILITY_AVX512 for the machine)
// and parallelised with at::parallel_for (torch's own OpenMP pool and thread count).
//
// Each op computes what its torch reference in kernels/ computes, in the same order of
// roundings where that order is observable in fp32 (products and sums are separate roundings:
// the build turns floating-point contraction off), so fp32 greedy output stays HF's.
// Reduced-precision inputs (bf16, fp16) are widened to fp32 for the arithmetic.
//
// One translation unit, split into a header a job (attention, K/V store, rotary, norms,
// activations, greedy picks, panel linears, quantized linears, LoRA, the decoder stack) that
// all come together here: torch's headers, most of the first start's build time, are parsed
// once rather than once a job, and the decoder stack's calls into the other jobs stay
// inlinable.

#include "attention.h"
#include "kv_store.h"
#include "rotary.h"
#include "norms.h"
#include "activations.h"
#include "greedy.h"
#include "panel_linear.h"
#include "quantized_linear.h"
#include "lora.h"
#include "decoder_stack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("store_kv", &store_kv);
  m.def("rotary_", &rotary_);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("greedy_pick", &greedy_pick);
  m.def("greedy_head_pick", &greedy_head_pick);
  m.def("pack_linear_weight", &pack_linear_weight);
  m.def("packed_linear", &packed_linear);
  m.def("pack_gated_weight", &pack_gated_weight);
  m.def("bf16_panels", &bf16_dots);  // the panels take bf16 weights
  m.def("gated_linear", &gated_linear);
  m.def("int8_linear", &int8_linear);
  m.def("int4_dequantize", &int4_dequantize);
  m.def("int8_dequantize", &int8_dequantize);
  m.def("lora_add_", &lora_add_);
  // forward() holds no Python object: other Python threads run meanwhile.
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor,
                    bool>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_split_sequences", &DecoderStack::set_split_sequences)
      .def("sequence_parts", &DecoderStack::sequence_parts)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("set_greedy_head", &DecoderStack::set_greedy_head)
      .def("forward_greedy", &DecoderStack::forward_greedy,
           py::call_guard<py::gil_scoped_release>());
  m.def("vector_width", [] { return static_cast<int64_t>(Vec::size()); });
  m.def("fast_decode_items", [] { return fast_decode_items; });
}
