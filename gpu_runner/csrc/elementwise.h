// Fused elementwise kernels of the decoder layer (float32 or bfloat16, CPU); see
// elementwise.cpp.
#pragma once

#include <torch/extension.h>

// residual += x (in place), then returns rms_norm(residual) * weight. x, residual: [rows, width].
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);

// gate_up = [gate | up] along the last dimension -> silu(gate) * up, a new [rows, width / 2].
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// Rotary embedding in Hugging Face's rotate-half layout: x [tokens, heads, dim] (dim
// contiguous), cos and sin [tokens, dim / 2] -> a new contiguous x * cos + rotate_half(x) * sin.
at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
