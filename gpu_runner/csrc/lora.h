#pragma once

#include <torch/extension.h>

// y[rows] += (x[rows] @ a[slot].T) @ bt[slot] for every adapter group of a batch, part by part
// of a fused projection (see lora.cpp).
void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& rows, const at::Tensor& group_starts,
              const at::Tensor& group_slots, const at::Tensor& part_rows,
              const at::Tensor& ranks, const at::Tensor& part_offsets);
