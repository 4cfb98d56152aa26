// chosen_logprob's options: the non-tensor arguments of chosen_logprob_stats and
// chosen_logprob_backward, after their tensors, declared once (how: common/options.h). Python
// declares them as ChosenLogprobOptions (fused_rl_ops/chosen_logprob.py). The row kernels take
// them in Params and read the logit map's constants (with_logit_map in chosen_logprob/math.h). A
// new option comes last, with a default: code outside the package calls the stats op by position.
//   temperature: the softmax takes the logits divided by it.
//   vocab_start: the global id of weight's row 0.
//   chunk_size, row_block, pass_rows: vocab rows per chunk; token rows per GEMM and per workspace
//     pass, 0: all rows (RowTiling in chosen_logprob/chunks.h).
//   softcap: the logits are capped as softcap * tanh(logits / softcap) first; none: no cap.
//   valid_rows: weight's first rows that are vocabulary, the rest padding; none: all of them.
//   grad_chunks: the backward's gradient GEMMs take the logit gradients of this many chunks at once
//     (chosen_logprob/chunks.h); the stats op ignores it.
//   top_k, top_p: the sampler's filter: the softmax is restricted to the top_k largest logits (ties
//     included), then to the most likely of those whose probability reaches top_p; none: no filter.
//     chosen_logprob applies it through per-token thresholds (the ops' threshold tensors, found
//     by fused_rl_ops/_sampler_filter.py; top_p's with the search op). The stats op reads top_k:
//     it then also returns the shard's top_k largest logits (chosen_logprob/sampler_filter.h).
#pragma once

#include "common/options.h"

#define FRL_CHOSEN_LOGPROB_OPTIONS(X)                                        \
  X(double, temperature, "float", "", PositiveFinite)                        \
  X(int64_t, vocab_start, "int", "", NonNegativeInteger)                     \
  X(int64_t, chunk_size, "int", "", PositiveInteger)                         \
  X(int64_t, row_block, "int", "=0", NonNegativeInteger)                     \
  X(int64_t, pass_rows, "int", "=0", NonNegativeInteger)                     \
  X(std::optional<double>, softcap, "float?", "=None", PositiveFinite)       \
  X(std::optional<int64_t>, valid_rows, "int?", "=None", NonNegativeInteger) \
  X(int64_t, grad_chunks, "int", "=1", PositiveInteger)                      \
  X(std::optional<int64_t>, top_k, "int?", "=None", PositiveInteger)         \
  X(std::optional<double>, top_p, "float?", "=None", Probability)

namespace fused_rl_ops::chosen_logprob {

struct Options {
  FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const Options& options, const Fn& fn) {
  FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VISIT)
}

}  // namespace fused_rl_ops::chosen_logprob
