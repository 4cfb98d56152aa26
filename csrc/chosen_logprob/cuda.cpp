// chosen_logprob, CUDA: the shared chunk loop with cuBLAS GEMMs through ATen (bf16/fp16 inputs
// accumulate into fp32 outputs via the out_dtype overloads) and the row kernels of chosen_logprob/kernel.cu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "chosen_logprob/chunks.h"
#include "chosen_logprob/kernel.h"

namespace fused_rl_ops::chosen_logprob {
namespace {

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

struct CudaBackend {
  static at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType acc) {
    TORCH_CHECK(acc == at::kFloat, "chosen_logprob: float64 is supported on CPU only");
    return t;
  }

  static void logits(const at::Tensor& h, const at::Tensor& w, at::Tensor& out) {
    if (h.scalar_type() == at::kFloat) at::mm_out(out, h, w.t());
    else at::mm_out(out, h, w.t(), at::kFloat);
  }

  static void stats_rows(at::Tensor& logits, const at::Tensor& tokens, int64_t col0, double temperature,
                         double softcap, at::Tensor& stats) {
    C10_CUDA_CHECK(launch_chosen_logprob_stats_rows(logits.const_data_ptr<float>(), logits.size(0), logits.size(1),
                                                    col0, tokens.const_data_ptr<int64_t>(), temperature, softcap,
                                                    stats.mutable_data_ptr<float>(), stream()));
  }

  static void grad_rows(at::Tensor& logits, const at::Tensor& tokens, int64_t col0, const at::Tensor& row_max,
                        const at::Tensor& lse, const at::Tensor& mean, const at::Tensor& gl, const at::Tensor& ge,
                        double temperature, double softcap) {
    C10_CUDA_CHECK(launch_chosen_logprob_grad_rows(logits.mutable_data_ptr<float>(), logits.size(0), logits.size(1),
                                                   col0, tokens.const_data_ptr<int64_t>(),
                                                   row_max.const_data_ptr<float>(), lse.const_data_ptr<float>(),
                                                   mean.const_data_ptr<float>(), gl.const_data_ptr<float>(),
                                                   ge.const_data_ptr<float>(), temperature, softcap, stream()));
  }

  // Tensor cores take the logit gradients in the inputs' dtype; the hidden gradient still
  // accumulates over chunks in fp32.
  static at::Tensor grad_operand(const at::Tensor& dlogits, at::ScalarType dtype) {
    return dtype == at::kFloat ? dlogits : dlogits.to(dtype);
  }

  static void add_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    if (a.scalar_type() == at::kFloat) out.addmm_(a, b);
    else at::addmm_out(out, out, a, b, at::kFloat);
  }

  static void mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) { at::mm_out(out, a, b); }
};

at::Tensor stats_cuda(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                      double temperature, int64_t vocab_start, int64_t chunk_size, int64_t row_block,
                      int64_t pass_rows, std::optional<double> softcap) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return stats_impl<CudaBackend>(hidden, weight, tokens, temperature, vocab_start, chunk_size, row_block,
                                 pass_rows, softcap);
}

std::tuple<at::Tensor, at::Tensor> backward_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                 const at::Tensor& tokens, const at::Tensor& row_max,
                                                 const at::Tensor& lse, const at::Tensor& mean,
                                                 const at::Tensor& grad_logprob,
                                                 const at::Tensor& grad_entropy, double temperature,
                                                 int64_t vocab_start, int64_t valid_rows, int64_t chunk_size,
                                                 int64_t row_block, int64_t pass_rows,
                                                 const std::optional<at::Tensor>& main_grad,
                                                 std::optional<double> softcap) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  return backward_impl<CudaBackend>(hidden, weight, tokens, row_max, lse, mean, grad_logprob, grad_entropy,
                                    temperature, vocab_start, valid_rows, chunk_size, row_block, pass_rows,
                                    main_grad, softcap);
}

at::Tensor combine_cuda(const at::Tensor& partials_in) {
  check_combine_input(partials_in);
  TORCH_CHECK(partials_in.scalar_type() == at::kFloat, "chosen_logprob_combine: float64 is supported on CPU only");
  const c10::cuda::CUDAGuard guard(partials_in.device());
  const at::Tensor partials = partials_in.contiguous();
  at::Tensor out = at::empty({partials.size(1), 4}, partials.options());
  C10_CUDA_CHECK(launch_chosen_logprob_combine(partials.const_data_ptr<float>(), partials.size(0), partials.size(1),
                                               out.mutable_data_ptr<float>(), stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("chosen_logprob_stats", &stats_cuda);
  m.impl("chosen_logprob_backward", &backward_cuda);
  m.impl("chosen_logprob_combine", &combine_cuda);
}

}  // namespace fused_rl_ops::chosen_logprob
