// Launchers of the clamped SwiGLU CUDA kernels (clamped_swiglu/kernel.cuh). Compiled by nvcc and by
// the kernels-on-CPU tests.
#include "clamped_swiglu/kernel.cuh"
#include "clamped_swiglu/kernel.h"
#include "common/launch.h"

namespace fused_rl_ops::clamped_swiglu {
namespace {

// Calls launch(type_tag, width, interleaved_tag, cfg) with the element type, the vector width the
// pointers' alignment allows, the layout and the launch shape of a kernel over p's [rows, F] output;
// launch returns launch_grid_stride's error.
template <typename Launch>
cudaError_t launch_rows(const Params& p, DType dtype, std::initializer_list<const void*> ptrs, const Launch& launch) {
  if (p.rows * p.F == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  auto run = [&](auto interleaved_tag) {
    constexpr bool kInter = decltype(interleaved_tag)::value;
    return launch_with_width<kInter ? 8 : 16>(dtype, p.F, ptrs, [&](auto* type_tag, auto width) {
      err = launch(type_tag, width, interleaved_tag, row_launch(p.rows, p.F / decltype(width)::value, kBlockThreads));
    });
  };
  const cudaError_t launch_err = p.interleaved ? run(std::true_type{}) : run(std::false_type{});
  return err != cudaSuccess ? err : launch_err;
}

}  // namespace

cudaError_t launch_clamped_swiglu_forward(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_rows(p, dtype, {p.x, p.y}, [&](auto* type_tag, auto width, auto inter, RowLaunch cfg) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    return launch_grid_stride(clamped_swiglu_forward_kernel<T, decltype(width)::value, decltype(inter)::value>,
                              cfg.work_blocks, cfg.block, 0, stream, static_cast<const T*>(p.x),
                              static_cast<const float*>(p.scale), static_cast<T*>(p.y), p.rows, p.F, p.act);
  });
}

cudaError_t launch_clamped_swiglu_backward(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_rows(p, dtype, {p.dy, p.x, p.dx}, [&](auto* type_tag, auto width, auto inter, RowLaunch cfg) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    return launch_grid_stride(clamped_swiglu_backward_kernel<T, decltype(width)::value, decltype(inter)::value>,
                              cfg.work_blocks, cfg.block, 0, stream, static_cast<const T*>(p.dy),
                              static_cast<const T*>(p.x), static_cast<T*>(p.dx), p.rows, p.F, p.act);
  });
}

cudaError_t launch_clamped_swiglu_scaled_backward(const Params& p, DType dtype, cudaStream_t stream) {
  return launch_rows(p, dtype, {p.dy, p.x, p.dx}, [&](auto* type_tag, auto width, auto inter, RowLaunch cfg) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    return launch_grid_stride(
        clamped_swiglu_scaled_backward_kernel<T, decltype(width)::value, decltype(inter)::value>, cfg.work_blocks,
        cfg.block, 0, stream, static_cast<const T*>(p.dy), static_cast<const T*>(p.x),
        static_cast<const float*>(p.scale), static_cast<T*>(p.dx), static_cast<float*>(p.dscale), p.rows, p.F, p.act);
  });
}

}  // namespace fused_rl_ops::clamped_swiglu
