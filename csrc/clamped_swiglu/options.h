// Clamped SwiGLU's options: the non-tensor arguments of the clamped_swiglu ops, declared once (how:
// common/options.h). Python declares them as ClampedSwigluOptions.
// The kernels take them as the formula's constants (activation(), clamped_swiglu/math.h) and the
// layout flag of Params.
//   limit: the clamp L (+inf or none: no clamp).
//   alpha: the gate's sigmoid slope.
//   linear_offset: beta, added to the clamped linear half.
//   interleaved: x holds (g, u) pairs instead of the halves [g | u].
#pragma once

#include "common/options.h"

#define FRL_CLAMPED_SWIGLU_OPTIONS(X)                     \
  X(std::optional<double>, limit, "float?", "", Positive) \
  X(double, alpha, "float", "", PositiveFinite)           \
  X(double, linear_offset, "float", "", Finite)           \
  X(bool, interleaved, "bool", "", AnyBool)

namespace fused_rl_ops::clamped_swiglu {

struct Options {
  FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const Options& options, const Fn& fn) {
  FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_VISIT)
}

}  // namespace fused_rl_ops::clamped_swiglu
