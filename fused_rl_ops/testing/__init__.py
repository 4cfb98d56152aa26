"""Helpers for running fused_rl_ops with megatron-core on the CPU, as the docs and examples do; not
for production use. What only the repository's tests use lives in tests/helpers/.

- distributed.run_distributed: run a function in several gloo (CPU) processes as ranks.
- megatron_cpu: shims that let megatron-core 0.18 and 0.19 run on the CPU (its optimizers included), tiny
  models to test with, and the bf16 set-up of a Megatron run (megatron_bf16_training).
  They patch megatron-core process-wide, so only tests and examples import them.
- ppo: the pieces of a tiny PPO step (rollout, loss, forward-backward, a DDP training step) that
  examples/ppo_step.py runs and the tests check.
"""
