"""The GPT's language-model head loss: per-token cross-entropy of ``model.head`` on the
last block's output, vocab-parallel under Megatron TP (``hooks.cross_entropy``), in
sequence slices with ``model.loss_chunks``. The plain loss (``models.lm``) and the
pipeline's last stage (``models.pipeline_stage``) both take it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib import hooks
from shardlib.errors import ConfigError


def token_mean(losses_bt: jax.Array, weights_bt: jax.Array | None) -> jax.Array:
    """The mean of the per-token losses, each times its weight when the batch has
    ``loss_weights`` (SFT: 0 off the assistant's tokens, the rest scaled so that this mean
    is the mean over the global batch's assistant tokens; see ``data.sft``)."""
    if weights_bt is None:
        return jnp.mean(losses_bt)
    return jnp.mean(losses_bt * weights_bt.astype(losses_bt.dtype))


def target_logit(logits_btv: jax.Array, ids_bt: jax.Array) -> jax.Array:
    """``logits_btv[b, t, ids_bt[b, t]]`` (B, T) as a one-hot sum (see
    ``parallel.tensor.target_logit``, which the installed hook uses)."""
    vocab_v = jnp.arange(logits_btv.shape[-1], dtype=ids_bt.dtype)
    return jnp.sum(jnp.where(vocab_v == ids_bt[..., None], logits_btv, 0), axis=-1)


def token_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Per-token cross-entropy (B, T) on whole logits."""
    return jax.nn.logsumexp(logits_btv, axis=-1) - target_logit(logits_btv, targets_bt)


def head_losses(model: nnx.Module, x_btd: jax.Array, targets_bt: jax.Array,
                output_dtype: jnp.dtype, chunks: int) -> jax.Array:
    """Per-token cross-entropy (B, T) of the LM head on the last block's output, vocab-parallel
    under TP. With ``chunks`` > 1 the head runs on strided slices of the sequence in a loop,
    one slice's logits alive at a time and recomputed in the backward (the head's gradient
    is summed over slices in the compute dtype)."""
    def slice_losses(x_bcd: jax.Array, targets_bc: jax.Array) -> jax.Array:
        logits_bcv = model.head(x_bcd).astype(output_dtype)
        return hooks.cross_entropy(logits_bcv, targets_bc, local=token_cross_entropy)

    if chunks == 1:
        return slice_losses(x_btd, targets_bt)
    (b, t_x, d), t = x_btd.shape, targets_bt.shape[1]
    if t_x % chunks:
        raise ConfigError(f"model.loss_chunks={chunks} does not divide this device's "
                          f"{t_x} positions per sequence; fix: a divisor of {t_x}")
    # slice n holds positions i * chunks + n: each slice spans every shard of a sequence-
    # sharded T. Under SP the head gathers T over tensor (r = t / t_x shards, in order).
    r = t // t_x
    x_nbcd = jnp.moveaxis(x_btd.reshape(b, t_x // chunks, chunks, d), 2, 0)
    targets_nbc = jnp.moveaxis(targets_bt.reshape(b, r, t_x // chunks, chunks), 3, 0)
    losses_nbc = jax.lax.map(lambda xt: jax.checkpoint(slice_losses)(*xt),
                             (x_nbcd, targets_nbc.reshape(chunks, b, -1)))
    return jnp.moveaxis(losses_nbc.reshape(chunks, b, r, t_x // chunks), 0, 3).reshape(b, t)
