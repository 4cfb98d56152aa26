// The extension module and the op schemas. Each op's CPU and CUDA kernels register themselves
// in their own files (TORCH_LIBRARY_IMPL); fake kernels and autograd are registered in Python.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing fused_rl_ops._C runs the static registrations below; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(fused_rl_ops, m) {
  // clamped_swiglu: scale (per row) makes it the weighted form, with its own backward.
  m.def(
      "clamped_swiglu(Tensor x, float? limit, float alpha, float linear_offset, bool interleaved, "
      "Tensor? scale=None) -> Tensor");
  m.def(
      "clamped_swiglu_backward(Tensor grad_out, Tensor x, float? limit, float alpha, float linear_offset, "
      "bool interleaved) -> Tensor");
  m.def(
      "clamped_swiglu_scaled_backward(Tensor grad_out, Tensor x, Tensor scale, float? limit, float alpha, "
      "float linear_offset, bool interleaved) -> (Tensor, Tensor)");
  // chosen_logprob: per-shard partials, their merge across shards, and the chunked backward.
  // row_block / pass_rows: GEMMs of exactly row_block token rows, pass_rows rows per workspace
  // (0: all rows at once); see RowTiling in chosen_logprob/chunks.h. softcap: logits
  // softcap * tanh(logits / softcap) before the temperature (None: no cap).
  m.def(
      "chosen_logprob_stats(Tensor hidden, Tensor weight, Tensor tokens, float temperature, int vocab_start, int chunk_size, "
      "int row_block=0, int pass_rows=0, float? softcap=None) -> Tensor");
  m.def("chosen_logprob_combine(Tensor partials) -> Tensor");
  m.def(
      "chosen_logprob_backward(Tensor hidden, Tensor weight, Tensor tokens, Tensor row_max, Tensor lse, Tensor mean, "
      "Tensor grad_logprob, Tensor grad_entropy, float temperature, int vocab_start, int valid_rows, int chunk_size, "
      "int row_block=0, int pass_rows=0, Tensor(a!)? main_grad=None, float? softcap=None) -> (Tensor, Tensor)");
  m.def("value_head(Tensor hidden, Tensor weight, Tensor? bias) -> Tensor");
  m.def("value_head_backward_hidden(Tensor grad_out, Tensor weight, ScalarType dtype) -> Tensor");
  m.def("value_head_backward_params(Tensor grad_out, Tensor hidden) -> (Tensor, Tensor)");
}
