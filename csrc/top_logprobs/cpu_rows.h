// top_logprobs's CPU row kernels, one table per ISA (common/cpu_isa.h): built from cpu_rows.cpp,
// called by cpu.cpp. Each runs in double where fp64, else in float (the accumulation dtype).
#pragma once

#include "common/cpu_isa.h"
#include "top_logprobs/params.h"

namespace fused_rl_ops::top_logprobs {

struct RowKernels {
  void (*stats_rows)(const Params& p, bool fp64);
  void (*top_ids_rows)(const Params& p, bool fp64);
};

FRL_DECLARE_CPU_ROW_KERNELS(RowKernels)

}  // namespace fused_rl_ops::top_logprobs
