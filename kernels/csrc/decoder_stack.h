// A Llama-family decoder stack run by one call a step.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "attention.h"
#include "kv_store.h"
#include "rotary.h"
#include "norms.h"
#include "activations.h"
#include "greedy.h"
#include "panel_linear.h"
#include "quantized_linear.h"
#include "lora.h"

namespace {

// ---------------------------------------------------------------------------------------------
// A Llama-family decoder stack on one rank with packed weights: LlamaModel.forward's
// ops (rolling_batch/model/families/llama.py) in the same order on the same tensors, called
// from here instead of from Python. Between a layer's ~10 ops Python spent 1.5 ms a step with warm
// caches but 4.5 ms in a real step, where the weight stream evicts the interpreter's working
// set every layer: 18% of a batch-1 decode step on a 2-core Xeon, 12% at batch 32.

// A linear in oneDNN's blocked layout, as rolling_batch/model/layers/cpu_matmul.py's PackedWeight
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
  int64_t window;  // the layer's sliding window, 0: none
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
                 std::optional<at::Tensor> down_bias, int64_t window) {
    layers_.push_back({std::move(input_norm), std::move(qkv), std::move(o), std::move(post_norm),
                       std::move(gate_up), std::move(down), std::move(qkv_bias),
                       std::move(o_bias), std::move(gate_up_bias), std::move(down_bias),
                       window});
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

  // The LM head that greedy decodes read (GreedyHead in rolling_batch/model/layers/greedy_head.py):
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
                          block_tables, seq_lens, query_start_loc, scale_, layer.window, 0.0);
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
