// Helpers for the torch-side glue of the CPU and CUDA kernels (not for .cu files): dtype mappings,
// and the checks each op makes of its arguments, worded as the Python checks word them: ValueError
// for a bad value or shape, TypeError for a bad dtype.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "common/cpu_dtype.h"
#include "common/math.h"
#include "common/options.h"

namespace fused_rl_ops {

// The accumulation (and fp32-output) dtype of a kernel reading `dtype`, as acc_t in common/math.h.
inline at::ScalarType acc_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

inline DType to_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "fused_rl_ops: unsupported dtype ", dtype, " on CUDA");
  }
}

inline DType to_dtype(const at::Tensor& t) { return to_dtype(t.scalar_type()); }

inline CpuDType to_cpu_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return CpuDType::kFloat64;
    case at::kFloat: return CpuDType::kFloat32;
    case at::kBFloat16: return CpuDType::kBFloat16;
    case at::kHalf: return CpuDType::kFloat16;
    default: TORCH_CHECK(false, "fused_rl_ops: unsupported dtype ", t.scalar_type(), " on CPU");
  }
}

// "op: <prefix>name must be <the rule's requirement>, got value"; an optional option may also be none.
template <class T, class Rule>
void check_option(const char* op, const char* prefix, const char* name, const T& value, Rule) {
  TORCH_CHECK_VALUE(Rule::holds(value), op, ": ", prefix, name, " must be ", Rule::requirement, ", got ", value);
}

template <class T, class Rule>
void check_option(const char* op, const char* prefix, const char* name, const std::optional<T>& value, Rule) {
  TORCH_CHECK_VALUE(!value || Rule::holds(*value), op, ": ", prefix, name, " must be None or ", Rule::requirement,
                    ", got ", *value);
}

// Every option of an op's Options (declared as common/options.h says), in its declared order; prefix:
// what the schema puts before their names (a group it takes twice: "teacher_").
template <class Options>
void check_options(const char* op, const Options& options, const char* prefix = "") {
  visit_options(options, [&](const char* name, const auto& value, auto rule) {
    check_option(op, prefix, name, value, rule);
  });
}

// The floating dtypes the kernels read: float32, bfloat16, float16, and float64 on the CPU.
inline void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const at::ScalarType dtype = t.scalar_type();
  const bool ok = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
                  (dtype == at::kDouble && t.is_cpu());
  TORCH_CHECK_TYPE(ok, op, ": ", name, " must be float32, bfloat16 or float16",
                   dtype == at::kDouble ? " (float64 only on CPU)" : "", ", got ", dtype);
}

// Megatron's gradient-accumulation buffer of weight (none: undefined): float32, or weight's dtype,
// of weight's shape and on its device.
inline void check_main_grad(const char* op, const std::optional<at::Tensor>& main_grad, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(!main_grad || (main_grad->sizes() == weight.sizes() && main_grad->device() == weight.device() &&
                                   (main_grad->scalar_type() == at::kFloat ||
                                    main_grad->scalar_type() == weight.scalar_type())),
                    op, ": main_grad must be a float32 (or weight-dtype) tensor of weight's shape ", weight.sizes(),
                    " on ", weight.device());
}

inline void check_same_device(const char* op, const at::Tensor& first, const at::Tensor& other, const char* names) {
  TORCH_CHECK_VALUE(other.device() == first.device(), op, ": all tensors must be on one device, got ", names, " on ",
                    first.device(), " and ", other.device());
}

}  // namespace fused_rl_ops
