// chosen_logprob, CUDA: the ops of chosen_logprob/entry.h with cuBLAS GEMMs through ATen (bf16/fp16
// inputs accumulate into fp32 outputs via the out_dtype overloads) and the row kernels of
// chosen_logprob/kernel.cu (which stays free of torch headers) on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "chosen_logprob/entry.h"
#include "chosen_logprob/kernel.h"

namespace fused_rl_ops::chosen_logprob {
namespace {

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// The ops' checks (entry.h) leave fp32 the only accumulation dtype on CUDA.
struct CudaKernels {
  // While a CUDA graph is captured on the current stream no value may be read on the host (the
  // ops then compute every row, entry.h's RowSkipping).
  static bool capturing() {
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  }

  static at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType) { return t; }

  // The chunk loop's GEMMs take whole row blocks, in order on the stream, and each row kernel all
  // the rows of a pass (chosen_logprob/chunks.h).
  static constexpr int64_t kPieceRows = 0;

  // An fp32 main_grad takes the weight gradient from the GEMMs' fp32 accumulation (add_mm's
  // addmm_out with out_dtype float), as Megatron's gradient_accumulation_fusion does.
  static constexpr bool fuses_main_grad = true;

  static void logits(const at::Tensor& h, const at::Tensor& w, at::Tensor& out) {
    if (h.scalar_type() == at::kFloat) at::mm_out(out, h, w.t());
    else at::mm_out(out, h, w.t(), at::kFloat);
  }

  static void stats_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_chosen_logprob_stats_rows(p, stream()));
  }

  // Tensor cores take the logit gradients in the inputs' dtype (grad_rows writes them so, no cast);
  // the hidden gradient still accumulates over chunks in fp32.
  static at::ScalarType grad_dtype(at::ScalarType dtype) { return dtype; }

  static void grad_rows(const Params& p, at::ScalarType, at::ScalarType grads) {
    C10_CUDA_CHECK(launch_chosen_logprob_grad_rows(p, to_dtype(grads), stream()));
  }

  static void top_rows(const Params& p, at::ScalarType) { C10_CUDA_CHECK(launch_chosen_logprob_top_rows(p, stream())); }

  static void top_ids_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_chosen_logprob_top_ids_rows(p, stream()));
  }

  static void hist_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_chosen_logprob_hist_rows(p, stream()));
  }

  static void add_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    if (a.scalar_type() == at::kFloat) out.addmm_(a, b);
    else at::addmm_out(out, out, a, b, at::kFloat);
  }

  static void mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) { at::mm_out(out, a, b); }

  static void combine(const Params& p, at::ScalarType) { C10_CUDA_CHECK(launch_chosen_logprob_combine(p, stream())); }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("chosen_logprob_stats", &stats<CudaKernels>);
  m.impl("chosen_logprob_backward", &backward<CudaKernels>);
  m.impl("chosen_logprob_combine", &combine<CudaKernels>);
  m.impl("chosen_logprob_search", &search<CudaKernels>);
  m.impl("top_logprobs_stats", &top_logprobs_stats<CudaKernels>);
}

}  // namespace fused_rl_ops::chosen_logprob
