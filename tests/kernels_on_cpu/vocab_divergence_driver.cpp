// Calls vocab_divergence's launchers (csrc/vocab_divergence/kernel.cu) on the CPU: stats_rows,
// mixture_rows, grad_rows (in place, or into a buffer of the gradient GEMMs' dtype) and combine. A
// case's logit maps: driver::read_logit_map's, the teacher's with the prefix teacher_; kind and beta.
#include "driver.h"
#include "vocab_divergence/kernel.h"

using namespace fused_rl_ops::vocab_divergence;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    Params p;
    p.rows = c.i("N");
    if (c.kernel == "combine") {
      driver::read_combine(c, p);
      return launch_vocab_divergence_combine(p, nullptr);
    }
    p.logits = c.buf<float>("logits");
    p.teacher_logits = c.buf<float>("teacher_logits");
    p.cols = c.i("C");
    p.logit_map = driver::read_logit_map(c);
    p.teacher_logit_map = driver::read_logit_map(c, "teacher_");
    p.beta = c.d("beta");
    if (c.kernel == "stats_rows") {
      p.stats = c.buf<float>("stats");
      return launch_vocab_divergence_stats_rows(p, nullptr);
    }
    p.row = c.buf<float>("rows");
    if (c.kernel == "mixture_rows") {
      p.mixture = c.buf<float>("mixture");
      return launch_vocab_divergence_mixture_rows(p, nullptr);
    }
    if (c.kernel != "grad_rows") cuda_on_host::fail("unknown kernel " + c.kernel);
    p.kind = int(c.i("kind"));
    p.row_term = c.buf<float>("row_term");
    p.grad = c.buf<float>("grad");
    const fused_rl_ops::DType grads_dtype = driver::read_grads(c, p);
    return launch_vocab_divergence_grad_rows(p, grads_dtype, nullptr);
  });
}
