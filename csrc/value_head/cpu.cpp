// Value head, CPU kernels: the forward and the hidden gradient run over rows in parallel, in SIMD
// (reduced-precision rows are widened to fp32 as they are loaded); the weight and bias gradients
// follow the fixed two-stage reduction of value_head/math.h, with one parallel task per row block.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common/torch_utils.h"
#include "value_head/args.h"

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

at::Tensor value_head_cpu(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                          const std::optional<at::Tensor>& bias) {
  check_value_head_args(hidden_in, weight_in, bias);
  const at::Tensor hidden = hidden_in.contiguous();
  const at::ScalarType acc_type = acc_dtype(hidden.scalar_type());
  const at::Tensor weight = value_head_weight(weight_in, acc_type);
  at::Tensor out = at::empty(value_head_out_shape(hidden.sizes()), hidden.options().dtype(acc_type));
  const int64_t H = hidden.size(-1), rows = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "value_head_cpu", [&] {
    using acc = acc_t<scalar_t>;
    const acc b = bias ? bias->to(acc_type).item<acc>() : acc(0);
    const auto* h = hidden.const_data_ptr<scalar_t>();
    const auto* w = weight.const_data_ptr<acc>();
    auto* v = out.mutable_data_ptr<acc>();
    at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
      int64_t r = r0;
      for (; r + kRowsAtOnce <= r1; r += kRowsAtOnce) dot_rows<kRowsAtOnce>(h + r * H, H, w, v + r);
      for (; r < r1; ++r) dot_rows<1>(h + r * H, H, w, v + r);
      for (r = r0; r < r1; ++r) v[r] += b;
    });
  });
  return out;
}

at::Tensor value_head_backward_hidden_cpu(const at::Tensor& grad_out_in, const at::Tensor& weight_in,
                                          at::ScalarType dtype) {
  const auto hidden_shape = backward_hidden_shape(grad_out_in, weight_in, dtype);
  const int64_t H = hidden_shape.back();
  const at::ScalarType acc_type = acc_dtype(dtype);
  const at::Tensor grad_out = grad_out_in.contiguous(), weight = value_head_weight(weight_in, acc_type);
  at::Tensor grad_hidden = at::empty(hidden_shape, grad_out.options().dtype(dtype));
  const int64_t rows = grad_out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "value_head_backward_hidden_cpu", [&] {
    using acc = acc_t<scalar_t>;
    const auto* g = grad_out.const_data_ptr<acc>();
    const auto* w = weight.const_data_ptr<acc>();
    auto* dh = grad_hidden.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) scale_row(g[r], w, dh + r * H, H);
    });
  });
  return grad_hidden;
}

std::tuple<at::Tensor, at::Tensor> value_head_backward_params_cpu(const at::Tensor& grad_out_in,
                                                                  const at::Tensor& hidden_in) {
  check_backward_params_args(grad_out_in, hidden_in);
  const at::Tensor hidden = hidden_in.contiguous(), grad_out = grad_out_in.contiguous();
  const at::ScalarType acc_type = acc_dtype(hidden.scalar_type());
  const int64_t H = hidden.size(-1), rows = grad_out.numel(), blocks = value_head_row_blocks(rows);
  const auto opts = grad_out.options().dtype(acc_type);
  at::Tensor weight_partials = at::zeros({blocks, H}, opts), bias_partials = at::empty({blocks}, opts);
  at::Tensor grad_weight = at::empty({H}, opts), grad_bias = at::empty({}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "value_head_params_cpu", [&] {
    using acc = acc_t<scalar_t>;
    const auto* g = grad_out.const_data_ptr<acc>();
    const auto* h = hidden.const_data_ptr<scalar_t>();
    auto* wp = weight_partials.mutable_data_ptr<acc>();
    auto* bp = bias_partials.mutable_data_ptr<acc>();
    // Stage 1: one task per fixed block of rows, so the partials do not depend on the thread count.
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const auto [r0, r1] = value_head_block_rows(b, rows);
        int64_t r = r0;
        for (; r + kRowsAtOnce <= r1; r += kRowsAtOnce) accumulate_rows<kRowsAtOnce>(g + r, h + r * H, H, wp + b * H);
        for (; r < r1; ++r) accumulate_rows<1>(g + r, h + r * H, H, wp + b * H);
        acc g_sum = 0;
        for (r = r0; r < r1; ++r) g_sum += g[r];
        bp[b] = g_sum;
      }
    });
    sum_partials(wp, blocks, H, grad_weight.mutable_data_ptr<acc>());
    sum_partials(bp, blocks, 1, grad_bias.mutable_data_ptr<acc>());
  });
  return {grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("value_head", &value_head_cpu);
  m.impl("value_head_backward_hidden", &value_head_backward_hidden_cpu);
  m.impl("value_head_backward_params", &value_head_backward_params_cpu);
}

}  // namespace fused_rl_ops::value_head
