// Calls the value-head launchers (csrc/value_head/kernel.cu) on the CPU: forward, backward_hidden,
// and backward_params (both reduction stages).
#include "driver.h"
#include "value_head/kernel.h"

using namespace fused_rl_ops::value_head;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    Params p;
    p.rows = c.i("rows");
    p.H = c.i("H");
    if (c.kernel == "forward") {
      p.hidden = c.raw("hidden");
      p.weight = c.buf<float>("weight");
      p.bias = c.i("has_bias") ? c.buf<float>("bias") : nullptr;
      p.out = c.buf<float>("out");
      return launch_value_head_forward(p, c.dtype(), nullptr);
    }
    p.grad_out = c.buf<float>("grad_out");
    if (c.kernel == "backward_hidden") {
      p.weight = c.buf<float>("weight");
      p.grad_hidden = c.raw("grad_hidden");
      return launch_value_head_backward_hidden(p, c.dtype(), nullptr);
    }
    if (c.kernel != "backward_params") cuda_on_host::fail("unknown kernel " + c.kernel);
    p.hidden = c.raw("hidden");
    p.weight_partials = c.buf<float>("weight_partials");
    p.bias_partials = c.buf<float>("bias_partials");
    p.grad_weight = c.buf<float>("grad_weight");
    p.grad_bias = c.buf<float>("grad_bias");
    return launch_value_head_backward_params(p, c.dtype(), nullptr);
  });
}
