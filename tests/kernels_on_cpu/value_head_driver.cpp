// Calls the value-head launchers (csrc/value_head/kernel.cu) on the CPU: forward, backward_hidden,
// and backward_params (both reduction stages).
#include "driver.h"
#include "value_head/kernel.h"

using namespace fused_rl_ops::value_head;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    const int64_t rows = c.i("rows"), H = c.i("H");
    if (c.kernel == "forward") {
      const float* bias = c.i("has_bias") ? c.buf<float>("bias") : nullptr;
      return launch_value_head_forward(c.raw("hidden"), c.buf<float>("weight"), bias, c.buf<float>("out"), rows, H,
                                       c.dtype(), nullptr);
    }
    if (c.kernel == "backward_hidden") {
      return launch_value_head_backward_hidden(c.buf<float>("grad_out"), c.buf<float>("weight"),
                                               c.raw("grad_hidden"), rows, H, c.dtype(), nullptr);
    }
    if (c.kernel != "backward_params") cuda_on_host::fail("unknown kernel " + c.kernel);
    return launch_value_head_backward_params(c.buf<float>("grad_out"), c.raw("hidden"), c.buf<float>("weight_partials"),
                                             c.buf<float>("bias_partials"), c.buf<float>("grad_weight"),
                                             c.buf<float>("grad_bias"), rows, H, c.dtype(), nullptr);
  });
}
