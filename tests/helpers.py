"""Shared test helpers: tiny configs and a few-step training run on any mesh."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from shardlib import data as data_lib
from shardlib.config import Config, MeshConfig, OptimConfig, TrainConfig
from shardlib.models import get_preset

TINY = get_preset("tiny")


def tiny_config(mesh: MeshConfig, steps: int = 3, **model_changes) -> Config:
    """fp32 tiny GPT, batch 8 x 32 tokens, no warm-up (so every step moves the params).

    Adam's first steps are ~lr * sign(grad): a gradient within ~eps of zero can flip
    sign under another reduction order (gradients agree to ~5e-7 relative) and move one
    element by 2 lr. eps=1e-6 keeps the update Lipschitz in the gradient (constant
    lr/eps), and lr=1e-3 keeps three steps' parameter error well inside 1e-5.
    """
    return Config(
        mesh=mesh,
        model=dataclasses.replace(TINY, **model_changes),
        optim=OptimConfig(lr=1e-3, eps=1e-6, warmup_steps=0),
        train=TrainConfig(steps=steps, batch_size=8, seq_len=32, data="synthetic",
                          eval_every=0, sample_tokens=0),
    )


def run_steps(config: Config, num_devices: int = 8, batches: list[dict] | None = None,
              history: list[dict] | None = None):
    """Train ``config.train.steps`` steps (on ``batches``, host arrays, if given; else the
    config's data); return (losses, host params by path, setup). ``history``, if given,
    receives each step's metrics as floats."""
    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import make_train_step

    setup = build_setup(config, jax.devices()[:num_devices])
    tc = config.train
    source, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state = init_state(setup, tc.seed)
    step = make_train_step(setup)
    losses = []
    for i in range(tc.steps):
        batch = (data_lib.global_batch(source, i, setup.batch_sharding) if batches is None
                 else {k: jax.device_put(v, setup.batch_sharding) for k, v in batches[i].items()})
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if history is not None:
            history.append({key: float(value) for key, value in metrics.items()})
    params = {".".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(state.params)}
    return np.array(losses), params, setup


def packed_batch(b: int = 8, t: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """A packed batch: random tokens, 1-3 documents per row, positions from 0 per document."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, t + 1), dtype=np.int32)
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), rng.integers(0, 3), replace=False))
        bounds = [0, *cuts.tolist(), t]
        for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seg[row, lo:hi], pos[row, lo:hi] = d + 1, np.arange(hi - lo)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
            "positions": pos}


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||: the per-tensor relative error the equivalence tests bound."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def loss_and_grads(config: Config, num_devices: int = 8):
    """Loss and gradients of the first batch at init, as host arrays by path."""
    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import loss_fn

    setup = build_setup(config, jax.devices()[:num_devices])
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state = init_state(setup, tc.seed)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(setup, p, b)),
                      in_shardings=(setup.state_shardings.params, setup.batch_sharding),
                      out_shardings=(None, setup.state_shardings.params))
    loss, grads = grad_fn(state.params, data_lib.global_batch(batches, 0, setup.batch_sharding))
    return float(loss), {".".join(map(str, p)): np.asarray(v.get_value())
                         for p, v in nnx.to_flat_state(grads)}
