# %% [markdown]
# # Mixed precision and ZeRO: fewer bytes per number, fewer numbers per device
#
# Two ways to fit a bigger model on the same devices:
# - **Mixed precision**: run the matmuls in 16-bit floats (`bf16` or `fp16`) while the
#   master weights and the optimizer state stay in `fp32`. `fp16` has a narrow exponent
#   range, so small gradients underflow to zero; **dynamic loss scaling** multiplies the
#   loss by a large factor before the backward pass and divides the gradients after.
# - **ZeRO** (Zero Redundancy Optimizer): with data parallelism every device holds the same
#   optimizer state, gradients and parameters. ZeRO stage 1 splits the optimizer state
#   over the `data` axis, stage 2 also the gradients, stage 3 also the parameters (that
#   is FSDP).
#
# Every number below is measured in this notebook.

# %% [setup]

# %% [parameters]
MODEL = "small"  # tiny (CI) or small (3.2M params)
STEPS = 60  # steps per precision run
BATCH_SIZE = 16
SEQ_LEN = 128

# %%
import dataclasses

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from shardlib.analysis.memory import state_bytes
from shardlib.analysis.theory import state_bytes_per_device
from shardlib.config import PrecisionConfig
from shardlib.train.state import abstract_state

base = shardlib.Config(
    mesh=shardlib.MeshConfig(data=8), model=shardlib.get_preset(MODEL),
    train=shardlib.TrainConfig(steps=STEPS, batch_size=BATCH_SIZE, seq_len=SEQ_LEN,
                               eval_every=0, log_every=max(STEPS // 10, 1), sample_tokens=0),
)
psi = shardlib.count_params(base.model)
print(f"model {MODEL}: {psi:,} parameters")

# %% [markdown]
# ## Why fp16 needs loss scaling
# fp16 has 5 exponent bits, bf16 has fp32's 8 (with fewer mantissa bits), so tiny numbers
# vanish in fp16 long before they do in bf16. Below: the range of each, and what happens
# to a gradient of 1e-8 in fp16 with and without scaling it by 2^15 first.

# %%
for dtype in (jnp.float16, jnp.bfloat16):
    info = jnp.finfo(dtype)
    print(f"{info.dtype}: smallest subnormal {float(info.smallest_subnormal):.3g}, max "
          f"{float(info.max):.3g}, machine epsilon {float(info.eps):.3g}")
grad = 1e-8
scale = 2.0**15
plain = float(jnp.float16(grad))
scaled = float(jnp.float32(jnp.float16(grad * scale)) / scale)
print(f"gradient {grad:g} in fp16: {plain:g}; scaled by 2^15, cast, unscaled: {scaled:.4g} "
      f"(relative error {abs(scaled - grad) / grad:.2%})")

# %% [markdown]
# ## Train in fp32, bf16 and fp16
# Same model, data and seed. For fp16 we start the loss scale far too high (2^24): the first
# steps overflow, shardlib skips them (parameters and optimizer state untouched), halves
# the scale and carries on. All of this happens inside the jitted step.

# %%
runs = {}
for policy, extra in (("fp32", {}), ("bf16", {}), ("fp16", {"init_scale": 2.0**24})):
    config = dataclasses.replace(base, precision=PrecisionConfig(policy=policy, **extra))
    runs[policy] = shardlib.train(config, devices=DEVICES)
    s = runs[policy].summary
    print(f"{policy}: loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}")

fp16 = runs["fp16"].history
skipped = int(fp16[-1]["skipped_steps"])
print(f"fp16: {skipped} of {len(fp16)} steps skipped for overflow, so it made "
      f"{len(fp16) - skipped} updates; loss scale {fp16[0]['loss_scale']:g} after step 1 -> "
      f"{fp16[-1]['loss_scale']:g} after step {fp16[-1]['step']}")
for policy in ("bf16", "fp16"):
    a, b = runs[policy].summary["final_loss"], runs["fp32"].summary["final_loss"]
    print(f"final loss {policy} vs fp32: {a:.4f} vs {b:.4f} ({(a - b) / b:+.2%})")

# %%
fig, (ax, ax_scale) = plt.subplots(1, 2, figsize=(12, 3.8))
for policy, result in runs.items():
    ax.plot([r["step"] for r in result.history], [r["loss"] for r in result.history],
            label=policy)
ax.set(title=f"{MODEL} GPT on data=8: training loss by precision", xlabel="optimizer step",
       ylabel="loss (nats per byte)")
ax.legend()
ax_scale.semilogy([r["step"] for r in fp16], [r["loss_scale"] for r in fp16], "o-",
                  label="loss scale")
ax_skip = ax_scale.twinx()
ax_skip.step([r["step"] for r in fp16], [r["skipped_steps"] for r in fp16], color="C3",
             where="post", label="skipped steps (total)")
ax_scale.set(title="fp16 dynamic loss scaling", xlabel="optimizer step",
             ylabel="loss scale (log)")
ax_skip.set_ylabel("skipped steps (count)")
fig.legend(loc="upper right", bbox_to_anchor=(0.98, 0.88))
fig.tight_layout()
plt.show()

# %% [markdown]
# ## ZeRO stages: memory per device
# The persistent train state of one device (parameters plus AdamW's two moments) under
# each ZeRO stage over `data=8`. We read it off the state's shardings (nothing is
# allocated) and hold it against the formula for fp32 master weights, `Psi` parameters,
# `N` devices: stage 0 (plain DP) `12 Psi`, stages 1 and 2 `4 Psi + 8 Psi / N` (the
# gradients of stage 2 only live inside the step), stage 3 `12 Psi / N` bytes.

# %%
stages = {}
for zero in (0, 1, 2, 3):
    config = dataclasses.replace(base, mesh=shardlib.MeshConfig(data=8, zero=zero))
    setup = shardlib.build_setup(config, DEVICES)
    held = state_bytes(abstract_state(setup))
    stages[zero] = (held.params, held.opt_state, state_bytes_per_device(config, setup.sizes))
    print(f"ZeRO-{zero}: params {held.params:>10,} B + optimizer {held.opt_state:>10,} B = "
          f"{held.total:>10,} B per device; formula {stages[zero][2]:>10,} B "
          f"(ratio {held.total / stages[zero][2]:.3f})")

zero0 = sum(stages[0][:2])
for zero in (1, 2, 3):
    print(f"ZeRO-{zero} holds {sum(stages[zero][:2]) / zero0:.3f} of ZeRO-0's state per device")

# %%
x = np.arange(4)
params = np.array([stages[z][0] for z in range(4)]) / 2**20
opt = np.array([stages[z][1] for z in range(4)]) / 2**20
formula = np.array([stages[z][2] for z in range(4)]) / 2**20
fig, ax = plt.subplots(figsize=(8, 4))
ax.bar(x, params, label="parameters (fp32)")
ax.bar(x, opt, bottom=params, label="AdamW moments (fp32)")
ax.scatter(x, formula, color="black", marker="_", s=900, zorder=3, label="formula")
ax.set(xticks=x, xticklabels=[f"ZeRO-{z}" for z in range(4)], ylabel="MiB per device",
       title=f"train state per device, {MODEL} ({psi:,} params), data=8")
ax.legend()
plt.show()

# %% [markdown]
# The temporaries (activations, gradients inside the step) come on top; `shardlib
# inspect --mesh data=8 --zero 2` shows them next to the state.
