// value_head's CPU row kernels, one table per ISA (common/cpu_isa.h): built from cpu_rows.cpp, called
// by cpu.cpp on ranges of rows, or of the weight gradient's fixed row blocks (value_head/math.h).
#pragma once

#include "common/cpu_dtype.h"
#include "common/cpu_isa.h"
#include "value_head/params.h"

namespace fused_rl_ops::value_head {

struct RowKernels {
  void (*forward_rows)(const Params& p, CpuDType hidden, int64_t begin, int64_t end);
  void (*backward_hidden_rows)(const Params& p, CpuDType hidden, int64_t begin, int64_t end);
  // Stage 1 of the weight and bias gradients: the partials of row blocks [begin, end).
  void (*partials_blocks)(const Params& p, CpuDType hidden, int64_t begin, int64_t end);
};

FRL_DECLARE_CPU_ROW_KERNELS(RowKernels)

}  // namespace fused_rl_ops::value_head
