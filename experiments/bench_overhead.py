"""shardlib's train step vs a hand-written plain ``jax.jit`` step of the same model.

Both steps use the same parameters, optimizer (optax AdamW + clipping), batch and
shardings; the hand-written one is a functional GPT on a dict of arrays, the way a
user writes it without a library. Steps are timed interleaved (A, B, A, B, ...) in one
process so machine noise hits both alike; the printed figure is the median step-time
ratio shardlib / hand-written (goal <= 1.05).

    python experiments/bench_overhead.py [--model small] [--mesh data=8] [--rounds 10]
"""

from __future__ import annotations

import argparse
import time

from shardlib.cli import setup_devices


def hand_written_loss(params: dict, tokens_bt, targets_bt, cfg):
    """A plain-JAX GPT forward (same math as shardlib.models.GPT) and its loss."""
    import jax
    import jax.numpy as jnp
    import optax

    from shardlib.models.layers import apply_rope, causal_attention, rope_tables

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    w_vd = params["embed"]["w_vd"]
    x = jnp.take(w_vd, tokens_bt, axis=0)
    cos, sin = rope_tables(tokens_bt.shape[1], cfg.head_dim, cfg.rope_theta)

    def layer(x, p):
        h = rms(x, p["attn_norm"]["scale_d"])
        a = p["attn"]
        q = apply_rope(jnp.einsum("btd,dhk->bthk", h, a["w_q_dhk"]), cos, sin)
        k = apply_rope(jnp.einsum("btd,dhk->bthk", h, a["w_k_dhk"]), cos, sin)
        v = jnp.einsum("btd,dhk->bthk", h, a["w_v_dhk"])
        x = x + jnp.einsum("bthk,hkd->btd", causal_attention(q, k, v), a["w_o_hkd"])
        h = rms(x, p["mlp_norm"]["scale_d"])
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["mlp"]["w_in_df"]))
        return x + jnp.einsum("btf,fd->btd", h, p["mlp"]["w_out_fd"]), None

    x, _ = jax.lax.scan(layer, x, params["blocks"])
    logits = jnp.einsum("btd,vd->btv", rms(x, params["final_norm"]["scale_d"]), w_vd)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_bt).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="data=8")
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=5)
    args = parser.parse_args()
    devices = setup_devices(args.devices)

    import dataclasses

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from shardlib import data as data_lib
    from shardlib.config import Config, parse_mesh
    from shardlib.models import get_preset
    from shardlib.train.state import build_setup, init_state, lr_schedule
    from shardlib.train.step import make_train_step

    config = Config(mesh=parse_mesh(args.mesh), model=get_preset(args.model))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=10**6))
    setup = build_setup(config, devices)
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    batch = data_lib.global_batch(batches, 0, setup.batch_sharding)

    # shardlib
    lib_state = init_state(setup, tc.seed)
    lib_step = make_train_step(setup).lower(lib_state, batch).compile()

    # hand-written: same params as a plain dict, same optimizer, same shardings
    to_dict = lambda tree: nnx.to_pure_dict(tree)
    hand_params = to_dict(init_state(setup, tc.seed).params)
    param_sh = to_dict(setup.state_shardings.params)
    decay = jax.tree_util.tree_map_with_path(
        lambda path, _: "scale" not in jax.tree_util.keystr(path), hand_params)
    tx_plain = optax.chain(
        optax.clip_by_global_norm(config.optim.grad_clip),
        optax.adamw(lr_schedule(config.optim, tc.steps), b1=config.optim.b1,
                    b2=config.optim.b2, eps=config.optim.eps,
                    weight_decay=config.optim.weight_decay, mask=decay))
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(tx_plain, lambda _, s: s, jax.eval_shape(
        tx_plain.init, hand_params), param_sh, transform_non_params=lambda _: replicated)
    hand_opt = jax.jit(tx_plain.init, out_shardings=opt_sh)(hand_params)

    def hand_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(hand_written_loss)(
            params, batch["inputs"], batch["targets"], config.model)
        updates, opt_state = tx_plain.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
    hand = jax.jit(hand_step, in_shardings=(param_sh, opt_sh, batch_sh),
                   out_shardings=(param_sh, opt_sh, None), donate_argnums=(0, 1))
    hand = hand.lower(hand_params, hand_opt, batch).compile()

    # Same model: the first losses agree.
    lib_state, lib_metrics = lib_step(lib_state, batch)
    hand_params, hand_opt, hand_loss = hand(hand_params, hand_opt, batch)
    print(f"first-step loss: shardlib {float(lib_metrics['loss']):.6f}  "
          f"hand-written {float(hand_loss):.6f}")

    lib_times, hand_times = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps_per_round):
            lib_state, lib_metrics = lib_step(lib_state, batch)
        jax.block_until_ready(lib_state)
        lib_times.append((time.perf_counter() - start) / args.steps_per_round)
        start = time.perf_counter()
        for _ in range(args.steps_per_round):
            hand_params, hand_opt, hand_loss = hand(hand_params, hand_opt, batch)
        jax.block_until_ready(hand_params)
        hand_times.append((time.perf_counter() - start) / args.steps_per_round)
    lib_s, hand_s = float(np.median(lib_times)), float(np.median(hand_times))
    print(f"model {args.model}, {args.mesh}, {len(devices)} {devices[0].platform} devices, "
          f"batch {tc.batch_size}x{tc.seq_len}")
    print(f"step time: shardlib {lib_s * 1e3:.1f} ms  hand-written jax.jit {hand_s * 1e3:.1f} ms")
    print(f"ratio shardlib / hand-written: {lib_s / hand_s:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
