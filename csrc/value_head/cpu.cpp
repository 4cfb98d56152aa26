// Value head, CPU kernels: the forward and the hidden gradient run over rows in parallel, in SIMD
// (reduced-precision rows are widened to fp32 as they are loaded); the weight and bias gradients
// follow the fixed two-stage reduction of value_head/math.h, with one parallel task per row block.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "value_head/entry.h"

namespace fused_rl_ops::value_head {
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

// Rows per parallel task: enough elements that a task outweighs its scheduling.
int64_t row_grain(int64_t H) { return std::max<int64_t>(1, 32768 / H); }

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

// Runs the kernels above for the given tensor's dtype (float64 too, for gradcheck).
struct CpuKernels {
  static void forward(const Params& p, const at::Tensor& hidden) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "value_head_cpu", [&] {
      using acc = acc_t<scalar_t>;
      const int64_t H = p.H;
      const acc b = p.bias != nullptr ? *static_cast<const acc*>(p.bias) : acc(0);
      const auto* h = static_cast<const scalar_t*>(p.hidden);
      const auto* w = static_cast<const acc*>(p.weight);
      auto* v = static_cast<acc*>(p.out);
      at::parallel_for(0, p.rows, row_grain(H), [&](int64_t r0, int64_t r1) {
        int64_t r = r0;
        for (; r + kRowsAtOnce <= r1; r += kRowsAtOnce) dot_rows<kRowsAtOnce>(h + r * H, H, w, v + r);
        for (; r < r1; ++r) dot_rows<1>(h + r * H, H, w, v + r);
        for (r = r0; r < r1; ++r) v[r] += b;
      });
    });
  }

  static void backward_hidden(const Params& p, const at::Tensor& grad_hidden) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_hidden.scalar_type(),
                                    "value_head_backward_hidden_cpu", [&] {
      using acc = acc_t<scalar_t>;
      const int64_t H = p.H;
      const auto* g = static_cast<const acc*>(p.grad_out);
      const auto* w = static_cast<const acc*>(p.weight);
      auto* dh = static_cast<scalar_t*>(p.grad_hidden);
      at::parallel_for(0, p.rows, row_grain(H), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) scale_row(g[r], w, dh + r * H, H);
      });
    });
  }

  static void backward_params(const Params& p, const at::Tensor& hidden) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "value_head_params_cpu", [&] {
      using acc = acc_t<scalar_t>;
      const int64_t H = p.H, rows = p.rows, blocks = value_head_row_blocks(rows);
      const auto* g = static_cast<const acc*>(p.grad_out);
      const auto* h = static_cast<const scalar_t*>(p.hidden);
      auto* wp = static_cast<acc*>(p.weight_partials);
      auto* bp = static_cast<acc*>(p.bias_partials);
      // Stage 1: one task per fixed block of rows, so the partials do not depend on the thread count.
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const auto [r0, r1] = value_head_block_rows(b, rows);
          std::fill(wp + b * H, wp + (b + 1) * H, acc(0));
          int64_t r = r0;
          for (; r + kRowsAtOnce <= r1; r += kRowsAtOnce) accumulate_rows<kRowsAtOnce>(g + r, h + r * H, H, wp + b * H);
          for (; r < r1; ++r) accumulate_rows<1>(g + r, h + r * H, H, wp + b * H);
          acc g_sum = 0;
          for (r = r0; r < r1; ++r) g_sum += g[r];
          bp[b] = g_sum;
        }
      });
      sum_partials(wp, blocks, H, static_cast<acc*>(p.grad_weight));
      sum_partials(bp, blocks, 1, static_cast<acc*>(p.grad_bias));
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
