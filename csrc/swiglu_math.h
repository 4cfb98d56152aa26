// Clamped SwiGLU per-element math, one formula for the CPU and CUDA kernels.
//   g' = min(g, L), u' = clamp(u, -L, L), s = sigmoid(alpha g'), y = g' s (u' + beta)
// A gradient is masked only strictly beyond the limit: values exactly on -L or L keep theirs (the
// README's "Gradient masks"; torch 2.14's clamp gradient drops the boundary) and NaN inputs give
// NaN gradients rather than a silent zero. L = +inf means no clamp.
#pragma once

#include "common.h"

namespace fused_rl_ops {

struct SwigluParams {
  float alpha;
  float limit;   // L; +inf for no clamp
  float offset;  // beta, added to the linear half
};

// M supplies the primitives: Math<T> by default; the CPU kernels for bf16 / fp16 pass one with a
// faster exp (vec_math.h).
template <typename T, typename M = Math<T>>
FRL_HD T swiglu_sigmoid(T x) {
  return M::recip(T(1) + M::exp(T(0) - x));
}

template <typename T, typename M = Math<T>>
FRL_HD T swiglu_forward(T g, T u, const SwigluParams& p) {
  const T lim(p.limit), neg(-p.limit);
  g = M::select(g > lim, lim, g);  // NaN stays NaN, as torch.clamp
  u = M::select(u > lim, lim, M::select(u < neg, neg, u));
  const T s = swiglu_sigmoid<T, M>(T(p.alpha) * g);
  return g * s * (u + T(p.offset));
}

// Writes d/dg and d/du of swiglu_forward for upstream gradient dy.
template <typename T, typename M = Math<T>>
FRL_HD void swiglu_backward(T g, T u, T dy, const SwigluParams& p, T& dg, T& du) {
  const T lim(p.limit), neg(-p.limit), zero(0);
  const T gc = M::select(g > lim, lim, g);
  const T uc = M::select(u > lim, lim, M::select(u < neg, neg, u));
  const T alpha(p.alpha);
  const T s = swiglu_sigmoid<T, M>(alpha * gc);
  const T lin = uc + T(p.offset);
  dg = dy * lin * (s + alpha * gc * s * (T(1) - s));
  du = dy * gc * s;
  dg = M::select(g > lim, zero, dg);
  du = M::select((u > lim) | (u < neg), zero, du);
}

}  // namespace fused_rl_ops
