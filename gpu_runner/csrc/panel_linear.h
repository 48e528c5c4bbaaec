// Few-row linear layers from weights packed in panels (float32 or bfloat16, CPU); see
// panel_linear.cpp.
#pragma once

#include <torch/extension.h>

// weight [N, K] -> panels [ceil(N / 16), K, 16]: panels[p][k][i] = weight[16 p + i][k]; in
// bfloat16 with AVX512_BF16, pairs of k: [ceil(N / 16), ceil(K / 2), 32].
at::Tensor pack_panels(const at::Tensor& weight);

// x [M, K] (contiguous) @ weight^T (+ bias) -> [M, out_features], weight given as its panels.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features);
