// chosen_logprob, CPU: the chunk loop with ATen GEMMs (in fp32, or fp64 for float64 inputs) and
// SIMD row kernels running the shared formulas of chosen_logprob/math.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "chosen_logprob/chunks.h"
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
void stats_rows_cpu(const acc* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens,
                    const Logit& logit, acc* stats) {
  using Vec = at::vec::Vectorized<acc>;
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
      stats_update_row(stats + 4 * r, RowStats<acc>{m, s, t}, x, tokens[r] - col0, C, logit);
    }
  });
}

template <typename acc, class Logit>
void grad_rows_cpu(acc* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens, const acc* row_max,
                   const acc* lse, const acc* mean, const acc* gl, const acc* ge, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const int64_t C_vec = C - C % Vec::size();
  const auto vlogit = logit.template as<Vec>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      acc* x = logits + r * C;
      const int64_t target = tokens[r] - col0;
      const bool has_target = target >= 0 && target < C;
      const acc x_target = has_target ? x[target] : acc(0);  // read before x is overwritten
      const Vec vmax(row_max[r]), vlse(lse[r]), vmean(mean[r]), vgl(gl[r]), vge(ge[r]);
      for (int64_t k = 0; k < C_vec; k += Vec::size()) {
        const Vec xk = Vec::loadu(x + k);
        (logit_grad(vlogit(xk) - vmax, vlse, vmean, vgl, vge) * vlogit.slope(xk)).store(x + k);
      }
      for (int64_t k = C_vec; k < C; ++k) {
        x[k] = logit_grad(logit(x[k]) - row_max[r], lse[r], mean[r], gl[r], ge[r]) * logit.slope(x[k]);
      }
      if (has_target) x[target] += gl[r] * logit.slope(x_target);
    }
  });
}

struct CpuBackend {
  static at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

  static void logits(const at::Tensor& h, const at::Tensor& w, at::Tensor& out) { at::mm_out(out, h, w.t()); }

  static void stats_rows(at::Tensor& logits, const at::Tensor& tokens, int64_t col0, double temperature,
                         double softcap, at::Tensor& stats) {
    AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "chosen_logprob_stats_cpu", [&] {
      with_logit_map<scalar_t>(temperature, softcap, [&](const auto& logit) {
        stats_rows_cpu<scalar_t>(logits.const_data_ptr<scalar_t>(), logits.size(0), logits.size(1), col0,
                                 tokens.const_data_ptr<int64_t>(), logit, stats.mutable_data_ptr<scalar_t>());
      });
    });
  }

  static void grad_rows(at::Tensor& logits, const at::Tensor& tokens, int64_t col0, const at::Tensor& row_max,
                        const at::Tensor& lse, const at::Tensor& mean, const at::Tensor& gl, const at::Tensor& ge,
                        double temperature, double softcap) {
    AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "chosen_logprob_grad_cpu", [&] {
      with_logit_map<scalar_t>(temperature, softcap, [&](const auto& logit) {
        grad_rows_cpu<scalar_t>(logits.mutable_data_ptr<scalar_t>(), logits.size(0), logits.size(1), col0,
                                tokens.const_data_ptr<int64_t>(), row_max.const_data_ptr<scalar_t>(),
                                lse.const_data_ptr<scalar_t>(), mean.const_data_ptr<scalar_t>(),
                                gl.const_data_ptr<scalar_t>(), ge.const_data_ptr<scalar_t>(), logit);
      });
    });
  }

  static at::Tensor grad_operand(const at::Tensor& dlogits, at::ScalarType) { return dlogits; }

  static void add_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) { out.addmm_(a, b); }

  static void mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    if (out.scalar_type() == a.scalar_type()) at::mm_out(out, a, b);
    else out.copy_(at::mm(a, b));
  }
};

at::Tensor stats_cpu(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                     double temperature, int64_t vocab_start, int64_t chunk_size, int64_t row_block,
                     int64_t pass_rows, std::optional<double> softcap) {
  return stats_impl<CpuBackend>(hidden, weight, tokens, temperature, vocab_start, chunk_size, row_block,
                                pass_rows, softcap);
}

std::tuple<at::Tensor, at::Tensor> backward_cpu(const at::Tensor& hidden, const at::Tensor& weight,
                                                const at::Tensor& tokens, const at::Tensor& row_max,
                                                const at::Tensor& lse, const at::Tensor& mean,
                                                const at::Tensor& grad_logprob,
                                                const at::Tensor& grad_entropy, double temperature,
                                                int64_t vocab_start, int64_t valid_rows, int64_t chunk_size,
                                                int64_t row_block, int64_t pass_rows,
                                                const std::optional<at::Tensor>& main_grad,
                                                std::optional<double> softcap) {
  return backward_impl<CpuBackend>(hidden, weight, tokens, row_max, lse, mean, grad_logprob, grad_entropy,
                                   temperature, vocab_start, valid_rows, chunk_size, row_block, pass_rows,
                                   main_grad, softcap);
}

at::Tensor combine_cpu(const at::Tensor& partials_in) {
  check_combine_input(partials_in);
  const at::Tensor partials = partials_in.contiguous();
  const int64_t ranks = partials.size(0), N = partials.size(1);
  at::Tensor out = at::empty({N, 4}, partials.options());
  AT_DISPATCH_FLOATING_TYPES(partials.scalar_type(), "chosen_logprob_combine_cpu", [&] {
    const scalar_t* p = partials.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) combine_row(p, ranks, N, r, o);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("chosen_logprob_stats", &stats_cpu);
  m.impl("chosen_logprob_backward", &backward_cpu);
  m.impl("chosen_logprob_combine", &combine_cpu);
}

}  // namespace fused_rl_ops::chosen_logprob
