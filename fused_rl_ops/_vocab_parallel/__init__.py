"""What every op over a vocab-parallel shard of the output layer shares (chosen_logprob, top_logprobs,
vocab_divergence), and no op's own: the call path of their Python functions (call), the
tensor-parallel agreement check (agreement) and communication (group), the ops' shared option groups
(kernel_options), the tiling and workspace model (tiling), the shard's resolution (shard), the host
token check (tokens), Megatron's main_grad (main_grad) and the sampler's filter (sampler_filter)."""
