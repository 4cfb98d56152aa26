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

// The grid of the warp-per-row kernels (stats, mixture) for N rows.
cudaError_t warp_rows_grid(int64_t N, unsigned& grid) {
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  grid = grid_for((N + kRowsPerBlock - 1) / kRowsPerBlock, kRowsPerBlock * kWarp, dev);
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_vocab_divergence_stats_rows(const Params& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  unsigned grid = 0;
  if (const cudaError_t err = warp_rows_grid(p.rows, grid); err != cudaSuccess) return err;
  with_logit_maps(p, [&](auto student, auto teacher) {
    launch_kernel(vocab_divergence_stats_rows_kernel<decltype(student), decltype(teacher)>, grid,
                  kRowsPerBlock * kWarp, 0, stream, static_cast<const float*>(p.logits),
                  static_cast<const float*>(p.teacher_logits), p.rows, p.cols, student, teacher,
                  static_cast<float*>(p.stats));
  });
  return cudaGetLastError();
}

cudaError_t launch_vocab_divergence_mixture_rows(const Params& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  unsigned grid = 0;
  if (const cudaError_t err = warp_rows_grid(p.rows, grid); err != cudaSuccess) return err;
  with_logit_maps(p, [&](auto student, auto teacher) {
    launch_kernel(vocab_divergence_mixture_rows_kernel<decltype(student), decltype(teacher)>, grid,
                  kRowsPerBlock * kWarp, 0, stream, static_cast<const float*>(p.logits),
                  static_cast<const float*>(p.teacher_logits), p.rows, p.cols, student, teacher,
                  static_cast<const float*>(p.row), MixtureWeights<float>::of(p.beta), static_cast<float*>(p.mixture));
  });
  return cudaGetLastError();
}

cudaError_t launch_vocab_divergence_grad_rows(const Params& p, DType grads_dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  const RowLaunch cfg = row_launch(p.rows, p.cols, kGradThreads, dev);
  dispatch_dtype(grads_dtype, [&](auto* type_tag) {
    using G = std::remove_pointer_t<decltype(type_tag)>;
    with_kind(p.kind, [&](auto kind) {
      with_logit_maps(p, [&](auto student, auto teacher) {
        launch_kernel(vocab_divergence_grad_rows_kernel<decltype(kind)::value, decltype(student), decltype(teacher), G>,
                      cfg.grid, cfg.block, 0, stream, static_cast<const float*>(p.logits),
                      static_cast<const float*>(p.teacher_logits), p.rows, p.cols, student, teacher,
                      static_cast<const float*>(p.row), static_cast<const float*>(p.row_term),
                      static_cast<const float*>(p.grad), MixtureWeights<float>::of(p.beta), static_cast<G*>(p.grads),
                      p.grads_stride);
      });
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_vocab_divergence_combine(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  const unsigned grid = grid_for((N + kCombineThreads - 1) / kCombineThreads, kCombineThreads, dev);
  launch_kernel(vocab_divergence_combine_kernel, grid, kCombineThreads, 0, stream,
                static_cast<const float*>(p.partials), p.ranks, N, static_cast<float*>(p.out));
  return cudaGetLastError();
}

}  // namespace fused_rl_ops::vocab_divergence
