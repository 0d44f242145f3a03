"""Tensor parallelism: the ranks, sharding, their worker and loading a sharded target."""
