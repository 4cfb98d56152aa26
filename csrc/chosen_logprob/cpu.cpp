// chosen_logprob, CPU: the chunk loop with ATen GEMMs (vocab_parallel/cpu_gemms.h) and the SIMD row
// kernels of the CPU's ISA (cpu_rows.h), both on pieces of rows handed to the threads as they come
// free (RowPieces in vocab_parallel/tiling.h).
#include <torch/library.h>

#include "chosen_logprob/cpu_rows.h"
#include "chosen_logprob/entry.h"
#include "vocab_parallel/combine.h"
#include "vocab_parallel/cpu_gemms.h"

namespace fused_rl_ops::chosen_logprob {
namespace {

const RowKernels& row_kernels() { return FRL_CPU_ROW_KERNELS(); }

struct CpuKernels : CpuGemms {
  static void stats_rows(const Params& p, at::ScalarType acc) { row_kernels().stats_rows(p, acc == at::kDouble); }

  static void grad_rows(const Params& p, at::ScalarType acc, at::ScalarType /* grads: grad_dtype, acc */) {
    row_kernels().grad_rows(p, acc == at::kDouble);
  }

  static void top_rows(const Params& p, at::ScalarType acc) { row_kernels().top_rows(p, acc == at::kDouble); }

  static void hist_rows(const Params& p, at::ScalarType acc) { row_kernels().hist_rows(p, acc == at::kDouble); }

  static void combine(const Params& p, at::ScalarType acc) {
    combine_rows_cpu(p, acc, [&](const auto* partials, int64_t ranks, int64_t rows, int64_t r, auto* out) {
      combine_row(partials, ranks, rows, r, stats_column::chosen + p.tokens_per_row, out);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("chosen_logprob_stats", &stats<CpuKernels>);
  m.impl("chosen_logprob_backward", &backward<CpuKernels>);
  m.impl("chosen_logprob_combine", &combine<CpuKernels>);
  m.impl("chosen_logprob_search", &search<CpuKernels>);
}

}  // namespace fused_rl_ops::chosen_logprob
