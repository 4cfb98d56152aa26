// Calls vocab_divergence's launchers (csrc/vocab_divergence/kernel.cu) on the CPU: stats_rows,
// mixture_rows, grad_rows (in place, or into a buffer of the gradient GEMMs' dtype) and combine. A
// case's logit maps: scalars temperature, softcap (the student's) and teacher_softcap, an optional
// one left out for none; kind and beta.
#include "driver.h"
#include "vocab_divergence/kernel.h"

using namespace fused_rl_ops::vocab_divergence;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    Params p;
    p.rows = c.i("N");
    if (c.kernel == "combine") {
      p.partials = c.buf<float>("partials");
      p.out = c.buf<float>("out");
      p.ranks = c.i("ranks");
      return launch_vocab_divergence_combine(p, nullptr);
    }
    p.logits = c.buf<float>("logits");
    p.teacher_logits = c.buf<float>("teacher_logits");
    p.cols = c.i("C");
    p.logit_map.temperature = c.d("temperature");
    if (c.has_scalar("softcap")) p.logit_map.softcap = c.d("softcap");
    p.teacher_logit_map.temperature = c.d("temperature");
    if (c.has_scalar("teacher_softcap")) p.teacher_logit_map.softcap = c.d("teacher_softcap");
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
    // In place over the logits, or into columns [grads_col, grads_col + C) of grads' rows of
    // grads_stride elements in dtype.
    if (c.i("in_place")) {
      p.grads = c.buf<float>("logits");
      p.grads_stride = p.cols;
      return launch_vocab_divergence_grad_rows(p, fused_rl_ops::DType::kFloat32, nullptr);
    }
    const size_t elem = c.dtype() == fused_rl_ops::DType::kFloat32 ? 4 : 2;
    p.grads = static_cast<unsigned char*>(c.raw("grads")) + c.i("grads_col") * elem;
    p.grads_stride = c.i("grads_stride");
    return launch_vocab_divergence_grad_rows(p, c.dtype(), nullptr);
  });
}
