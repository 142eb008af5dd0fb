// fp32 and bf16 linears on weights packed into panels, and the gated (gate/up) one.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"
#include "activations.h"

namespace {

// ---------------------------------------------------------------------------------------------
// fp32 linear on a weight packed once into panels of kPanel outputs, each panel [in][kPanel]
// contiguous (the last one zero-padded). A tile of up to kLinearRows rows of x by one panel
// keeps its sums in registers, so every weight vector loaded serves all the tile's rows. Few
// rows (decode) are bound by reading the weight: each tile also prefetches a share of the
// panel the thread computes next (the next of its unit, or the first of the unit it has
// already claimed) into L2, so the stream never waits on memory. oneDNN's packed fp32
// matmul, which leaves the stream to the hardware prefetcher, took 1.3-1.7x as long at 1-64
// rows (benchmarks/README.md). Each output is one chain of fused multiply-adds over the
// inputs in order, however many rows there are: a row's result does not depend on its batch.
// bf16 weights and inputs take the same panels where the CPU has AVX512-BF16: two inputs a
// step, half the bytes of the weight stream, fp32 sums, one rounding to bf16 at the end.

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPanelVecs = 3, kLinearRows = 8;  // 24 sums of 32 registers
#else
constexpr int kPanelVecs = 2, kLinearRows = 6;  // 12 sums of 16 registers
#endif
constexpr int64_t kPanel = kPanelVecs * Vec::size();
constexpr int64_t kLineFloats = 64 / sizeof(float);
// The rows of x one pass over the weight serves: their activations stay in L2 meanwhile.
constexpr int64_t kLinearBlockBytes = 512 * 1024;
// Inputs between two asks for the next panel's lines where a panel has 2 to 16 row tiles.
constexpr int kSpreadInputs = 4;
// Rows up to which a panel's single tile asks for no lines ahead (panel_unit).
constexpr int64_t kStreamOnlyRows = 6;

// Gate and up (SwiGLU): a gated weight packs each panel of gate outputs beside the panel of
// up outputs with the same indices, [pairs, in, 2 * kPanel], so one tile holds both sums of
// its outputs and can write silu(gate) * up straight away: no [rows, 2 * intermediate]
// written out and read back by a pass of its own (3.6 ms of a 107 ms step of 64 decodes on a
// 2-core Zen 4, its reads mostly from the other core's L2).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kGatedVecs = 2, kGatedRows = 6;  // gate's 2 and up's 2 vectors: 24 sums
#else
constexpr int kGatedVecs = 1, kGatedRows = 6;  // 12 sums
#endif
constexpr int64_t kGatedPanel = kGatedVecs * Vec::size();  // outputs of gate (and up) a panel

// acc[r][v] = sum over i of x[r][i] * panel[i][v-th vector], for R rows of x and a panel PV
// vectors wide. Every `AskEvery` inputs it asks for `prefetch_lines` lines of the panel ahead.
template <int R, int PV, int AskEvery>
inline void tile_sums(const float* x, int64_t in, const float* panel, Vec (&acc)[R][PV],
                      const float*& prefetch, int64_t prefetch_lines, const float* prefetch_end) {
  constexpr int64_t width = PV * Vec::size();
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < PV; ++v) acc[r][v] = Vec(0.f);
  }
  for (int64_t i = 0; i < in; ++i) {
    Vec w[PV];
    for (int v = 0; v < PV; ++v) w[v] = Vec::loadu(panel + i * width + v * Vec::size());
    const bool asks = AskEvery == 1 || i % AskEvery == 0;
    for (int64_t line = 0; asks && line < prefetch_lines && prefetch < prefetch_end; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch), _MM_HINT_T1);
      prefetch += kLineFloats;
    }
    for (int r = 0; r < R; ++r) {
      const Vec xi(x[r * in + i]);
      for (int v = 0; v < PV; ++v) acc[r][v] = at::vec::fmadd(xi, w[v], acc[r][v]);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 panels: each step takes two inputs, its weight vectors hold 16 outputs' bf16 pairs
// (what pair_inputs lays out), and AVX512-BF16's dot product adds both exact products to the
// fp32 sums. Only this function uses the instruction, so the AVX-512 build still runs on CPUs
// without it (bf16_dots() says which). A step reads as many bytes as an fp32 input: the
// prefetch asks are counted in steps.
template <int R, int PV, int AskEvery>
__attribute__((target("avx512bf16"))) void tile_sums(const at::BFloat16* x, int64_t in,
                                                     const at::BFloat16* panel,
                                                     Vec (&acc)[R][PV],
                                                     const at::BFloat16*& prefetch,
                                                     int64_t prefetch_lines,
                                                     const at::BFloat16* prefetch_end) {
  constexpr int64_t width = PV * Vec::size();
  __m512 sums[R][PV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < PV; ++v) sums[r][v] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < in; i += 2) {
    __m512bh w[PV];
    for (int v = 0; v < PV; ++v) {
      w[v] = (__m512bh)_mm512_loadu_si512(panel + i * width + v * 2 * Vec::size());
    }
    const bool asks = AskEvery == 1 || (i / 2) % AskEvery == 0;
    for (int64_t line = 0; asks && line < prefetch_lines && prefetch < prefetch_end; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch), _MM_HINT_T1);
      prefetch += 64 / sizeof(at::BFloat16);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // inputs i and i + 1 of row r, broadcast to every lane
      std::memcpy(&pair, x + r * in + i, sizeof(pair));
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < PV; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], xi, w[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < PV; ++v) acc[r][v] = Vec(sums[r][v]);
  }
}
#endif

// Rows of a tile in its sums' array type: Vec[R][PV].
template <typename Acc>
constexpr int tile_rows = static_cast<int>(std::extent_v<std::remove_reference_t<Acc>>);

// One unit of panel work: x's rows r0..r1 (one row block, its activations in L2) by panels
// begin..end of `weights` (each [in][PV vectors], fp32 or bf16 pairs), each tile's sums handed
// to `finish(acc, panel, first_row)`. The last panel's tiles ask for panel `next` (the first of
// the thread's next unit; -1: none), so that it streams in while this one computes.
template <int PV, int MaxRows, typename T, typename Finish>
void panel_unit(const T* xs, int64_t r0, int64_t r1, int64_t in, const T* weights, int64_t begin,
                int64_t end, int64_t next, const Finish& finish) {
  constexpr int64_t width = PV * Vec::size();
  const int64_t tiles = (r1 - r0 + MaxRows - 1) / MaxRows;
  // The rows shared out evenly over the tiles: 32 rows on AVX2 as 6, 6, 5, 5, 5, 5, not
  // 6, 6, 6, 6, 6, 2. A tile of a few rows has too few independent sums to cover the
  // multiply-add's latency (two rows: 4 on AVX2 where 8 keep both units busy) and took
  // about as long as a full one.
  const auto tile_start = [&](int64_t tile) { return r0 + tile * (r1 - r0) / tiles; };
  // One panel is in * width values: from 2 to 16 tiles its lines go out a few every
  // kSpreadInputs inputs, spread over all of this panel's tiles (asking for them at every
  // input, in the first tiles only and faster than memory delivers, stalled the
  // multiply-adds: 64 rows 1.13x, 32 rows 1.03x slower). One tile asks at every input, as
  // the weight stream bounds it; more than 16 tiles hide the stream anyway, where the test
  // per input cost 2-5%.
  const bool spread = tiles >= 2 && tiles <= 16;
  // (a bf16 step of two inputs reads the bytes of one fp32 input). A panel of a few rows
  // streams best left to the hardware's prefetcher: with the asks, 30 layers of fp32 gate/up
  // and down at 1-6 rows took 1.06-1.13x as long on two threads (1.08-1.5x on one), the bf16
  // LM head at 1-4 rows 1.12-1.16x (1.25-1.6x); at 8 rows they helped one thread.
  const int64_t prefetch_lines =
      tiles == 1 && r1 - r0 <= kStreamOnlyRows
          ? 0
          : ((spread ? kSpreadInputs : 1) * width / kLineFloats + tiles - 1) / tiles;
  for (int64_t p = begin; p < end; ++p) {
    const T* panel = weights + p * in * width;
    const int64_t ahead = p + 1 < end ? p + 1 : next;
    const T* prefetch = ahead < 0 ? panel : weights + ahead * in * width;
    const T* prefetch_end = ahead < 0 ? prefetch : prefetch + in * width;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t r = tile_start(tile);
      with_count<MaxRows>(tile_start(tile + 1) - r, [&](auto count) {
        Vec acc[decltype(count)::value][PV];
        if (spread) {
          tile_sums<decltype(count)::value, PV, kSpreadInputs>(
              xs + r * in, in, panel, acc, prefetch, prefetch_lines, prefetch_end);
        } else {
          tile_sums<decltype(count)::value, PV, 1>(xs + r * in, in, panel, acc, prefetch,
                                                   prefetch_lines, prefetch_end);
        }
        finish(acc, p, r);
      });
    }
  }
}

// Computes every tile of x's `rows` rows by the `panels` panels of `weights` (each [in][PV
// vectors], fp32 or bf16 pairs) and hands each tile's sums to `finish(acc, panel, first_row)`.
template <int PV, int MaxRows, typename T, typename Finish>
void for_each_tile(const T* xs, int64_t rows, int64_t in, const T* weights, int64_t panels,
                   const Finish& finish) {
  const int64_t block_rows = std::max<int64_t>(
      MaxRows, kLinearBlockBytes / (in * sizeof(T)) / MaxRows * MaxRows);
  const int64_t row_blocks = (rows + block_rows - 1) / block_rows;
  // Blocks of even size: 225 rows in two passes of 113 and 112, not 224 and one, whose pass
  // streams the whole weight for a row.
  const auto block_start = [&](int64_t block) { return block * rows / row_blocks; };
  // Work units of a row block by a run of panels, taken from a shared counter: a thread that
  // wakes late or streams slower takes fewer, so neither waits long for the other at the end.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool_threads(), panels));
  const int64_t unit_panels = std::clamp<int64_t>(panels / (workers * 4), 2, 16);
  const int64_t units_per_block = (panels + unit_panels - 1) / unit_panels;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t units = row_blocks * units_per_block;
    const auto first_panel = [&](int64_t unit) { return unit % units_per_block * unit_panels; };
    for (int64_t unit = next.fetch_add(1); unit < units;) {
      // The unit after this one is claimed now, so that its first panel streams in while
      // this unit's last panel computes.
      const int64_t following = next.fetch_add(1);
      const int64_t block = unit / units_per_block;
      const int64_t begin = first_panel(unit);
      panel_unit<PV, MaxRows>(xs, block_start(block), block_start(block + 1), in, weights, begin,
                              std::min(panels, begin + unit_panels),
                              following < units ? first_panel(following) : -1, finish);
      unit = following;
    }
  });
}

// out[c] = v lane by lane for the first `left` of a vector's lanes.
inline void store_lanes(Vec v, float* out, int64_t left) {
  if (left == Vec::size()) {
    v.store(out);
  } else {
    v.store(out, left);
  }
}

// v as fp32 (identity) or rounded to T's precision lane by lane, as a tensor of T holds it.
template <typename T>
inline Vec round_to(Vec v) {
  return v;
}

// A bias vector's first `left` lanes (the rest zero), or zeros where there is no bias.
inline Vec bias_lanes(const float* bias, int64_t offset, int64_t left) {
  return bias == nullptr ? Vec(0.f) : Vec::loadu(bias + offset, left);
}

#if defined(CPU_CAPABILITY_AVX512)
// c10::BFloat16's rounding (to nearest even, NaN kept), on 16 lanes at once: bf16 is fp32's
// upper half.
template <>
inline Vec round_to<at::BFloat16>(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(-65536)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512 quiet_nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  return _mm512_mask_blend_ps(nan, rounded, quiet_nan);
}

inline void store_lanes(Vec v, at::BFloat16* out, int64_t left) {
  const __m512i halves = _mm512_srli_epi32(_mm512_castps_si512(round_to<at::BFloat16>(v)), 16);
  _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << left) - 1),
                           _mm512_cvtepi32_epi16(halves));
}

inline Vec bias_lanes(const at::BFloat16* bias, int64_t offset, int64_t left) {
  if (bias == nullptr) return Vec(0.f);
  const __m256i halves =
      _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << left) - 1), bias + offset);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
#endif

// Calls f with a value of the panels' element type for x's dtype: float, or at::BFloat16
// where the build has bf16 panels (check_panel_inputs has refused bf16 elsewhere).
template <typename F>
auto with_panel_type(const at::Tensor& x, const F& f) {
#if defined(CPU_CAPABILITY_AVX512)
  if (x.scalar_type() == at::kBFloat16) return f(at::BFloat16{});
#endif
  return f(float{});
}

// An [panels, in, width] panel layout as the panels of x's dtype read it: fp32 as it is, bf16
// with each step's two inputs side by side for each output, [panels, in / 2, width, 2].
at::Tensor pair_inputs(const at::Tensor& layout) {
  if (layout.scalar_type() == at::kFloat) return layout;
  const int64_t panels = layout.size(0), in = layout.size(1), width = layout.size(2);
  return layout.view({panels, in / 2, 2, width}).transpose(2, 3).contiguous().view(
      {panels, in, width});
}

// fp32 weights always; bf16 where the CPU multiplies bf16 pairs, with an even number of inputs.
void check_panel_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    weight.scalar_type() == at::kBFloat16),
              "weight must be fp32 or bf16 [out, in]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || bf16_dots(),
              "bf16 panels need AVX512-BF16 (bf16_panels() is false here)");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.size(1) % 2 == 0,
              "bf16 panels need an even number of inputs");
}

// [out, in] -> [panels, in, kPanel] (bf16: pair_inputs): what packed_linear reads.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_panel_weight(weight);
  const int64_t out_features = weight.size(0), in = weight.size(1);
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, in}, weight.options());
  padded.narrow(0, 0, out_features).copy_(weight);
  return pair_inputs(padded.view({panels, kPanel, in}).transpose(1, 2).contiguous());
}

// [gate; up] [2 * n, in] -> [pairs, in, 2 * kGatedPanel] (bf16: pair_inputs): pair p holds
// gate outputs p * kGatedPanel.. and the up outputs alike, side by side for every input.
at::Tensor pack_gated_weight(const at::Tensor& gate_up) {
  check_panel_weight(gate_up);
  TORCH_CHECK(gate_up.size(0) % 2 == 0, "gate_up must be [2 * intermediate, in]");
  const int64_t n = gate_up.size(0) / 2, in = gate_up.size(1);
  const int64_t pairs = (n + kGatedPanel - 1) / kGatedPanel;
  auto padded = at::zeros({2, pairs * kGatedPanel, in}, gate_up.options());
  padded.narrow(1, 0, n).copy_(gate_up.view({2, n, in}));
  // [2, pairs, kGatedPanel, in] -> [pairs, in, 2, kGatedPanel]
  return pair_inputs(padded.view({2, pairs, kGatedPanel, in})
                         .permute({1, 3, 0, 2})
                         .contiguous()
                         .view({pairs, in, 2 * kGatedPanel}));
}

// Checks shared by the panel linears: x [rows, in] fp32 (or bf16 with bf16 panels), the
// packed weight and bias [bias_size] of x's dtype.
void check_panel_inputs(const at::Tensor& x, const at::Tensor& packed, int64_t width,
                        const std::optional<at::Tensor>& bias, int64_t bias_size) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || (dtype == at::kBFloat16 && bf16_dots())),
              "x must be fp32 [rows, in] (or bf16 where bf16_panels())");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.size(2) == width && packed.size(1) == x.size(1),
              "packed must come from pack_linear_weight (pack_gated_weight for gated_linear) of"
              " an [out, in] weight of x's dtype");
  TORCH_CHECK(x.size(1) > 0, "a linear needs at least one input feature");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->is_contiguous() &&
                                    bias->dim() == 1 && bias->size(0) == bias_size),
              "bias must be contiguous [out] of x's dtype");
}

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// [rows, out_features] of x's dtype: every tile's sums of x by the panels of `packed`, handed
// to finish(acc, panel, first_row, bias, out) with the bias (or null) and out as T pointers.
template <int PV, int MaxRows, typename Finish>
at::Tensor run_panels(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias, const Finish& finish) {
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0);
  auto out = at::empty({rows, out_features}, xc.options());
  if (rows == 0) return out;
  with_panel_type(xc, [&](auto type) {
    using T = decltype(type);
    const T* bias_data = data_or_null<T>(bias);
    T* o = out.data_ptr<T>();
    for_each_tile<PV, MaxRows>(xc.data_ptr<T>(), rows, packed.size(1), packed.data_ptr<T>(),
                               packed.size(0), [&](const auto& acc, int64_t p, int64_t row) {
                                 finish(acc, p, row, bias_data, o);
                               });
  });
  return out;
}

// packed_linear's outputs of a tile of rows from `row` by panel p: its sums plus the bias (or
// none), in rows of out_features.
template <typename Acc, typename T>
void store_tile(const Acc& acc, int64_t p, int64_t row, const T* bias, T* out,
                int64_t out_features) {
  for (int v = 0; v < kPanelVecs; ++v) {
    const int64_t col = p * kPanel + v * Vec::size();
    const int64_t left = std::min<int64_t>(out_features - col, Vec::size());
    if (left <= 0) break;
    const Vec b = bias_lanes(bias, col, left);
    for (int r = 0; r < tile_rows<Acc>; ++r) {
      store_lanes(acc[r][v] + b, out + (row + r) * out_features + col, left);
    }
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  check_panel_inputs(x, packed, kPanel, bias, out_features);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features does not match the packed weight");
  return run_panels<kPanelVecs, kLinearRows>(
      x, packed, out_features, bias,
      [&](const auto& acc, int64_t p, int64_t row, const auto* bias_data, auto* o) {
        store_tile(acc, p, row, bias_data, o, out_features);
      });
}

// x [rows, in] by a pack_gated_weight weight of `intermediate` gate and up outputs (bias:
// [gate | up] biases). `fused`: silu(gate) * up, [rows, intermediate], the bits silu_and_mul
// gives from the [gate | up] that packed_linear computes (bf16: with the same roundings of
// gate, up and silu(gate) between); else [gate | up], [rows, 2 * intermediate],
// packed_linear's bits (a LoRA adapter adds to them before the activation).
at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                        const std::optional<at::Tensor>& bias, bool fused) {
  check_panel_inputs(x, packed, 2 * kGatedPanel, bias, 2 * intermediate);
  const int64_t pairs = packed.size(0);
  TORCH_CHECK(intermediate > (pairs - 1) * kGatedPanel && intermediate <= pairs * kGatedPanel,
              "intermediate does not match the packed weight");
  const int64_t out_features = fused ? intermediate : 2 * intermediate;
  return run_panels<2 * kGatedVecs, kGatedRows>(
      x, packed, out_features, bias,
      [&](const auto& acc, int64_t p, int64_t row, const auto* bias_data, auto* o) {
        using T = std::remove_pointer_t<decltype(o)>;
        for (int v = 0; v < kGatedVecs; ++v) {
          const int64_t col = p * kGatedPanel + v * Vec::size();
          const int64_t left = std::min<int64_t>(intermediate - col, Vec::size());
          if (left <= 0) break;
          const Vec gate_bias = bias_lanes(bias_data, col, left);
          const Vec up_bias = bias_lanes(bias_data, intermediate + col, left);
          for (int r = 0; r < tile_rows<decltype(acc)>; ++r) {
            const Vec gate = acc[r][v] + gate_bias, up = acc[r][kGatedVecs + v] + up_bias;
            T* out_row = o + (row + r) * out_features;
            if (fused) {
              const Vec activated = round_to<T>(silu(round_to<T>(gate)));
              store_lanes(activated * round_to<T>(up), out_row + col, left);
            } else {
              store_lanes(gate, out_row + col, left);
              store_lanes(up, out_row + intermediate + col, left);
            }
          }
        }
      });
}

}  // namespace
