// Clamped SwiGLU per-element math, one formula for the CPU and CUDA kernels.
//   g' = min(g, L), u' = clamp(u, -L, L), s = sigmoid(alpha g'), y = g' s (u' + beta)
// A gradient is masked only strictly beyond the limit: values exactly on -L or L keep theirs (the
// README's "Gradient masks"; torch 2.14's clamp gradient drops the boundary) and NaN inputs give
// NaN gradients rather than a silent zero. L = +inf means no clamp.
#pragma once

#include "clamped_swiglu/options.h"
#include "common/math.h"

namespace fused_rl_ops::clamped_swiglu {

struct Activation {
  float alpha;
  float limit;   // L; +inf for no clamp
  float offset;  // beta, added to the linear half
};

// The formula's constants for the op's options.
inline Activation activation(const Options& options) {
  return {static_cast<float>(options.alpha), static_cast<float>(options.limit.value_or(INFINITY)),
          static_cast<float>(options.linear_offset)};
}

// M supplies the primitives: Math<T> by default; the CPU kernels for bf16 / fp16 pass one with a
// faster exp (common/vec_math.h).
template <typename T, typename M = Math<T>>
FRL_HD T clamped_swiglu_sigmoid(T x) {
  return M::recip(T(1) + M::exp(T(0) - x));
}

// One element's clamped gate g', sigmoid(alpha g') and u' + beta, which forward and backward share.
template <typename T>
struct Terms {
  T gate, sig, lin;
};

template <typename T, typename M = Math<T>>
FRL_HD Terms<T> clamped_swiglu_terms(T g, T u, const Activation& p) {
  const T lim(p.limit), neg(-p.limit);
  g = M::select(g > lim, lim, g);  // NaN stays NaN, as torch.clamp
  u = M::select(u > lim, lim, M::select(u < neg, neg, u));
  return {g, clamped_swiglu_sigmoid<T, M>(T(p.alpha) * g), u + T(p.offset)};
}

template <typename T, typename M = Math<T>>
FRL_HD T clamped_swiglu_forward(T g, T u, const Activation& p) {
  const Terms<T> t = clamped_swiglu_terms<T, M>(g, u, p);
  return t.gate * t.sig * t.lin;
}

// d/dg and d/du for upstream gradient dy, from the terms of (g, u).
template <typename T, typename M = Math<T>>
FRL_HD void clamped_swiglu_input_grads(const Terms<T>& t, T g, T u, T dy, const Activation& p, T& dg, T& du) {
  const T lim(p.limit), neg(-p.limit), zero(0), alpha(p.alpha);
  dg = dy * t.lin * (t.sig + alpha * t.gate * t.sig * (T(1) - t.sig));
  du = dy * t.gate * t.sig;
  dg = M::select(g > lim, zero, dg);
  du = M::select((u > lim) | (u < neg), zero, du);
}

// Writes d/dg and d/du of clamped_swiglu_forward for upstream gradient dy.
template <typename T, typename M = Math<T>>
FRL_HD void clamped_swiglu_backward(T g, T u, T dy, const Activation& p, T& dg, T& du) {
  clamped_swiglu_input_grads<T, M>(clamped_swiglu_terms<T, M>(g, u, p), g, u, dy, p, dg, du);
}

// The weighted form y = scale * clamped_swiglu_forward(g, u) (scale: the row's routing weight): writes
// d/dg and d/du, and returns this element's term dy * clamped_swiglu_forward(g, u) of d/dscale (the
// kernels sum it over the row).
template <typename T, typename M = Math<T>>
FRL_HD T clamped_swiglu_scaled_backward(T g, T u, T dy, T scale, const Activation& p, T& dg, T& du) {
  const Terms<T> t = clamped_swiglu_terms<T, M>(g, u, p);
  clamped_swiglu_input_grads<T, M>(t, g, u, dy * scale, p, dg, du);
  return dy * (t.gate * t.sig * t.lin);
}

}  // namespace fused_rl_ops::clamped_swiglu
