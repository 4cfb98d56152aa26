// Math<> for at::vec::Vectorized, so the CPU kernels run the shared per-element formulas in SIMD.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include "common.h"

namespace fused_rl_ops {

template <typename S>
struct Math<at::vec::Vectorized<S>> {
  using V = at::vec::Vectorized<S>;
  static V select(const V& mask, const V& a, const V& b) { return V::blendv(b, a, mask); }
  static V exp(const V& x) { return x.exp(); }
  static V log(const V& x) { return x.log(); }
  static V max(const V& a, const V& b) { return at::vec::maximum(a, b); }
  static V recip(const V& x) { return V(S(1)) / x; }
};

}  // namespace fused_rl_ops
