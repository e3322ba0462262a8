"""Strategies that need explicit collectives in ``jax.shard_map``."""
