// top_logprobs, CPU: the chunk loop with ATen GEMMs (vocab_parallel/cpu_gemms.h) and the row kernels
// of the CPU's ISA (cpu_rows.h: the shared stats kernel and the top-ids one), on pieces of rows
// handed to the threads as they come free.
#include <torch/library.h>

#include "top_logprobs/cpu_rows.h"
#include "top_logprobs/entry.h"
#include "vocab_parallel/cpu_gemms.h"

namespace fused_rl_ops::top_logprobs {
namespace {

const RowKernels& row_kernels() { return FRL_CPU_ROW_KERNELS(); }

struct CpuKernels : CpuGemms {
  // The shared stats kernel, then the top over the same piece of rows (in cache).
  static void stats_top_ids_rows(const Params& p, at::ScalarType acc) {
    row_kernels().stats_rows(p, acc == at::kDouble);
    row_kernels().top_ids_rows(p, acc == at::kDouble);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) { m.impl("top_logprobs_stats", &stats<CpuKernels>); }

}  // namespace fused_rl_ops::top_logprobs
