// LoRA for a batch mixing adapters.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

// LoRA for a batch mixing adapters (kernels/lora_segments.py's reference, the same loop): each
// segment (`lengths[i]` tokens from `token_starts[i]`, in slot `slots[i]`) gets
// x @ A_slot^T @ B_slot^T added to each projection's output columns of its rows in `out`.
// A is [slots x projections x rank, in]; B one [projection outputs, slots x rank] a projection.
// Dense matmuls on row and column slices: no copy of any adapter or activation.
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a,
               const std::vector<at::Tensor>& bs, const std::vector<int64_t>& starts,
               const std::vector<int64_t>& slots, const std::vector<int64_t>& token_starts,
               const std::vector<int64_t>& lengths, int64_t rank) {
  TORCH_CHECK(bs.size() == starts.size(), "one start per projection");
  TORCH_CHECK(slots.size() == lengths.size() && slots.size() == token_starts.size(),
              "one slot, start and length per segment");
  const int64_t width = static_cast<int64_t>(bs.size()) * rank;
  const auto segment = [&](int64_t i) {
    const at::Tensor low_rank = at::mm(x.narrow(0, token_starts[i], lengths[i]),
                                       a.narrow(0, slots[i] * width, width).t());
    at::Tensor rows = out.narrow(0, token_starts[i], lengths[i]);
    for (size_t p = 0; p < bs.size(); ++p) {
      rows.narrow(1, starts[p], bs[p].size(0))
          .addmm_(low_rank.narrow(1, static_cast<int64_t>(p) * rank, rank),
                  bs[p].narrow(1, slots[i] * rank, rank).t());
    }
  };
  const int64_t num_segments = static_cast<int64_t>(slots.size());
  if (num_segments == 1) {
    segment(0);  // its matmuls use every thread
    return;
  }
  // Segments write disjoint rows: one thread a segment, each matmul single-threaded inside the
  // parallel region. Small matmuls spend more on waking threads than on the work (a few tokens
  // by rank 16: 16 us each on two threads, measured on SmolLM2's gate/up linear).
  // The workers do not inherit the caller's inference mode (tensors made under it refuse
  // in-place updates outside it): each thread takes it on.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, num_segments, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    for (int64_t i = begin; i < end; ++i) segment(i);
  });
}

}  // namespace
