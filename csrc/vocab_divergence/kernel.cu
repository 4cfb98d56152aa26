// Launchers of the vocab_divergence CUDA row kernels (vocab_divergence/kernel.cuh); the GEMMs around
// them are cuBLAS calls made by the torch glue. Compiled by nvcc and by the kernels-on-CPU tests.
#include "common/launch.h"
#include "vocab_divergence/kernel.cuh"
#include "vocab_divergence/kernel.h"

namespace fused_rl_ops::vocab_divergence {
namespace {

// Calls fn(student map, teacher map) in float.
template <class Fn>
void with_logit_maps(const Params& p, const Fn& fn) {
  with_logit_map<float>(p.logit_map, [&](auto student) {
    with_logit_map<float>(p.teacher_logit_map, [&](auto teacher) { fn(student, teacher); });
  });
}

// Whether rows of `cols` logits of both models, rows apart by their length, start aligned for
// kPackWidth columns per access.
bool packs_fit(const Params& p) {
  return p.cols % kPackWidth == 0 && is_aligned(p.logits, sizeof(Pack<float, kPackWidth>)) &&
         is_aligned(p.teacher_logits, sizeof(Pack<float, kPackWidth>));
}

// Calls fn(width), width the columns per access as a compile-time constant: kPackWidth where
// vectorised, else 1.
template <class Fn>
void with_width(bool vectorised, const Fn& fn) {
  if (vectorised) fn(std::integral_constant<int, kPackWidth>{});
  else fn(std::integral_constant<int, 1>{});
}

// Launches a warp-per-row kernel over p's rows, kernel_for(student, teacher, width) for p's pair of
// logit maps and columns per access, with both models' logits, the row shape and the maps, then args.
template <class KernelFor, class... Args>
cudaError_t launch_warp_rows(const Params& p, cudaStream_t stream, const KernelFor& kernel_for, Args... args) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  with_logit_maps(p, [&](auto student, auto teacher) {
    with_width(packs_fit(p), [&](auto width) {
      err = launch_grid_stride(kernel_for(student, teacher, width), (p.rows + kRowsPerBlock - 1) / kRowsPerBlock,
                               kRowsPerBlock * kWarp, 0, stream, static_cast<const float*>(p.logits),
                               static_cast<const float*>(p.teacher_logits), p.rows, p.cols, student, teacher,
                               args...);
    });
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace

cudaError_t launch_vocab_divergence_stats_rows(const Params& p, cudaStream_t stream) {
  return launch_warp_rows(
      p, stream,
      [](auto student, auto teacher, auto width) {
        return vocab_divergence_stats_rows_kernel<decltype(student), decltype(teacher), decltype(width)::value>;
      },
      static_cast<float*>(p.stats));
}

cudaError_t launch_vocab_divergence_mixture_rows(const Params& p, cudaStream_t stream) {
  return launch_warp_rows(
      p, stream,
      [](auto student, auto teacher, auto width) {
        return vocab_divergence_mixture_rows_kernel<decltype(student), decltype(teacher), decltype(width)::value>;
      },
      static_cast<const float*>(p.row), MixtureWeights<float>::of(p.beta), static_cast<float*>(p.mixture));
}

cudaError_t launch_vocab_divergence_grad_rows(const Params& p, DType grads_dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  dispatch_dtype(grads_dtype, [&](auto* type_tag) {
    using G = std::remove_pointer_t<decltype(type_tag)>;
    const bool vectorised = packs_fit(p) && p.grads_stride % kPackWidth == 0 &&
                            is_aligned(p.grads, sizeof(Pack<G, kPackWidth>));
    with_kind(p.kind, [&](auto kind) {
      with_logit_maps(p, [&](auto student, auto teacher) {
        with_width(vectorised, [&](auto width) {
          constexpr int kWidth = decltype(width)::value;
          const RowLaunch cfg = row_launch(p.rows, p.cols / kWidth, kGradThreads);
          err = launch_grid_stride(
              vocab_divergence_grad_rows_kernel<decltype(kind)::value, decltype(student), decltype(teacher), G, kWidth>,
              cfg.work_blocks, cfg.block, 0, stream, static_cast<const float*>(p.logits),
              static_cast<const float*>(p.teacher_logits), p.rows, p.cols, student, teacher,
              static_cast<const float*>(p.row), static_cast<const float*>(p.row_term),
              static_cast<const float*>(p.grad), MixtureWeights<float>::of(p.beta), static_cast<G*>(p.grads),
              p.grads_stride);
        });
      });
    });
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t launch_vocab_divergence_combine(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0) return cudaSuccess;
  const cudaError_t err =
      launch_grid_stride(vocab_divergence_combine_kernel, (N + kCombineThreads - 1) / kCombineThreads,
                         kCombineThreads, 0, stream, static_cast<const float*>(p.partials), p.ranks, N,
                         static_cast<float*>(p.out));
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace fused_rl_ops::vocab_divergence
