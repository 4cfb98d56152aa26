// clamped_swiglu's CPU row kernels, one table per ISA (common/cpu_isa.h): built from cpu_rows.cpp,
// called by cpu.cpp on ranges of tiles (kTile outputs of a row) or of whole rows.
#pragma once

#include "clamped_swiglu/params.h"
#include "common/cpu_dtype.h"
#include "common/cpu_isa.h"

namespace fused_rl_ops::clamped_swiglu {

constexpr int64_t kTile = 64;  // outputs per tile: a multiple of every SIMD width

inline int64_t tiles_per_row(int64_t F) { return (F + kTile - 1) / kTile; }

struct RowKernels {
  // Tiles [begin, end) of the [rows, F] output, tile t holding row t / tiles_per_row(F)'s outputs
  // from (t % tiles_per_row(F)) * kTile: the forward (weighted where p.scale is set) and the
  // unweighted backward.
  void (*forward_tiles)(const Params& p, CpuDType x, int64_t begin, int64_t end);
  void (*backward_tiles)(const Params& p, CpuDType x, int64_t begin, int64_t end);
  // The weighted backward of rows [begin, end), a row's tiles in order, so that its scale's gradient
  // is summed in a fixed order at any thread count.
  void (*scaled_backward_rows)(const Params& p, CpuDType x, int64_t begin, int64_t end);
};

FRL_DECLARE_CPU_ROW_KERNELS(RowKernels)

}  // namespace fused_rl_ops::clamped_swiglu
