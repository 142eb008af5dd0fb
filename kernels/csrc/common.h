// What every kernel shares: the vector type, rows widened to fp32, the thread pool's helpers.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Whether this build and CPU have AVX512-BF16's dot product of bf16 pairs, which the bf16
// panels and bf16 decode scores use (else bf16 weights stay with oneDNN and bf16 rows are
// widened). Only the functions that use it are compiled for it, so the AVX-512 build still
// runs on AVX-512 CPUs without it.
bool bf16_dots() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
#else
  return false;
#endif
}

// Whether rows of T with head_dim d are scored by bf16 dot products of 32 values a step
// (score_keys_bf16, decode_scores_bf16): bf16 rows of whole steps where the CPU has them.
template <typename T>
bool bf16_dot_rows(int64_t d) {
  return std::is_same_v<T, at::BFloat16> && d % 32 == 0 && bf16_dots();
}

// A row of `n` values as fp32: fp32 rows are read in place, others widened into `scratch`.
template <typename T>
inline const float* as_float(const T* src, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    at::vec::convert(src, scratch, n);
    return scratch;
  }
}

template <typename T>
inline void store_from_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// y += alpha * x
inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const Vec a(alpha);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    at::vec::fmadd(a, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  }
  for (; d < n; ++d) y[d] += alpha * x[d];
}

inline void scale_in_place(float* y, float factor, int64_t n) {
  const Vec f(factor);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) (Vec::loadu(y + d) * f).store(y + d);
  for (; d < n; ++d) y[d] *= factor;
}

// Threads a kernel may share its work among: one inside a parallel region, where
// at::parallel_for runs inline (a decoder stack's step split by sequences, a run a thread).
inline int64_t pool_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

// Runs `work(item, following, worker)` for every item in `order`, items handed out one at a
// time to the pool's threads (costs differ a lot between items: a static split would idle
// threads). A thread claims its following item (-1: none) before it works on this one, so the
// work can ask for what the following one reads.
template <typename F>
void parallel_items(const std::vector<int64_t>& order, const F& work) {
  const int64_t num_items = static_cast<int64_t>(order.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool_threads(), num_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_items;) {
        const int64_t following = next.fetch_add(1);
        work(order[i], following < num_items ? order[following] : -1, worker);
        i = following;
      }
    }
  });
}

void check_rows_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3, name, " must be [tokens, heads, head_dim]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": each token's heads must be contiguous (the token stride may be anything)");
}

// Calls f(std::integral_constant<int, n>) for a runtime 1 <= n <= N: a tile's remainder gets
// its own fully unrolled instance.
template <int N, typename F>
inline void with_count(int64_t n, const F& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

}  // namespace
