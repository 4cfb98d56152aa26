// Calls top_logprobs' launcher (csrc/top_logprobs/kernel.cu) on the CPU: stats_top_ids_rows. A
// case's logit map: driver::read_logit_map's.
#include "driver.h"
#include "top_logprobs/kernel.h"

using namespace fused_rl_ops::top_logprobs;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    Params p;
    p.rows = c.i("N");
    p.logits = c.buf<float>("logits");
    p.cols = c.i("C");
    p.col0 = c.i("col0");
    p.logit_map = driver::read_logit_map(c);
    if (c.kernel != "stats_top_ids_rows") cuda_on_host::fail("unknown kernel " + c.kernel);
    p.stats = c.buf<float>("stats");
    p.top = c.buf<float>("top");
    p.top_ids = c.buf<int64_t>("top_ids");
    p.top_width = c.i("K");
    return launch_top_logprobs_stats_top_ids_rows(p, nullptr);
  });
}
