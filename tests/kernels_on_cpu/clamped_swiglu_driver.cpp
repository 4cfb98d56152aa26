// Calls the clamped SwiGLU launchers (csrc/clamped_swiglu/kernel.cu) on the CPU: forward (with a
// "scale" buffer when the int has_scale is 1: the weighted form), backward, and scaled_backward
// (dx and dscale of the weighted form). The buffer y holds dy for the backward launchers.
#include "clamped_swiglu/kernel.h"
#include "driver.h"

using namespace fused_rl_ops::clamped_swiglu;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    const int64_t rows = c.i("rows"), F = c.i("F");
    const Params p{c.f("alpha"), c.f("limit"), c.f("offset")};
    const bool interleaved = c.i("interleaved");
    if (c.kernel == "forward") {
      const float* scale = c.i("has_scale") ? c.buf<float>("scale") : nullptr;
      return launch_clamped_swiglu_forward(c.raw("x"), scale, c.raw("y"), rows, F, c.dtype(), interleaved, p, nullptr);
    }
    if (c.kernel == "backward") {
      return launch_clamped_swiglu_backward(c.raw("y"), c.raw("x"), c.raw("x_grad"), rows, F, c.dtype(), interleaved,
                                            p, nullptr);
    }
    if (c.kernel != "scaled_backward") cuda_on_host::fail("unknown kernel " + c.kernel);
    return launch_clamped_swiglu_scaled_backward(c.raw("y"), c.raw("x"), c.buf<float>("scale"), c.raw("x_grad"),
                                                 c.buf<float>("dscale"), rows, F, c.dtype(), interleaved, p, nullptr);
  });
}
