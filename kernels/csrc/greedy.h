// Greedy decoding's pick, and an fp32 LM head's greedy token from its bf16 logits.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Greedy decoding's pick: each row's most likely token (the first of equal maxima, NaN above
// all, as torch.max) and its log-probability, -log(sum of exp(logit - max)), which is what
// log_softmax gives the maximum. Two passes over a row that stays in L2, where torch.max and
// log_softmax write and read a whole [rows, vocab] distribution.

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits must be fp32 [rows, vocab]");
  const at::Tensor rows = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t n = rows.size(0), vocab = rows.size(1), stride = rows.stride(0);
  auto tokens = at::empty({n}, rows.options().dtype(at::kLong));
  auto log_probs = at::empty({n}, rows.options());
  const float* data = rows.data_ptr<float>();
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* log_prob_out = log_probs.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = data + r * stride;
      int64_t i = 0;
      Vec maxima(-std::numeric_limits<float>::infinity());
      for (; i + Vec::size() <= vocab; i += Vec::size()) {
        maxima = at::vec::maximum(maxima, Vec::loadu(x + i));  // NaN wins, as in torch.max
      }
      float max = at::vec::vec_reduce_all<float>(
          [](Vec a, Vec b) { return at::vec::maximum(a, b); }, maxima);
      for (; i < vocab; ++i) max = std::isnan(x[i]) || x[i] > max ? x[i] : max;
      int64_t token = 0;
      while (token < vocab && !(std::isnan(max) ? std::isnan(x[token]) : x[token] == max)) {
        ++token;
      }
      const Vec shift(max);
      Vec sums(0.f);
      for (i = 0; i + Vec::size() <= vocab; i += Vec::size()) {
        sums = sums + (Vec::loadu(x + i) - shift).exp();
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, sums);
      for (; i < vocab; ++i) sum += std::exp(x[i] - max);
      token_out[r] = token;
      log_prob_out[r] = -std::log(sum);
    }
  });
  return {tokens, log_probs};
}

// ---------------------------------------------------------------------------------------------
// The greedy choice of an fp32 LM head without its fp32 logits. `approx` [rows, vocab] are the
// bf16 panels' logits (hidden and weight rounded to bf16, the sums rounded to bf16), at half
// the multiply-add cost of fp32 where the CPU has AVX512-BF16. Each is within
//   bound_j = dot_slack(in) * |h| * |w_j| + kRoundSlack * |approx_j|
// of the fp32 logit packed_linear computes: each factor rounded to bf16 is off by at most 2^-8
// of itself (a product by 2^-7 + 2^-16), each of the two fp32 sums of `in` terms (the bf16 and
// the fp32 one) by in * 2^-24 of the sum of |terms|, and by Cauchy-Schwarz sum |h_i w_ji| <=
// |h| |w_j|; the sum's own rounding to bf16 is at most 2^-8 / (1 - 2^-8) of the rounded value.
// Both slacks hold a few percent of margin for the rounding of this arithmetic. So no token
// whose approx_j + bound_j falls below the largest approx_k - bound_k can be the argmax: the
// rest (a few tokens a row for a trained model's peaked logits) are computed exactly as
// packed_linear computes them, one fused multiply-add chain over the inputs in order, and the
// first of the maxima wins, as greedy_pick picks: the same token, bit for bit the same logits
// compared. -1 for a row whose hidden or approximations are not all finite (or whose chosen
// logit is not): its caller computes the fp32 logits.

// 2^-7 + 2^-16 + 2 * in * 2^-24, with margin
inline float dot_slack(int64_t in) {
  return (0x1p-7f + 0x1p-16f + 2.f * static_cast<float>(in) * 0x1p-24f) * 1.04f;
}
constexpr float kRoundSlack = 0.0041f;  // 2^-8 / (1 - 2^-8) = 0.00392, with margin

// The first of the largest exact fp32 logits of `tokens` (rows of the LM head, ascending), or -1
// where one is not finite. Each logit is the panels' chain of fused multiply-adds from zero
// over the inputs in order; eight chains run side by side, as one alone waits on the
// multiply-add's latency at every input (a row of flat logits leaves ~70 tokens of SmolLM2's
// 49k to compute).
int64_t best_exact(const float* h, const float* weight, int64_t in,
                   const std::vector<int64_t>& tokens) {
  constexpr int kChains = 8;
  int64_t best = -1;
  float best_logit = 0.f;
  for (size_t first = 0; first < tokens.size(); first += kChains) {
    const int count = static_cast<int>(std::min<size_t>(kChains, tokens.size() - first));
    const float* rows[kChains];  // the last token again where fewer are left: not read out
    for (int c = 0; c < kChains; ++c) {
      rows[c] = weight + tokens[first + std::min(c, count - 1)] * in;
    }
    float sums[kChains] = {};
    for (int64_t i = 0; i < in; ++i) {
      for (int c = 0; c < kChains; ++c) sums[c] = std::fma(h[i], rows[c][i], sums[c]);
    }
    for (int c = 0; c < count; ++c) {
      if (!std::isfinite(sums[c])) return -1;
      if (best < 0 || sums[c] > best_logit) best = tokens[first + c], best_logit = sums[c];
    }
  }
  return best;
}

#if defined(CPU_CAPABILITY_AVX512)
// The bf16 approximations a[0..16) as fp32, the lanes outside `lanes` zero (bf16 is fp32's
// upper half).
inline __m512 load_bf16(const at::BFloat16* a, __mmask16 lanes) {
  const __m256i halves = _mm256_maskz_loadu_epi16(lanes, a);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// bound_j for 16 tokens: `dot_scale` is dot_slack(in) * |h|.
inline __m512 bounds(__m512 approx, const float* norms, __mmask16 lanes, __m512 dot_scale) {
  const __m512 round = _mm512_mul_ps(_mm512_abs_ps(approx), _mm512_set1_ps(kRoundSlack));
  return _mm512_add_ps(_mm512_mul_ps(dot_scale, _mm512_maskz_loadu_ps(lanes, norms)), round);
}

inline __mmask16 lanes_from(int64_t j, int64_t vocab) {
  const int64_t left = std::min<int64_t>(16, vocab - j);
  return static_cast<__mmask16>((1u << left) - 1);
}

int64_t greedy_head_row(const float* h, const at::BFloat16* approx, const float* weight,
                        const float* norms, int64_t in, int64_t vocab) {
  double squares = 0.0;
  for (int64_t i = 0; i < in; ++i) squares += static_cast<double>(h[i]) * h[i];
  // |h| rounded up, so the bound only grows
  const float norm = std::nextafter(static_cast<float>(std::sqrt(squares)),
                                    std::numeric_limits<float>::infinity());
  if (!std::isfinite(norm)) return -1;
  const __m512 dot_scale = _mm512_set1_ps(dot_slack(in) * norm);
  // The largest approx - bound; a non-finite approximation sends the row to the fp32 logits.
  __m512 floor = _mm512_set1_ps(kNegInf);
  __mmask16 odd = 0;
  for (int64_t j = 0; j < vocab; j += 16) {
    const __mmask16 lanes = lanes_from(j, vocab);
    const __m512 a = load_bf16(approx + j, lanes);
    odd |= _mm512_fpclass_ps_mask(a, 0x99);  // NaN or infinity
    const __m512 low = _mm512_sub_ps(a, bounds(a, norms + j, lanes, dot_scale));
    floor = _mm512_mask_max_ps(floor, lanes, floor, low);
  }
  if (odd != 0) return -1;
  float threshold = _mm512_reduce_max_ps(floor);
  // the subtraction above may have rounded up by half an ulp
  threshold -= std::abs(threshold) * 0x1p-20f;
  const __m512 lowest = _mm512_set1_ps(threshold);
  std::vector<int64_t> candidates;
  for (int64_t j = 0; j < vocab; j += 16) {
    const __mmask16 lanes = lanes_from(j, vocab);
    const __m512 a = load_bf16(approx + j, lanes);
    const __m512 reach = _mm512_add_ps(a, bounds(a, norms + j, lanes, dot_scale));
    __mmask16 m = _mm512_mask_cmp_ps_mask(lanes, reach, lowest, _CMP_GE_OQ);
    for (; m != 0; m &= m - 1) candidates.push_back(j + __builtin_ctz(m));
  }
  return best_exact(h, weight, in, candidates);
}
#endif

// hidden [rows, in] fp32, approx [rows, vocab] bf16 (packed_linear of both in bf16), weight
// [vocab, in] fp32 as the LM head's fp32 panels were packed from, norms [vocab] fp32 each
// weight row's L2 norm rounded up: the greedy token of each row, or -1 (see above).
at::Tensor greedy_head_pick(const at::Tensor& hidden, const at::Tensor& approx,
                            const at::Tensor& weight, const at::Tensor& norms) {
  TORCH_CHECK(bf16_dots(), "greedy_head_pick needs AVX512-BF16 (bf16_panels() is false here)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "hidden must be contiguous fp32 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && weight.size(1) == hidden.size(1),
              "weight must be contiguous fp32 [vocab, in]");
  const int64_t rows = hidden.size(0), in = hidden.size(1), vocab = weight.size(0);
  TORCH_CHECK(approx.scalar_type() == at::kBFloat16 && approx.is_contiguous() &&
                  approx.dim() == 2 && approx.size(0) == rows && approx.size(1) == vocab,
              "approx must be contiguous bf16 [rows, vocab]");
  TORCH_CHECK(norms.scalar_type() == at::kFloat && norms.is_contiguous() && norms.dim() == 1 &&
                  norms.size(0) == vocab,
              "norms must be contiguous fp32 [vocab]");
  auto tokens = at::empty({rows}, hidden.options().dtype(at::kLong));
#if defined(CPU_CAPABILITY_AVX512)
  const float* h = hidden.data_ptr<float>();
  const at::BFloat16* a = approx.data_ptr<at::BFloat16>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      out[r] = greedy_head_row(h + r * in, a + r * vocab, weight.data_ptr<float>(),
                               norms.data_ptr<float>(), in, vocab);
    }
  });
#endif
  return tokens;
}

}  // namespace
