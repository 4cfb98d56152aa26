// vocab_divergence, CPU: the chunk loops with ATen GEMMs (vocab_parallel/cpu_gemms.h) and the SIMD row
// kernels of the CPU's ISA (cpu_rows.h), both on pieces of rows handed to the threads as they come
// free (RowPieces in vocab_parallel/tiling.h).
#include <torch/library.h>

#include "vocab_divergence/cpu_rows.h"
#include "vocab_divergence/entry.h"
#include "vocab_parallel/combine.h"
#include "vocab_parallel/cpu_gemms.h"

namespace fused_rl_ops::vocab_divergence {
namespace {

const RowKernels& row_kernels() { return FRL_CPU_ROW_KERNELS(); }

struct CpuKernels : CpuGemms {
  static void stats_rows(const Params& p, at::ScalarType acc) { row_kernels().stats_rows(p, acc == at::kDouble); }

  static void mixture_rows(const Params& p, at::ScalarType acc) {
    row_kernels().mixture_rows(p, acc == at::kDouble);
  }

  static void grad_rows(const Params& p, at::ScalarType acc, at::ScalarType /* grads: grad_dtype, acc */) {
    row_kernels().grad_rows(p, acc == at::kDouble);
  }

  static void combine(const Params& p, at::ScalarType acc) {
    combine_rows_cpu(p, acc, [](const auto* partials, int64_t ranks, int64_t rows, int64_t r, auto* out) {
      combine_row(partials, ranks, rows, r, out);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("vocab_divergence_stats", &stats<CpuKernels>);
  m.impl("vocab_divergence_combine", &combine<CpuKernels>);
  m.impl("vocab_divergence_mixture", &mixture<CpuKernels>);
  m.impl("vocab_divergence_backward", &backward<CpuKernels>);
}

}  // namespace fused_rl_ops::vocab_divergence
