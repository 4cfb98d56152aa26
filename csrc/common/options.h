// How an op's options (its non-tensor arguments) are declared: in groups, each once as a list
//   #define FRL_<GROUP>(X) X(C++ type, name, schema type, schema default, rule) ...
// in the order the schema takes them: the groups every vocab-parallel op shares (FRL_LOGIT_MAP in
// vocab_parallel/logit_map.h, FRL_VOCAB_SHARD and FRL_TILING in vocab_parallel/options.h) and an op's own
// (FRL_<OP>_OPTIONS in <op>/options.h). An op's schema takes its groups one after the other. From
// a list the macros below make the schema's arguments (module.cpp), the group's struct, the
// parameters of the typed op functions (entry.h) and their checks (check_options,
// common/torch_utils.h). A rule is one of the structs below: what the option must be, in the words
// of the error, and the test. Python declares each group as an options dataclass with the same
// rules (fused_rl_ops/_options.py); tests/test_op_contract.py compares the two. Free of torch and
// CUDA headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

namespace fused_rl_ops {

struct PositiveFinite {
  static constexpr const char* requirement = "a positive finite number";
  static bool holds(double v) { return v > 0 && std::isfinite(v); }
};

struct Positive {  // +inf included
  static constexpr const char* requirement = "a positive number";
  static bool holds(double v) { return v > 0; }
};

struct Finite {
  static constexpr const char* requirement = "a finite number";
  static bool holds(double v) { return std::isfinite(v); }
};

struct PositiveInteger {
  static constexpr const char* requirement = "a positive integer";
  static bool holds(int64_t v) { return v > 0; }
};

struct NonNegativeInteger {
  static constexpr const char* requirement = "a non-negative integer";
  static bool holds(int64_t v) { return v >= 0; }
};

struct Integer {  // any, negative too (ignore_index)
  static constexpr const char* requirement = "an integer";
  static bool holds(int64_t) { return true; }
};

struct AnyBool {
  static constexpr const char* requirement = "True or False";
  static bool holds(bool) { return true; }
};

}  // namespace fused_rl_ops

// A field of a group's struct (an optional option is std::optional: none means None).
#define FRL_OPTION_FIELD(type, name, schema_type, schema_default, rule) type name{};
// ", float alpha", ", float? limit=None": the option in the schema, after the op's tensors.
#define FRL_OPTION_SCHEMA(type, name, schema_type, schema_default, rule) ", " schema_type " " #name schema_default
// The option as a parameter of a typed op function, after its tensors.
#define FRL_OPTION_PARAM(type, name, schema_type, schema_default, rule) , type name
// The parameter of the same name, as an initializer: Group{FRL_GROUP(FRL_OPTION_VALUE)}.
#define FRL_OPTION_VALUE(type, name, schema_type, schema_default, rule) name,
// In visit_options: calls fn(name, value, rule) for the option.
#define FRL_OPTION_VISIT(type, name, schema_type, schema_default, rule) fn(#name, options.name, rule{});
