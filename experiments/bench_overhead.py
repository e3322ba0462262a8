"""shardlib's train step vs a hand-written plain ``jax.jit`` step of the same model.

Both steps use the same parameters, optimizer (optax AdamW + clipping), batch and
shardings; the hand-written one is a functional GPT on a dict of arrays, written the
way a user writes it without a library (``jax.nn.dot_product_attention``, nothing from
shardlib's layers). Its attention kernel is the one shardlib's step resolved
(``hand_kernel``: cuDNN on a GPU, XLA's on CPU), so the ratio measures the library, not
the kernel choice. Steps are timed interleaved (A, B, A, B, ...) in one process so
machine noise hits both alike; the printed figure is the median step-time ratio shardlib /
hand-written (goal <= 1.05). ``experiments/bench.py`` reuses these pieces.

    python experiments/bench_overhead.py [--model small] [--mesh data=8] [--rounds 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardlib.cli import setup_devices

HAND_KERNELS = ("xla", "cudnn")  # the implementations jax.nn.dot_product_attention offers


def hand_kernel(setup) -> str:
    """The attention kernel of the hand-written step: the one shardlib's step resolved
    (``analysis.peak.resolved_kernel``) where ``jax.nn.dot_product_attention`` has it,
    else ``xla`` (shardlib's chunked and splash kernels have no ``jax.nn`` twin)."""
    from shardlib.analysis.peak import resolved_kernel
    from shardlib.mesh import capability_of, platform_of

    chosen = resolved_kernel(setup.config, platform=platform_of(setup.mesh),
                             dtype=setup.policy.compute, capability=capability_of(setup.mesh))
    return chosen if chosen in HAND_KERNELS else "xla"


def hand_written_loss(params: dict, tokens_bt, targets_bt, cfg, kernel: str = "xla") -> Any:
    """A plain-JAX GPT forward (same math as shardlib.models.GPT) and its loss; ``kernel``:
    the ``implementation`` of ``jax.nn.dot_product_attention`` (xla or cudnn)."""
    import jax
    import jax.numpy as jnp
    import optax

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    def rope(x_bthk, cos_tk, sin_tk):
        x1, x2 = jnp.split(x_bthk, 2, axis=-1)
        cos, sin = (c[None, :, None, :].astype(x_bthk.dtype) for c in (cos_tk, sin_tk))
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(q, k, v):  # (B, T, H, K) each
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kernel)

    seq_len, head_dim = tokens_bt.shape[1], cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, head_dim, 2) / head_dim)
    angles = jnp.arange(seq_len)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    w_vd = params["embed"]["w_vd"]
    x = jnp.take(w_vd, tokens_bt, axis=0)

    def layer(x, p):
        h = rms(x, p["attn_norm"]["scale_d"])
        a = p["attn"]
        q = rope(jnp.einsum("btd,dhk->bthk", h, a["w_q_dhk"]), cos, sin)
        k = rope(jnp.einsum("btd,dhk->bthk", h, a["w_k_dhk"]), cos, sin)
        v = jnp.einsum("btd,dhk->bthk", h, a["w_v_dhk"])
        x = x + jnp.einsum("bthk,hkd->btd", attention(q, k, v), a["w_o_hkd"])
        h = rms(x, p["mlp_norm"]["scale_d"])
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["mlp"]["w_in_df"]))
        return x + jnp.einsum("btf,fd->btd", h, p["mlp"]["w_out_fd"]), None

    blocks = params["blocks"]
    if isinstance(blocks, dict) and blocks and all(isinstance(i, int) for i in blocks):
        for i in sorted(blocks):  # model.scan_layers=false: one dict per layer, unrolled
            x, _ = layer(x, blocks[i])
    else:
        x, _ = jax.lax.scan(layer, x, blocks)
    logits = jnp.einsum("btd,vd->btv", rms(x, params["final_norm"]["scale_d"]), w_vd)
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_bt).mean()


@dataclass
class SteppedRun:
    """A compiled step and the state it carries: ``advance()`` runs one step."""

    step: Callable[..., Any]
    carry: tuple
    batch: dict
    compile_s: float
    compiled: Any = None  # the jax.stages.Compiled step (HLO text, memory analysis)

    @property
    def hlo(self) -> str:
        return self.compiled.as_text()

    def advance(self) -> Any:
        """One step; returns the loss (a device array, not synced)."""
        *self.carry, loss = self.step(*self.carry, self.batch)
        return loss

    def sync(self) -> None:
        import jax

        jax.block_until_ready(self.carry)


def lib_run(setup, batch: dict, seed: int) -> SteppedRun:
    """shardlib's own jitted step, compiled ahead of time, with a fresh state."""
    from shardlib.train.state import init_state
    from shardlib.train.step import make_train_step

    state = init_state(setup, seed)
    tick = time.perf_counter()
    compiled = make_train_step(setup).lower(state, batch).compile()
    compile_s = time.perf_counter() - tick

    def step(state, batch):
        state, metrics = compiled(state, batch)
        return state, metrics["loss"]

    return SteppedRun(step, (state,), batch, compile_s, compiled)


def hand_run(setup, batch: dict, seed: int, kernel: str | None = None) -> SteppedRun:
    """The hand-written step: same initial params, optimizer and shardings as shardlib;
    attention with ``kernel`` (default ``hand_kernel(setup)``, shardlib's own)."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from shardlib.train.state import init_state, lr_schedule

    config = setup.config
    params = nnx.to_pure_dict(init_state(setup, seed).params)
    param_sh = nnx.to_pure_dict(setup.state_shardings.params)
    decay = jax.tree_util.tree_map_with_path(
        lambda path, _: "scale" not in jax.tree_util.keystr(path), params)
    tx = optax.chain(
        optax.clip_by_global_norm(config.optim.grad_clip),
        optax.adamw(lr_schedule(config.optim, config.train.steps), b1=config.optim.b1,
                    b2=config.optim.b2, eps=config.optim.eps,
                    weight_decay=config.optim.weight_decay, mask=decay))
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params),
                                   param_sh, transform_non_params=lambda _: replicated)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)

    compute = setup.policy.compute  # bf16/fp16 runs: matmuls in the compute dtype
    kernel = hand_kernel(setup) if kernel is None else kernel

    def loss_fn(params, batch):
        params = jax.tree.map(lambda p: p.astype(compute), params)
        return hand_written_loss(params, batch["inputs"], batch["targets"], config.model,
                                 kernel)

    def hand_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
    tick = time.perf_counter()
    compiled = jax.jit(hand_step, in_shardings=(param_sh, opt_sh, batch_sh),
                       out_shardings=(param_sh, opt_sh, None), donate_argnums=(0, 1),
                       ).lower(params, opt_state, batch).compile()
    return SteppedRun(compiled, (params, opt_state), batch, time.perf_counter() - tick, compiled)


def time_steps(run: SteppedRun, steps: int) -> float:
    """Seconds per step over ``steps`` back-to-back steps (one sync at the end)."""
    start = time.perf_counter()
    for _ in range(steps):
        run.advance()
    run.sync()
    return (time.perf_counter() - start) / steps


def make_setup(config, devices):
    """Setup and first batch for a config (steps set high so the lr schedule is flat-ish)."""
    from shardlib import data as data_lib
    from shardlib.train.state import build_setup

    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=10**6))
    setup = build_setup(config, devices)
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    return setup, data_lib.global_batch(batches, 0, setup.batch_sharding)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="data=8")
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=5)
    args = parser.parse_args()
    devices = setup_devices(args.devices)

    import numpy as np

    from shardlib.config import Config, parse_mesh
    from shardlib.inspect import attention_kernel
    from shardlib.models import get_preset

    config = Config(mesh=parse_mesh(args.mesh), model=get_preset(args.model))
    setup, batch = make_setup(config, devices)
    lib, hand = lib_run(setup, batch, config.train.seed), hand_run(setup, batch, config.train.seed)
    print(f"attention: shardlib {attention_kernel(setup)}, hand-written {hand_kernel(setup)}")
    print(f"first-step loss: shardlib {float(lib.advance()):.6f}  "
          f"hand-written {float(hand.advance()):.6f}")
    lib_times, hand_times = [], []
    for _ in range(args.rounds):
        lib_times.append(time_steps(lib, args.steps_per_round))
        hand_times.append(time_steps(hand, args.steps_per_round))
    lib_s, hand_s = float(np.median(lib_times)), float(np.median(hand_times))
    tc = config.train
    print(f"model {args.model}, {args.mesh}, {len(devices)} {devices[0].platform} devices, "
          f"batch {tc.batch_size}x{tc.seq_len}")
    print(f"step time: shardlib {lib_s * 1e3:.1f} ms  hand-written jax.jit {hand_s * 1e3:.1f} ms")
    print(f"ratio shardlib / hand-written: {lib_s / hand_s:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
