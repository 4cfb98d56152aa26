// Value head, CPU: the row kernels of the CPU's ISA (cpu_rows.h) on ranges of rows handed to ATen's
// threads; the weight and bias gradients follow the fixed two-stage reduction of value_head/math.h,
// with one parallel task per row block.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "value_head/cpu_rows.h"
#include "value_head/entry.h"

namespace fused_rl_ops::value_head {
namespace {

const RowKernels& row_kernels() { return FRL_CPU_ROW_KERNELS(); }

// Rows per parallel task: enough elements that a task outweighs its scheduling.
int64_t row_grain(int64_t H) { return std::max<int64_t>(1, 32768 / H); }

// Stage 2: out[c] = sum over b, in order, of partials[b, c], in parallel over column tiles.
template <typename acc>
void sum_partials(const acc* partials, int64_t blocks, int64_t cols, acc* out) {
  constexpr int64_t kCols = 512;  // a tile of out stays in L1 while the partial rows stream by
  at::parallel_for(0, (cols + kCols - 1) / kCols, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * kCols, c1 = std::min(cols, c0 + kCols);
      std::fill(out + c0, out + c1, acc(0));
      for (int64_t b = 0; b < blocks; ++b) {
        const acc* p = partials + b * cols;
        for (int64_t c = c0; c < c1; ++c) out[c] += p[c];
      }
    }
  });
}

struct CpuKernels {
  static void forward(const Params& p, const at::Tensor& hidden) {
    const CpuDType dtype = to_cpu_dtype(hidden);
    at::parallel_for(0, p.rows, row_grain(p.H),
                     [&](int64_t begin, int64_t end) { row_kernels().forward_rows(p, dtype, begin, end); });
  }

  static void backward_hidden(const Params& p, const at::Tensor& grad_hidden) {
    const CpuDType dtype = to_cpu_dtype(grad_hidden);
    at::parallel_for(0, p.rows, row_grain(p.H),
                     [&](int64_t begin, int64_t end) { row_kernels().backward_hidden_rows(p, dtype, begin, end); });
  }

  static void backward_params(const Params& p, const at::Tensor& hidden) {
    const CpuDType dtype = to_cpu_dtype(hidden);
    const int64_t blocks = value_head_row_blocks(p.rows);
    // Stage 1: one task per fixed block of rows, so the partials do not depend on the thread count.
    at::parallel_for(0, blocks, 1,
                     [&](int64_t begin, int64_t end) { row_kernels().partials_blocks(p, dtype, begin, end); });
    AT_DISPATCH_FLOATING_TYPES(acc_dtype(hidden.scalar_type()), "value_head_params_cpu", [&] {
      sum_partials(static_cast<const scalar_t*>(p.weight_partials), blocks, p.H, static_cast<scalar_t*>(p.grad_weight));
      sum_partials(static_cast<const scalar_t*>(p.bias_partials), blocks, 1, static_cast<scalar_t*>(p.grad_bias));
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("value_head", &forward<CpuKernels>);
  m.impl("value_head_backward_hidden", &backward_hidden<CpuKernels>);
  m.impl("value_head_backward_params", &backward_params<CpuKernels>);
}

}  // namespace fused_rl_ops::value_head
