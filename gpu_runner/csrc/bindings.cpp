// The Python module of pagewire's CPU kernels (built by gpu_runner/cpu_kernels.py).
#include <torch/extension.h>

#include "elementwise.h"
#include "lanes.h"
#include "lora.h"
#include "paged_attention.h"
#include "panel_linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Causal attention of each sequence's new tokens over a paged KV cache read in place "
        "(float32 or bfloat16, CPU)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("query_start_locs"), py::arg("scale"));
  m.def("add_rms_norm", &add_rms_norm,
        "residual += x in place, then rms_norm(residual) * weight (float32, CPU)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "[gate | up] -> silu(gate) * up (float32, CPU)",
        py::arg("gate_up"));
  m.def("rotate_half", &rotate_half,
        "x * cos + rotate_half(x) * sin for x [tokens, heads, dim] (float32 or bfloat16, CPU)",
        py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("vector_registers", [] { return pagewire::lanes::kParts; },
        "SIMD registers per 16-lane vector in this build: 1 with AVX-512, 2 with AVX2, 4 "
        "below");
  m.def("pack_panels", &pack_panels, "weight [N, K] -> its panels (see panel_linear.h)",
        py::arg("weight"));
  m.def("panel_linear", &panel_linear,
        "x [M, K] @ weight^T (+ bias) from the weight's panels (float32 or bfloat16, CPU, few "
        "rows)",
        py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("out_features"));
  m.def("lora_add", &lora_add,
        "y[rows] += (x[rows] @ a[slot].T) @ bt[slot] per adapter group and part of a fused "
        "projection (float32, CPU; see lora.cpp)",
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("bt"), py::arg("rows"),
        py::arg("group_starts"), py::arg("group_slots"), py::arg("part_rows"),
        py::arg("ranks"), py::arg("part_offsets"));
}
