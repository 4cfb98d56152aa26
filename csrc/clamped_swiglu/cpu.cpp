// Clamped SwiGLU, CPU: the row kernels of the CPU's ISA (cpu_rows.h) on ranges of tiles (rows for the
// weighted backward) handed to ATen's threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "clamped_swiglu/cpu_rows.h"
#include "clamped_swiglu/entry.h"

namespace fused_rl_ops::clamped_swiglu {
namespace {

const RowKernels& row_kernels() { return FRL_CPU_ROW_KERNELS(); }

constexpr int64_t kTilesPerTask = 16;

void for_tile_ranges(const Params& p, void (*kernel)(const Params&, CpuDType, int64_t, int64_t), CpuDType x) {
  at::parallel_for(0, p.rows * tiles_per_row(p.F), kTilesPerTask,
                   [&](int64_t begin, int64_t end) { kernel(p, x, begin, end); });
}

struct CpuKernels {
  static void forward(const Params& p, const at::Tensor& x) {
    for_tile_ranges(p, row_kernels().forward_tiles, to_cpu_dtype(x));
  }
  static void backward(const Params& p, const at::Tensor& x) {
    for_tile_ranges(p, row_kernels().backward_tiles, to_cpu_dtype(x));
  }
  // Whole rows per task, as many as make up kTilesPerTask tiles.
  static void scaled_backward(const Params& p, const at::Tensor& x) {
    const CpuDType dtype = to_cpu_dtype(x);
    const int64_t per_row = tiles_per_row(p.F);
    at::parallel_for(0, p.rows, (kTilesPerTask + per_row - 1) / per_row, [&](int64_t begin, int64_t end) {
      row_kernels().scaled_backward_rows(p, dtype, begin, end);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("clamped_swiglu", &forward<CpuKernels>);
  m.impl("clamped_swiglu_backward", &backward<CpuKernels>);
  m.impl("clamped_swiglu_scaled_backward", &scaled_backward<CpuKernels>);
}

}  // namespace fused_rl_ops::clamped_swiglu
