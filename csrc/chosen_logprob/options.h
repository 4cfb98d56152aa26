// chosen_logprob's own options, after the groups every vocab-parallel op takes (common/logit_map.h,
// common/vocab_parallel.h), declared once (how: common/options.h; what each means:
// docs/chosen_logprob.md, "The ops underneath"). Python declares them as ChosenLogprobOptions
// (fused_rl_ops/chosen_logprob.py).
#pragma once

#include "common/logit_map.h"
#include "common/vocab_parallel.h"

#define FRL_CHOSEN_LOGPROB_OPTIONS(X)                                  \
  X(std::optional<int64_t>, ignore_index, "int?", "=None", Integer) \
  X(int64_t, top_width, "int", "=0", NonNegativeInteger)

// Every option of the stats and backward ops, group by group, in the schema's order.
#define FRL_CHOSEN_LOGPROB_OP_OPTIONS(X) FRL_LOGIT_MAP(X) FRL_VOCAB_SHARD(X) FRL_TILING(X) FRL_CHOSEN_LOGPROB_OPTIONS(X)
// The search op's: it scores no tokens.
#define FRL_CHOSEN_LOGPROB_SEARCH_OPTIONS(X) FRL_LOGIT_MAP(X) FRL_VOCAB_SHARD(X) FRL_TILING(X)
// The top_logprobs op's own (fused_rl_ops/top_logprobs.py, TopLogprobsOptions), after the search
// op's groups: k, the ids kept per row (a default only because the options before it have some).
#define FRL_TOP_LOGPROBS_OPTIONS(X) X(int64_t, k, "int", "=1", PositiveInteger)
#define FRL_TOP_LOGPROBS_OP_OPTIONS(X) FRL_CHOSEN_LOGPROB_SEARCH_OPTIONS(X) FRL_TOP_LOGPROBS_OPTIONS(X)

namespace fused_rl_ops::chosen_logprob {

struct Options {
  FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const Options& options, const Fn& fn) {
  FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VISIT)
}

struct TopLogprobsOptions {
  FRL_TOP_LOGPROBS_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const TopLogprobsOptions& options, const Fn& fn) {
  FRL_TOP_LOGPROBS_OPTIONS(FRL_OPTION_VISIT)
}

}  // namespace fused_rl_ops::chosen_logprob
