# %% [markdown]
# # Checkpoints: save on one mesh, restore on another, resume exactly
#
# A sharded train state never sits whole on one device, so a checkpoint is written by every
# device, each its own slices (shardlib uses orbax). Restoring reads each slice straight
# into the sharding the *new* run wants: the mesh may differ from the one that saved.
#
# This notebook
# 1. trains on `data=8`, saving a checkpoint half-way and at the end;
# 2. resumes from the half-way checkpoint on the same mesh and checks that the
#    continuation is **bit for bit** the same as the run that never stopped;
# 3. restores the same checkpoint onto `fsdp=4, tensor=2`, checks every array is bit-equal
#    to what was saved, and trains on to compare the losses.

# %% [setup]

# %% [parameters]
MODEL = "small"  # tiny (CI) or small (3.2M params)
STEPS = 60  # the run saves at STEPS // 2 and at STEPS
BATCH_SIZE = 16
SEQ_LEN = 128

# %%
import dataclasses
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from shardlib.checkpoint import Checkpointer
from shardlib.config import CheckpointConfig

CKPT_DIR = Path("runs/notebook05").absolute()  # runs/ is git-ignored
shutil.rmtree(CKPT_DIR, ignore_errors=True)  # start clean on every run of the notebook
CKPT_DIR.parent.mkdir(parents=True, exist_ok=True)
HALF = STEPS // 2

base = shardlib.Config(
    mesh=shardlib.MeshConfig(data=8), model=shardlib.get_preset(MODEL),
    train=shardlib.TrainConfig(steps=STEPS, batch_size=BATCH_SIZE, seq_len=SEQ_LEN,
                               eval_every=0, log_every=1, sample_tokens=0),
)

# %% [markdown]
# ## 1. Train on `data=8`, saving every `STEPS // 2` steps
# Saves are asynchronous: the state is copied off the devices and written by a background
# thread while training goes on.

# %%
saving = dataclasses.replace(base, checkpoint=CheckpointConfig(dir=str(CKPT_DIR), every=HALF))
full = shardlib.train(saving, devices=DEVICES)
print(f"trained {full.summary['steps']} steps: loss {full.summary['first_loss']:.4f} -> "
      f"{full.summary['final_loss']:.4f}")

ckpt = Checkpointer(CKPT_DIR, read_only=True)
print("checkpoints on disk:", ckpt.steps())
for step in ckpt.steps():
    files = [f for f in (CKPT_DIR / str(step)).rglob("*") if f.is_file()]
    print(f"  step {step}: {len(files)} files, {sum(f.stat().st_size for f in files):,} bytes")
arrays = ckpt.saved_arrays(HALF)
print(f"step {HALF} holds {len(arrays)} arrays, e.g.:")
for path in [p for p in arrays if p.startswith("params.")][:4]:
    print(f"  {path}: shape {tuple(arrays[path][1].shape)}, {arrays[path][1].dtype}")

# %% [markdown]
# ## 2. Resume on the same mesh
# `ckpt.restore(setup, step)` reads the step into the shardings of `setup` (built from the
# config, nothing else allocated). `shardlib.train(config, state=...)` continues from the
# restored step: same parameters, AdamW moments, RNG key and data position (batch `i`
# depends only on the seed and `i`).

# %%
plain = dataclasses.replace(base)  # no checkpoint dir: this run only continues
setup = shardlib.build_setup(plain, DEVICES)
restored = ckpt.restore(setup, step=HALF)
print(f"restored step {int(restored.step)} onto {dict(setup.mesh.shape)}")
resumed = shardlib.train(plain, devices=DEVICES, state=restored)

ref = {r["step"]: r["loss"] for r in full.history}
again = {r["step"]: r["loss"] for r in resumed.history}
same_losses = all(again[s] == ref[s] for s in again)
final_a = jax.tree.leaves(jax.device_get(full.state.params))
final_b = jax.tree.leaves(jax.device_get(resumed.state.params))
same_params = all(np.array_equal(a, b) for a, b in zip(final_a, final_b, strict=True))
print(f"steps {min(again)}..{max(again)} after resuming: losses bit-identical to the "
      f"uninterrupted run: {same_losses}")
print(f"final parameters bit-identical ({len(final_a)} arrays): {same_params}")
assert same_losses and same_params

# %% [markdown]
# ## 3. Restore onto another mesh: `fsdp=4, tensor=2`
# The same checkpoint, read into a different layout: every weight is now split over all 8
# devices. Each device reads only its own slices from disk.

# %%
other = dataclasses.replace(base, mesh=shardlib.MeshConfig(data=1, fsdp=4, tensor=2))
setup2 = shardlib.build_setup(other, DEVICES)
moved = ckpt.restore(setup2, step=HALF)
restored = ckpt.restore(setup, step=HALF)  # again: the run above consumed (donated) the first

name = "blocks.mlp.w_in_df"
for label, state in (("data=8", restored), ("fsdp=4,tensor=2", moved)):
    w = state.params["blocks"]["mlp"]["w_in_df"][...]
    shard = w.addressable_shards[0].data.shape
    print(f"{label:16s} {name}: global {w.shape}, spec {tuple(w.sharding.spec)}, "
          f"device 0 holds {shard}")

a_leaves = jax.tree.leaves(jax.device_get(restored))
b_leaves = jax.tree.leaves(jax.device_get(moved))
equal = sum(np.array_equal(a, b) for a, b in zip(a_leaves, b_leaves, strict=True))
print(f"{equal} of {len(a_leaves)} arrays of the train state are bit-equal on both meshes")
assert equal == len(a_leaves)

held = [sum(np.prod(leaf.addressable_shards[0].data.shape) * leaf.dtype.itemsize
            for leaf in jax.tree.leaves(s.params)) for s in (restored, moved)]
print(f"parameter bytes on device 0: data=8 {held[0]:,}, fsdp=4,tensor=2 {held[1]:,} "
      f"({held[1] / held[0]:.3f} of it)")

# %%
continued = shardlib.train(other, devices=DEVICES, state=moved)
other_losses = {r["step"]: r["loss"] for r in continued.history}
rel = max(abs(other_losses[s] - ref[s]) / abs(ref[s]) for s in other_losses)
print(f"steps {min(other_losses)}..{max(other_losses)} on fsdp=4,tensor=2: largest relative "
      f"loss difference from the data=8 run {rel:.2e} (floating-point sums in another order)")

# %%
fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(12, 3.8))
ax.plot(list(ref), list(ref.values()), label="data=8, uninterrupted", lw=3, alpha=0.4)
ax.plot(list(again), list(again.values()), "o", ms=3, label=f"resumed at {HALF}, data=8")
ax.plot(list(other_losses), list(other_losses.values()), "x", ms=4,
        label=f"resumed at {HALF}, fsdp=4,tensor=2")
ax.axvline(HALF, color="gray", ls="--")
ax.set(title="loss before and after the checkpoint", xlabel="optimizer step",
       ylabel="loss (nats per byte)")
ax.legend()
steps = sorted(other_losses)
ax_diff.semilogy(steps, [abs(other_losses[s] - ref[s]) / ref[s] + 1e-12 for s in steps],
                 "x-", label="fsdp=4,tensor=2")
ax_diff.semilogy(steps, [abs(again[s] - ref[s]) / ref[s] + 1e-12 for s in steps], "o-",
                 label="data=8 (exact: 0, drawn at 1e-12)")
ax_diff.set(title="difference from the uninterrupted run", xlabel="optimizer step",
            ylabel="relative loss difference (log)")
ax_diff.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# From a terminal the same works with flags: `shardlib train --checkpoint-dir runs/a
# --checkpoint-every 50`, then `--resume` (optionally with another `--mesh`). A run that
# gets SIGTERM (a preempted VM) saves and exits; `--resume` continues bit for bit.
