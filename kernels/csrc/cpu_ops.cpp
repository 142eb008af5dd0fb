// lmserve's CPU kernels: the hot ops of a Llama-family step, vectorised with ATen's at::vec
// (one source: the build defines CPU_CAPABILITY_AVX2 or CPU_CAPABILITY_AVX512 for the machine)
// and parallelised with at::parallel_for (torch's own OpenMP pool and thread count).
//
// Each op computes what its torch reference in kernels/ computes, in the same order of
// roundings where that order is observable in fp32 (products and sums are separate roundings:
// the build turns floating-point contraction off), so fp32 greedy output stays HF's.
// Reduced-precision inputs (bf16, fp16) are widened to fp32 for the arithmetic.

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

// ---------------------------------------------------------------------------------------------
// Paged attention over a packed mixed batch.
//
// Sequence s owns query rows query_start_loc[s]..query_start_loc[s+1] (its newest q_len tokens)
// and has seq_lens[s] tokens cached; its row i sits at position seq_lens[s] - q_len + i and
// sees keys 0..position. A work item is (sequence, KV head, tile of query tokens): the query
// heads sharing the KV head and the tile's tokens are its rows, so each K/V row is read once
// from the cache, in place, for all of them.
//
// Keys go kKeyChunk at a time (across cache blocks) through an online softmax (running max and
// sum per row). Many rows (a prompt tile) keep a chunk's scores transposed, [key][row]: the
// scores are then a register tile of independent FMAs, K x (scale * Q)^T with Q^T laid out
// [head_dim][row], and the softmax runs down whole vectors of rows. A few rows (a decode: one
// token's heads) would leave most lanes of such vectors empty, so they score a vector of keys
// at a time (each key's products down head_dim, then one transposing sum) into [row][key].
// Either way acc += P V is a register tile reading V rows in place.

constexpr int64_t kKeyChunk = 64;
// Query tokens per item: enough rows for whole vectors (a multi-head model has one row a
// token), few enough that a long prompt still splits into many items for the threads.
constexpr int64_t kTileTokens = 16;
constexpr int64_t kTileRows = 32;
constexpr int64_t kTransposeRows = 8;  // fewer rows score by dot products

// Register tiles: scores kKeyTile keys x kScoreVecs vectors of rows; the output kOutRows rows
// x kOutVecs vectors of head_dim. AVX-512 has 32 vector registers, AVX2 16.
constexpr int kKeyTile = 4;
constexpr int kScoreVecs = Vec::size() == 16 ? 4 : 2;
constexpr int kOutRows = 4;
constexpr int kOutVecs = Vec::size() == 16 ? 4 : 3;
// Vectors of head_dim an output tile of `rows` rows takes: a decode's 3 query heads a KV head
// (SmolLM2's 9 over 3) take 4 on AVX2 too, so head_dim 64 goes in two passes over the keys'
// values, not three. The AVX2 build on a 2-core Zen 4, 30 layers' caches: 32 decodes of 100
// keys 1.04-1.06x, 64 of 250 1.07-1.09x faster, a lone decode of 288 keys (from cache) 5-7%
// slower. Tiles of 4 rows keep 3 vectors: 4 x 4 sums do not fit AVX2's 16 registers (prompt
// tiles of 3 rows x 4 vectors instead ran 1.15-1.2x slower).
constexpr int out_vecs(int rows) { return rows <= 3 ? 4 : kOutVecs; }

// Cascade: decodes whose block tables start with the same blocks (a prompt prefix shared
// through the prefix cache) score those keys in one item per KV head whose rows are all of
// their query heads, enough rows for the transposed tiles where each decode alone has too few;
// each decode then attends over its own keys alone. Both leave partial results (unnormalised
// output, running max and sum) that a last pass merges. Shared keys are read once, not once a
// sequence, and the long shared range splits into parts for the threads.
constexpr int64_t kMinSharedKeys = 2 * kKeyChunk;
constexpr int64_t kSharedPartKeys = 4 * kKeyChunk;  // a part is at least this long

struct CascadeGroup {
  std::vector<int64_t> seqs;  // decodes (one query token each)
  int64_t shared_keys;        // keys 0..shared_keys-1: the same cache slots for all of them
  int64_t parts;              // the shared keys go in this many items per KV head
  int64_t first_slot;         // partial slot of (member 0, query head 0, part 0)
  // The partial slot of member m's query head h: parts 0..parts-1 shared, `parts` its own.
  int64_t slot(int64_t member, int64_t head, int64_t q_heads, int64_t part) const {
    return first_slot + (member * q_heads + head) * (parts + 1) + part;
  }
};

enum class ItemKind { kWhole, kShared, kOwn };

// A work item: one KV head, some query rows, a range of keys.
//   kWhole: tokens token_begin..token_end of sequence `seq`, every key they see: the output.
//   kShared: every member of cascade group `group`, keys key_begin..key_end: part `part`.
//   kOwn: member `member` (sequence `seq`) of group `group`, its keys past the shared ones.
struct AttentionItem {
  ItemKind kind;
  int64_t seq, kv_head, token_begin, token_end;  // tokens: indices within the sequence's query
  int64_t key_begin = 0, key_end = 0;
  int64_t group = -1, member = -1, part = -1;
};

// Where a chunk's score (and then weight) of row r for key t lives: t * key + r * row.
struct ScoreLayout {
  int64_t key, row;
};

// Calls f(std::integral_constant<int, n>) for a runtime 1 <= n <= N: a tile's remainder gets
// its own fully unrolled instance.
template <int N, typename F>
inline void with_count(int64_t n, const F& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// scores[t][v] for kKeyTile keys and RV vectors of rows: sum over i of key[t][i] * qt[i][v].
template <int RV>
inline void score_tile(const float* const* keys, const float* qt, int64_t row_pad, int64_t d,
                       float* scores) {
  Vec acc[kKeyTile][RV];
  for (int t = 0; t < kKeyTile; ++t) {
    for (int v = 0; v < RV; ++v) acc[t][v] = Vec(0.f);
  }
  for (int64_t i = 0; i < d; ++i) {
    Vec q[RV];
    for (int v = 0; v < RV; ++v) q[v] = Vec::loadu(qt + i * row_pad + v * Vec::size());
    for (int t = 0; t < kKeyTile; ++t) {
      const Vec k(keys[t][i]);
      for (int v = 0; v < RV; ++v) acc[t][v] = at::vec::fmadd(k, q[v], acc[t][v]);
    }
  }
  for (int t = 0; t < kKeyTile; ++t) {
    for (int v = 0; v < RV; ++v) acc[t][v].store(scores + t * row_pad + v * Vec::size());
  }
}

// The horizontal sums of Vec::size() vectors, one a lane: a transposing tree of adds that
// sums all of them in log2(lanes) steps where one vector's own reduction takes as many.
inline Vec sum_each(Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // in each 128-bit block: partial sums of v[2i] and v[2i+1]
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // each 128-bit block: a partial sum of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {  // blocks: quads[2i] twice, quads[2i+1] twice, half summed
    const __m512 a = quads[2 * i], b = quads[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return Vec(_mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1))));
#else
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = v[2 * i], b = v[2 * i + 1];
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(pairs[2 * i]), b = _mm256_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return Vec(_mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                           _mm256_permute2f128_ps(quads[0], quads[1], 0x31)));
#endif
}

// scores[t] = q . keys[t] for Vec::size() keys, keys in lanes: each key's products go down
// vectors of head_dim, then one sum_each reduces all of them together.
inline void score_keys(const float* q, const float* const* keys, int64_t d, float* scores) {
  Vec acc[Vec::size()];
  for (int t = 0; t < Vec::size(); ++t) acc[t] = Vec(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) {
    const Vec qi = Vec::loadu(q + i);
    for (int t = 0; t < Vec::size(); ++t) {
      acc[t] = at::vec::fmadd(qi, Vec::loadu(keys[t] + i), acc[t]);
    }
  }
  sum_each(acc).store(scores);
  for (; i < d; ++i) {  // head_dim % vector width
    for (int t = 0; t < Vec::size(); ++t) scores[t] += q[i] * keys[t][i];
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// score_keys for bf16 rows where the CPU has AVX512-BF16: q and the keys as they are in the
// cache (no widening), two exact products a lane and step into fp32 sums, then the scale
// (score_keys takes a pre-scaled q). head_dim % 32 == 0.
__attribute__((target("avx512bf16"))) void score_keys_bf16(const at::BFloat16* q,
                                                           const at::BFloat16* const* keys,
                                                           int64_t d, float scale,
                                                           float* scores) {
  __m512 sums[Vec::size()];
  for (int t = 0; t < Vec::size(); ++t) sums[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 2 * Vec::size()) {
    const __m512bh qi = (__m512bh)_mm512_loadu_si512(q + i);
    for (int t = 0; t < Vec::size(); ++t) {
      sums[t] = _mm512_dpbf16_ps(sums[t], qi, (__m512bh)_mm512_loadu_si512(keys[t] + i));
    }
  }
  Vec acc[Vec::size()];
  for (int t = 0; t < Vec::size(); ++t) acc[t] = Vec(sums[t]);
  (sum_each(acc) * Vec(scale)).store(scores);
}
#endif

// K/V rows asked for `lead` keys before they are read (kAheadKeys for fp32 rows, a chunk for
// rows widened a chunk at a time; in this chunk, the next, or the first of the thread's next
// item), a few lines at each step of the scores and of P V, so the lines stream in while the
// chunk computes. A whole chunk asked for at once (512 lines at
// head_dim 64) stalls the core until most of them have arrived, and fetching and computing
// then take turns: on a 2-core Zen 4, 64 decodes of 250 keys over 30 layers' caches took 1.2x
// as long that way.
constexpr int64_t kAheadKeys = 32;

// Asks for every line of a K or V row of `bytes` into L2.
inline void ask_lines(const void* row, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) {
    _mm_prefetch(static_cast<const char*>(row) + at, _MM_HINT_T1);
  }
}
// A call reading less K/V than this asks for whole chunks: its misses can all be in flight at
// once (a lone decode of 288 keys ran 15% faster so on Zen 4; 2 of 1,000 keys 1.3x slower).
constexpr int64_t kStreamAheadBytes = 1 << 20;
struct RowsAhead {
  const char* keys[2 * kKeyChunk];  // this chunk's rows, then the next chunk's
  const char* values[2 * kKeyChunk];
  int64_t count = 0, bytes = 0;
  int64_t lead = kAheadKeys;  // keys between the one computed and the one asked for

  template <typename T>
  void set(const T* const* k, const T* const* v, int64_t at, int64_t n, int64_t d) {
    for (int64_t t = 0; t < n; ++t) {
      keys[at + t] = reinterpret_cast<const char*>(k[t]);
      values[at + t] = reinterpret_cast<const char*>(v[t]);
    }
    count = at + n;
    bytes = d * static_cast<int64_t>(sizeof(T));
  }
  // While keys t0..t0+n of this chunk score.
  void ask_keys(int64_t t0, int64_t n) const {
    for (int64_t t = t0 + lead; t < std::min(t0 + lead + n, count); ++t) ask_lines(keys[t], bytes);
  }
  // The V rows asked for while keys 0..n accumulate: key t asks for row t + lead, if any.
  int64_t values_asked(int64_t n) const { return std::clamp<int64_t>(count - lead, 0, n); }
};

// Asks for the first kAskedLines lines of `row` (all of a row of at most 512 bytes, head_dim
// up to 128 in fp32; a longer row's first 8, its rest read on demand), each line where the row
// has it, else its last line again: a fixed run of prefetches with no loop or branch on the
// row's size. With a loop there, inside output_tile's loop over keys, GCC kept the tile's sums
// on the stack (a load and a store around every multiply-add of P V).
constexpr int64_t kAskedLines = 8;
inline void ask_row(const char* row, int64_t bytes) {
  const int64_t last = std::max<int64_t>(bytes - 64, 0);
#pragma GCC unroll 8
  for (int64_t line = 0; line < kAskedLines; ++line) {
    _mm_prefetch(row + std::min(line * 64, last), _MM_HINT_T1);
  }
}

// acc[r][j] += sum over keys t of weight(t, r) * value[t][offset + j], for RT rows and DV
// vectors of j; `acc` points at the tile's first element, rows d apart. With Asks, each
// key's step asks for the V row `ahead` holds kAheadKeys keys later.
template <int RT, int DV, bool Asks>
inline void output_tile(const float* weights, ScoreLayout layout, const float* const* values,
                        int64_t offset, int64_t num_keys, int64_t d, float* acc,
                        const RowsAhead& ahead) {
  Vec a[RT][DV];
  for (int r = 0; r < RT; ++r) {
    for (int j = 0; j < DV; ++j) a[r][j] = Vec::loadu(acc + r * d + j * Vec::size());
  }
  const int64_t asked = Asks ? ahead.values_asked(num_keys) : 0;
  for (int64_t t = 0; t < num_keys; ++t) {
    if constexpr (Asks) {
      // Past the rows to ask for, the chunk's first V row again (asked for already): no branch.
      ask_row(ahead.values[t < asked ? t + ahead.lead : 0], ahead.bytes);
    }
    Vec v[DV];
    for (int j = 0; j < DV; ++j) v[j] = Vec::loadu(values[t] + offset + j * Vec::size());
    for (int r = 0; r < RT; ++r) {
      const Vec weight(weights[t * layout.key + r * layout.row]);
      for (int j = 0; j < DV; ++j) a[r][j] = at::vec::fmadd(weight, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    for (int j = 0; j < DV; ++j) a[r][j].store(acc + r * d + j * Vec::size());
  }
}

// One item's rows, their running softmax state and one chunk's keys; one per thread, reused.
struct AttentionState {
  int64_t rows = 0, row_pad = 0, d = 0;
  bool transposed = false;
  ScoreLayout layout{};
  std::vector<float> buffer;
  float *q, *scores, *acc, *row_max, *row_sum, *correction, *last_key, *keys_f, *values_f,
      *q_row, *zeros;
  std::vector<const float*> keys, values;  // the chunk's K and V rows as fp32
  // bf16 rows scored by dot products on AVX512-BF16 (bf16_scores): the unscaled query rows
  // [rows][d] then a row of zeros (the keys past a partial chunk), and the chunk's K rows as
  // they are in the cache.
  bool bf16_scores = false;
  float scale = 1.f;
  std::vector<at::BFloat16> q_bf16;
  std::vector<const at::BFloat16*> keys_bf16;
  RowsAhead ahead;  // empty where the rows are asked for a chunk at a time
  int64_t next_asked = 0;  // the next item's first keys asked for during this one's last chunk
  std::vector<float> decode_buffer;  // attend_decode's query rows, scores and sums

  void reset(int64_t num_rows, int64_t head_dim) {
    rows = num_rows;
    d = head_dim;
    row_pad = (rows + Vec::size() - 1) / Vec::size() * Vec::size();
    transposed = rows >= kTransposeRows;
    layout = transposed ? ScoreLayout{row_pad, 1} : ScoreLayout{1, kKeyChunk};
    const int64_t chunk = kKeyChunk;
    buffer.resize(d * row_pad + chunk * row_pad + row_pad * d + 4 * row_pad + 2 * chunk * d +
                  2 * d);
    q = buffer.data();             // scale * Q: [d][row_pad] transposed, else [rows][d]
    scores = q + d * row_pad;      // [chunk][row_pad] transposed, else [rows][chunk]
    acc = scores + chunk * row_pad;  // [row_pad][d]
    row_max = acc + row_pad * d;
    row_sum = row_max + row_pad;
    correction = row_sum + row_pad;
    last_key = correction + row_pad;  // the last key each row may see, as a float
    keys_f = last_key + row_pad;      // [chunk][d] widened K (bf16, fp16)
    values_f = keys_f + chunk * d;    // [chunk][d] widened V
    q_row = values_f + chunk * d;
    zeros = q_row + d;  // stands in for the keys past the end of a partial chunk
    // Only what is read before it is written: transposed Q's padding lanes are computed with
    // (set_query_row writes the rows), and P V adds to the real rows' sums alone. A decode's
    // item (3 rows) takes about a microsecond, and zeroed 16 rows of both.
    if (transposed) std::fill(q, q + d * row_pad, 0.f);
    std::fill(acc, acc + rows * d, 0.f);
    std::fill(zeros, zeros + d, 0.f);
    std::fill(row_max, row_max + row_pad, kNegInf);
    std::fill(row_sum, row_sum + row_pad, 0.f);
    keys.resize(chunk);
    values.resize(chunk);
    keys_bf16.resize(chunk);
  }

  // Scores by bf16 dot products, K rows read as they are in the cache, where rows are bf16
  // and scored by dot products (few rows a KV head: decodes), head_dim is a multiple of the
  // 32 values a step takes and the CPU has AVX512-BF16: bf16 decodes on Zen 4 1.04-1.16x
  // faster than with widened K rows. Sets up the query rows' buffer.
  template <typename T>
  void choose_scores(float query_scale) {
    scale = query_scale;
    bf16_scores = !transposed && bf16_dot_rows<T>(d);
    if (!bf16_scores) return;
    q_bf16.assign((rows + 1) * d, at::BFloat16(0.f));
  }

  void set_query_row(int64_t r, const float* row, float scale) {
    for (int64_t i = 0; i < d; ++i) {
      (transposed ? q[i * row_pad + r] : q[r * d + i]) = row[i] * scale;
    }
  }

  // Keys a transposed chunk scores: its real ones in whole key tiles. An item's last chunk
  // often holds fewer than kKeyChunk (the first tile of a 32-token prompt sees 16 keys), and
  // the rest would be scored, masked and summed as zero weights for nothing.
  static int64_t scored(int64_t in_chunk) {
    return (in_chunk + kKeyTile - 1) / kKeyTile * kKeyTile;
  }

  void score_chunk(int64_t in_chunk) {
    if (!transposed) {
      // Keys past in_chunk are zeros, their scores masked in the softmax.
      int64_t asks_from[kTransposeRows];  // a vector's keys asked for, shared out by row
      for (int64_t r = 0; r <= rows; ++r) asks_from[r] = Vec::size() * r / rows;
      for (int64_t t = 0; t < in_chunk; t += Vec::size()) {
        for (int64_t r = 0; r < rows; ++r) {
          ahead.ask_keys(t + asks_from[r], asks_from[r + 1] - asks_from[r]);
#if defined(CPU_CAPABILITY_AVX512)
          if (bf16_scores) {
            score_keys_bf16(q_bf16.data() + r * d, keys_bf16.data() + t, d, scale,
                            scores + r * kKeyChunk + t);
            continue;
          }
#endif
          score_keys(q + r * d, keys.data() + t, d, scores + r * kKeyChunk + t);
        }
      }
      return;
    }
    const int64_t row_vecs = row_pad / Vec::size();
    for (int64_t t = 0; t < scored(in_chunk); t += kKeyTile) {
      ahead.ask_keys(t, kKeyTile);
      for (int64_t v = 0; v < row_vecs; v += kScoreVecs) {
        with_count<kScoreVecs>(std::min<int64_t>(kScoreVecs, row_vecs - v), [&](auto count) {
          score_tile<decltype(count)::value>(keys.data() + t, q + v * Vec::size(), row_pad, d,
                                             scores + t * row_pad + v * Vec::size());
        });
      }
    }
  }

  // Scores of keys past a row's last key become -inf, then weights exp(score - running max).
  // An item's first key is one every row sees, so a running max is finite from the first
  // chunk on and the corrections exp(old max - new max) are never exp(-inf + inf).
  void softmax_chunk(int64_t key0, int64_t in_chunk, bool masked, bool first_chunk) {
    if (transposed) {
      for (int64_t v = 0; v < row_pad; v += Vec::size()) {
        softmax_lanes_are_rows(key0, v, scored(in_chunk), masked);
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) softmax_lanes_are_keys(key0, in_chunk, r);
    }
    for (int64_t r = 0; r < rows && !first_chunk; ++r) {  // acc is still zero after the first
      if (correction[r] != 1.f) scale_in_place(acc + r * d, correction[r], d);
    }
  }

  void softmax_lanes_are_rows(int64_t key0, int64_t v, int64_t keys_scored, bool masked) {
    const Vec last = Vec::loadu(last_key + v);
    const Vec hidden(kNegInf);
    Vec chunk_max(kNegInf);
    for (int64_t t = 0; t < keys_scored; ++t) {
      Vec s = Vec::loadu(scores + t * row_pad + v);
      if (masked) {
        s = Vec::blendv(s, hidden, Vec(static_cast<float>(key0 + t)) > last);
        s.store(scores + t * row_pad + v);
      }
      chunk_max = at::vec::maximum(chunk_max, s);
    }
    const Vec old_max = Vec::loadu(row_max + v);
    const Vec new_max = at::vec::maximum(old_max, chunk_max);
    Vec sums(0.f);
    for (int64_t t = 0; t < keys_scored; ++t) {
      const Vec p = (Vec::loadu(scores + t * row_pad + v) - new_max).exp();
      p.store(scores + t * row_pad + v);
      sums = sums + p;
    }
    const Vec factor = (old_max - new_max).exp();
    (Vec::loadu(row_sum + v) * factor + sums).store(row_sum + v);
    new_max.store(row_max + v);
    factor.store(correction + v);
  }

  // Over the vectors of keys the chunk has (score_chunk scored them; a short last chunk, or a
  // new sequence's first, has fewer than kKeyChunk): the keys past them would only add -inf
  // to the maxima and zeros to the sums.
  void softmax_lanes_are_keys(int64_t key0, int64_t in_chunk, int64_t r) {
    float* s = scores + r * kKeyChunk;
    const int64_t visible =
        std::clamp<int64_t>(static_cast<int64_t>(last_key[r]) - key0 + 1, 0, in_chunk);
    const int64_t keys_scored = (in_chunk + Vec::size() - 1) / Vec::size() * Vec::size();
    std::fill(s + visible, s + keys_scored, kNegInf);
    Vec maxima(kNegInf);
    for (int64_t t = 0; t < keys_scored; t += Vec::size()) {
      maxima = at::vec::maximum(maxima, Vec::loadu(s + t));
    }
    const float chunk_max = at::vec::vec_reduce_all<float>(
        [](Vec a, Vec b) { return at::vec::maximum(a, b); }, maxima);
    const float new_max = std::max(row_max[r], chunk_max);
    const Vec shift(new_max);
    Vec sums(0.f);
    for (int64_t t = 0; t < keys_scored; t += Vec::size()) {
      const Vec p = (Vec::loadu(s + t) - shift).exp();
      p.store(s + t);
      sums = sums + p;
    }
    const float factor = std::exp(row_max[r] - new_max);
    row_sum[r] = row_sum[r] * factor +
                 at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, sums);
    row_max[r] = new_max;
    correction[r] = factor;
  }

  // acc += P V over the chunk's real keys.
  void accumulate_values(int64_t in_chunk) {
    const int64_t full_vecs = d / Vec::size();
    for (int64_t r = 0; r < rows; r += kOutRows) {
      const int64_t row_count = std::min<int64_t>(kOutRows, rows - r);
      const float* weights = scores + r * layout.row;
      with_count<kOutRows>(row_count, [&](auto rt) {
        constexpr int RT = decltype(rt)::value, kVecs = out_vecs(RT);
        for (int64_t j = 0; j < full_vecs; j += kVecs) {
          const int64_t offset = j * Vec::size();
          const bool asks = r == 0 && j == 0 && ahead.count > 0;  // the first tile's keys ask
          with_count<kVecs>(std::min<int64_t>(kVecs, full_vecs - j), [&](auto dv) {
            constexpr int DV = decltype(dv)::value;
            float* tile = acc + r * d + offset;
            if (asks) {
              output_tile<RT, DV, true>(weights, layout, values.data(), offset, in_chunk, d, tile,
                                        ahead);
            } else {
              output_tile<RT, DV, false>(weights, layout, values.data(), offset, in_chunk, d, tile,
                                         ahead);
            }
          });
        }
      });
      for (int64_t i = full_vecs * Vec::size(); i < d; ++i) {  // head_dim % vector width
        for (int64_t rr = 0; rr < row_count; ++rr) {
          float sum = acc[(r + rr) * d + i];
          for (int64_t t = 0; t < in_chunk; ++t) {
            sum += weights[t * layout.key + rr * layout.row] * values[t][i];
          }
          acc[(r + rr) * d + i] = sum;
        }
      }
    }
  }
};

// What every item of one call reads and writes.
template <typename T>
struct AttentionCall {
  const T *query, *k_cache, *v_cache;
  int64_t q_token_stride, q_head_stride, block_size, kv_heads, q_heads, heads_per_kv, d;
  const int32_t *lens, *starts, *tables;
  int64_t table_stride;
  float scale;
  T* out;
  float* partials;  // [slot][d + 2]: unnormalised output, running max, running sum
  const std::vector<CascadeGroup>* groups;
  bool stream_ahead = false;  // K/V rows asked for a few at a time ahead (see attend_keys)

  int64_t q_len(int64_t seq) const { return starts[seq + 1] - starts[seq]; }
  int64_t first_position(int64_t seq) const { return lens[seq] - q_len(seq); }
  const int32_t* table(int64_t seq) const { return tables + seq * table_stride; }
  int64_t out_offset(int64_t seq, int64_t token, int64_t head) const {
    return ((starts[seq] + token) * q_heads + head) * d;
  }
  float* partial(const CascadeGroup& g, int64_t member, int64_t head, int64_t part) const {
    return partials + g.slot(member, head, q_heads, part) * (d + 2);
  }
};

// Where an item's row r comes from: a sequence's query token and a query head.
struct RowSource {
  int64_t seq, token, head;
};

// Query tokens an item holds: a shared item one per member (each a decode).
int64_t item_tokens(const AttentionItem& item, const std::vector<CascadeGroup>& groups) {
  if (item.kind == ItemKind::kShared) return static_cast<int64_t>(groups[item.group].seqs.size());
  return item.token_end - item.token_begin;
}

template <typename T>
RowSource row_source(const AttentionItem& item, const AttentionCall<T>& call, int64_t r) {
  const int64_t head = item.kv_head * call.heads_per_kv + r % call.heads_per_kv;
  if (item.kind == ItemKind::kShared) {
    return {(*call.groups)[item.group].seqs[r / call.heads_per_kv], 0, head};
  }
  return {item.seq, item.token_begin + r / call.heads_per_kv, head};
}

// Where keys key0..key0+count of one KV head sit in the cache: block by block, one table
// lookup a block.
template <typename T>
void locate_keys(const AttentionCall<T>& call, const int32_t* table, int64_t kv_head,
                 int64_t key0, int64_t count, const T** keys, const T** values) {
  const int64_t row_stride = call.kv_heads * call.d;
  for (int64_t t = 0; t < count;) {
    const int64_t key = key0 + t;
    const int64_t in_block = key % call.block_size;
    const int64_t run = std::min(call.block_size - in_block, count - t);
    const int64_t first =
        ((table[key / call.block_size] * call.block_size + in_block) * call.kv_heads + kv_head) *
        call.d;
    for (int64_t j = 0; j < run; ++j, ++t) {
      keys[t] = call.k_cache + first + j * row_stride;
      values[t] = call.v_cache + first + j * row_stride;
    }
  }
}

// Asks for the cache lines of `count` K and V rows: one KV head's slice of each token's row,
// in blocks scattered over the cache, too irregular for the hardware prefetcher.
template <typename T>
void prefetch_rows(const T* const* keys, const T* const* values, int64_t count, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < count; ++t) {
    ask_lines(keys[t], bytes);
    ask_lines(values[t], bytes);
  }
}

// The keys an item reads: one KV head's, key_begin..key_end, through a block table.
struct KeyRange {
  const int32_t* table;
  int64_t kv_head, key_begin, key_end;
};

// acc, max and sum over the keys of `range` for the rows `state` holds; the rows' last keys
// are in state.last_key, range.table is the block table of every row's sequence. Every
// chunk's rows are asked for before they are read. Where the call streams K/V ahead (it reads
// enough to be bound by the stream), a few rows at a time as the chunk computes (RowsAhead):
// fp32 rows, read as they compute, kAheadKeys keys ahead; bf16/fp16 rows, read all at once
// when the chunk is widened, a whole chunk ahead (the next chunk's key t while this chunk's
// key t computes: bf16 decodes on Zen 4 1.04-1.18x faster than with the next chunk asked for
// at once, prompts 2-4% slower). An item's first keys (kAheadKeys, or its whole first chunk
// where it is widened) go out at once, unless the item before asked for them in its last
// chunk (`following`, the item this thread takes next: 32 decodes of 100 keys 1.03-1.07x
// faster on Zen 4).
// Otherwise a chunk at a time: the first chunk's all at once (many misses in flight instead
// of the few the computation's loads keep), the next while this one is computed, before
// bf16/fp16 rows are widened. On a 2-core AVX-512 Xeon, 64 decodes of 200 keys (9 query
// heads, 3 KV heads, head_dim 64) over 30 layers' caches took 0.72x the time of demand loads
// alone with chunks asked for whole.
template <typename T>
void attend_keys(const AttentionCall<T>& call, const KeyRange& range, const KeyRange* following,
                 AttentionState& state) {
  const int64_t d = call.d, key_begin = range.key_begin, key_end = range.key_end;
  const bool rolling = call.stream_ahead;
  constexpr bool widened = !std::is_same_v<T, float>;
  // Rows see keys up to the smallest last key: chunks before it need no mask.
  const float first_hidden =
      *std::min_element(state.last_key, state.last_key + state.rows) + 1.f;
  const T *keys[2][kKeyChunk], *values[2][kKeyChunk];  // this chunk's rows and the next's
  // Locates the rows of the chunk of `r` from `key0` into buffer `b`; how many there are.
  const auto locate = [&](const KeyRange& r, int64_t key0, int b) {
    const int64_t count = std::min(kKeyChunk, r.key_end - key0);
    locate_keys(call, r.table, r.kv_head, key0, count, keys[b], values[b]);
    return count;
  };
  const int64_t first = locate(range, key_begin, 0);
  if (rolling) {  // less what the item before asked for
    const int64_t asked = std::min(state.next_asked, first);
    const int64_t burst = (widened ? first : std::min(first, kAheadKeys)) - asked;
    prefetch_rows(keys[0] + asked, values[0] + asked, burst, d);
  } else {
    prefetch_rows(keys[0], values[0], first, d);
  }
  state.ahead.count = 0;
  state.next_asked = 0;
  for (int64_t key0 = key_begin, c = 0; key0 < key_end; key0 += kKeyChunk, c ^= 1) {
    const int64_t in_chunk = std::min(kKeyChunk, key_end - key0);
    const bool more = key0 + kKeyChunk < key_end;
    if (rolling) {
      state.ahead.set(keys[c], values[c], 0, in_chunk, d);
      state.ahead.lead = widened ? in_chunk : kAheadKeys;
      if (more) {
        const int64_t next = locate(range, key0 + kKeyChunk, c ^ 1);
        state.ahead.set(keys[c ^ 1], values[c ^ 1], in_chunk, next, d);
      } else if (following != nullptr) {
        // The following item's first keys, asked for while this last chunk computes: as many
        // as its first burst would ask where this chunk has keys enough to ask them from.
        const int64_t next = locate(*following, following->key_begin, c ^ 1);
        state.ahead.set(keys[c ^ 1], values[c ^ 1], in_chunk, next, d);
        if (widened) {
          state.next_asked = std::min(in_chunk, next);
        } else {
          state.next_asked = in_chunk >= kAheadKeys ? std::min(kAheadKeys, next) : 0;
        }
      }
    } else if (more) {
      prefetch_rows(keys[c ^ 1], values[c ^ 1], locate(range, key0 + kKeyChunk, c ^ 1), d);
    }
    for (int64_t t = 0; t < kKeyChunk; ++t) {
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (state.bf16_scores) {
          state.keys_bf16[t] = t < in_chunk ? keys[c][t] : state.q_bf16.data() + state.rows * d;
        }
      }
      if (t >= in_chunk) {
        state.keys[t] = state.values[t] = state.zeros;
        continue;
      }
      if (!state.bf16_scores) state.keys[t] = as_float(keys[c][t], state.keys_f + t * d, d);
      state.values[t] = as_float(values[c][t], state.values_f + t * d, d);
    }
    state.score_chunk(in_chunk);
    state.softmax_chunk(key0, in_chunk, key0 + kKeyChunk > first_hidden, key0 == key_begin);
    state.accumulate_values(in_chunk);
  }
}

// ---- A decode's item in fp32 or bf16: one query token (a decode, or a prompt tile's last
// token alone), its query heads of one KV head as rows, every key up to its own.
//
// The general path above stages every chunk of 64 keys (pointers written to three arrays,
// masks, a softmax per chunk, a rescale of the sums), which at a decode's few rows costs more
// than reading the key: on a 2-core Zen 4 ~30 ns a key and KV head on one thread, where one
// core's share of the memory stream is ~38 ns. Here a decode goes in three tight passes: every
// key's scores (each K row read once for all rows, a vector of keys reduced together), one
// softmax over the whole context (exp over whole vectors of keys), then P V (each V row read
// once). The rows are read in place through the block table, kAheadKeys keys ahead of use; the
// first V rows are asked for while the last keys score, and the thread's next item's first K
// rows while the last V rows accumulate. Zen 4, 30 layers' attention over 64 decodes of 200
// keys: 1.59x faster with one layer's cache (39 MB) read 30 times, level from memory (~22 GB/s
// of K/V either way); a whole decode step (the stack split by sequences, one thread's
// attention beside the other's linears) 1.025-1.07x faster, 64 x 200 keys 115.6 -> 111.1 ms.
// bf16 rows (half the bytes, so less bound by the stream) gained more: 30 layers of 64
// decodes of 250 keys 1.44-1.49x faster on one thread, their scores the same bits, P V's sums
// within bf16's rounding of the general path's (one softmax instead of one a chunk).

// Walks one KV head's rows of a sequence, key by key, through its block table: no division a
// key.
template <typename T = float>
struct RowCursor {
  const T* cache;
  const int32_t* table;
  int64_t block_size, row_stride, head_offset;
  int64_t block = 0, in_block = 0;

  const T* row() const {
    return cache + (table[block] * block_size + in_block) * row_stride + head_offset;
  }
  void advance() {
    if (++in_block == block_size) {
      in_block = 0;
      ++block;
    }
  }
};

// Where a decode may take the fast path: rows of whole vectors, few enough query heads a KV
// head and vectors a row for the query rows and P V's sums to stay in registers; fp32 rows,
// or bf16 rows where the CPU has AVX512-BF16 and head_dim is whole steps of 32 (their scores
// come from decode_scores_bf16).
constexpr int kDecodeMaxVecs = 8;
template <typename T>
bool fast_decode(const AttentionItem& item, const AttentionCall<T>& call) {
  const bool rows_fit = std::is_same_v<T, float> || bf16_dot_rows<T>(call.d);
  return rows_fit && item.kind == ItemKind::kWhole && item.token_end - item.token_begin == 1 &&
         call.d % Vec::size() == 0 && call.heads_per_kv <= kOutRows &&
         call.d <= kDecodeMaxVecs * Vec::size();
}

// Vec::size() values of a K or V row as fp32 (bf16 is fp32's upper half: exact).
inline Vec load_row(const float* row) { return Vec::loadu(row); }
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kBf16Decodes = true;  // bf16 decodes may take the fast path (fast_decode)
inline Vec load_row(const at::BFloat16* row) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
#else
constexpr bool kBf16Decodes = false;  // no bf16 dot products in this build
#endif

// The K rows of a decode's scores, key by key, each asked for kAheadKeys keys before it is
// read; in the last keys, pass three's first V rows instead. Past the last key, `zeros`.
template <typename T>
struct ScoredKeys {
  RowCursor<T> keys, ahead_keys, ahead_values;
  int64_t num_keys, bytes, asked_values = 0;
  const T* zeros;

  ScoredKeys(RowCursor<T> k, RowCursor<T> v, int64_t n, int64_t d, const T* zero_row)
      : keys(k), ahead_keys(k), ahead_values(v), num_keys(n), bytes(d * sizeof(T)),
        zeros(zero_row) {
    for (int64_t t = 0; t < kAheadKeys && t < num_keys; ++t) ahead_keys.advance();
  }

  // Key t's row (t counts up from 0, one call a key).
  const T* next(int64_t t) {
    if (t + kAheadKeys < num_keys) {
      ask_lines(ahead_keys.row(), bytes);
      ahead_keys.advance();
    } else if (asked_values < std::min<int64_t>(kAheadKeys, num_keys) && t < num_keys) {
      ask_lines(ahead_values.row(), bytes);
      ahead_values.advance();
      ++asked_values;
    }
    if (t >= num_keys) return zeros;
    const T* row = keys.row();
    keys.advance();
    return row;
  }
};

// scores[r][t] = q[r] . K[t] for the item's keys (R rows, DV vectors of head_dim).
template <int R, int DV>
void decode_scores(const float* q, ScoredKeys<float> keys, float* scores, int64_t stride) {
  constexpr int64_t d = DV * Vec::size();
  Vec qv[R][DV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < DV; ++v) qv[r][v] = Vec::loadu(q + r * d + v * Vec::size());
  }
  Vec sums[R][Vec::size()];
  for (int64_t t0 = 0; t0 < keys.num_keys; t0 += Vec::size()) {
    for (int64_t j = 0; j < Vec::size(); ++j) {
      const float* row = keys.next(t0 + j);
      Vec k[DV];
      for (int v = 0; v < DV; ++v) k[v] = Vec::loadu(row + v * Vec::size());
      for (int r = 0; r < R; ++r) {
        Vec acc = qv[r][0] * k[0];
        for (int v = 1; v < DV; ++v) acc = at::vec::fmadd(qv[r][v], k[v], acc);
        sums[r][j] = acc;
      }
    }
    for (int r = 0; r < R; ++r) sum_each(sums[r]).store(scores + r * stride + t0);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// decode_scores for bf16 rows (S steps of 32 values of head_dim): each key's score as
// score_keys_bf16 computes it on the general path (q unscaled in bf16, two exact products a
// lane and step into fp32 sums in head_dim's order, the lanes summed, then the scale): the
// general path's scores, bit for bit.
template <int R, int S>
__attribute__((target("avx512bf16"))) void decode_scores_bf16(const at::BFloat16* q, float scale,
                                                              ScoredKeys<at::BFloat16> keys,
                                                              float* scores, int64_t stride) {
  constexpr int64_t step = 2 * Vec::size();
  __m512bh qv[R][S];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < S; ++i) qv[r][i] = (__m512bh)_mm512_loadu_si512(q + (r * S + i) * step);
  }
  Vec sums[R][Vec::size()];
  for (int64_t t0 = 0; t0 < keys.num_keys; t0 += Vec::size()) {
    for (int64_t j = 0; j < Vec::size(); ++j) {
      const at::BFloat16* row = keys.next(t0 + j);
      __m512bh k[S];
      for (int i = 0; i < S; ++i) k[i] = (__m512bh)_mm512_loadu_si512(row + i * step);
      for (int r = 0; r < R; ++r) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < S; ++i) acc = _mm512_dpbf16_ps(acc, qv[r][i], k[i]);
        sums[r][j] = Vec(acc);
      }
    }
    for (int r = 0; r < R; ++r) (sum_each(sums[r]) * Vec(scale)).store(scores + r * stride + t0);
  }
}
#endif

// acc[r] = sum over keys t of weights[r][t] * V[t] for R rows, head_dim in passes of out_vecs
// vectors; the first pass asks for the V rows ahead, then for the first `next_count` rows of
// `next_keys` (the following item's K rows) past its end.
template <int R, typename T>
void decode_values(const float* weights, int64_t stride, RowCursor<T> values,
                   RowCursor<T> next_keys, int64_t next_count, int64_t num_keys, int64_t d,
                   float* acc) {
  constexpr int J = out_vecs(R);
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  RowCursor<T> ahead = values;
  for (int64_t t = 0; t < kAheadKeys && t < num_keys; ++t) ahead.advance();
  for (int64_t j0 = 0; j0 < d; j0 += J * Vec::size()) {
    with_count<J>(std::min<int64_t>(J, (d - j0) / Vec::size()), [&](auto count) {
      constexpr int DV = decltype(count)::value;
      Vec a[R][DV];
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < DV; ++v) a[r][v] = Vec(0.f);
      }
      RowCursor<T> rows = values;
      int64_t asked_next = 0;
      for (int64_t t = 0; t < num_keys; ++t) {
        if (j0 == 0) {
          if (t + kAheadKeys < num_keys) {
            ask_lines(ahead.row(), bytes);
            ahead.advance();
          } else if (asked_next < next_count) {
            ask_lines(next_keys.row(), bytes);
            next_keys.advance();
            ++asked_next;
          }
        }
        const T* row = rows.row() + j0;
        rows.advance();
        Vec v[DV];
        for (int i = 0; i < DV; ++i) v[i] = load_row(row + i * Vec::size());
        for (int r = 0; r < R; ++r) {
          const Vec w(weights[r * stride + t]);
          for (int i = 0; i < DV; ++i) a[r][i] = at::vec::fmadd(w, v[i], a[r][i]);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int v = 0; v < DV; ++v) a[r][v].store(acc + r * d + j0 + v * Vec::size());
      }
    });
  }
}

// Softmax over a row's `num_keys` scores in place (the lanes past them, up to whole vectors,
// are -inf first); 1 / the weights' sum.
inline float softmax_row(float* s, int64_t num_keys) {
  const int64_t padded = (num_keys + Vec::size() - 1) / Vec::size() * Vec::size();
  std::fill(s + num_keys, s + padded, kNegInf);
  Vec maxima(kNegInf);
  for (int64_t t = 0; t < padded; t += Vec::size()) {
    maxima = at::vec::maximum(maxima, Vec::loadu(s + t));
  }
  const Vec shift(at::vec::vec_reduce_all<float>(
      [](Vec a, Vec b) { return at::vec::maximum(a, b); }, maxima));
  Vec sums(0.f);
  for (int64_t t = 0; t < padded; t += Vec::size()) {
    const Vec p = (Vec::loadu(s + t) - shift).exp();
    p.store(s + t);
    sums = sums + p;
  }
  return 1.f / at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, sums);
}

// The decode items this thread has sent down the fast path (attend_decode): what the tests
// read to know that a shape took it, with one thread so that every item runs on theirs.
thread_local int64_t fast_decode_items = 0;

// A decode item (fast_decode) into its output rows; `following`: the thread's next item.
// fp32 rows are scored against the scaled query in fp32; bf16 rows by decode_scores_bf16.
template <typename T>
void attend_decode(const AttentionItem& item, const AttentionItem* following,
                   const AttentionCall<T>& call, AttentionState& state) {
  const int64_t d = call.d, rows = call.heads_per_kv, num_keys = item.key_end;
  const int64_t stride = (num_keys + Vec::size() - 1) / Vec::size() * Vec::size();
  state.decode_buffer.resize(rows * d + rows * stride + rows * d + d);
  float* q = state.decode_buffer.data();
  float* scores = q + rows * d;
  float* acc = scores + rows * stride;
  float* zeros = acc + rows * d;
  std::fill(zeros, zeros + d, 0.f);
  const T* query = call.query + (call.starts[item.seq] + item.token_begin) * call.q_token_stride;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = query + (item.kv_head * rows + r) * call.q_head_stride;
      for (int64_t i = 0; i < d; ++i) q[r * d + i] = src[i] * call.scale;
    }
  } else {  // the query rows as they are, then a row of zeros (keys past the last)
    state.q_bf16.assign((rows + 1) * d, at::BFloat16(0.f));
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = query + (item.kv_head * rows + r) * call.q_head_stride;
      std::copy(src, src + d, state.q_bf16.data() + r * d);
    }
  }
  const int64_t row_stride = call.kv_heads * d;
  const auto cursor = [&](const T* cache, int64_t seq, int64_t kv_head) {
    return RowCursor<T>{cache, call.table(seq), call.block_size, row_stride, kv_head * d};
  };
  const RowCursor<T> keys = cursor(call.k_cache, item.seq, item.kv_head);
  const RowCursor<T> values = cursor(call.v_cache, item.seq, item.kv_head);
  // The first K rows, less those the item before asked for.
  RowCursor<T> first = keys;
  for (int64_t t = 0; t < std::min(kAheadKeys, num_keys); ++t, first.advance()) {
    if (t >= state.next_asked) ask_lines(first.row(), d * sizeof(T));
  }
  with_count<kOutRows>(rows, [&](auto count) {
    constexpr int R = decltype(count)::value;
    if constexpr (std::is_same_v<T, float>) {
      const ScoredKeys<float> scored(keys, values, num_keys, d, zeros);
      with_count<kDecodeMaxVecs>(d / Vec::size(), [&](auto vecs) {
        decode_scores<R, decltype(vecs)::value>(q, scored, scores, stride);
      });
    } else {
#if defined(CPU_CAPABILITY_AVX512)
      const at::BFloat16* q_rows = state.q_bf16.data();
      const ScoredKeys<at::BFloat16> scored(keys, values, num_keys, d, q_rows + rows * d);
      with_count<kDecodeMaxVecs / 2>(d / (2 * Vec::size()), [&](auto steps) {
        decode_scores_bf16<R, decltype(steps)::value>(q_rows, call.scale, scored, scores, stride);
      });
#endif
    }
  });
  float inverse_sums[kOutRows];
  for (int64_t r = 0; r < rows; ++r) inverse_sums[r] = softmax_row(scores + r * stride, num_keys);
  // A following decode's first K rows go out during the last V rows (its start then skips
  // them); another kind of item asks for its own first rows, K and V, at once.
  RowCursor<T> next{};
  int64_t next_count = 0;
  if (following != nullptr && fast_decode(*following, call)) {
    next = cursor(call.k_cache, following->seq, following->kv_head);
    next_count = std::min(kAheadKeys, following->key_end);
  }
  with_count<kOutRows>(rows, [&](auto count) {
    decode_values<decltype(count)::value, T>(scores, stride, values, next, next_count, num_keys,
                                             d, acc);
  });
  // (asked during this decode's last kAheadKeys keys, so no more than it has)
  state.next_asked = std::min(next_count, num_keys);
  T* out = call.out + call.out_offset(item.seq, item.token_begin, item.kv_head * rows);
  for (int64_t r = 0; r < rows; ++r) {
    scale_in_place(acc + r * d, inverse_sums[r], d);
    store_from_float(acc + r * d, out + r * d, d);
  }
}

// A shared item's keys sit in the same slots for every member: any member's table reads them.
template <typename T>
KeyRange key_range(const AttentionItem& item, const AttentionCall<T>& call) {
  return {call.table(row_source(item, call, 0).seq), item.kv_head, item.key_begin, item.key_end};
}

// `following`: the item the thread takes next, or null.
template <typename T>
void attend_item(const AttentionItem& item, const AttentionItem* following,
                 const AttentionCall<T>& call, AttentionState& state) {
  if constexpr (std::is_same_v<T, float> || (kBf16Decodes && std::is_same_v<T, at::BFloat16>)) {
    if (fast_decode(item, call)) {
      ++fast_decode_items;
      return attend_decode(item, following, call, state);
    }
  }
  const int64_t d = call.d;
  const int64_t rows = item_tokens(item, *call.groups) * call.heads_per_kv;
  state.reset(rows, d);
  state.choose_scores<T>(call.scale);
  for (int64_t r = 0; r < state.row_pad; ++r) {
    // Padding rows see what the last row sees: their lanes stay finite, never written out.
    const RowSource row = row_source(item, call, std::min(r, rows - 1));
    const int64_t position = call.first_position(row.seq) + row.token;
    state.last_key[r] = static_cast<float>(std::min(position, item.key_end - 1));
    if (r >= rows) continue;
    const T* src = call.query + (call.starts[row.seq] + row.token) * call.q_token_stride +
                   row.head * call.q_head_stride;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (state.bf16_scores) {
        std::copy(src, src + d, state.q_bf16.data() + r * d);
        continue;
      }
    }
    state.set_query_row(r, as_float(src, state.q_row, d), call.scale);
  }
  const KeyRange next = following == nullptr ? KeyRange{} : key_range(*following, call);
  attend_keys(call, key_range(item, call), following == nullptr ? nullptr : &next, state);

  for (int64_t r = 0; r < rows; ++r) {
    const RowSource row = row_source(item, call, r);
    float* acc = state.acc + r * d;
    if (item.kind == ItemKind::kWhole) {
      scale_in_place(acc, 1.f / state.row_sum[r], d);
      store_from_float(acc, call.out + call.out_offset(row.seq, row.token, row.head), d);
      continue;
    }
    const CascadeGroup& g = (*call.groups)[item.group];
    const int64_t member = item.kind == ItemKind::kShared ? r / call.heads_per_kv : item.member;
    float* partial = call.partial(g, member, row.head, item.part);
    std::copy(acc, acc + d, partial);
    partial[d] = state.row_max[r];
    partial[d + 1] = state.row_sum[r];
  }
}

// Each cascaded decode's output: its parts' partial results rescaled to a common max.
template <typename T>
void merge_partials(const AttentionCall<T>& call) {
  const int64_t d = call.d;
  std::vector<float> acc(d);
  for (const CascadeGroup& g : *call.groups) {
    for (int64_t m = 0; m < static_cast<int64_t>(g.seqs.size()); ++m) {
      for (int64_t h = 0; h < call.q_heads; ++h) {
        float max = kNegInf;
        for (int64_t p = 0; p <= g.parts; ++p) max = std::max(max, call.partial(g, m, h, p)[d]);
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p <= g.parts; ++p) {
          const float* partial = call.partial(g, m, h, p);
          const float factor = std::exp(partial[d] - max);
          sum += factor * partial[d + 1];
          axpy(factor, partial, acc.data(), d);
        }
        scale_in_place(acc.data(), 1.f / sum, d);
        store_from_float(acc.data(), call.out + call.out_offset(g.seqs[m], 0, h), d);
      }
    }
  }
}

// Groups of decodes that share at least kMinSharedKeys leading keys, with enough rows
// between them for the transposed tiles. Decodes are grouped by their first block, and a
// group shares the blocks all its members' tables agree on.
template <typename T>
std::vector<CascadeGroup> find_cascades(const AttentionCall<T>& shape, int64_t num_seqs,
                                        int64_t workers) {
  std::vector<std::pair<int32_t, int64_t>> decodes;  // (first block, sequence)
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (shape.q_len(s) == 1 && shape.lens[s] > kMinSharedKeys) {
      decodes.emplace_back(shape.table(s)[0], s);
    }
  }
  std::sort(decodes.begin(), decodes.end());
  std::vector<CascadeGroup> groups;
  int64_t num_slots = 0;
  const int64_t min_members = (kTransposeRows + shape.heads_per_kv - 1) / shape.heads_per_kv;
  for (size_t begin = 0, end = 0; begin < decodes.size(); begin = end) {
    while (end < decodes.size() && decodes[end].first == decodes[begin].first) ++end;
    if (static_cast<int64_t>(end - begin) < std::max<int64_t>(2, min_members)) continue;
    CascadeGroup g;
    int64_t min_len = std::numeric_limits<int64_t>::max();
    for (size_t i = begin; i < end; ++i) {
      g.seqs.push_back(decodes[i].second);
      min_len = std::min<int64_t>(min_len, shape.lens[decodes[i].second]);
    }
    // Blocks that hold any of the smallest context's keys; the decode's own key never shared.
    const int64_t blocks = (min_len - 1 + shape.block_size - 1) / shape.block_size;
    int64_t common = blocks;
    const int32_t* first = shape.table(g.seqs[0]);
    for (int64_t s : g.seqs) {
      const int32_t* table = shape.table(s);
      common = std::mismatch(first, first + common, table).first - first;
    }
    g.shared_keys = std::min(common * shape.block_size, min_len - 1);
    if (g.shared_keys < kMinSharedKeys) continue;
    // Enough shared items for two per thread, none shorter than kSharedPartKeys.
    const int64_t wanted = (2 * workers + shape.kv_heads - 1) / shape.kv_heads;
    g.parts = std::clamp<int64_t>(g.shared_keys / kSharedPartKeys, 1, wanted);
    g.first_slot = num_slots;
    num_slots += static_cast<int64_t>(g.seqs.size()) * shape.q_heads * (g.parts + 1);
    groups.push_back(std::move(g));
  }
  return groups;
}

// The call's items, in runs of one per KV head (KV head innermost): a run shares its rows'
// tokens and its keys.
template <typename T>
std::vector<AttentionItem> attention_items(const AttentionCall<T>& call, int64_t num_seqs) {
  const int64_t tile_tokens =
      std::max(kTileTokens, (kTileRows + call.heads_per_kv - 1) / call.heads_per_kv);
  std::vector<bool> cascaded(num_seqs, false);
  std::vector<AttentionItem> items;
  const auto& groups = *call.groups;
  for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
    const CascadeGroup& g = groups[gi];
    for (int64_t p = 0; p < g.parts; ++p) {
      // Parts split the shared keys in whole chunks.
      const int64_t chunks = (g.shared_keys + kKeyChunk - 1) / kKeyChunk;
      const int64_t begin = std::min(g.shared_keys, chunks * p / g.parts * kKeyChunk);
      const int64_t end = std::min(g.shared_keys, chunks * (p + 1) / g.parts * kKeyChunk);
      for (int64_t h = 0; h < call.kv_heads; ++h) {
        items.push_back({ItemKind::kShared, g.seqs[0], h, 0, 1, begin, end, gi, -1, p});
      }
    }
    for (int64_t m = 0; m < static_cast<int64_t>(g.seqs.size()); ++m) {
      const int64_t s = g.seqs[m];
      cascaded[s] = true;
      for (int64_t h = 0; h < call.kv_heads; ++h) {
        items.push_back({ItemKind::kOwn, s, h, 0, 1, g.shared_keys, call.lens[s], gi, m, g.parts});
      }
    }
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (cascaded[s]) continue;
    const int64_t q_len = call.q_len(s), first_position = call.first_position(s);
    for (int64_t begin = 0; begin < q_len; begin += tile_tokens) {
      const int64_t end = std::min(q_len, begin + tile_tokens);
      for (int64_t h = 0; h < call.kv_heads; ++h) {
        items.push_back({ItemKind::kWhole, s, h, begin, end, 0, first_position + end});
      }
    }
  }
  return items;
}

template <typename T>
void paged_attention_impl(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t q_heads = query.size(1), kv_heads = k_cache.size(2);
  AttentionCall<T> call{
      query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
      query.stride(0), query.stride(1), k_cache.size(1), kv_heads, q_heads,
      q_heads / kv_heads, query.size(2),
      seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
      block_tables.data_ptr<int32_t>(), block_tables.stride(0),
      static_cast<float>(scale), out.data_ptr<T>(), nullptr, nullptr};
  const int64_t workers = pool_threads();
  const std::vector<CascadeGroup> groups = find_cascades(call, num_seqs, workers);
  // The slot past the last group's last: where a member after its last would start.
  const int64_t num_slots =
      groups.empty() ? 0 : groups.back().slot(groups.back().seqs.size(), 0, q_heads, 0);
  std::vector<float> partials(num_slots * (call.d + 2));
  call.partials = partials.data();
  call.groups = &groups;

  const std::vector<AttentionItem> items = attention_items(call, num_seqs);
  // Items come in runs of one per KV head (the same rows and keys). With runs enough to keep
  // every thread busy, a run goes to one thread: the KV heads' slices of a token's K/V row
  // share cache lines, which one core then fetches once. On a 2-core Xeon, 64 decodes of 200
  // keys (3 KV heads) went 1.12x faster than with the heads dealt out one at a time.
  const int64_t run =
      static_cast<int64_t>(items.size()) >= 4 * workers * kv_heads ? kv_heads : 1;
  const int64_t runs = static_cast<int64_t>(items.size()) / run;
  // K/V rows asked for ahead where the call reads enough of them to be bound by the stream.
  int64_t kv_bytes = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) kv_bytes += call.lens[seq];
  kv_bytes *= 2 * kv_heads * call.d * static_cast<int64_t>(sizeof(T));
  call.stream_ahead = kv_bytes >= kStreamAheadBytes;
  // Longest first: the last runs handed out are the short ones, so threads finish together.
  std::vector<int64_t> costs(runs);
  for (int64_t r = 0; r < runs; ++r) {
    const AttentionItem& item = items[r * run];
    costs[r] = item_tokens(item, groups) * (item.key_end - item.key_begin);
  }
  std::vector<int64_t> order(runs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return costs[a] > costs[b];
  });
  std::vector<AttentionState> scratch(workers);
  parallel_items(order, [&](int64_t index, int64_t following, int64_t worker) {
    const int64_t end = (index + 1) * run;
    for (int64_t i = index * run; i < end; ++i) {
      const int64_t after = i + 1 < end ? i + 1 : following < 0 ? -1 : following * run;
      attend_item<T>(items[i], after < 0 ? nullptr : &items[after], call,
                     scratch[worker % workers]);
    }
  });
  merge_partials(call);
}

void check_rows_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3, name, " must be [tokens, heads, head_dim]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": each token's heads must be contiguous (the token stride may be anything)");
}

at::Tensor paged_attention(
    const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale) {
  check_rows_contiguous(query, "query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "block_tables rows, seq_lens and query_start_loc must be contiguous");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "paged_attention", [&] {
    paged_attention_impl<scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                   query_start_loc, scale);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// K/V store: token t's K and V rows go to cache slot slot_mapping[t] (negative: skipped).

void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_rows_contiguous(key, "key");
  check_rows_contiguous(value, "value");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == v_cache.scalar_type(),
              "K/V and caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t num_tokens = key.size(0);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache");
  }
  auto* k_src = static_cast<const char*>(key.data_ptr());
  auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(k_dst + slots[t] * row_bytes, k_src + t * k_stride, row_bytes);
      std::memcpy(v_dst + slots[t] * row_bytes, v_src + t * v_stride, row_bytes);
    }
  });
}

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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(),
                                  "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(gate_up, out); });
  return out;
}

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

// ---------------------------------------------------------------------------------------------
// A Llama-family decoder stack on one rank with packed weights: LlamaModel.forward's
// ops (rolling_batch/models/llama.py) in the same order on the same tensors, called from here
// instead of from Python. Between a layer's ~10 ops Python spent 1.5 ms a step with warm
// caches but 4.5 ms in a real step, where the weight stream evicts the interpreter's working
// set every layer: 18% of a batch-1 decode step on a 2-core Xeon, 12% at batch 32.

// A linear in oneDNN's blocked layout, as rolling_batch/layers/cpu_matmul.py's PackedWeight
// calls it (the same op, so the same bits).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x.contiguous(), packed,
                                 bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 std::string("none"), c10::List<std::optional<c10::Scalar>>(),
                                 std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

struct DecoderLayer {
  at::Tensor input_norm, qkv, o, post_norm, gate_up, down;  // norms' weights; linears packed
  std::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
};

// A step split by sequences (DecoderStack::sequence_parts): how much more than an even share of
// its cost one thread's run may take, and the fewest decodes a run may have.
constexpr double kSplitSlack = 1.15;
constexpr int64_t kSplitMinRows = 12;

class DecoderStack {
 public:
  // `panels`: the linears are in packed_linear's panels (gate and up in pack_gated_weight's;
  // fp32, or bf16 with AVX512-BF16), else in oneDNN's layout.
  DecoderStack(int64_t num_q, int64_t num_kv, int64_t head_dim, int64_t hidden,
               int64_t intermediate, double eps, double scale, at::Tensor final_norm, bool panels)
      : num_q_(num_q), num_kv_(num_kv), head_dim_(head_dim), hidden_(hidden),
        intermediate_(intermediate), eps_(eps), scale_(scale), final_norm_(std::move(final_norm)),
        panels_(panels) {
    // A query row's linears, in keys of attention: their flops against the K/V bytes a key
    // reads in a layer, at ~8 flops a byte (a core's multiply-adds against its share of the
    // memory stream). SmolLM2-135M: 576 keys.
    const double weights = hidden * (num_q + 2 * num_kv) * head_dim +
                           num_q * head_dim * hidden + 3.0 * hidden * intermediate;
    row_keys_ = 2 * weights / (8.0 * 2 * num_kv * head_dim * final_norm_.element_size());
  }

  void add_layer(at::Tensor input_norm, at::Tensor qkv, std::optional<at::Tensor> qkv_bias,
                 at::Tensor o, std::optional<at::Tensor> o_bias, at::Tensor post_norm,
                 at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias, at::Tensor down,
                 std::optional<at::Tensor> down_bias) {
    layers_.push_back({std::move(input_norm), std::move(qkv), std::move(o), std::move(post_norm),
                       std::move(gate_up), std::move(down), std::move(qkv_bias),
                       std::move(o_bias), std::move(gate_up_bias), std::move(down_bias)});
  }

  // The final norm's output for the embedded tokens `embedded` [T, hidden]; each layer's new
  // K/V go to its caches at `slot_mapping`, then attention reads them (see paged_attention).
  // `output_rows` (int64): only those tokens' outputs, in that order. Every layer still stores
  // every token's K/V, but the last layer's O projection, MLP and the final norm run for these
  // rows alone: a prompt chunk reads only its last token's output, so a prefill step skips
  // most of 1/num_layers of its arithmetic.
  at::Tensor forward(const at::Tensor& embedded, const at::Tensor& positions,
                     const at::Tensor& cos, const at::Tensor& sin_signed,
                     const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc,
                     const std::optional<at::Tensor>& output_rows) const {
    TORCH_CHECK(!layers_.empty(), "a decoder stack needs its layers");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache a layer");
    const std::vector<int64_t> bounds = sequence_parts(seq_lens, query_start_loc, output_rows);
    const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
    if (parts < 2) {
      return forward_rows(embedded, positions, cos, sin_signed, k_caches, v_caches, slot_mapping,
                          block_tables, seq_lens, query_start_loc, output_rows);
    }
    const int32_t* starts = query_start_loc.data_ptr<int32_t>();
    std::vector<at::Tensor> outputs(parts);
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) {
        const int64_t s0 = bounds[part], s1 = bounds[part + 1];
        const int64_t t0 = starts[s0], t1 = starts[s1];
        outputs[part] = forward_rows(
            embedded.narrow(0, t0, t1 - t0), positions.narrow(0, t0, t1 - t0), cos, sin_signed,
            k_caches, v_caches, slot_mapping.narrow(0, t0, t1 - t0),
            block_tables.narrow(0, s0, s1 - s0), seq_lens.narrow(0, s0, s1 - s0),
            query_start_loc.narrow(0, s0, s1 - s0 + 1) - static_cast<int32_t>(t0), std::nullopt);
      }
    });
    return at::cat(outputs);
  }

  // The LM head that greedy decodes read (GreedyHead in rolling_batch/layers/greedy_head.py):
  // `approx` its weight's bf16 panels (pack_linear_weight of the bf16 copy), `weight` [vocab,
  // in] fp32 and `norms` each row's L2 norm rounded up, as greedy_head_pick takes them.
  void set_greedy_head(at::Tensor approx, at::Tensor weight, at::Tensor norms) {
    TORCH_CHECK(bf16_dots(), "a greedy head needs AVX512-BF16 (bf16_panels() is false here)");
    TORCH_CHECK(approx.scalar_type() == at::kBFloat16 && approx.dim() == 3 &&
                    approx.size(1) == hidden_ && approx.size(2) == kPanel &&
                    approx.is_contiguous(),
                "approx must be the LM head's bf16 panels");
    TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden_ &&
                    approx.size(0) == (weight.size(0) + kPanel - 1) / kPanel,
                "weight must be the LM head's [vocab, hidden]");
    head_ = GreedyHeadWeights{std::move(approx), std::move(weight), std::move(norms)};
  }

  // forward()'s final norm outputs (every token a decode or prompt chunk's) and each row's
  // greedy token, as greedy_head_pick gives it from packed_linear's bf16 approximations (-1:
  // the row's fp32 logits decide). Where the step splits, each thread goes on from its run to
  // the head's work on the rows it ran and then takes what is left of the other run's, so the
  // thread that finishes first works instead of waiting (the runs end 2-3 ms apart on
  // average, at random).
  std::tuple<at::Tensor, at::Tensor> forward_greedy(
      const at::Tensor& embedded, const at::Tensor& positions, const at::Tensor& cos,
      const at::Tensor& sin_signed, const std::vector<at::Tensor>& k_caches,
      const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
      const at::Tensor& block_tables, const at::Tensor& seq_lens,
      const at::Tensor& query_start_loc) const {
    TORCH_CHECK(head_.has_value(), "forward_greedy needs set_greedy_head first");
    const std::vector<int64_t> bounds = sequence_parts(seq_lens, query_start_loc, std::nullopt);
    const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
    if (parts < 2) {
      const at::Tensor hidden =
          forward_rows(embedded, positions, cos, sin_signed, k_caches, v_caches, slot_mapping,
                       block_tables, seq_lens, query_start_loc, std::nullopt);
      const at::Tensor approx =
          packed_linear(hidden.to(at::kBFloat16), head_->approx, vocab(), std::nullopt);
      return {hidden, greedy_head_pick(hidden, approx, head_->weight, head_->norms)};
    }
    const int32_t* starts = query_start_loc.data_ptr<int32_t>();
    std::vector<HeadRun> runs(parts);
    std::atomic<bool> failed{false};
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) {
        HeadRun& run = runs[part];
        const int64_t s0 = bounds[part], s1 = bounds[part + 1];
        const int64_t t0 = starts[s0], t1 = starts[s1];
        try {
          run.hidden = forward_rows(
              embedded.narrow(0, t0, t1 - t0), positions.narrow(0, t0, t1 - t0), cos,
              sin_signed, k_caches, v_caches, slot_mapping.narrow(0, t0, t1 - t0),
              block_tables.narrow(0, s0, s1 - s0), seq_lens.narrow(0, s0, s1 - s0),
              query_start_loc.narrow(0, s0, s1 - s0 + 1) - static_cast<int32_t>(t0),
              std::nullopt);
          run.x = run.hidden.to(at::kBFloat16);
          run.approx = at::empty({t1 - t0, vocab()}, run.x.options());
        } catch (...) {
          failed.store(true, std::memory_order_release);
          throw;
        }
        run.ready.store(true, std::memory_order_release);
      }
      head_units(runs, begin, failed);
    });
    std::vector<at::Tensor> hidden(parts), tokens(parts);
    for (int64_t part = 0; part < parts; ++part) {
      hidden[part] = runs[part].hidden;
      tokens[part] =
          greedy_head_pick(runs[part].hidden, runs[part].approx, head_->weight, head_->norms);
    }
    return {at::cat(hidden), at::cat(tokens)};
  }

  // Where a step's sequences split into runs, one a thread, each run then going through every
  // layer on its thread alone: [0, cut, ..., num_seqs], or empty where the step stays whole
  // (every op then shared by the threads). Split, the threads never wait for each other
  // between ops (about 270 times a decode step), at the price of each streaming every weight
  // itself. Alternating in one process on a 2-core Zen 4 (SmolLM2-135M, fp32): decodes of 32
  // at 100 keys 1.05-1.07x faster split, of 64 at 200 keys 1.02-1.09x, 24 at 150 1.03x; 16 at
  // 100 0.95x and 4 at 100 0.78x (bound by the weight stream, which a split doubles); prompt
  // steps of 1,024-2,048 tokens level. Served, a thread's run is fixed where a whole op's work
  // units go to whichever thread is free, and a burst's prompt steps share the cores with the
  // web workers taking its requests in: the mixed burst's TTFT p50 was 0.26-0.51 s higher
  // split in three rounds of three, and still 7.55 s in one of three with prompt steps of over
  // 512 rows whole (4.72-5.32 whole). So only a step of decodes (a query row a sequence)
  // splits. Runs are cut where the cost (a query row's linears plus the keys it reads) comes
  // nearest an even share; a step splits only where no run gets more than kSplitSlack times
  // its share and every run has kSplitMinRows decodes.
  std::vector<int64_t> sequence_parts(const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                      const std::optional<at::Tensor>& output_rows) const {
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                    seq_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                    query_start_loc.numel() == seq_lens.numel() + 1,
                "seq_lens and query_start_loc (one longer) must be contiguous int32");
    const int64_t threads = pool_threads();
    const int64_t num_seqs = seq_lens.size(0);
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int32_t* starts = query_start_loc.data_ptr<int32_t>();
    if (!split_sequences_ || threads < 2 || num_seqs < threads) return {};
    if (starts[num_seqs] != num_seqs || num_seqs < threads * kSplitMinRows) return {};
    // Decodes read every row unless one asks for no logits: such a rare step stays whole.
    if (output_rows.has_value()) return {};
    std::vector<double> cost(num_seqs + 1, 0.0);  // of the sequences before each
    for (int64_t s = 0; s < num_seqs; ++s) cost[s + 1] = cost[s] + row_keys_ + lens[s];
    const double share = cost[num_seqs] / threads;
    std::vector<int64_t> bounds{0};
    for (int64_t part = 1; part <= threads; ++part) {
      const int64_t last = bounds.back();
      int64_t cut = num_seqs;
      if (part < threads) {
        cut = last + 1;
        while (cut < num_seqs && cost[cut] < share * part) ++cut;
        if (cut > last + 1 && share * part - cost[cut - 1] < cost[cut] - share * part) --cut;
      }
      const bool fits = cut > last && cut <= num_seqs - (threads - part);  // a run each left
      if (!fits || cost[cut] - cost[last] > kSplitSlack * share ||
          starts[cut] - starts[last] < kSplitMinRows) {
        return {};
      }
      bounds.push_back(cut);
    }
    return bounds;
  }

  // Off: every step stays whole (a benchmark's baseline).
  void set_split_sequences(bool split) { split_sequences_ = split; }

 private:
  struct GreedyHeadWeights {
    at::Tensor approx, weight, norms;
  };

  // A split step's run as forward_greedy's threads share its head: the head's panels go out
  // kHeadUnitPanels at a time from `next` once the run's outputs are `ready`.
  struct HeadRun {
    at::Tensor hidden, x, approx;  // x: hidden in bf16; approx: x by the head's panels
    std::atomic<bool> ready{false};
    std::atomic<int64_t> next{0};
  };
  static constexpr int64_t kHeadUnitPanels = 16;

  int64_t vocab() const { return head_->weight.size(0); }

  // The head's panel units a thread works on: its own run's (`own`) first, then the others'
  // in turn, each once its run is ready, until none is left.
  void head_units(std::vector<HeadRun>& runs, int64_t own, const std::atomic<bool>& failed) const {
    const int64_t parts = static_cast<int64_t>(runs.size());
    const int64_t panels = head_->approx.size(0);
    const int64_t units = (panels + kHeadUnitPanels - 1) / kHeadUnitPanels;
    for (int64_t turn = 0; turn < parts;) {
      if (failed.load(std::memory_order_acquire)) return;
      HeadRun& run = runs[(own + turn) % parts];
      if (!run.ready.load(std::memory_order_acquire)) {
        _mm_pause();  // its run is still going (this thread would wait for it at the end)
        continue;
      }
      const int64_t unit = run.next.fetch_add(1);
      if (unit >= units) {
        ++turn;
        continue;
      }
#if defined(CPU_CAPABILITY_AVX512)  // bf16 panels (set_greedy_head refuses other builds)
      const int64_t begin = unit * kHeadUnitPanels;
      at::BFloat16* out = run.approx.data_ptr<at::BFloat16>();
      panel_unit<kPanelVecs, kLinearRows>(
          run.x.data_ptr<at::BFloat16>(), 0, run.x.size(0), hidden_,
          head_->approx.data_ptr<at::BFloat16>(), begin,
          std::min(panels, begin + kHeadUnitPanels), -1,
          [&](const auto& acc, int64_t p, int64_t row) {
            store_tile(acc, p, row, static_cast<const at::BFloat16*>(nullptr), out, vocab());
          });
#endif
    }
  }

  at::Tensor forward_rows(const at::Tensor& embedded, const at::Tensor& positions,
                          const at::Tensor& cos, const at::Tensor& sin_signed,
                          const std::vector<at::Tensor>& k_caches,
                          const std::vector<at::Tensor>& v_caches,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          const std::optional<at::Tensor>& output_rows) const {
    const int64_t tokens = embedded.size(0);
    const int64_t q_size = num_q_ * head_dim_, kv_size = num_kv_ * head_dim_;
    at::Tensor residual = embedded;
    at::Tensor hidden = rms_norm(residual, layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer& layer = layers_[i];
      if (i > 0) add_rms_norm_(hidden, residual, layer.input_norm, eps_);
      const at::Tensor qkv = linear(hidden, layer.qkv, q_size + 2 * kv_size, layer.qkv_bias);
      const at::Tensor query_key =
          qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_q_ + num_kv_, head_dim_});
      rotary_(query_key, positions, cos, sin_signed);
      const at::Tensor value =
          qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_, head_dim_});
      store_kv(query_key.narrow(1, num_q_, num_kv_), value, k_caches[i], v_caches[i],
               slot_mapping);
      at::Tensor attended =
          paged_attention(query_key.narrow(1, 0, num_q_), k_caches[i], v_caches[i],
                          block_tables, seq_lens, query_start_loc, scale_);
      if (output_rows.has_value() && i + 1 == layers_.size()) {
        attended = attended.index_select(0, *output_rows);
        residual = residual.index_select(0, *output_rows);
      }
      hidden = row_linear(attended.view({attended.size(0), q_size}), layer.o, layer.o_bias);
      add_rms_norm_(hidden, residual, layer.post_norm, eps_);
      hidden = row_linear(activated_mlp_input(hidden, layer), layer.down, layer.down_bias);
    }
    add_rms_norm_(hidden, residual, final_norm_, eps_);
    return hidden;
  }

  at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, int64_t out_features,
                    const std::optional<at::Tensor>& bias) const {
    return panels_ ? packed_linear(x, weight, out_features, bias) : onednn_linear(x, weight, bias);
  }

  // silu(gate) * up of the layer's gate and up projections of x.
  at::Tensor activated_mlp_input(const at::Tensor& x, const DecoderLayer& layer) const {
    if (panels_) return gated_linear(x, layer.gate_up, intermediate_, layer.gate_up_bias, true);
    return silu_and_mul(onednn_linear(x, layer.gate_up, layer.gate_up_bias));
  }

  // O and down: RowLinear adds the bias after the matmul (after the all-reduce with tensor
  // parallel), a rounding of its own in bf16.
  at::Tensor row_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) const {
    const at::Tensor out = linear(x, weight, hidden_, std::nullopt);
    return bias.has_value() ? out + *bias : out;
  }

  int64_t num_q_, num_kv_, head_dim_, hidden_, intermediate_;
  double eps_, scale_;
  at::Tensor final_norm_;
  bool panels_;
  bool split_sequences_ = true;
  double row_keys_;
  std::vector<DecoderLayer> layers_;
  std::optional<GreedyHeadWeights> head_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention);
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
