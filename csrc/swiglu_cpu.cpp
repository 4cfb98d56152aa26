// Clamped SwiGLU, CPU kernels: rows are cut into tiles of kTile outputs run through the shared
// formula in SIMD. Full tiles of the [g | u] layout load and store vectors straight from memory;
// the interleaved layout and a row's last partial tile go through fp32 (fp64 for double) buffers.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "swiglu_args.h"
#include "vec_math.h"

namespace fused_rl_ops {
namespace {

template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

constexpr int64_t kTile = 64;  // outputs per tile: a multiple of every SIMD width

// Copies tile [c, c + n) of one row's gate and linear halves into g and u.
template <typename scalar_t, typename acc>
void load_tile(const scalar_t* row, int64_t F, int64_t c, int64_t n, bool interleaved, acc* g, acc* u) {
  if (interleaved) {
    for (int64_t k = 0; k < n; ++k) {
      g[k] = static_cast<acc>(row[2 * (c + k)]);
      u[k] = static_cast<acc>(row[2 * (c + k) + 1]);
    }
  } else {
    for (int64_t k = 0; k < n; ++k) {
      g[k] = static_cast<acc>(row[c + k]);
      u[k] = static_cast<acc>(row[F + c + k]);
    }
  }
}

// SIMD load / store of Vectorized<acc>::size() elements of scalar_t, converting to / from acc.
template <typename scalar_t, typename acc = acc_t<scalar_t>>
at::vec::Vectorized<acc> load_acc(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, acc>) {
    return at::vec::Vectorized<acc>::loadu(p);
  } else {
    at::vec::Vectorized<float> v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

template <typename scalar_t, typename acc = acc_t<scalar_t>>
void store_acc(const at::vec::Vectorized<acc>& v, scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, acc>) {
    v.store(p);
  } else {
    alignas(64) float lanes[at::vec::Vectorized<float>::size()];
    v.store(lanes);
    for (int k = 0; k < at::vec::Vectorized<float>::size(); ++k) p[k] = static_cast<scalar_t>(lanes[k]);
  }
}

// Calls fn(row, c, n) for every tile of a [rows, F] output, in parallel.
template <typename Fn>
void for_each_tile(int64_t rows, int64_t F, const Fn& fn) {
  const int64_t tiles_per_row = (F + kTile - 1) / kTile;
  at::parallel_for(0, rows * tiles_per_row, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / tiles_per_row, c = (t % tiles_per_row) * kTile;
      fn(r, c, std::min(kTile, F - c));
    }
  });
}

template <typename scalar_t>
void swiglu_forward_cpu(const scalar_t* x, scalar_t* y, int64_t rows, int64_t F, bool interleaved,
                        const SwigluParams& p) {
  using acc = acc_t<scalar_t>;
  using Vec = at::vec::Vectorized<acc>;
  for_each_tile(rows, F, [&](int64_t r, int64_t c, int64_t n) {
    if (!interleaved && n == kTile) {
      const scalar_t* xr = x + r * 2 * F + c;
      for (int64_t k = 0; k < kTile; k += Vec::size()) {
        store_acc(swiglu_forward(load_acc(xr + k), load_acc(xr + F + k), p), y + r * F + c + k);
      }
      return;
    }
    alignas(64) acc g[kTile] = {}, u[kTile] = {}, out[kTile];
    load_tile(x + r * 2 * F, F, c, n, interleaved, g, u);
    for (int64_t k = 0; k < kTile; k += Vec::size()) {
      swiglu_forward(Vec::loadu(g + k), Vec::loadu(u + k), p).store(out + k);
    }
    scalar_t* yr = y + r * F + c;
    for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<scalar_t>(out[k]);
  });
}

template <typename scalar_t>
void swiglu_backward_cpu(const scalar_t* dy, const scalar_t* x, scalar_t* dx, int64_t rows, int64_t F,
                         bool interleaved, const SwigluParams& p) {
  using acc = acc_t<scalar_t>;
  using Vec = at::vec::Vectorized<acc>;
  for_each_tile(rows, F, [&](int64_t r, int64_t c, int64_t n) {
    if (!interleaved && n == kTile) {
      const scalar_t* xr = x + r * 2 * F + c;
      scalar_t* dxr = dx + r * 2 * F + c;
      for (int64_t k = 0; k < kTile; k += Vec::size()) {
        Vec vdg, vdu;
        swiglu_backward(load_acc(xr + k), load_acc(xr + F + k), load_acc(dy + r * F + c + k), p, vdg, vdu);
        store_acc(vdg, dxr + k);
        store_acc(vdu, dxr + F + k);
      }
      return;
    }
    alignas(64) acc g[kTile] = {}, u[kTile] = {}, d[kTile] = {}, dg[kTile], du[kTile];
    load_tile(x + r * 2 * F, F, c, n, interleaved, g, u);
    const scalar_t* dyr = dy + r * F + c;
    for (int64_t k = 0; k < n; ++k) d[k] = static_cast<acc>(dyr[k]);
    for (int64_t k = 0; k < kTile; k += Vec::size()) {
      Vec vdg, vdu;
      swiglu_backward(Vec::loadu(g + k), Vec::loadu(u + k), Vec::loadu(d + k), p, vdg, vdu);
      vdg.store(dg + k);
      vdu.store(du + k);
    }
    scalar_t* dxr = dx + r * 2 * F;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t gi = interleaved ? 2 * (c + k) : c + k;
      const int64_t ui = interleaved ? gi + 1 : F + c + k;
      dxr[gi] = static_cast<scalar_t>(dg[k]);
      dxr[ui] = static_cast<scalar_t>(du[k]);
    }
  });
}

at::Tensor clamped_swiglu_cpu(const at::Tensor& x, std::optional<double> limit, double alpha, double linear_offset,
                              bool interleaved) {
  const SwigluCall c = swiglu_forward_call(x, limit, alpha, linear_offset);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clamped_swiglu_cpu", [&] {
    swiglu_forward_cpu(c.x.const_data_ptr<scalar_t>(), c.half.mutable_data_ptr<scalar_t>(), c.rows, c.F, interleaved,
                       c.p);
  });
  return c.half;
}

at::Tensor clamped_swiglu_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, std::optional<double> limit,
                                       double alpha, double linear_offset, bool interleaved) {
  const SwigluCall c = swiglu_backward_call(grad_out, x, limit, alpha, linear_offset);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clamped_swiglu_backward_cpu", [&] {
    swiglu_backward_cpu(c.half.const_data_ptr<scalar_t>(), c.x.const_data_ptr<scalar_t>(),
                        c.full.mutable_data_ptr<scalar_t>(), c.rows, c.F, interleaved, c.p);
  });
  return c.full;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) {
  m.impl("clamped_swiglu", &clamped_swiglu_cpu);
  m.impl("clamped_swiglu_backward", &clamped_swiglu_backward_cpu);
}

}  // namespace fused_rl_ops
