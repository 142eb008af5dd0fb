// SiLU-and-mul.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------
// SiLU-and-mul: out = silu(gate) * up for gate_up = [gate | up], as torch computes
// `silu(gate) * up` (silu = x / (1 + exp(-x)), rounded to the model dtype, then the product).

// silu(x) = x / (1 + exp(-x)), lane by lane: the one formula of silu_and_mul and the gated
// linear's fused outputs, so either gives the same bits.
inline Vec silu(Vec x) { return x / (Vec(1.f) + x.neg().exp()); }

template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, const at::Tensor& out) {
  const int64_t rows = gate_up.size(0), n = out.size(1);
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(3 * n);
    float *gf = buffers.data(), *uf = gf + n, *result = uf + n;
    for (int64_t r = begin; r < end; ++r) {
      const float* g = as_float(in + r * 2 * n, gf, n);
      const float* u = as_float(in + r * 2 * n + n, uf, n);
      for (int64_t i = 0; i < n; i += Vec::size()) {
        const int64_t left = std::min<int64_t>(n - i, Vec::size());
        silu(Vec::loadu(g + i, left)).store(result + i, left);
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t i = 0; i < n; ++i) result[i] = static_cast<float>(static_cast<T>(result[i]));
      }
      for (int64_t i = 0; i < n; ++i) result[i] = result[i] * u[i];
      store_from_float(result, o + r * n, n);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [tokens, 2 * intermediate]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul",
      [&] { silu_and_mul_impl<scalar_t>(gate_up, out); });
  return out;
}

}  // namespace
