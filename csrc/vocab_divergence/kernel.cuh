// vocab_divergence CUDA row kernels (device code only: no torch headers, no launches). Included by
// vocab_divergence/kernel.cu, whose launchers pick the grids, and by the kernels-on-CPU tests. The
// math is vocab_divergence/math.h's; Student and Teacher are the two models' logit maps
// (PlainLogit<float> or SoftcappedLogit<float>, vocab_parallel/logit_map.h), raw logits -> z.
#pragma once

#include "common/cuda_utils.cuh"
#include "vocab_divergence/math.h"

namespace fused_rl_ops::vocab_divergence {

constexpr int kRowsPerBlock = 8;       // stats and mixture: one warp per row
constexpr int kGradThreads = 256;      // grad: threads per block, laid out by row_launch
constexpr int kCombineThreads = 256;   // combine: one thread per row

__device__ __forceinline__ RowConstants<float> row_constants(const float* __restrict__ rows,
                                                            const float* __restrict__ row_term, int64_t r) {
  const float* row = rows + r * combined_column::count;
  return {row[combined_column::student_max], row[combined_column::student_log_sum], row[combined_column::teacher_max],
          row[combined_column::teacher_log_sum], row_term ? row_term[r] : 0.f};
}

// A warp reads its row of both models twice (maxima, then sums); lanes take columns lane, lane +
// 32, ... and the butterfly reductions fix the order: deterministic.
template <class Student, class Teacher>
__global__ void vocab_divergence_stats_rows_kernel(const float* __restrict__ logits,
                                                   const float* __restrict__ teacher_logits, int64_t N, int64_t C,
                                                   Student student, Teacher teacher, float* __restrict__ stats) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    const float *xs = logits + r * C, *xt = teacher_logits + r * C;
    float ms = -INFINITY, mt = -INFINITY;
    for (int64_t k = lane; k < C; k += kWarp) {
      ms = Math<float>::max(ms, xs[k]);
      mt = Math<float>::max(mt, xt[k]);
    }
    // The maps are nondecreasing: a row's largest z is the map of its largest x.
    ms = student(warp_max(ms));
    mt = teacher(warp_max(mt));
    float ss = 0.f, cs = 0.f, st = 0.f, ct = 0.f;
    for (int64_t k = lane; k < C; k += kWarp) {
      const float zs = student(xs[k]), zt = teacher(xt[k]);
      side_add(zs, zt, ms, ss, cs);
      side_add(zt, zs, mt, st, ct);
    }
    ss = warp_sum(ss);
    cs = warp_sum(cs);
    st = warp_sum(st);
    ct = warp_sum(ct);
    if (lane == 0) stats_update_row(stats + r * stats_column::count, Side<float>{ms, ss, cs}, Side<float>{mt, st, ct});
  }
}

// jsd's sums of a chunk, added to each row's (one warp per row).
template <class Student, class Teacher>
__global__ void vocab_divergence_mixture_rows_kernel(const float* __restrict__ logits,
                                                     const float* __restrict__ teacher_logits, int64_t N, int64_t C,
                                                     Student student, Teacher teacher, const float* __restrict__ rows,
                                                     MixtureWeights<float> weights, float* __restrict__ sums) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    const float *xs = logits + r * C, *xt = teacher_logits + r * C;
    const RowConstants<float> row = row_constants(rows, nullptr, r);
    float kt = 0.f, ks = 0.f;
    for (int64_t k = lane; k < C; k += kWarp) mixture_add(student(xs[k]), teacher(xt[k]), row, weights, kt, ks);
    kt = warp_sum(kt);
    ks = warp_sum(ks);
    if (lane == 0) {
      sums[r * mixture_column::count + mixture_column::teacher] += kt;
      sums[r * mixture_column::count + mixture_column::student] += ks;
    }
  }
}

// The student's logits [N, C] -> their gradients times the upstream grad and the map's slope,
// rounded once to the gradient GEMMs' dtype G, into grads (rows grads_stride apart), which may be
// logits itself (G = float): every element is read and then written by one thread, so neither
// pointer is __restrict__. Blocks [columns, rows] (row_launch), one column per thread.
template <Kind kKind, class Student, class Teacher, typename G>
__global__ void __launch_bounds__(kGradThreads)
    vocab_divergence_grad_rows_kernel(const float* logits, const float* __restrict__ teacher_logits, int64_t N,
                                      int64_t C, Student student, Teacher teacher, const float* __restrict__ rows,
                                      const float* __restrict__ row_term, const float* __restrict__ grad,
                                      MixtureWeights<float> weights, G* grads, int64_t grads_stride) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < N; r += int64_t(gridDim.x) * blockDim.y) {
    const float *xs = logits + r * C, *xt = teacher_logits + r * C;
    G* d = grads + r * grads_stride;
    const RowConstants<float> row = row_constants(rows, row_term, r);
    const float g = grad[r];
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
      const float x = xs[k];
      d[k] = from_float<G>(student_logit_grad<kKind>(student(x), teacher(xt[k]), row, weights) * g * student.slope(x));
    }
  }
}

__global__ void vocab_divergence_combine_kernel(const float* __restrict__ partials, int64_t ranks, int64_t N,
                                                float* __restrict__ out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < N; r += int64_t(gridDim.x) * blockDim.x) {
    combine_row(partials, ranks, N, r, out);
  }
}

}  // namespace fused_rl_ops::vocab_divergence
