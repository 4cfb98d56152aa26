// Calls chosen_logprob's launchers (csrc/chosen_logprob/kernel.cu) on the CPU: stats_rows,
// grad_rows (in place, or into a buffer of the gradient GEMMs' dtype), combine, top_rows and
// hist_rows. A case's optional buffers: threshold (stats_rows, grad_rows, top_rows),
// window (top_rows), entry_grads (grad_rows); its optional scalar k: the tokens per position
// (stats_rows, grad_rows, combine; default 1). Its logit map: driver::read_logit_map's.
#include "chosen_logprob/kernel.h"
#include "driver.h"

using namespace fused_rl_ops::chosen_logprob;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    Params p;
    p.rows = c.i("N");
    if (c.has_scalar("k")) p.tokens_per_row = c.i("k");
    if (c.kernel == "combine") {
      driver::read_combine(c, p);
      return launch_chosen_logprob_combine(p, nullptr);
    }
    p.logits = c.buf<float>("logits");
    p.cols = c.i("C");
    p.logit_map = driver::read_logit_map(c);
    if (c.has("threshold")) p.threshold = c.buf<float>("threshold");
    if (c.has("window")) p.window = c.buf<double>("window");
    if (c.kernel == "top_rows") {
      p.top = c.buf<float>("top");
      p.top_width = c.i("K");
      return launch_chosen_logprob_top_rows(p, nullptr);
    }
    if (c.kernel == "hist_rows") {
      p.row_max = c.buf<float>("row_max");
      p.hist = c.buf<int64_t>("hist");
      return launch_chosen_logprob_hist_rows(p, nullptr);
    }
    p.tokens = c.buf<int64_t>("tokens");
    p.col0 = c.i("col0");
    if (c.kernel == "stats_rows") {
      p.stats = c.buf<float>("stats");
      return launch_chosen_logprob_stats_rows(p, nullptr);
    }
    if (c.kernel != "grad_rows") cuda_on_host::fail("unknown kernel " + c.kernel);
    p.row_max = c.buf<float>("row_max");
    p.log_sum = c.buf<float>("log_sum");
    p.log_sum_minus_entropy = c.buf<float>("log_sum_minus_entropy");
    p.grad_logprob = c.buf<float>("gl");
    p.grad_entropy = c.buf<float>("ge");
    if (c.has("entry_grads")) p.entry_grads = c.buf<float>("entry_grads");
    const fused_rl_ops::DType grads_dtype = driver::read_grads(c, p);
    return launch_chosen_logprob_grad_rows(p, grads_dtype, nullptr);
  });
}
