// chosen_logprob, CPU: the chunk loop with ATen GEMMs (in fp32, or fp64 for float64 inputs) and
// SIMD row kernels running the shared formulas of chosen_logprob/math.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "chosen_logprob/entry.h"
#include "chosen_logprob/math.h"
#include "common/vec_math.h"

namespace fused_rl_ops::chosen_logprob {
namespace {

template <typename acc>
acc horizontal_max(const at::vec::Vectorized<acc>& v) {
  alignas(64) acc lanes[at::vec::Vectorized<acc>::size()];
  v.store(lanes);
  acc m = lanes[0];
  for (int k = 1; k < at::vec::Vectorized<acc>::size(); ++k) m = Math<acc>::max(m, lanes[k]);
  return m;
}

template <typename acc>
acc horizontal_sum(const at::vec::Vectorized<acc>& v) {
  alignas(64) acc lanes[at::vec::Vectorized<acc>::size()];
  v.store(lanes);
  acc s = 0;
  for (int k = 0; k < at::vec::Vectorized<acc>::size(); ++k) s += lanes[k];
  return s;
}

// Logit: the PlainLogit or SoftcappedLogit of chosen_logprob/math.h, in acc.
template <typename acc, class Logit>
void stats_rows_cpu(const Params& p, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* logits = static_cast<const acc*>(p.logits);
  auto* stats = static_cast<acc*>(p.stats);
  const int64_t N = p.rows, C = p.cols, col0 = p.col0;
  const int64_t* tokens = p.tokens;
  const int64_t C_vec = C - C % Vec::size();
  const auto vlogit = logit.template as<Vec>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const acc* x = logits + r * C;
      Vec vmax(-INFINITY);
      for (int64_t k = 0; k < C_vec; k += Vec::size()) vmax = Math<Vec>::max(vmax, Vec::loadu(x + k));
      acc m = horizontal_max(vmax);
      for (int64_t k = C_vec; k < C; ++k) m = Math<acc>::max(m, x[k]);
      m = logit(m);  // the map is nondecreasing: the largest z is the map of the largest x
      const Vec vm(m);
      Vec vs(0), vt(0);
      for (int64_t k = 0; k < C_vec; k += Vec::size()) stats_add(vlogit(Vec::loadu(x + k)), vm, vs, vt);
      acc s = horizontal_sum(vs), t = horizontal_sum(vt);
      for (int64_t k = C_vec; k < C; ++k) stats_add(logit(x[k]), m, s, t);
      stats_update_row(stats + stats_column::count * r, RowStats<acc>{m, s, t}, x, tokens[r] - col0, C, logit);
    }
  });
}

// Into p.grads (acc; may be p.logits itself: each row's chosen logit is read before the row is
// overwritten).
template <typename acc, class Logit>
void grad_rows_cpu(const Params& p, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* logits = static_cast<const acc*>(p.logits);
  auto* grads = static_cast<acc*>(p.grads);
  const auto* row_max = static_cast<const acc*>(p.row_max);
  const auto* log_sum = static_cast<const acc*>(p.log_sum);
  const auto* log_sum_minus_entropy = static_cast<const acc*>(p.log_sum_minus_entropy);
  const auto *gl = static_cast<const acc*>(p.grad_logprob), *ge = static_cast<const acc*>(p.grad_entropy);
  const int64_t N = p.rows, C = p.cols, col0 = p.col0;
  const int64_t* tokens = p.tokens;
  const int64_t C_vec = C - C % Vec::size();
  const auto vlogit = logit.template as<Vec>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const acc* x = logits + r * C;
      acc* d = grads + r * p.grads_stride;
      const int64_t target = tokens[r] - col0;
      const bool has_target = target >= 0 && target < C;
      const acc x_target = has_target ? x[target] : acc(0);
      const acc m = row_max[r], l = log_sum[r], l_minus_ent = log_sum_minus_entropy[r];
      const Vec vm(m), vl(l), vl_minus_ent(l_minus_ent), vgl(gl[r]), vge(ge[r]);
      for (int64_t k = 0; k < C_vec; k += Vec::size()) {
        const Vec xk = Vec::loadu(x + k);
        (logit_grad(vlogit(xk) - vm, vl, vl_minus_ent, vgl, vge) * vlogit.slope(xk)).store(d + k);
      }
      for (int64_t k = C_vec; k < C; ++k) {
        d[k] = logit_grad(logit(x[k]) - m, l, l_minus_ent, gl[r], ge[r]) * logit.slope(x[k]);
      }
      if (has_target) d[target] += gl[r] * logit.slope(x_target);
    }
  });
}

struct CpuKernels {
  static at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

  static void logits(const at::Tensor& h, const at::Tensor& w, at::Tensor& out) { at::mm_out(out, h, w.t()); }

  static void stats_rows(const Params& p, at::ScalarType acc) {
    AT_DISPATCH_FLOATING_TYPES(acc, "chosen_logprob_stats_cpu", [&] {
      with_logit_map<scalar_t>(p.options, [&](const auto& logit) { stats_rows_cpu<scalar_t>(p, logit); });
    });
  }

  // The GEMMs take the logit gradients in the accumulation dtype.
  static at::ScalarType grad_dtype(at::ScalarType dtype) { return acc_dtype(dtype); }

  static void grad_rows(const Params& p, at::ScalarType acc, at::ScalarType /* grads: grad_dtype, acc */) {
    AT_DISPATCH_FLOATING_TYPES(acc, "chosen_logprob_grad_cpu", [&] {
      with_logit_map<scalar_t>(p.options, [&](const auto& logit) { grad_rows_cpu<scalar_t>(p, logit); });
    });
  }

  static void add_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) { out.addmm_(a, b); }

  static void mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    if (out.scalar_type() == a.scalar_type()) at::mm_out(out, a, b);
    else out.copy_(at::mm(a, b));
  }

  static void combine(const Params& p, at::ScalarType acc) {
    AT_DISPATCH_FLOATING_TYPES(acc, "chosen_logprob_combine_cpu", [&] {
      const auto* partials = static_cast<const scalar_t*>(p.partials);
      auto* out = static_cast<scalar_t*>(p.out);
      at::parallel_for(0, p.rows, 256, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) combine_row(partials, p.ranks, p.rows, r, out);
      });
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("chosen_logprob_stats", &stats<CpuKernels>);
  m.impl("chosen_logprob_backward", &backward<CpuKernels>);
  m.impl("chosen_logprob_combine", &combine<CpuKernels>);
}

}  // namespace fused_rl_ops::chosen_logprob
