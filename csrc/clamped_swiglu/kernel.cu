// Launchers of the clamped SwiGLU CUDA kernels (clamped_swiglu/kernel.cuh). Compiled by nvcc and by
// the kernels-on-CPU tests.
#include "clamped_swiglu/kernel.cuh"
#include "clamped_swiglu/kernel.h"
#include "common/launch.h"

namespace fused_rl_ops::clamped_swiglu {
namespace {

// Calls launch(type_tag, width, interleaved_tag, cfg) with the element type, the vector width the
// pointers' alignment allows, the layout and the launch shape of a kernel over a [rows, F] output.
template <typename Launch>
cudaError_t launch_rows(std::initializer_list<const void*> ptrs, int64_t rows, int64_t F, DType dtype,
                        bool interleaved, const Launch& launch) {
  if (rows * F == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  auto run = [&](auto interleaved_tag) {
    constexpr bool kInter = decltype(interleaved_tag)::value;
    return launch_with_width<kInter ? 8 : 16>(dtype, F, ptrs, [&](auto* type_tag, auto width) {
      launch(type_tag, width, interleaved_tag, row_launch(rows, F / decltype(width)::value, kBlockThreads, dev));
    });
  };
  return interleaved ? run(std::true_type{}) : run(std::false_type{});
}

}  // namespace

cudaError_t launch_clamped_swiglu_forward(const void* x, const float* scale, void* y, int64_t rows, int64_t F,
                                          DType dtype, bool interleaved, Params p, cudaStream_t stream) {
  return launch_rows({x, y}, rows, F, dtype, interleaved, [&](auto* type_tag, auto width, auto inter, RowLaunch cfg) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    launch_kernel(clamped_swiglu_forward_kernel<T, decltype(width)::value, decltype(inter)::value>, cfg.grid,
                  cfg.block, 0, stream, static_cast<const T*>(x), scale, static_cast<T*>(y), rows, F, p);
  });
}

cudaError_t launch_clamped_swiglu_backward(const void* dy, const void* x, void* dx, int64_t rows, int64_t F,
                                           DType dtype, bool interleaved, Params p, cudaStream_t stream) {
  return launch_rows({dy, x, dx}, rows, F, dtype, interleaved, [&](auto* type_tag, auto width, auto inter,
                                                                  RowLaunch cfg) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    launch_kernel(clamped_swiglu_backward_kernel<T, decltype(width)::value, decltype(inter)::value>, cfg.grid,
                  cfg.block, 0, stream, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx),
                  rows, F, p);
  });
}

cudaError_t launch_clamped_swiglu_scaled_backward(const void* dy, const void* x, const float* scale, void* dx,
                                                  float* dscale, int64_t rows, int64_t F, DType dtype,
                                                  bool interleaved, Params p, cudaStream_t stream) {
  return launch_rows({dy, x, dx}, rows, F, dtype, interleaved, [&](auto* type_tag, auto width, auto inter,
                                                                  RowLaunch cfg) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    launch_kernel(clamped_swiglu_scaled_backward_kernel<T, decltype(width)::value, decltype(inter)::value>,
                  cfg.grid, cfg.block, 0, stream, static_cast<const T*>(dy), static_cast<const T*>(x), scale,
                  static_cast<T*>(dx), dscale, rows, F, p);
  });
}

}  // namespace fused_rl_ops::clamped_swiglu
