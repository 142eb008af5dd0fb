// The K/V store into the paged cache.
// Part of cpu_ops.cpp's one translation unit (see there).

#pragma once

#include "common.h"

namespace {

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

}  // namespace
