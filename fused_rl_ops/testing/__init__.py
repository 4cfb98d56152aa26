"""Helpers for the tests, benchmarks and examples of fused_rl_ops; not for production use.

- distributed.run_distributed: run a function in several gloo (CPU) processes as ranks.
- megatron_cpu: shims that let megatron-core 0.18 and 0.19 run on the CPU (its optimizers included), tiny
  models to test with, and the bf16 set-up of a Megatron run (megatron_bf16_training).
  They patch megatron-core process-wide, so only tests and examples import them.
- checkpoint: reference splits, bit-exact comparisons and toy modules for the checkpoint tests.
- ppo: the pieces of a tiny PPO step (rollout, loss, forward-backward) the example runs and the
  tests check.
- peak_memory: peak resident memory growth of a call, in this process or a fresh one.
- kernel_calls: a record of the torch.ops.fused_rl_ops calls (and what they got) of a piece of code.
- op_table: the package's ops with what the tooling needs about each (operators, options
  declarations, benchmark runs, kernels-on-CPU driver, sanitizer cases), read by the scripts and tests.
- sanitizer_cases: small calls of each op's CUDA kernels for compute-sanitizer.
"""
