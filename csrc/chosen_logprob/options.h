// chosen_logprob's own options, after the groups every vocab-parallel op takes, declared once (how:
// common/options.h). Python declares them as ChosenLogprobOptions; docs/chosen_logprob.md, "The ops
// underneath", says what each means.
#pragma once

#include "vocab_parallel/options.h"

#define FRL_CHOSEN_LOGPROB_OPTIONS(X)                                  \
  X(std::optional<int64_t>, ignore_index, "int?", "=None", Integer) \
  X(int64_t, top_width, "int", "=0", NonNegativeInteger)

// Every option of the stats and backward ops, group by group, in the schema's order (the search
// op's: FRL_VOCAB_PARALLEL_OPTIONS alone, it scores no tokens).
#define FRL_CHOSEN_LOGPROB_OP_OPTIONS(X) FRL_VOCAB_PARALLEL_OPTIONS(X) FRL_CHOSEN_LOGPROB_OPTIONS(X)

namespace fused_rl_ops::chosen_logprob {

struct Options {
  FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const Options& options, const Fn& fn) {
  FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VISIT)
}

}  // namespace fused_rl_ops::chosen_logprob
