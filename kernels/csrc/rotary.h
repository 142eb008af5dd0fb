// Rotary embedding in place.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Rotary embedding in place, HF's `x * cos + rotate_half(x) * sin` with the sign of
// rotate_half folded into the table: sin_signed = (-sin, sin), x_rot = roll(x, half).

template <typename T>
void rotary_impl(const at::Tensor& heads, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin_signed) {
  const int64_t num_tokens = heads.size(0), num_heads = heads.size(1), d = heads.size(2);
  const int64_t half = d / 2;
  T* base = heads.data_ptr<T>();
  const int64_t token_stride = heads.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin_signed.data_ptr<float>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> x(d), scratch(d), rotated(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_table + pos[t] * d;
      const float* s = sin_table + pos[t] * d;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* row = base + t * token_stride + h * d;
        const float* src = as_float(row, scratch.data(), d);
        std::copy(src, src + d, x.data());
        int64_t i = 0;
        for (; i + Vec::size() <= half; i += Vec::size()) {
          const Vec x1 = Vec::loadu(x.data() + i), x2 = Vec::loadu(x.data() + half + i);
          (x1 * Vec::loadu(c + i) + x2 * Vec::loadu(s + i)).store(rotated.data() + i);
          (x2 * Vec::loadu(c + half + i) + x1 * Vec::loadu(s + half + i))
              .store(rotated.data() + half + i);
        }
        for (; i < half; ++i) {
          rotated[i] = x[i] * c[i] + x[half + i] * s[i];
          rotated[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
        }
        store_from_float(rotated.data(), row, d);
      }
    }
  });
}

void rotary_(const at::Tensor& heads, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin_signed) {
  check_rows_contiguous(heads, "heads");
  TORCH_CHECK(heads.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == heads.size(0),
              "positions must be contiguous int64, one per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin_signed.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin_signed.is_contiguous() &&
                  cos.size(1) == heads.size(2),
              "cos/sin tables must be contiguous fp32 [max_positions, head_dim]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, heads.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(heads, positions, cos, sin_signed);
  });
}

}  // namespace
