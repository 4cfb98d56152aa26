"""What every op over a vocab-parallel shard of the output layer shares (chosen_logprob now): the
tiling and workspace model (tiling), the shard's resolution (shard), the tensor-parallel agreement
check (agreement) and communication (group), the host token check (tokens), Megatron's main_grad
(main_grad) and the sampler's filter (sampler_filter)."""
