"""Sampling from a trained model, sharded like training.

``generate``: a window of tokens runs through the model once per new token (no KV cache:
the train step's shardings; the reference). The window is the shortest that holds the
prompt and the new tokens, else ``seq_len`` tokens that slide. One row per batch shard,
so every device works on its own sample.
``generate_cached``: prefill + one-token steps over a KV cache (the model's ``decode``,
for the ``generate`` capability: the GPT's is ``models.decode``), a batch of prompts of
different lengths, cache sharded like the activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardlib.errors import ConfigError
from shardlib.sharding import activation_rules, entry_axes
from shardlib.train.state import TrainSetup


def sample_logits(logits_bv: jax.Array, key: jax.Array, temperature: float,
                  top_k: int) -> jax.Array:
    """Temperature + top-k sampling; temperature 0 means greedy."""
    if temperature <= 0:
        return jnp.argmax(logits_bv, axis=-1)
    logits_bv = logits_bv / temperature
    if 0 < top_k < logits_bv.shape[-1]:
        kth_best_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv < kth_best_b1, -jnp.inf, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1)


def generate(setup: TrainSetup, params: nnx.State, prompt: np.ndarray, num_tokens: int, *,
             temperature: float = 0.8, top_k: int = 20, seed: int = 0) -> np.ndarray:
    """Continue ``prompt`` (1-D int tokens) by ``num_tokens``; returns (rows, len+new)."""
    return compile_generate(setup, params, prompt, num_tokens, temperature=temperature,
                            top_k=top_k)(params, seed)


def compile_generate(setup: TrainSetup, params: nnx.State, prompt: np.ndarray,
                     num_tokens: int, *, temperature: float = 0.8, top_k: int = 20
                     ) -> Callable[[nnx.State, int], np.ndarray]:
    """``generate`` compiled ahead of time: a function of (params, seed) that only runs
    (the loop times compiling and sampling apart, and its watchdog watches only the run)."""
    prompt = np.asarray(prompt, np.int32)[-setup.config.train.seq_len:]
    window = _window(setup, len(prompt) + num_tokens)
    rows = _shards(setup, dim=0)
    buf_bt = np.zeros((rows, window), np.int32)
    buf_bt[:, : len(prompt)] = prompt

    def step(params: nnx.State, i: int, carry: tuple[jax.Array, jax.Array, jax.Array]):
        buf_bt, out_bn, key = carry
        pos = jnp.minimum(len(prompt) + i, window)  # tokens in the window
        with activation_rules(setup.mesh, setup.rules):
            logits_btv = nnx.merge(setup.graphdef, params)(buf_bt)
        key, sub = jax.random.split(key)
        next_b = sample_logits(logits_btv[:, pos - 1], sub, temperature, top_k).astype(jnp.int32)
        shifted_bt = jnp.where(pos == window, jnp.roll(buf_bt, -1, axis=1), buf_bt)
        buf_bt = shifted_bt.at[:, jnp.minimum(pos, window - 1)].set(next_b)
        return buf_bt, out_bn.at[:, i].set(next_b), key

    # params are an argument, not a closure, and the output is replicated: with several
    # processes a jit may not close over, nor the host read, arrays on other processes
    @partial(jax.jit, out_shardings=NamedSharding(setup.mesh, PartitionSpec()))
    def run(params: nnx.State, buf_bt: jax.Array, key: jax.Array) -> jax.Array:
        out_bn = jnp.zeros((rows, num_tokens), jnp.int32)
        return jax.lax.fori_loop(0, num_tokens, partial(step, params), (buf_bt, out_bn, key))[1]

    buf = jax.device_put(buf_bt, setup.batch_sharding)
    compiled = run.lower(params, buf, jax.random.key(0)).compile()

    def sample(params: nnx.State, seed: int) -> np.ndarray:
        new_bn = np.asarray(compiled(params, buf, jax.random.key(seed)))
        return np.concatenate([np.broadcast_to(prompt, (rows, len(prompt))), new_bn], axis=1)

    return sample


def generate_cached(setup: TrainSetup, params: nnx.State, prompts: list[list[int]],
                    max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, stop_tokens: tuple[int, ...] = (),
                    seed: int = 0) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` (fewer after a stop token, which
    is kept) with the KV cache; rows are padded up to a multiple of the batch shards."""
    return compile_generate_cached(setup, params, prompts, max_new_tokens,
                                   temperature=temperature, top_k=top_k, top_p=top_p,
                                   stop_tokens=stop_tokens)(params, seed)


def compile_generate_cached(setup: TrainSetup, params: nnx.State, prompts: list[list[int]],
                            max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                            top_p: float = 1.0, stop_tokens: tuple[int, ...] = ()
                            ) -> Callable[[nnx.State, int], list[list[int]]]:
    """``generate_cached`` compiled ahead of time: a function of (params, seed) that only
    runs (a benchmark times decoding apart from compiling)."""
    setup.model.require("generate", "generate_cached")
    decode = setup.model.decode
    if decode is None:
        raise ConfigError(f"generate_cached: model {setup.model.name!r} declares 'generate' "
                          "but gives no decode; pass Model(decode=...)")
    rows = len(prompts)
    shards = _shards(setup, dim=0)
    batch = -(-rows // shards) * shards
    width = max(len(p) for p in prompts)
    prompts_bp = np.zeros((batch, width), np.int32)
    lengths_b = np.ones((batch,), np.int32)
    for i, prompt in enumerate(prompts):
        prompts_bp[i, : len(prompt)], lengths_b[i] = prompt, len(prompt)
    model_dtype = jax.tree.leaves(params)[0].dtype

    @partial(jax.jit, out_shardings=NamedSharding(setup.mesh, PartitionSpec()))
    def run(params: nnx.State, prompts_bp: jax.Array, lengths_b: jax.Array, key: jax.Array):
        with activation_rules(setup.mesh, setup.rules):
            model = nnx.merge(setup.graphdef, params)
            return decode(model, prompts_bp, lengths_b, key, length=width + max_new_tokens,
                          dtype=model_dtype, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p,
                          stop_tokens=stop_tokens)

    place = lambda x: jax.device_put(x, NamedSharding(setup.mesh, PartitionSpec(
        *setup.batch_sharding.spec[:1])))
    prompts_bp, lengths_b = place(prompts_bp), place(lengths_b)
    compiled = run.lower(params, prompts_bp, lengths_b, jax.random.key(0)).compile()

    def sample(params: nnx.State, seed: int) -> list[list[int]]:
        new_bn = np.asarray(compiled(params, prompts_bp, lengths_b, jax.random.key(seed)))
        return [_until_stop([int(t) for t in new_bn[i]], stop_tokens) for i in range(rows)]

    return sample


def _until_stop(tokens: list[int], stop_tokens: tuple[int, ...]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for i, token in enumerate(tokens):
        if token in stop_tokens:
            return tokens[: i + 1]
    return tokens


def _window(setup: TrainSetup, tokens: int) -> int:
    """The tokens a no-cache step runs: ``tokens`` rounded up to a multiple of twice the
    device count (any sequence split, zig-zag ring included, divides it), at most
    ``seq_len``. A causal model's logits at a position ignore the padding after it, so a
    short sample costs what it holds, not ``seq_len`` tokens per new token."""
    quantum = 2 * math.prod(setup.sizes.values())
    return min(setup.config.train.seq_len, -(-tokens // quantum) * quantum)


def _shards(setup: TrainSetup, dim: int) -> int:
    """How many pieces the batch sharding cuts ``dim`` into."""
    spec = setup.batch_sharding.spec
    entry = spec[dim] if len(spec) > dim else None
    axes = entry_axes(entry)
    return math.prod(setup.sizes[axis] for axis in axes)
