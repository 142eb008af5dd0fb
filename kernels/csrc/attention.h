// Paged attention over a packed mixed batch (decodes and prompt chunks in one call).
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Paged attention over a packed mixed batch.
//
// Sequence s owns query rows query_start_loc[s]..query_start_loc[s+1] (its newest q_len tokens)
// and has seq_lens[s] tokens cached; its row i sits at position seq_lens[s] - q_len + i and
// sees keys 0..position, or with a sliding window the `window` keys up to it (a row's first
// key is then position - window + 1: an item starts at its first row's, and the keys before a
// later row's first are masked for it). A softcap (Gemma 2's) squashes each scaled score into
// (-softcap, softcap) by softcap * tanh(score / softcap) before the softmax. A work item is
// (sequence, KV head, tile of query tokens): the query heads sharing the KV head and the
// tile's tokens are its rows, so each K/V row is read once from the cache, in place, for all
// of them.
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
//   kWhole: tokens token_begin..token_end of sequence `seq`, every key they see (from the
//           first row's first key): the output.
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

// softcap * tanh(s / softcap) for n scores in place (n a multiple of the vector width).
inline void cap_scores(float* s, int64_t n, float softcap) {
  const Vec cap(softcap);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    ((Vec::loadu(s + i) / cap).tanh() * cap).store(s + i);
  }
}

// One item's rows, their running softmax state and one chunk's keys; one per thread, reused.
struct AttentionState {
  int64_t rows = 0, row_pad = 0, d = 0;
  bool transposed = false;
  ScoreLayout layout{};
  std::vector<float> buffer;
  float *q, *scores, *acc, *row_max, *row_sum, *correction, *first_key, *last_key, *keys_f,
      *values_f, *q_row, *zeros;
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
    buffer.resize(d * row_pad + chunk * row_pad + row_pad * d + 5 * row_pad + 2 * chunk * d +
                  2 * d);
    q = buffer.data();             // scale * Q: [d][row_pad] transposed, else [rows][d]
    scores = q + d * row_pad;      // [chunk][row_pad] transposed, else [rows][chunk]
    acc = scores + chunk * row_pad;  // [row_pad][d]
    row_max = acc + row_pad * d;
    row_sum = row_max + row_pad;
    correction = row_sum + row_pad;
    first_key = correction + row_pad;  // the first key each row may see, as a float
    last_key = first_key + row_pad;    // the last key each row may see, as a float
    keys_f = last_key + row_pad;       // [chunk][d] widened K (bf16, fp16)
    values_f = keys_f + chunk * d;     // [chunk][d] widened V
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

  void score_chunk(int64_t in_chunk, float softcap) {
    score_keys_of_chunk(in_chunk);
    if (softcap == 0.f) return;
    if (transposed) return cap_scores(scores, scored(in_chunk) * row_pad, softcap);
    const int64_t keys_scored = (in_chunk + Vec::size() - 1) / Vec::size() * Vec::size();
    for (int64_t r = 0; r < rows; ++r) cap_scores(scores + r * kKeyChunk, keys_scored, softcap);
  }

  void score_keys_of_chunk(int64_t in_chunk) {
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

  // Scores of keys outside a row's first..last key become -inf, then weights exp(score -
  // running max). Without a window an item's first key is one every row sees; with one a row
  // may see none of a chunk's keys, and until it has seen one its running max is -inf: the
  // weights and the correction then take 0 for the max (exp(-inf - 0) = 0, where
  // exp(-inf + inf) would be NaN).
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
    const Vec first = Vec::loadu(first_key + v), last = Vec::loadu(last_key + v);
    const Vec hidden(kNegInf);
    Vec chunk_max(kNegInf);
    for (int64_t t = 0; t < keys_scored; ++t) {
      Vec s = Vec::loadu(scores + t * row_pad + v);
      if (masked) {
        const Vec key(static_cast<float>(key0 + t));
        s = Vec::blendv(s, hidden, (key > last) | (key < first));
        s.store(scores + t * row_pad + v);
      }
      chunk_max = at::vec::maximum(chunk_max, s);
    }
    const Vec old_max = Vec::loadu(row_max + v);
    const Vec new_max = at::vec::maximum(old_max, chunk_max);
    const Vec shift = Vec::blendv(new_max, Vec(0.f), new_max == hidden);
    Vec sums(0.f);
    for (int64_t t = 0; t < keys_scored; ++t) {
      const Vec p = (Vec::loadu(scores + t * row_pad + v) - shift).exp();
      p.store(scores + t * row_pad + v);
      sums = sums + p;
    }
    const Vec factor = (old_max - shift).exp();
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
    const int64_t hidden_before =
        std::clamp<int64_t>(static_cast<int64_t>(first_key[r]) - key0, 0, visible);
    const int64_t keys_scored = (in_chunk + Vec::size() - 1) / Vec::size() * Vec::size();
    std::fill(s, s + hidden_before, kNegInf);
    std::fill(s + visible, s + keys_scored, kNegInf);
    Vec maxima(kNegInf);
    for (int64_t t = 0; t < keys_scored; t += Vec::size()) {
      maxima = at::vec::maximum(maxima, Vec::loadu(s + t));
    }
    const float chunk_max = at::vec::vec_reduce_all<float>(
        [](Vec a, Vec b) { return at::vec::maximum(a, b); }, maxima);
    const float new_max = std::max(row_max[r], chunk_max);
    const Vec shift(new_max == kNegInf ? 0.f : new_max);
    Vec sums(0.f);
    for (int64_t t = 0; t < keys_scored; t += Vec::size()) {
      const Vec p = (Vec::loadu(s + t) - shift).exp();
      p.store(s + t);
      sums = sums + p;
    }
    const float factor = std::exp(row_max[r] - (new_max == kNegInf ? 0.f : new_max));
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
  int64_t window;  // keys a row sees back from its own position (itself included); 0: all
  float softcap;   // 0: none
  T* out;
  float* partials;  // [slot][d + 2]: unnormalised output, running max, running sum
  const std::vector<CascadeGroup>* groups;
  bool stream_ahead = false;  // K/V rows asked for a few at a time ahead (see attend_keys)

  int64_t q_len(int64_t seq) const { return starts[seq + 1] - starts[seq]; }
  int64_t first_position(int64_t seq) const { return lens[seq] - q_len(seq); }
  // The first key the row at `position` sees.
  int64_t first_key(int64_t position) const {
    return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  }
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
  // Rows see keys from the largest first key up to the smallest last key: chunks within
  // need no mask.
  const float first_hidden =
      *std::min_element(state.last_key, state.last_key + state.rows) + 1.f;
  const float all_see = *std::max_element(state.first_key, state.first_key + state.rows);
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
    state.score_chunk(in_chunk, call.softcap);
    const bool masked = key0 + kKeyChunk > first_hidden || static_cast<float>(key0) < all_see;
    state.softmax_chunk(key0, in_chunk, masked, key0 == key_begin);
    state.accumulate_values(in_chunk);
  }
}

// ---- A decode's item in fp32 or bf16: one query token (a decode, or a prompt tile's last
// token alone), its query heads of one KV head as rows, every key it sees (key_begin, its
// window's first, to its own).
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
  RowCursor at_key(int64_t key) const {
    RowCursor moved = *this;
    moved.block = key / block_size;
    moved.in_block = key % block_size;
    return moved;
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
  const int64_t d = call.d, rows = call.heads_per_kv, num_keys = item.key_end - item.key_begin;
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
  const auto cursor = [&](const T* cache, const AttentionItem& of) {
    return RowCursor<T>{cache, call.table(of.seq), call.block_size, row_stride, of.kv_head * d}
        .at_key(of.key_begin);
  };
  const RowCursor<T> keys = cursor(call.k_cache, item);
  const RowCursor<T> values = cursor(call.v_cache, item);
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
  if (call.softcap != 0.f) {
    for (int64_t r = 0; r < rows; ++r) cap_scores(scores + r * stride, stride, call.softcap);
  }
  float inverse_sums[kOutRows];
  for (int64_t r = 0; r < rows; ++r) inverse_sums[r] = softmax_row(scores + r * stride, num_keys);
  // A following decode's first K rows go out during the last V rows (its start then skips
  // them); another kind of item asks for its own first rows, K and V, at once.
  RowCursor<T> next{};
  int64_t next_count = 0;
  if (following != nullptr && fast_decode(*following, call)) {
    next = cursor(call.k_cache, *following);
    next_count = std::min(kAheadKeys, following->key_end - following->key_begin);
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
    state.first_key[r] = static_cast<float>(std::max(call.first_key(position), item.key_begin));
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
  // A window's decodes see their own last keys, not a shared prefix's (nor its partials).
  if (shape.window > 0) return {};
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
        items.push_back({ItemKind::kWhole, s, h, begin, end,
                         call.first_key(first_position + begin), first_position + end});
      }
    }
  }
  return items;
}

template <typename T>
void paged_attention_impl(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale, int64_t window, double softcap) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t q_heads = query.size(1), kv_heads = k_cache.size(2);
  AttentionCall<T> call{
      query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
      query.stride(0), query.stride(1), k_cache.size(1), kv_heads, q_heads,
      q_heads / kv_heads, query.size(2),
      seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
      block_tables.data_ptr<int32_t>(), block_tables.stride(0),
      static_cast<float>(scale), window, static_cast<float>(softcap), out.data_ptr<T>(),
      nullptr, nullptr};
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

at::Tensor paged_attention(
    const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale, int64_t window, double softcap) {
  check_rows_contiguous(query, "query");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
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
                                   query_start_loc, scale, window, softcap);
  });
  return out;
}

}  // namespace
