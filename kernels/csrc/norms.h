// RMSNorm, alone and fused with the residual add.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------
// RMSNorm as HF's LlamaRMSNorm: x in fp32, x * rsqrt(mean(x^2) + eps), rounded to the model
// dtype, then times the weight (a rounding of its own in bf16/fp16). The fused variant first
// adds the sublayer output to the residual stream in the model dtype (HF's `residual + x`).

template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps, float* xf,
              float* wf, float* normed) {
  const float* v = as_float(x, xf, n);
  Vec squares(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec a = Vec::loadu(v + i);
    squares = squares + a * a;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, squares);
  for (; i < n; ++i) sum += v[i] * v[i];
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) normed[i] = v[i] * inverse;
  if constexpr (!std::is_same_v<T, float>) {  // HF rounds to the model dtype before the weight
    for (i = 0; i < n; ++i) normed[i] = static_cast<float>(static_cast<T>(normed[i]));
  }
  const float* w = as_float(weight, wf, n);
  for (i = 0; i < n; ++i) normed[i] = w[i] * normed[i];
  store_from_float(normed, out, n);
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
               const at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xs = x.data_ptr<T>();
  T* res = residual.defined() ? residual.data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(4 * n);
    float *xf = buffers.data(), *wf = xf + n, *normed = wf + n, *sum = normed + n;
    for (int64_t r = begin; r < end; ++r) {
      const T* source = xs + r * n;
      if (res != nullptr) {  // residual += x, in the model dtype
        T* stream = res + r * n;
        const float* a = as_float(stream, sum, n);
        const float* b = as_float(xs + r * n, xf, n);
        for (int64_t i = 0; i < n; ++i) normed[i] = a[i] + b[i];
        store_from_float(normed, stream, n);
        source = stream;
      }
      norm_row<T>(source, w, o + r * n, n, static_cast<float>(eps), xf, wf, normed);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [tokens, hidden]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [hidden] in x's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x, at::Tensor(), weight, out, eps);
  });
  return out;
}

// residual += x; x = rms_norm(residual) * weight. Both updated in place.
void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_",
                                  [&] { norm_rows<scalar_t>(x, residual, weight, x, eps); });
}

}  // namespace
