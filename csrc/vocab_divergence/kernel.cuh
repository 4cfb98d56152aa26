// vocab_divergence CUDA row kernels (device code only: no torch headers, no launches). Included by
// vocab_divergence/kernel.cu, whose launchers pick the grids, and by the kernels-on-CPU tests. The
// math is vocab_divergence/math.h's; Student and Teacher are the two models' logit maps
// (PlainLogit<float> or SoftcappedLogit<float>, vocab_parallel/logit_map.h), raw logits -> z.
#pragma once

#include "common/cuda_utils.cuh"
#include "vocab_divergence/math.h"
#include "vocab_parallel/warp_partial.cuh"

namespace fused_rl_ops::vocab_divergence {

constexpr int kRowsPerBlock = 8;       // stats and mixture: one warp per row
constexpr int kPackWidth = 4;          // columns per lane / thread and access where aligned (16 bytes of fp32)
constexpr int kGradThreads = 256;      // grad: threads per block, laid out by row_launch
constexpr int kCombineThreads = 256;   // combine: one thread per row

__device__ __forceinline__ RowConstants<float> row_constants(const float* __restrict__ rows,
                                                            const float* __restrict__ row_term, int64_t r) {
  const float* row = rows + r * combined_column::count;
  return {row[combined_column::student_max], row[combined_column::student_log_sum], row[combined_column::teacher_max],
          row[combined_column::teacher_log_sum], row_term ? row_term[r] : 0.f};
}

// kWidth columns of a row of both models' raw logits at column k (one aligned access each where
// kWidth > 1), mapped: zs, zt.
template <int kWidth, class Student, class Teacher>
__device__ __forceinline__ void mapped_pair(const float* xs, const float* xt, int64_t k, Student student,
                                            Teacher teacher, float (&zs)[kWidth], float (&zt)[kWidth]) {
  const Pack<float, kWidth> in_s = *reinterpret_cast<const Pack<float, kWidth>*>(xs + k);
  const Pack<float, kWidth> in_t = *reinterpret_cast<const Pack<float, kWidth>*>(xt + k);
#pragma unroll
  for (int i = 0; i < kWidth; ++i) {
    zs[i] = student(in_s.v[i]);
    zt[i] = teacher(in_t.v[i]);
  }
}

// A warp per row reads both models' rows once: each lane keeps online Sides (side_add_online) of
// kWidth columns at a time (kWidth where the launcher finds the rows aligned for it, else 1), lane l
// taking columns [kWidth l, kWidth (l + 1)), then those kWarp kWidth further on; the lanes merge in
// a fixed butterfly (deterministic).
template <class Student, class Teacher, int kWidth>
__global__ void vocab_divergence_stats_rows_kernel(const float* __restrict__ logits,
                                                   const float* __restrict__ teacher_logits, int64_t N, int64_t C,
                                                   Student student, Teacher teacher, float* __restrict__ stats) {
  const int lane = threadIdx.x % kWarp;
  const auto merge = [](Side<float>& a, const Side<float>& b) { side_merge(a, b); };
  for (int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    const float *xs = logits + r * C, *xt = teacher_logits + r * C;
    Side<float> s = partial_empty<Side<float>>(), t = partial_empty<Side<float>>();
    for (int64_t k = int64_t(lane) * kWidth; k < C; k += kWarp * kWidth) {
      float zs[kWidth], zt[kWidth];
      mapped_pair(xs, xt, k, student, teacher, zs, zt);
      side_add_online(s, zs, zt);
      side_add_online(t, zt, zs);
    }
    s = warp_partial(s, merge);
    t = warp_partial(t, merge);
    if (lane == 0) stats_update_row(stats + r * stats_column::count, s, t);
  }
}

// jsd's sums of a chunk, added to each row's (one warp per row, kWidth columns per lane and access
// as in stats_rows).
template <class Student, class Teacher, int kWidth>
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
    for (int64_t k = int64_t(lane) * kWidth; k < C; k += kWarp * kWidth) {
      float zs[kWidth], zt[kWidth];
      mapped_pair(xs, xt, k, student, teacher, zs, zt);
#pragma unroll
      for (int i = 0; i < kWidth; ++i) mixture_add(zs[i], zt[i], row, weights, kt, ks);
    }
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
// pointer is __restrict__. kWidth columns per thread and access, one load of each model's logits
// and one store (store_pack), where the launcher finds every row aligned for it (1: the scalar
// path). Blocks [columns, rows] (row_launch).
template <Kind kKind, class Student, class Teacher, typename G, int kWidth>
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
    for (int64_t k = int64_t(threadIdx.x) * kWidth; k < C; k += int64_t(blockDim.x) * kWidth) {
      const Pack<float, kWidth> in_s = *reinterpret_cast<const Pack<float, kWidth>*>(xs + k);
      const Pack<float, kWidth> in_t = *reinterpret_cast<const Pack<float, kWidth>*>(xt + k);
      Pack<G, kWidth> out;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        const float x = in_s.v[i];
        out.v[i] = from_float<G>(student_logit_grad<kKind>(student(x), teacher(in_t.v[i]), row, weights) * g *
                                 student.slope(x));
      }
      store_pack(d + k, out);
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
