// chosen_logprob's CPU row kernels: SIMD (at::vec) runs of the shared formulas of
// chosen_logprob/math.h and sampler_filter.h, compiled once per ISA (common/cpu_isa.h); no torch
// header but at::vec.
#include <vector>

#include "chosen_logprob/cpu_rows.h"
#include "chosen_logprob/math.h"
#include "chosen_logprob/sampler_filter.h"
#include "common/vec_math.h"
#include "vocab_parallel/stats_rows_cpu.h"

namespace fused_rl_ops::chosen_logprob::CPU_CAPABILITY {
namespace {

// Into p.grads (acc; may be p.logits itself: each row's chosen columns are computed before the row
// is overwritten, then written over it: gather_chosen_grads, scatter_chosen_grads).
template <typename acc, class Logit>
void grad_rows_cpu(const Params& p, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* logits = static_cast<const acc*>(p.logits);
  auto* grads = static_cast<acc*>(p.grads);
  const auto* row_max = static_cast<const acc*>(p.row_max);
  const auto* log_sum = static_cast<const acc*>(p.log_sum);
  const auto* log_sum_minus_entropy = static_cast<const acc*>(p.log_sum_minus_entropy);
  const auto *gl = static_cast<const acc*>(p.grad_logprob), *ge = static_cast<const acc*>(p.grad_entropy);
  const int64_t N = p.rows, C = p.cols, col0 = p.col0, k = p.tokens_per_row;
  const int64_t* tokens = p.tokens;
  const auto* threshold = static_cast<const acc*>(p.threshold);
  const int64_t C_vec = C - C % Vec::size();
  const auto vlogit = logit.template as<Vec>();
  std::vector<acc> chosen(k);
  for (int64_t r = 0; r < N; ++r) {
    const acc* x = logits + r * C;
    acc* d = grads + r * p.grads_stride;
    const int64_t* targets = tokens + k * r;
    const acc m = row_max[r], l = log_sum[r], l_minus_ent = log_sum_minus_entropy[r];
    const acc tau = threshold ? threshold[r] : acc(-INFINITY);
    const acc G = gather_chosen_grads(x, targets, gl + k * r, k, col0, C, m, tau, l, l_minus_ent, ge[r], logit,
                                      chosen.data());
    const Vec vm(m), vtau(tau), vl(l), vl_minus_ent(l_minus_ent), vG(G), vge(ge[r]);
    for (int64_t c = 0; c < C_vec; c += Vec::size()) {
      const Vec xc = Vec::loadu(x + c);
      (logit_grad(vlogit(xc), vm, vtau, vl, vl_minus_ent, vG, vge) * vlogit.slope(xc)).store(d + c);
    }
    for (int64_t c = C_vec; c < C; ++c) {
      d[c] = logit_grad(logit(x[c]), m, tau, l, l_minus_ent, G, ge[r]) * logit.slope(x[c]);
    }
    scatter_chosen_grads(d, targets, chosen.data(), k, col0, C, [](acc v) { return v; });
  }
}

// The window's bounds (SearchWindow::lowest, highest) rounded outwards to acc: every logit of the
// window lies in [lo, hi], so a vector with none there is skipped.
template <typename acc>
std::pair<acc, acc> window_bounds(const SearchWindow& window) {
  return {std::nextafter(acc(window.lowest()), acc(-INFINITY)), std::nextafter(acc(window.highest()), acc(INFINITY))};
}

// Gives each logit of a row that the filter keeps (threshold) and that lies in its window (window;
// without one, every logit) to the row's top (chosen_logprob/sampler_filter.h), in column order.
template <typename acc, class Logit>
void top_rows_cpu(const Params& p, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* logits = static_cast<const acc*>(p.logits);
  const auto* threshold = static_cast<const acc*>(p.threshold);
  const auto* windows = static_cast<const double*>(p.window);
  auto* tops = static_cast<acc*>(p.top);
  const int64_t N = p.rows, C = p.cols, K = p.top_width;
  const int64_t C_vec = C - C % Vec::size();
  const int no_lane = (1 << Vec::size()) - 1;  // the zero_mask of a comparison no lane passes
  const auto vlogit = logit.template as<Vec>();
  alignas(64) acc lanes[Vec::size()];
  for (int64_t r = 0; r < N; ++r) {
    const SearchWindow window = windows ? SearchWindow{windows[2 * r], windows[2 * r + 1]} : SearchWindow{1, 0};
    if (!window.active()) continue;
    const acc tau = threshold ? threshold[r] : acc(-INFINITY);
    const acc* x = logits + r * C;
    acc* top = tops + r * (top_column::values + K);
    int64_t seen = 0;
    const auto give = [&](acc z) {
      if (z < tau || (windows && !SearchWindow::in_range(window.cell(z)))) return;
      ++seen;
      if (z >= top_floor(top, K)) top_push(top, K, z);
    };
    const auto [lo, hi] = windows ? window_bounds<acc>(window) : std::pair<acc, acc>(-INFINITY, INFINITY);
    const Vec vlo(lo), vhi(hi), vtau(tau);
    for (int64_t k = 0; k < C_vec; k += Vec::size()) {
      const Vec z = vlogit(Vec::loadu(x + k));
      if (!windows && !threshold) {  // every logit counts; one below the floor changes nothing
        seen += Vec::size();
        if ((z >= Vec(top_floor(top, K))).zero_mask() == no_lane) continue;
        z.store(lanes);
        for (int j = 0; j < Vec::size(); ++j) {
          if (lanes[j] >= top_floor(top, K)) top_push(top, K, lanes[j]);
        }
        continue;
      }
      if (windows ? ((z >= vlo) & (z <= vhi)).zero_mask() == no_lane  // none in the window (nor a NaN)
                  : (z < vtau).zero_mask() == 0) {                     // all dropped
        continue;
      }
      z.store(lanes);
      for (int j = 0; j < Vec::size(); ++j) give(lanes[j]);
    }
    for (int64_t k = C_vec; k < C; ++k) give(logit(x[k]));
    top[top_column::seen] += acc(seen);
  }
}

// Adds the mass (relative to the global row max) of each logit in a row's search window to the
// row's histogram, in the bin of its cell.
template <typename acc, class Logit>
void hist_rows_cpu(const Params& p, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* logits = static_cast<const acc*>(p.logits);
  const auto* row_max = static_cast<const acc*>(p.row_max);
  const auto* windows = static_cast<const double*>(p.window);
  auto* hist = static_cast<int64_t*>(p.hist);
  const int64_t N = p.rows, C = p.cols;
  const int64_t C_vec = C - C % Vec::size();
  const int no_lane = (1 << Vec::size()) - 1;
  const auto vlogit = logit.template as<Vec>();
  alignas(64) acc z[Vec::size()], mass[Vec::size()];
  for (int64_t r = 0; r < N; ++r) {
    const SearchWindow window{windows[2 * r], windows[2 * r + 1]};
    if (!window.active()) continue;
    const auto [lo, hi] = window_bounds<acc>(window);
    const acc m = row_max[r];
    const acc* x = logits + r * C;
    int64_t* bins = hist + r * kSearchBins;
    const auto add = [&](acc zk, acc mk) {
      const double cell = window.cell(zk);
      if (SearchWindow::in_range(cell)) bins[int64_t(cell)] += mass_units(mk);
    };
    const Vec vlo(lo), vhi(hi), vm(m);
    for (int64_t k = 0; k < C_vec; k += Vec::size()) {
      const Vec zk = vlogit(Vec::loadu(x + k));
      if (((zk >= vlo) & (zk <= vhi)).zero_mask() == no_lane) continue;
      zk.store(z);
      Math<Vec>::exp(zk - vm).store(mass);
      for (int j = 0; j < Vec::size(); ++j) add(z[j], mass[j]);
    }
    for (int64_t k = C_vec; k < C; ++k) {
      const acc zk = logit(x[k]);
      add(zk, Math<acc>::exp(zk - m));
    }
  }
}

void grad_rows(const Params& p, bool fp64) {
  with_acc_logit_map(p.logit_map, fp64, [&](auto zero, const auto& logit) { grad_rows_cpu<decltype(zero)>(p, logit); });
}

void top_rows(const Params& p, bool fp64) {
  with_acc_logit_map(p.logit_map, fp64, [&](auto zero, const auto& logit) { top_rows_cpu<decltype(zero)>(p, logit); });
}

void hist_rows(const Params& p, bool fp64) {
  with_acc_logit_map(p.logit_map, fp64, [&](auto zero, const auto& logit) { hist_rows_cpu<decltype(zero)>(p, logit); });
}

}  // namespace

const RowKernels row_kernels{&::fused_rl_ops::CPU_CAPABILITY::stats_rows_cpu<Params>, &grad_rows, &top_rows,
                             &hist_rows};

}  // namespace fused_rl_ops::chosen_logprob::CPU_CAPABILITY
