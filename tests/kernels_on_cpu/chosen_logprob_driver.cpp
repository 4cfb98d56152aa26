// Calls chosen_logprob's launchers (csrc/chosen_logprob/kernel.cu) on the CPU: stats_rows,
// grad_rows and combine.
#include "chosen_logprob/kernel.h"
#include "driver.h"

using namespace fused_rl_ops::chosen_logprob;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    const int64_t N = c.i("N");
    if (c.kernel == "stats_rows") {
      return launch_chosen_logprob_stats_rows(c.buf<float>("logits"), N, c.i("C"), c.i("col0"),
                                              c.buf<int64_t>("tokens"), c.d("temperature"), c.d("softcap"),
                                              c.buf<float>("stats"), nullptr);
    }
    if (c.kernel == "grad_rows") {
      return launch_chosen_logprob_grad_rows(c.buf<float>("logits"), N, c.i("C"), c.i("col0"),
                                             c.buf<int64_t>("tokens"), c.buf<float>("row_max"), c.buf<float>("lse"),
                                             c.buf<float>("mean"), c.buf<float>("gl"), c.buf<float>("ge"),
                                             c.d("temperature"), c.d("softcap"), nullptr);
    }
    if (c.kernel != "combine") cuda_on_host::fail("unknown kernel " + c.kernel);
    return launch_chosen_logprob_combine(c.buf<float>("partials"), c.i("ranks"), N, c.buf<float>("out"), nullptr);
  });
}
