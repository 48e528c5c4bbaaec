// Paged attention over the KV cache read in place (float32, CPU); see paged_attention.cpp.
#pragma once

#include <torch/extension.h>

// Each sequence's new tokens (rows query_start_locs[i] .. query_start_locs[i + 1] of query)
// attend causally over its first context_lens[i] keys. Returns [tokens, heads, head_dim].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, const at::Tensor& query_start_locs,
                           double scale);
