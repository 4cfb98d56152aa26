// Runs the clamped SwiGLU CUDA kernels (csrc/clamped_swiglu/kernel.cuh) on the CPU, through
// launch_with_width and the launch shapes of clamped_swiglu/kernel.cu (the grid: the case's, or the
// launcher's for one pass). Kernels: forward (with a "scale" buffer when the int has_scale is 1:
// the weighted form), backward, and scaled_backward (dx and dscale of the weighted form).
#include "driver.h"
#include "clamped_swiglu/kernel.cuh"

using namespace fused_rl_ops;
using namespace fused_rl_ops::clamped_swiglu;
using cuda_on_host::launch;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    const int64_t rows = c.i("rows"), F = c.i("F");
    const Params p{c.f("alpha"), c.f("limit"), c.f("offset")};
    const bool forward = c.kernel == "forward", scaled_backward = c.kernel == "scaled_backward";
    if (!forward && !scaled_backward && c.kernel != "backward") cuda_on_host::fail("unknown kernel " + c.kernel);
    void *x = c.raw("x"), *y = c.raw("y");  // backward: y holds dy, dx is written to x_grad
    const float* scale = (forward && c.i("has_scale")) || scaled_backward ? c.buf<float>("scale") : nullptr;
    auto run = [&](auto interleaved_tag) {
      constexpr bool kInter = decltype(interleaved_tag)::value;
      const auto body = [&](auto* type_tag, auto width) {
        using T = std::remove_pointer_t<decltype(type_tag)>;
        constexpr int N = decltype(width)::value;
        std::cout << "width " << N << "\n";
        const RowLaunch cfg = row_launch(rows, F / N, kBlockThreads, driver::kLargeDevice);
        std::cout << "block_x " << cfg.block.x << "\n";
        const dim3 grid = c.row_grid(rows, cfg.block.y, cfg.grid);
        if (forward)
          launch(clamped_swiglu_forward_kernel<T, N, kInter>, grid, cfg.block, 0, static_cast<const T*>(x), scale,
                 static_cast<T*>(y), rows, F, p);
        else if (scaled_backward)
          launch(clamped_swiglu_scaled_backward_kernel<T, N, kInter>, grid, cfg.block, 0, static_cast<const T*>(y),
                 static_cast<const T*>(x), scale, static_cast<T*>(c.raw("x_grad")), c.buf<float>("dscale"), rows, F,
                 p);
        else
          launch(clamped_swiglu_backward_kernel<T, N, kInter>, grid, cfg.block, 0, static_cast<const T*>(y),
                 static_cast<const T*>(x), static_cast<T*>(c.raw("x_grad")), rows, F, p);
      };
      constexpr int kBytes = kInter ? 8 : 16;
      return forward ? launch_with_width<kBytes>(c.dtype(), F, {x, y}, body)
                     : launch_with_width<kBytes>(c.dtype(), F, {y, x, c.raw("x_grad")}, body);
    };
    return c.i("interleaved") ? run(std::true_type{}) : run(std::false_type{});
  });
}
