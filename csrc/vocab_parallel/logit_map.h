// The logit map of every op over a vocab-parallel output layer: the GEMMs give raw logits
// x = h . w, the softmax takes z = map(x). Its options, declared once (how: common/options.h) and
// documented with the Python declaration, LogitMap:
//   temperature: z = x / temperature.
//   softcap: z = softcap * tanh(x / softcap) / temperature; none: no cap.
// The row kernels take the map's constants (with_logit_map), one kernel per map. A new map option
// is a line of the list below and its formula in with_logit_map. Free of torch and CUDA headers.
#pragma once

#include <optional>

#include "common/math.h"
#include "common/options.h"

// The options, each named P##name in a schema: a model's map P empty, a second model's (the
// teacher's of vocab_divergence) P teacher_; both are a LogitMap.
#define FRL_LOGIT_MAP_NAMED(P, X)                       \
  X(double, P##temperature, "float", "", PositiveFinite) \
  X(std::optional<double>, P##softcap, "float?", "", PositiveFinite)
#define FRL_LOGIT_MAP(X) FRL_LOGIT_MAP_NAMED(, X)
#define FRL_TEACHER_LOGIT_MAP(X) FRL_LOGIT_MAP_NAMED(teacher_, X)

namespace fused_rl_ops {

struct LogitMap {
  FRL_LOGIT_MAP(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const LogitMap& options, const Fn& fn) {
  FRL_LOGIT_MAP(FRL_OPTION_VISIT)
}

// z = x / T. Without a softcap the kernels run this map, which has no tanh.
// T may be a scalar or an at::vec::Vectorized; as<V>() broadcasts a scalar map to V.
template <typename T>
struct PlainLogit {
  T inv_temp;

  template <typename V>
  PlainLogit<V> as() const {
    return {V(inv_temp)};
  }
  FRL_HD T operator()(T x) const { return x * inv_temp; }
  FRL_HD T slope(T) const { return inv_temp; }  // dz / dx
};

// z = c tanh(x / c) / T (Gemma 2's final_logit_softcapping; the sampler's temperature acts on the
// capped logit). Both maps are nondecreasing, so a row's largest z is the map of its largest x.
template <typename T>
struct SoftcappedLogit {
  T inv_cap, cap_over_temp, inv_temp;

  template <typename V>
  SoftcappedLogit<V> as() const {
    return {V(inv_cap), V(cap_over_temp), V(inv_temp)};
  }
  FRL_HD T operator()(T x) const { return Math<T>::tanh(x * inv_cap) * cap_over_temp; }
  // dz / dx = (1 - tanh^2(x / c)) / T, written 4 e / (1 + e)^2 with e = exp(-2 |x / c|): near
  // saturation 1 - tanh^2 would subtract two numbers within an ulp of 1 and keep no significant
  // digit, where this keeps full relative precision down to underflow. 0 at x = +-inf, NaN at NaN.
  FRL_HD T slope(T x) const {
    const T e = Math<T>::exp(T(-2) * Math<T>::abs(x * inv_cap));
    const T one_plus_e = T(1) + e;
    return T(4) * e / (one_plus_e * one_plus_e) * inv_temp;
  }
};

// Calls fn with the map, in T: PlainLogit without a softcap, else SoftcappedLogit. Its constants
// are taken in double and rounded once.
template <typename T, class Fn>
void with_logit_map(const LogitMap& map, const Fn& fn) {
  const double temperature = map.temperature;
  if (const std::optional<double> cap = map.softcap) {
    fn(SoftcappedLogit<T>{T(1.0 / *cap), T(*cap / temperature), T(1.0 / temperature)});
  } else {
    fn(PlainLogit<T>{T(1.0 / temperature)});
  }
}

// A CPU row-kernel table's call (common/cpu_isa.h): fn(zero, logit) in acc = decltype(zero), double
// where fp64, else float, with the map in acc.
template <class Fn>
void with_acc_logit_map(const LogitMap& map, bool fp64, const Fn& fn) {
  const auto in = [&](auto zero) {
    with_logit_map<decltype(zero)>(map, [&](const auto& logit) { fn(zero, logit); });
  };
  if (fp64) in(double(0));
  else in(float(0));
}

}  // namespace fused_rl_ops
