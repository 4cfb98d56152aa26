// value_head's CPU row kernels, in SIMD (reduced-precision rows are widened to fp32 as they are
// loaded), compiled once per ISA (common/cpu_isa.h); no torch header but at::vec.
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <cmath>

#include "value_head/cpu_rows.h"

namespace fused_rl_ops::value_head::CPU_CAPABILITY {
namespace {

// Loads and stores a row in chunks of two accumulator vectors, whatever the element type.
template <typename scalar_t>
struct Chunk {
  using acc = acc_t<scalar_t>;
  using Vec = at::vec::Vectorized<acc>;
  static constexpr int64_t kSize = 2 * Vec::size();
  static_assert(std::is_same_v<scalar_t, acc> || at::vec::Vectorized<scalar_t>::size() == kSize);

  static std::pair<Vec, Vec> load(const scalar_t* p) {
    if constexpr (std::is_same_v<scalar_t, acc>) {
      return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
    } else {
      auto [lo, hi] = at::vec::convert_to_float(at::vec::Vectorized<scalar_t>::loadu(p));
      return {lo, hi};
    }
  }
  static void store(scalar_t* p, const Vec& lo, const Vec& hi) {
    if constexpr (std::is_same_v<scalar_t, acc>) {
      lo.store(p);
      hi.store(p + Vec::size());
    } else {
      at::vec::convert_from_float<scalar_t>(lo, hi).store(p);
    }
  }
};

// Rows handled side by side: the weight or partial chunk is loaded once for all of them, and the
// rows stream in parallel (more memory traffic in flight than one row gives).
constexpr int kRowsAtOnce = 4;

// out[i] = sum_j h[i * H + j] w[j] for kRows consecutive rows.
template <int kRows, typename scalar_t, typename acc = acc_t<scalar_t>>
void dot_rows(const scalar_t* h, int64_t H, const acc* w, acc* out) {
  using C = Chunk<scalar_t>;
  using Vec = typename C::Vec;
  Vec sum_lo[kRows], sum_hi[kRows];
  for (int i = 0; i < kRows; ++i) sum_lo[i] = sum_hi[i] = Vec(0);
  int64_t j = 0;
  for (; j + C::kSize <= H; j += C::kSize) {
    const Vec w_lo = Vec::loadu(w + j), w_hi = Vec::loadu(w + j + Vec::size());
    for (int i = 0; i < kRows; ++i) {
      const auto [lo, hi] = C::load(h + i * H + j);
      sum_lo[i] = at::vec::fmadd(lo, w_lo, sum_lo[i]);
      sum_hi[i] = at::vec::fmadd(hi, w_hi, sum_hi[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    out[i] = at::vec::vec_reduce_all([](const Vec& a, const Vec& b) { return a + b; }, sum_lo[i] + sum_hi[i]);
    for (int64_t k = j; k < H; ++k) out[i] = std::fma(static_cast<acc>(h[i * H + k]), w[k], out[i]);
  }
}

// dh = g * w, rounded to dh's dtype.
template <typename scalar_t, typename acc = acc_t<scalar_t>>
void scale_row(acc g, const acc* w, scalar_t* dh, int64_t H) {
  using C = Chunk<scalar_t>;
  const typename C::Vec vg(g);
  int64_t j = 0;
  for (; j + C::kSize <= H; j += C::kSize) {
    C::store(dh + j, vg * C::Vec::loadu(w + j), vg * C::Vec::loadu(w + j + C::Vec::size()));
  }
  for (; j < H; ++j) dh[j] = static_cast<scalar_t>(g * w[j]);
}

// partial += g[i] * h[i * H + :] for kRows consecutive rows, added in row order.
template <int kRows, typename scalar_t, typename acc = acc_t<scalar_t>>
void accumulate_rows(const acc* g, const scalar_t* h, int64_t H, acc* partial) {
  using C = Chunk<scalar_t>;
  using Vec = typename C::Vec;
  Vec vg[kRows];
  for (int i = 0; i < kRows; ++i) vg[i] = Vec(g[i]);
  int64_t j = 0;
  for (; j + C::kSize <= H; j += C::kSize) {
    Vec sum_lo = Vec::loadu(partial + j), sum_hi = Vec::loadu(partial + j + Vec::size());
    for (int i = 0; i < kRows; ++i) {
      const auto [lo, hi] = C::load(h + i * H + j);
      sum_lo = at::vec::fmadd(vg[i], lo, sum_lo);
      sum_hi = at::vec::fmadd(vg[i], hi, sum_hi);
    }
    sum_lo.store(partial + j);
    sum_hi.store(partial + j + Vec::size());
  }
  for (; j < H; ++j) {
    for (int i = 0; i < kRows; ++i) partial[j] = std::fma(g[i], static_cast<acc>(h[i * H + j]), partial[j]);
  }
}

// Rows [begin, end) of the forward: v = h . w + b.
template <typename scalar_t, typename acc = acc_t<scalar_t>>
void forward_rows(const Params& p, int64_t begin, int64_t end) {
  const int64_t H = p.H;
  const acc b = p.bias != nullptr ? *static_cast<const acc*>(p.bias) : acc(0);
  const auto* h = static_cast<const scalar_t*>(p.hidden);
  const auto* w = static_cast<const acc*>(p.weight);
  auto* v = static_cast<acc*>(p.out);
  int64_t r = begin;
  for (; r + kRowsAtOnce <= end; r += kRowsAtOnce) dot_rows<kRowsAtOnce>(h + r * H, H, w, v + r);
  for (; r < end; ++r) dot_rows<1>(h + r * H, H, w, v + r);
  for (r = begin; r < end; ++r) v[r] += b;
}

template <typename scalar_t, typename acc = acc_t<scalar_t>>
void backward_hidden_rows(const Params& p, int64_t begin, int64_t end) {
  const int64_t H = p.H;
  const auto* g = static_cast<const acc*>(p.grad_out);
  const auto* w = static_cast<const acc*>(p.weight);
  auto* dh = static_cast<scalar_t*>(p.grad_hidden);
  for (int64_t r = begin; r < end; ++r) scale_row(g[r], w, dh + r * H, H);
}

// Blocks [begin, end) of stage 1: each block's rows summed in row order into its own partials.
template <typename scalar_t, typename acc = acc_t<scalar_t>>
void partials_blocks(const Params& p, int64_t begin, int64_t end) {
  const int64_t H = p.H, rows = p.rows;
  const auto* g = static_cast<const acc*>(p.grad_out);
  const auto* h = static_cast<const scalar_t*>(p.hidden);
  auto* wp = static_cast<acc*>(p.weight_partials);
  auto* bp = static_cast<acc*>(p.bias_partials);
  for (int64_t b = begin; b < end; ++b) {
    const auto [r0, r1] = value_head_block_rows(b, rows);
    std::fill(wp + b * H, wp + (b + 1) * H, acc(0));
    int64_t r = r0;
    for (; r + kRowsAtOnce <= r1; r += kRowsAtOnce) accumulate_rows<kRowsAtOnce>(g + r, h + r * H, H, wp + b * H);
    for (; r < r1; ++r) accumulate_rows<1>(g + r, h + r * H, H, wp + b * H);
    acc g_sum = 0;
    for (r = r0; r < r1; ++r) g_sum += g[r];
    bp[b] = g_sum;
  }
}

}  // namespace

const RowKernels row_kernels{
    [](const Params& p, CpuDType hidden, int64_t begin, int64_t end) {
      with_cpu_dtype(hidden, [&](auto zero) { forward_rows<decltype(zero)>(p, begin, end); });
    },
    [](const Params& p, CpuDType hidden, int64_t begin, int64_t end) {
      with_cpu_dtype(hidden, [&](auto zero) { backward_hidden_rows<decltype(zero)>(p, begin, end); });
    },
    [](const Params& p, CpuDType hidden, int64_t begin, int64_t end) {
      with_cpu_dtype(hidden, [&](auto zero) { partials_blocks<decltype(zero)>(p, begin, end); });
    },
};

}  // namespace fused_rl_ops::value_head::CPU_CAPABILITY
