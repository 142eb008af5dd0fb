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
#include <limits>
#include <numeric>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
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

// Runs `work(item, worker)` for every item in `order`, items handed out one at a time to
// the pool's threads (costs differ a lot between items: a static split would idle threads).
template <typename F>
void parallel_items(const std::vector<int64_t>& order, const F& work) {
  const int64_t num_items = static_cast<int64_t>(order.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        work(order[i], worker);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Paged attention over a packed mixed batch.
//
// Sequence s owns query rows query_start_loc[s]..query_start_loc[s+1] (its newest q_len tokens)
// and has seq_lens[s] tokens cached; its row i sits at position seq_lens[s] - q_len + i and
// sees keys 0..position. A work item is (sequence, KV head, tile of up to kTileTokens query
// tokens): the query heads sharing the KV head and the tile's tokens are its rows, so each K/V
// row is read once from the cache, in place, for all of them. Softmax is online (running max
// and sum per row), one cache block of keys at a time.

constexpr int64_t kTileTokens = 16;

struct AttentionItem {
  int64_t seq, kv_head, token_begin, token_end;  // tokens: indices within the sequence's query
};

// Scores of `rows` query rows against one block's keys, two ways. Few rows (a decode: one
// token's heads) take a dot product per (row, key). Many rows (a prompt tile) transpose the
// block's keys to [head_dim, keys] once, so each row's scores for the whole block come out of
// head_dim vector FMAs with no horizontal sums.
constexpr int64_t kTransposeRows = 8;

template <typename T>
void block_scores_by_dots(const float* q, int64_t rows, const T* k_block, int64_t token_stride,
                          int64_t in_block, int64_t d, float* kv_row, float* scores,
                          int64_t score_stride) {
  for (int64_t t = 0; t < in_block; ++t) {
    const float* k = as_float(k_block + t * token_stride, kv_row, d);
    for (int64_t r = 0; r < rows; ++r) scores[r * score_stride + t] = dot(q + r * d, k, d);
  }
}

template <typename T>
void block_scores_transposed(const float* q, int64_t rows, const T* k_block,
                             int64_t token_stride, int64_t in_block, int64_t d, float* kv_row,
                             float* keys_t, float* scores, int64_t score_stride) {
  // keys_t: [d, score_stride], keys past in_block zero (their scores are masked later)
  std::fill(keys_t, keys_t + d * score_stride, 0.f);
  for (int64_t t = 0; t < in_block; ++t) {
    const float* k = as_float(k_block + t * token_stride, kv_row, d);
    for (int64_t i = 0; i < d; ++i) keys_t[i * score_stride + t] = k[i];
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * d;
    for (int64_t t = 0; t < score_stride; t += Vec::size()) {
      Vec acc(0.f);
      for (int64_t i = 0; i < d; ++i) {
        acc = at::vec::fmadd(Vec(qr[i]), Vec::loadu(keys_t + i * score_stride + t), acc);
      }
      acc.store(scores + r * score_stride + t);
    }
  }
}

template <typename T>
void attend_item(
    const AttentionItem& item,
    const T* query, int64_t q_token_stride, int64_t q_head_stride,
    const T* k_cache, const T* v_cache, int64_t block_size, int64_t kv_heads, int64_t head_dim,
    const int32_t* table, int64_t first_position, int64_t heads_per_kv, int64_t query_row0,
    float scale, T* out, int64_t out_token_stride, std::vector<float>& scratch) {
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t rows = num_tokens * heads_per_kv;  // row r: token r / hpk, head r % hpk
  const int64_t d = head_dim;
  // Score rows padded to whole vectors: the exponentials run over full vectors.
  const int64_t stride = (block_size + Vec::size() - 1) / Vec::size() * Vec::size();
  scratch.resize(rows * d * 2 + rows * stride + 2 * rows + 2 * d + 2 * d * stride);
  float* q = scratch.data();                 // [rows, d]
  float* acc = q + rows * d;                 // [rows, d]
  float* scores = acc + rows * d;            // [rows, stride]
  float* row_max = scores + rows * stride;
  float* row_sum = row_max + rows;
  float* kv_row = row_sum + rows;            // widened K or V row
  float* q_row = kv_row + d;
  float* keys_t = q_row + d;                 // [d, stride]
  float* values_f = keys_t + d * stride;     // [block_size, d] widened V (bf16, fp16)

  std::vector<int64_t> last_key(rows);  // the last key each row may see
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = item.token_begin + r / heads_per_kv;
    const int64_t head = item.kv_head * heads_per_kv + r % heads_per_kv;
    const T* src = query + (query_row0 + token) * q_token_stride + head * q_head_stride;
    const float* widened = as_float(src, q_row, d);
    std::copy(widened, widened + d, q + r * d);
    last_key[r] = first_position + token;
    row_max[r] = kNegInf;
    row_sum[r] = 0.f;
  }
  std::fill(acc, acc + rows * d, 0.f);

  const int64_t num_keys = first_position + item.token_end;
  const int64_t token_stride = kv_heads * d;
  for (int64_t key0 = 0; key0 < num_keys; key0 += block_size) {
    const int64_t block = table[key0 / block_size];
    const int64_t in_block = std::min(block_size, num_keys - key0);
    const T* k_block = k_cache + (block * block_size * kv_heads + item.kv_head) * d;
    const T* v_block = v_cache + (block * block_size * kv_heads + item.kv_head) * d;
    if (rows >= kTransposeRows) {
      block_scores_transposed(q, rows, k_block, token_stride, in_block, d, kv_row, keys_t,
                              scores, stride);
    } else {
      block_scores_by_dots(q, rows, k_block, token_stride, in_block, d, kv_row, scores, stride);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(in_block, last_key[r] - key0 + 1);
      float* s = scores + r * stride;
      if (visible <= 0) {  // the whole block is in this row's future
        std::fill(s, s + stride, 0.f);
        continue;
      }
      float block_max = kNegInf;
      for (int64_t t = 0; t < visible; ++t) {
        s[t] *= scale;
        block_max = std::max(block_max, s[t]);
      }
      std::fill(s + visible, s + stride, kNegInf);
      const float new_max = std::max(row_max[r], block_max);
      if (row_max[r] != kNegInf && row_max[r] != new_max) {
        const float correction = std::exp(row_max[r] - new_max);
        row_sum[r] *= correction;
        scale_in_place(acc + r * d, correction, d);
      }
      row_max[r] = new_max;
      const Vec shift(new_max);
      Vec sums(0.f);
      for (int64_t t = 0; t < stride; t += Vec::size()) {
        const Vec p = (Vec::loadu(s + t) - shift).exp();
        p.store(s + t);
        sums = sums + p;
      }
      row_sum[r] += at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, sums);
    }
    // acc[r] += sum_t p[r, t] V[t]: one vector of a row's accumulator stays in a register
    // across the block's keys. fp32 V rows are read in place, others widened once.
    const float* values = reinterpret_cast<const float*>(v_block);
    int64_t value_stride = token_stride;
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t t = 0; t < in_block; ++t) {
        at::vec::convert(v_block + t * token_stride, values_f + t * d, d);
      }
      values = values_f;
      value_stride = d;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(in_block, last_key[r] - key0 + 1);
      const float* p = scores + r * stride;
      float* a = acc + r * d;
      int64_t i = 0;
      for (; i + Vec::size() <= d; i += Vec::size()) {
        Vec sum = Vec::loadu(a + i);
        for (int64_t t = 0; t < visible; ++t) {
          sum = at::vec::fmadd(Vec(p[t]), Vec::loadu(values + t * value_stride + i), sum);
        }
        sum.store(a + i);
      }
      for (; i < d; ++i) {
        for (int64_t t = 0; t < visible; ++t) a[i] += p[t] * values[t * value_stride + i];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = item.token_begin + r / heads_per_kv;
    const int64_t head = item.kv_head * heads_per_kv + r % heads_per_kv;
    scale_in_place(acc + r * d, 1.f / row_sum[r], d);
    store_from_float(acc + r * d, out + (query_row0 + token) * out_token_stride + head * d, d);
  }
}

template <typename T>
void paged_attention_impl(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, double scale) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t q_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t heads_per_kv = q_heads / kv_heads;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);

  std::vector<AttentionItem> items;
  std::vector<int64_t> costs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    const int64_t first_position = lens[s] - q_len;
    for (int64_t begin = 0; begin < q_len; begin += kTileTokens) {
      const int64_t end = std::min(q_len, begin + kTileTokens);
      for (int64_t h = 0; h < kv_heads; ++h) {
        items.push_back({s, h, begin, end});
        costs.push_back((end - begin) * (first_position + end));
      }
    }
  }
  // Longest first: the last items handed out are the short ones, so threads finish together.
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return costs[a] > costs[b];
  });

  const T* q = query.data_ptr<T>();
  const T* k = k_cache.data_ptr<T>();
  const T* v = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t workers = at::get_num_threads();
  std::vector<std::vector<float>> scratch(workers);
  parallel_items(order, [&](int64_t index, int64_t worker) {
    const AttentionItem& item = items[index];
    const int64_t q_len = starts[item.seq + 1] - starts[item.seq];
    attend_item<T>(
        item, q, query.stride(0), query.stride(1), k, v, block_size, kv_heads, head_dim,
        tables + item.seq * table_stride, lens[item.seq] - q_len, heads_per_kv,
        starts[item.seq], static_cast<float>(scale), o, q_heads * head_dim,
        scratch[worker % workers]);
  });
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
      const Vec one(1.f);
      int64_t i = 0;
      for (; i + Vec::size() <= n; i += Vec::size()) {
        const Vec x = Vec::loadu(g + i);
        (x / (one + x.neg().exp())).store(result + i);
      }
      for (; i < n; ++i) result[i] = g[i] / (1.f + std::exp(-g[i]));
      if constexpr (!std::is_same_v<T, float>) {
        for (i = 0; i < n; ++i) result[i] = static_cast<float>(static_cast<T>(result[i]));
      }
      for (i = 0; i < n; ++i) result[i] = result[i] * u[i];
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention);
  m.def("store_kv", &store_kv);
  m.def("rotary_", &rotary_);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("vector_width", [] { return static_cast<int64_t>(Vec::size()); });
}
