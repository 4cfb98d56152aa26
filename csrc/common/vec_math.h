// Math<> for at::vec::Vectorized, so the CPU kernels run the shared per-element formulas in SIMD.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include "common/math.h"

namespace fused_rl_ops {

template <typename S>
struct Math<at::vec::Vectorized<S>> {
  using V = at::vec::Vectorized<S>;
  static V select(const V& mask, const V& a, const V& b) { return V::blendv(b, a, mask); }
  static V exp(const V& x) { return x.exp(); }
  static V log(const V& x) { return x.log(); }
  static V tanh(const V& x) { return x.tanh(); }
  static V abs(const V& x) { return x.abs(); }
  static V max(const V& a, const V& b) { return at::vec::maximum(a, b); }
  static V recip(const V& x) { return V(S(1)) / x; }
};

// Math<Vectorized<float>> with ATen's polynomial exp_u20 (within 20 fp32 ulp, the exp Inductor's CPU
// code uses, much cheaper than Sleef's u10), for kernels whose results are rounded to bf16 or fp16:
// 20 fp32 ulp is 1/3000 of a bf16 ulp and 1/400 of an fp16 ulp. exp_u20 saturates to +inf and 0 as
// exp does, but turns NaN into +inf (it clamps its input with min / max), so NaN is put back.
struct MathForHalfOutputs : Math<at::vec::Vectorized<float>> {
  static V exp(const V& x) { return V::blendv(x.exp_u20(), x, x.isnan()); }
};

// The largest and the sum of a vector's lanes (NaN-propagating max, as Math<>::max).
template <typename S>
S horizontal_max(const at::vec::Vectorized<S>& v) {
  alignas(64) S lanes[at::vec::Vectorized<S>::size()];
  v.store(lanes);
  S m = lanes[0];
  for (int k = 1; k < at::vec::Vectorized<S>::size(); ++k) m = Math<S>::max(m, lanes[k]);
  return m;
}

template <typename S>
S horizontal_sum(const at::vec::Vectorized<S>& v) {
  alignas(64) S lanes[at::vec::Vectorized<S>::size()];
  v.store(lanes);
  S s = 0;
  for (int k = 0; k < at::vec::Vectorized<S>::size(); ++k) s += lanes[k];
  return s;
}

}  // namespace fused_rl_ops
