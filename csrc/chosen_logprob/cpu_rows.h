// chosen_logprob's CPU row kernels, one table per ISA (common/cpu_isa.h): built from cpu_rows.cpp,
// called by cpu.cpp. Each runs in double where fp64, else in float (the accumulation dtype).
#pragma once

#include "chosen_logprob/params.h"
#include "common/cpu_isa.h"

namespace fused_rl_ops::chosen_logprob {

struct RowKernels {
  void (*stats_rows)(const Params& p, bool fp64);
  void (*grad_rows)(const Params& p, bool fp64);
  void (*top_rows)(const Params& p, bool fp64);
  void (*hist_rows)(const Params& p, bool fp64);
};

FRL_DECLARE_CPU_ROW_KERNELS(RowKernels)

}  // namespace fused_rl_ops::chosen_logprob
