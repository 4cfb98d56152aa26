// The extension module and the op schemas. Each op's CPU and CUDA kernels register themselves
// in their own files (TORCH_LIBRARY_IMPL); fake kernels and autograd are registered in Python.
// The options after the tensors come from their groups' declarations (common/options.h).
#include <Python.h>
#include <torch/library.h>

#include "chosen_logprob/options.h"
#include "clamped_swiglu/options.h"
#include "common/cpu_isa.h"
#include "top_logprobs/options.h"
#include "vocab_divergence/options.h"

namespace {
// fused_rl_ops._C.cpu_isa(): the ISA the CPU row kernels run (common/cpu_isa.h).
PyObject* cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(fused_rl_ops::cpu_isa_name(fused_rl_ops::cpu_isa()));
}
PyMethodDef methods[] = {{"cpu_isa", cpu_isa, METH_NOARGS, "The ISA the CPU row kernels run."}, {nullptr}};
}  // namespace

extern "C" {
// Importing fused_rl_ops._C runs the static registrations below and chooses the row kernels' ISA
// (warning here, once, where ATen's capability is one the CPU lacks); the module has cpu_isa only.
PyObject* PyInit__C(void) {
  fused_rl_ops::cpu_isa();
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}

#define CLAMPED_SWIGLU_OPTIONS FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_SCHEMA)
#define CHOSEN_LOGPROB_OPTIONS FRL_CHOSEN_LOGPROB_OP_OPTIONS(FRL_OPTION_SCHEMA)
#define CHOSEN_LOGPROB_SEARCH_OPTIONS FRL_VOCAB_PARALLEL_OPTIONS(FRL_OPTION_SCHEMA)
#define TOP_LOGPROBS_OPTIONS FRL_TOP_LOGPROBS_OP_OPTIONS(FRL_OPTION_SCHEMA)
#define VOCAB_DIVERGENCE_OPTIONS FRL_VOCAB_DIVERGENCE_OP_OPTIONS(FRL_OPTION_SCHEMA)

TORCH_LIBRARY(fused_rl_ops, m) {
  // clamped_swiglu: scale (per row) makes it the weighted form, with its own backward.
  m.def("clamped_swiglu(Tensor x" CLAMPED_SWIGLU_OPTIONS ", Tensor? scale=None) -> Tensor");
  m.def("clamped_swiglu_backward(Tensor grad_out, Tensor x" CLAMPED_SWIGLU_OPTIONS ") -> Tensor");
  m.def("clamped_swiglu_scaled_backward(Tensor grad_out, Tensor x, Tensor scale" CLAMPED_SWIGLU_OPTIONS
        ") -> (Tensor, Tensor)");
  // chosen_logprob: per-shard partials (stats), their merge across shards (combine), and the
  // chunked backward from the merged row max, log-sum and entropy; search: one round of top_p's
  // threshold search, updating hist and top. What each takes: docs/chosen_logprob.md, "The ops
  // underneath".
  m.def("chosen_logprob_stats(Tensor hidden, Tensor weight, Tensor tokens" CHOSEN_LOGPROB_OPTIONS
        ", Tensor? threshold=None) -> Tensor");
  m.def("chosen_logprob_combine(Tensor partials) -> Tensor");
  m.def(
      "chosen_logprob_backward(Tensor hidden, Tensor weight, Tensor tokens, Tensor row_max, Tensor log_sum, "
      "Tensor log_sum_minus_entropy, Tensor grad_logprob, Tensor grad_entropy, Tensor(a!)? main_grad"
      CHOSEN_LOGPROB_OPTIONS ", Tensor? threshold=None) -> (Tensor, Tensor)");
  m.def("chosen_logprob_search(Tensor hidden, Tensor weight, Tensor row_max, Tensor window, Tensor(a!) hist, "
        "Tensor(b!)? top" CHOSEN_LOGPROB_SEARCH_OPTIONS ") -> ()");
  // top_logprobs: each row's partials (as chosen_logprob_stats's, without tokens) and its k largest
  // logits with their global ids, the masked rows left out.
  m.def("top_logprobs_stats(Tensor hidden, Tensor weight, Tensor? mask" TOP_LOGPROBS_OPTIONS
        ") -> (Tensor, Tensor, Tensor)");
  // vocab_divergence: per-shard partials of both models (stats), their merge across shards
  // (combine), jsd's second pass (mixture) and the chunked backward, the masked rows left out. What
  // each takes: docs/vocab_divergence.md, "The ops underneath".
  m.def("vocab_divergence_stats(Tensor hidden, Tensor weight, Tensor teacher_hidden, Tensor teacher_weight, "
        "Tensor? mask" VOCAB_DIVERGENCE_OPTIONS ") -> Tensor");
  m.def("vocab_divergence_combine(Tensor partials) -> Tensor");
  m.def("vocab_divergence_mixture(Tensor hidden, Tensor weight, Tensor teacher_hidden, Tensor teacher_weight, "
        "Tensor? mask, Tensor rows" VOCAB_DIVERGENCE_OPTIONS ") -> Tensor");
  m.def("vocab_divergence_backward(Tensor hidden, Tensor weight, Tensor teacher_hidden, Tensor teacher_weight, "
        "Tensor? mask, Tensor rows, Tensor row_term, Tensor grad, Tensor(a!)? main_grad" VOCAB_DIVERGENCE_OPTIONS
        ") -> (Tensor, Tensor)");
  m.def("value_head(Tensor hidden, Tensor weight, Tensor? bias) -> Tensor");
  m.def("value_head_backward_hidden(Tensor grad_out, Tensor weight, ScalarType dtype) -> Tensor");
  m.def("value_head_backward_params(Tensor grad_out, Tensor hidden) -> (Tensor, Tensor)");
}
