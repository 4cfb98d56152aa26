// The GEMMs of the vocab-chunk loop on CUDA (vocab_parallel/chunk_loop.h lists what a device's Kernels
// supply): cuBLAS through ATen, bf16 / fp16 inputs accumulating into fp32 outputs via the out_dtype
// overloads, on the current stream. An op's CudaKernels derive from it and add the launchers of
// their row kernels. For the torch glue (cuda.cpp), not for .cu files.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>

namespace fused_rl_ops {

struct CudaGemms {
  // While a CUDA graph is captured on the current stream no value may be read on the host (the
  // ops then compute every row, chosen_logprob/entry.h's RowSkipping).
  static bool capturing() {
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  }

  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

  static at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType) { return t; }

  // The chunk loop's GEMMs take whole row blocks, in order on the stream, and each row kernel all
  // the rows of a pass (vocab_parallel/chunk_loop.h).
  static constexpr int64_t kPieceRows = 0;

  // An fp32 main_grad takes the weight gradient from the GEMMs' fp32 accumulation (add_mm's
  // addmm_out with out_dtype float), as Megatron's gradient_accumulation_fusion does.
  static constexpr bool fuses_main_grad = true;

  static void logits(const at::Tensor& h, const at::Tensor& w, at::Tensor& out) {
    if (h.scalar_type() == at::kFloat) at::mm_out(out, h, w.t());
    else at::mm_out(out, h, w.t(), at::kFloat);
  }

  // Tensor cores take the logit gradients in the inputs' dtype (the row kernels write them so, no
  // cast); the hidden gradient still accumulates over chunks in fp32.
  static at::ScalarType grad_dtype(at::ScalarType dtype) { return dtype; }

  static void add_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    if (a.scalar_type() == at::kFloat) out.addmm_(a, b);
    else at::addmm_out(out, out, a, b, at::kFloat);
  }

  static void mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) { at::mm_out(out, a, b); }
};

}  // namespace fused_rl_ops
