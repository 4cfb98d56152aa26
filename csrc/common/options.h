// How an op's options (its non-tensor arguments) are declared: in groups, each once as a list
//   #define FRL_<GROUP>(X) X(C++ type, name, schema type, schema default, rule) ...
// in the order the schema takes them: the vocab-parallel ops' shared groups (vocab_parallel/) and an
// op's own (<op>/options.h). From a list the macros below make the schema's arguments (module.cpp),
// the group's struct, the typed op functions' parameters (entry.h) and their checks (check_options).
// A rule says what the option must be, in the words of the error. Python declares each group as an
// options dataclass with the same rules; the op contract test compares the two. Free of torch and
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
