"""The Megatron integration: the output processor, MLP and value head in megatron-core models."""
