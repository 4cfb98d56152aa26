// The GEMMs of the vocab-chunk loop on the CPU (vocab_parallel/chunk_loop.h lists what a device's
// Kernels supply): ATen GEMMs in the accumulation dtype (fp32, or fp64 for float64 inputs), and the
// threads that run the loop's row pieces. An op's CpuKernels derive from it and add their row kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <atomic>

#include "common/torch_utils.h"

namespace fused_rl_ops {

struct CpuGemms {
  static bool capturing() { return false; }  // no graphs on the CPU

  // Rows per piece (RowPieces, which doubles them in blocks of 2048 rows and more): a divisor of the
  // batch-invariant row block, and enough pieces per chunk (8 at N = 1024) to even out a slowed
  // thread's share.
  static constexpr int64_t kPieceRows = 128;

  // fn(i) for each task i < count (the chunk loop's TaskQueue), taken in order by whichever thread is
  // free: one parallel region, in which the GEMMs (ATen's, in a parallel region) run on the calling
  // thread alone. The threads
  // run with the caller's thread-local state (dispatch keys, grad mode), which ATen's parallel_for
  // does not pass on.
  template <class Fn>
  static void for_each_piece(int64_t count, const Fn& fn) {
    std::atomic<int64_t> next{0};
    const at::ThreadLocalState state;
    at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      const at::ThreadLocalStateGuard guard(state);
      for (int64_t i = next++; i < count; i = next++) fn(i);
    });
  }

  // main_grad gets the weight gradient rounded to weight's dtype, as Megatron's unfused path
  // (gradient_accumulation_fusion needs CUDA) hands it over.
  static constexpr bool fuses_main_grad = false;

  static at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

  static void logits(const at::Tensor& h, const at::Tensor& w, at::Tensor& out) { at::mm_out(out, h, w.t()); }

  // The GEMMs take the logit gradients in the accumulation dtype.
  static at::ScalarType grad_dtype(at::ScalarType dtype) { return acc_dtype(dtype); }

  static void add_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) { out.addmm_(a, b); }

  static void mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    if (out.scalar_type() == a.scalar_type()) at::mm_out(out, a, b);
    else out.copy_(at::mm(a, b));
  }
};

}  // namespace fused_rl_ops
