# %% [markdown]
# # Your own model: a ViT from its definition to sharded training on 8 devices
#
# shardlib trains any Flax NNX model. This notebook
# 1. writes a small ViT classifier in plain Flax NNX, annotated the way Flax's docs teach
#    (`nnx.with_partitioning`), with its loss and the layout of its batch;
# 2. trains it on `data=2, fsdp=2, tensor=2` and checks the losses against one device;
# 3. shows `inspect`'s view of it: where each weight lives, the collectives per mesh axis
#    against the theory computed from its parameter tree, the memory per device;
# 4. saves a checkpoint and restores it onto `fsdp=4, tensor=2`.

# %% [setup]

# %% [parameters]
STEPS = 40
DEPTH = 4  # residual MLP blocks: each one FSDP unit
WIDTH = 64
BATCH_SIZE = 32

# %%
import dataclasses
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from rich.console import Console

from shardlib.analysis.tables import sharding_table
from shardlib.checkpoint import Checkpointer
from shardlib.config import CheckpointConfig
from shardlib.inspect import analyze, collectives_table, memory_table, theory_table

# %% [markdown]
# ## 1. The model, its loss and its batch
# Nothing here is shardlib's: a ViT with 4 x 4 patches of 16 x 16 images, `DEPTH` residual
# MLP blocks in an `nnx.List`, a linear head. The `("embed", "mlp")` annotations are
# logical dims; shardlib's presets split `embed` over `fsdp` and `mlp` over `tensor`.

# %%
def dense(din, dout, dims, rngs):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), dims)
    return nnx.Linear(din, dout, kernel_init=init, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = dense(WIDTH, 4 * WIDTH, ("embed", "mlp"), rngs)
        self.down = dense(4 * WIDTH, WIDTH, ("mlp", "embed"), rngs)

    def __call__(self, x_bpd):
        return x_bpd + self.down(jax.nn.gelu(self.up(self.norm(x_bpd))))


class ViT(nnx.Module):
    def __init__(self, rngs):
        self.patch = dense(4 * 4 * 3, WIDTH, (None, "embed"), rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(DEPTH)])
        self.head = dense(WIDTH, 10, ("embed", None), rngs)

    def __call__(self, images_bhwc):
        b = images_bhwc.shape[0]
        x = images_bhwc.reshape(b, 4, 4, 4, 4, 3).transpose(0, 1, 3, 2, 4, 5)
        x_bpd = self.patch(x.reshape(b, 16, 48))  # (B, 16 patches, WIDTH)
        for block in self.blocks:
            x_bpd = block(x_bpd)
        return self.head(x_bpd.mean(axis=1))


def loss(model, batch):
    logits = model(batch["image"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return ce, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def data(k):
    """Batch k: images whose class is their mean brightness (learnable)."""
    rng = np.random.default_rng(k)
    labels = rng.integers(0, 10, BATCH_SIZE).astype(np.int32)
    images = rng.normal(size=(BATCH_SIZE, 16, 16, 3)).astype(np.float32)
    return {"image": images + labels[:, None, None, None] / 10, "label": labels}


model = shardlib.Model(build=lambda rngs: ViT(rngs), loss=loss, name="vit",
                       batch={"image": ("batch", None, None, None), "label": ("batch",)})

# %% [markdown]
# ## 2. Train on `data=2, fsdp=2, tensor=2`, and on one device
# The `tensor` axis splits the MLP's hidden dim through the rules and XLA's partitioner
# (the explicit Megatron path is a capability this model does not declare); the losses
# equal one device's.

# %%
def config(mesh, steps=STEPS, **train):
    return shardlib.Config(mesh=mesh, train=shardlib.TrainConfig(
        steps=steps, batch_size=BATCH_SIZE, log_every=1, **train))


sharded = shardlib.train(config(shardlib.MeshConfig(data=2, fsdp=2, tensor=2)), model=model,
                         data=data, devices=DEVICES)
single = shardlib.train(config(shardlib.MeshConfig(data=1)), model=model, data=data,
                        devices=DEVICES[:1])
ours = np.array([r["loss"] for r in sharded.history])
ref = np.array([r["loss"] for r in single.history])
print(f"max relative difference of the losses: {np.max(np.abs(ours - ref) / ref):.2e}")
plt.plot(ref, label="1 device")
plt.plot(ours, "--", label="data=2, fsdp=2, tensor=2")
plt.xlabel("step"), plt.ylabel("loss"), plt.legend()
plt.show()

# %% [markdown]
# ## 3. What `inspect` sees
# Compiled ahead of time, nothing run: each weight's logical dims and placement, the
# collectives per mesh axis against the theory from the parameter tree (FSDP's gathers and
# reduce-scatters, data parallelism's all-reduce), and the memory per device.

# %%
ins = analyze(config(shardlib.MeshConfig(data=2, fsdp=4)), model=model, batch=data(0),
              devices=DEVICES)
console = Console(width=140)
console.print(sharding_table(shardlib.param_table(ins.setup)))
console.print(collectives_table(ins))
console.print(theory_table(ins))
console.print(memory_table(ins))

# %% [markdown]
# ## 4. Save, then restore onto `fsdp=4, tensor=2`
# The checkpoint holds each device's slices; restoring reads them straight into the new
# mesh's shardings.

# %%
CKPT = Path("runs/notebook10").absolute()
shutil.rmtree(CKPT, ignore_errors=True)
CKPT.parent.mkdir(parents=True, exist_ok=True)
saving = dataclasses.replace(config(shardlib.MeshConfig(data=2, fsdp=2, tensor=2)),
                             checkpoint=CheckpointConfig(dir=str(CKPT)))
saved = shardlib.train(saving, model=model, data=data, devices=DEVICES)
other = shardlib.build_setup(config(shardlib.MeshConfig(data=1, fsdp=4, tensor=2)),
                             model=model, devices=DEVICES)
restored = Checkpointer(CKPT, read_only=True).restore(other)
same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
           zip(jax.tree.leaves(restored.params), jax.tree.leaves(saved.state.params),
               strict=True))
print(f"restored step {int(restored.step)} onto {dict(other.mesh.shape)}: "
      f"every array equal: {same}")
kernel = restored.params["blocks"][0]["up"]["kernel"].get_value()
print("blocks.0.up.kernel on the new mesh:", kernel.sharding.spec)
