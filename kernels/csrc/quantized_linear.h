// The weight-only int8 linear and the int4/int8 dequantizers.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Weight-only int8 linear, GGUF's Q8_0 layout: codes [out, in] int8 and one fp32 scale for each
// group of 32 inputs (w = code * scale). Few rows read the weight once, which is what makes it
// pay: the codes are a quarter of fp32's bytes. Each group's codes are widened in registers
// and used for up to kInt8Rows rows of x at once; outputs are split across the threads in
// blocks small enough that a block's codes stay in cache for the next rows of x.

constexpr int64_t kInt8Group = 32;
constexpr int kInt8Rows = 8;
constexpr int64_t kInt8OutBlock = 64;

// Vec::size() int8 codes widened to fp32.
inline Vec load_int8_as_float(const int8_t* codes) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i narrow = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(narrow)));
#else
  const __m128i narrow = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(narrow)));
#endif
}

// out[r][n] for R rows of x and outputs n0..n1: the sum over inputs of (code * scale) * x.
template <int R>
void int8_rows(const float* x, int64_t in, const int8_t* codes, const float* scales, int64_t n0,
               int64_t n1, float* out, int64_t out_stride) {
  const int64_t groups = in / kInt8Group;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row_codes = codes + n * in;
    const float* row_scales = scales + n * groups;
    Vec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Vec(0.f);
    for (int64_t g = 0; g < groups; ++g) {
      const Vec scale(row_scales[g]);
      for (int64_t i = g * kInt8Group; i < (g + 1) * kInt8Group; i += Vec::size()) {
        const Vec w = load_int8_as_float(row_codes + i) * scale;  // once for all R rows
        for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(w, Vec::loadu(x + r * in + i), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      out[r * out_stride + n] =
          at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, acc[r]);
    }
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1),
              "x [rows, in] and codes [out, in] must agree on in");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous int8");
  TORCH_CHECK(codes.size(1) % kInt8Group == 0, "in must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) / kInt8Group,
              "scales must be contiguous fp32 [out, in / 32]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), in = codes.size(1), out_features = codes.size(0);
  auto out = at::empty({rows, out_features}, xf.options());
  const float* xs = xf.data_ptr<float>();
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t blocks = (out_features + kInt8OutBlock - 1) / kInt8OutBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kInt8OutBlock;
      const int64_t n1 = std::min(out_features, n0 + kInt8OutBlock);
      for (int64_t r0 = 0; r0 < rows; r0 += kInt8Rows) {
        with_count<kInt8Rows>(std::min<int64_t>(kInt8Rows, rows - r0), [&](auto count) {
          int8_rows<decltype(count)::value>(xs + r0 * in, in, c, sc, n0, n1,
                                            o + r0 * out_features, out_features);
        });
      }
    }
  });
  return out.to(x.scalar_type());
}

// torch's CPU int4 packing (_convert_weight_to_int4pack_for_cpu, inner_k_tiles 1) holds the
// codes of B outputs at a time, B = 64 where torch runs its AVX-512 code and 32 elsewhere (an
// AVX2-only CPU): for block b and input k, B / 2 bytes whose low nibbles are outputs B b + j
// and high nibbles B b + B / 2 + j (read off the packing itself, layers/quantized.py's
// torch_int4_block; the int4 tests check it against the kernel). Scales and zeros
// [in / group, out, 2] in bf16, as that kernel reads them: w = (code - 8) * scale + zero.
constexpr int64_t kInt4Block = 64;  // the largest B

// Widened to [in, out] in the dtype of `like`: bf16 (for oneDNN's bf16 matmul where the CPU has
// it) or fp32 (where bf16 would be emulated).
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                           int64_t group_size, const at::Tensor& like, int64_t block) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be torch's contiguous uint8 int4 packing [out, in / 2]");
  // torch packs blocks of 64 outputs where it runs AVX-512 code, of 32 elsewhere (AVX2).
  TORCH_CHECK(block == 32 || block == kInt4Block, "torch packs int4 in blocks of 32 or 64");
  const int64_t out_features = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(out_features % block == 0, "the packing holds outputs in whole blocks");
  TORCH_CHECK(group_size > 0 && in % group_size == 0, "in must be a multiple of group_size");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 &&
                  scales_and_zeros.is_contiguous() && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.size(0) == in / group_size &&
                  scales_and_zeros.size(1) == out_features && scales_and_zeros.size(2) == 2,
              "scales_and_zeros must be contiguous bf16 [in / group_size, out, 2]");
  TORCH_CHECK(like.scalar_type() == at::kBFloat16 || like.scalar_type() == at::kFloat,
              "int4 weights widen to bf16 or fp32");
  auto out = at::empty({in, out_features}, packed.options().dtype(like.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, like.scalar_type(), "int4_dequantize", [&] {
    const uint8_t* codes = packed.data_ptr<uint8_t>();
    const at::BFloat16* sz = scales_and_zeros.data_ptr<at::BFloat16>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t blocks = out_features / block, half = block / 2;
    at::parallel_for(0, in, 16, [&](int64_t begin, int64_t end) {
      float scale[kInt4Block], zero[kInt4Block];
      for (int64_t k = begin; k < end; ++k) {
        const at::BFloat16* group = sz + (k / group_size) * out_features * 2;
        scalar_t* row = o + k * out_features;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t n0 = b * block;
          for (int64_t j = 0; j < block; ++j) {
            scale[j] = static_cast<float>(group[(n0 + j) * 2]);
            zero[j] = static_cast<float>(group[(n0 + j) * 2 + 1]) - 8.f * scale[j];
          }
          // Input k's byte j of a block: output n0 + j in its low half, n0 + j + half high.
          const uint8_t* bytes = codes + (b * in + k) * half;
          for (int64_t j = 0; j < half; ++j) {
            row[n0 + j] = static_cast<float>(bytes[j] & 15) * scale[j] + zero[j];
            row[n0 + j + half] =
                static_cast<float>(bytes[j] >> 4) * scale[j + half] + zero[j + half];
          }
        }
      }
    });
  });
  return out;
}

// int8 codes [out, in] with an fp32 scale per 32 inputs (int8_linear's layout) widened to
// [out, in] in the dtype of `x` (the activations it will multiply): w = code * scale.
at::Tensor int8_dequantize(const at::Tensor& codes, const at::Tensor& scales,
                           const at::Tensor& x) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be contiguous int8 [out, in]");
  const int64_t out_features = codes.size(0), in = codes.size(1);
  TORCH_CHECK(in % kInt8Group == 0, "in must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == out_features && scales.size(1) == in / kInt8Group,
              "scales must be contiguous fp32 [out, in / 32]");
  auto out = at::empty({out_features, in}, codes.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_dequantize", [&] {
    const int8_t* c = codes.data_ptr<int8_t>();
    const float* sc = scales.data_ptr<float>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // Groups are contiguous: group g's codes at 32 g, its scale at g.
    at::parallel_for(0, out_features * (in / kInt8Group), 256, [&](int64_t begin, int64_t end) {
      for (int64_t group = begin; group < end; ++group) {
        const float scale = sc[group];
        for (int64_t i = group * kInt8Group; i < (group + 1) * kInt8Group; ++i) {
          o[i] = static_cast<scalar_t>(c[i] * scale);
        }
      }
    });
  });
  return out;
}

}  // namespace
