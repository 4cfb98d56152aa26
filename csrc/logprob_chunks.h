// The vocab-chunk loop of chosen_logprob, written once for every device. A Backend supplies the
// GEMMs and the hand-written row kernels:
//   gemm_operand(t, acc)                 t as the GEMMs take it (CPU: converted to acc dtype)
//   logits(h, w, out)                    out = h w^T, accumulated and stored in acc dtype
//   stats_rows(logits, tokens, col0, inv_temp, stats)            merge a chunk into the row stats
//   grad_rows(logits, tokens, col0, row_max, lse, mean, gl, ge, inv_temp)
//                                        logits -> d(loss)/d(logits) in place
//   accumulate_grads(dlogits, h, w, grad_h, grad_w_chunk)        grad_h += dlogits w; grad_w = dlogits^T h
// Only one [tokens, chunk] workspace lives at a time; a fused tensor-core kernel can replace this
// loop without touching the Python API.
#pragma once

#include <ATen/ATen.h>

#include "logprob_args.h"
#include "torch_utils.h"

namespace fused_rl_ops {

// Calls fn(logits, w_chunk, c0) for each chunk of weight's rows [c0, c0 + n): logits = h w_chunk^T,
// [N, n] in the accumulation dtype, in one workspace reused by every chunk.
template <class Backend, class Fn>
void for_each_logits_chunk(const at::Tensor& h, const at::Tensor& weight, int64_t chunk_size, const Fn& fn) {
  const int64_t N = h.size(0), V = weight.size(0), chunk = std::min(chunk_size, V);
  const at::Tensor w = weight.contiguous();
  at::Tensor workspace = empty_buffer({N * chunk}, h.options().dtype(acc_dtype(h.scalar_type())));
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t n = std::min(chunk, V - c0);
    at::Tensor logits = workspace.narrow(0, 0, N * n).view({N, n});
    const at::Tensor w_chunk = Backend::gemm_operand(w.narrow(0, c0, n), acc_dtype(h.scalar_type()));
    Backend::logits(h, w_chunk, logits);
    fn(logits, w_chunk, c0);
  }
}

// [N, 4] per-token partials (max, sum, ent, chosen) of this shard's logits; chosen is 0 where the
// token is not in [vocab_start, vocab_start + V).
template <class Backend>
at::Tensor logprob_stats_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                              double temperature, int64_t vocab_start, int64_t chunk_size) {
  check_logprob_inputs(hidden, weight, tokens, temperature, chunk_size);
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = weight.size(0);
  at::Tensor stats = at::zeros({N, 4}, hidden.options().dtype(acc));
  stats.select(1, 0).fill_(-INFINITY);
  if (N == 0 || V == 0) return stats;
  const at::Tensor tok = tokens.contiguous();
  for_each_logits_chunk<Backend>(Backend::gemm_operand(hidden.contiguous(), acc), weight, chunk_size,
                                 [&](at::Tensor& logits, const at::Tensor&, int64_t c0) {
                                   Backend::stats_rows(logits, tok, vocab_start + c0, 1.0 / temperature, stats);
                                 });
  return stats;
}

// Gradients of sum(grad_logprob * logprob + grad_entropy * entropy) for this shard, whose first
// valid_rows rows of weight are vocabulary (the rest padding): the hidden gradient (in the
// accumulation dtype, a partial sum over this shard's vocabulary) and the weight gradient (in
// weight's dtype, one [V, H] tensor whose padded rows alone are zeroed). With main_grad ([V, H],
// Megatron's gradient-accumulation buffer) each chunk's weight gradient, in weight's dtype as an
// unfused backward hands it over, is added into main_grad's rows instead, through a [chunk, H]
// buffer, and the returned weight gradient is empty [0, H]. row_max, lse and mean (= lse - entropy)
// are the global per-token values, lse and mean relative to row_max (logprob_math.h).
template <class Backend>
std::tuple<at::Tensor, at::Tensor> logprob_backward_impl(const at::Tensor& hidden, const at::Tensor& weight,
                                                         const at::Tensor& tokens, const at::Tensor& row_max,
                                                         const at::Tensor& lse, const at::Tensor& mean,
                                                         const at::Tensor& grad_logprob,
                                                         const at::Tensor& grad_entropy, double temperature,
                                                         int64_t vocab_start, int64_t valid_rows, int64_t chunk_size,
                                                         const std::optional<at::Tensor>& main_grad) {
  check_logprob_inputs(hidden, weight, tokens, temperature, chunk_size);
  check_logprob_backward_args(weight, valid_rows, main_grad);
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = weight.size(0), H = weight.size(1);
  for (const at::Tensor* t : {&row_max, &lse, &mean, &grad_logprob, &grad_entropy}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == N && t->scalar_type() == acc && t->device() == hidden.device(),
                "chosen_logprob backward: per-token tensors must be [N] in the accumulation dtype");
  }
  at::Tensor grad_h = empty_buffer({N, H}, hidden.options().dtype(acc)).zero_();
  at::Tensor grad_w = main_grad ? at::empty({0, H}, weight.options()) : empty_buffer(weight.sizes(), weight.options());
  const bool any_chunk = N > 0 && valid_rows > 0;
  if (!main_grad) grad_w.narrow(0, any_chunk ? valid_rows : 0, any_chunk ? V - valid_rows : V).zero_();
  if (!any_chunk) return {grad_h, grad_w};
  const at::Tensor h = Backend::gemm_operand(hidden.contiguous(), acc), tok = tokens.contiguous();
  const at::Tensor max_c = row_max.contiguous(), lse_c = lse.contiguous(), mean_c = mean.contiguous();
  const at::Tensor gl = grad_logprob.contiguous(), ge = grad_entropy.contiguous();
  const at::Tensor chunk_grad = main_grad ? empty_buffer({std::min(chunk_size, valid_rows), H}, weight.options())
                                          : at::Tensor();
  for_each_logits_chunk<Backend>(h, weight.narrow(0, 0, valid_rows), chunk_size,
                                 [&](at::Tensor& logits, const at::Tensor& w_chunk, int64_t c0) {
    const int64_t n = logits.size(1);
    Backend::grad_rows(logits, tok, vocab_start + c0, max_c, lse_c, mean_c, gl, ge, 1.0 / temperature);
    at::Tensor grad_w_chunk = main_grad ? chunk_grad.narrow(0, 0, n) : grad_w.narrow(0, c0, n);
    Backend::accumulate_grads(logits, h, w_chunk, grad_h, grad_w_chunk);
    if (main_grad) main_grad->narrow(0, c0, n).add_(grad_w_chunk);
  });
  return {grad_h, grad_w};
}

}  // namespace fused_rl_ops
