// Calls the clamped SwiGLU launchers (csrc/clamped_swiglu/kernel.cu) on the CPU: forward (with a
// "scale" buffer when the int has_scale is 1: the weighted form), backward, and scaled_backward
// (dx and dscale of the weighted form). The buffer y holds dy for the backward launchers.
#include "clamped_swiglu/kernel.h"
#include "driver.h"

using namespace fused_rl_ops::clamped_swiglu;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    Params p;
    p.rows = c.i("rows");
    p.F = c.i("F");
    p.interleaved = c.i("interleaved");
    p.act = Activation{c.f("alpha"), c.f("limit"), c.f("offset")};
    p.x = c.raw("x");
    if (c.kernel == "forward") {
      p.scale = c.i("has_scale") ? c.buf<float>("scale") : nullptr;
      p.y = c.raw("y");
      return launch_clamped_swiglu_forward(p, c.dtype(), nullptr);
    }
    p.dy = c.raw("y");
    p.dx = c.raw("x_grad");
    if (c.kernel == "backward") return launch_clamped_swiglu_backward(p, c.dtype(), nullptr);
    if (c.kernel != "scaled_backward") cuda_on_host::fail("unknown kernel " + c.kernel);
    p.scale = c.buf<float>("scale");
    p.dscale = c.buf<float>("dscale");
    return launch_clamped_swiglu_scaled_backward(p, c.dtype(), nullptr);
  });
}
