"""Sharded checkpoints: save, load, reshard, integrity, optimizers."""
