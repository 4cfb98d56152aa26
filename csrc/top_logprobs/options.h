// top_logprobs' own options, after the groups every vocab-parallel op takes, declared once (how:
// common/options.h). Python declares them as TopLogprobsOptions.
#pragma once

#include "vocab_parallel/options.h"

// k: the ids kept per row (a default only because the options before it have some).
#define FRL_TOP_LOGPROBS_OPTIONS(X) X(int64_t, k, "int", "=1", PositiveInteger)

// Every option of the op, group by group, in the schema's order.
#define FRL_TOP_LOGPROBS_OP_OPTIONS(X) FRL_VOCAB_PARALLEL_OPTIONS(X) FRL_TOP_LOGPROBS_OPTIONS(X)

namespace fused_rl_ops::top_logprobs {

struct Options {
  FRL_TOP_LOGPROBS_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const Options& options, const Fn& fn) {
  FRL_TOP_LOGPROBS_OPTIONS(FRL_OPTION_VISIT)
}

}  // namespace fused_rl_ops::top_logprobs
