"""Models written the way a user writes them, none of them shardlib's: a ViT classifier
annotated as Flax's documentation teaches (``nnx.with_partitioning``), a convolutional
network with BatchNorm and no annotation at all, and a classifier with dropout. Each
comes with its loss and batch layout as a ``shardlib.Model``, and tiny data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardlib

IMAGE, PATCH, CLASSES = 8, 4, 10  # 8x8 images with 3 channels, 4x4 patches (4 of them)


def dense(din: int, dout: int, dims: tuple[str | None, str | None], rngs: nnx.Rngs):
    """A Linear whose kernel carries Flax's sharding annotation (logical dims)."""
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), dims)
    return nnx.Linear(din, dout, kernel_init=init, rngs=rngs)


class Block(nnx.Module):
    """x + MLP(LayerNorm(x)): the MLP's hidden dim is ``mlp``, split by tensor rules."""

    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = dense(d, f, ("embed", "mlp"), rngs)
        self.down = dense(f, d, ("mlp", "embed"), rngs)

    def __call__(self, x_bpd: jax.Array) -> jax.Array:
        return x_bpd + self.down(jax.nn.gelu(self.up(self.norm(x_bpd))))


class ViT(nnx.Module):
    """Patch embedding, ``depth`` residual MLP blocks (a list: one FSDP unit each), a
    mean-pooled linear head."""

    def __init__(self, *, d: int = 32, f: int = 64, depth: int = 2, rngs: nnx.Rngs):
        self.patch = dense(PATCH * PATCH * 3, d, (None, "embed"), rngs)
        self.blocks = nnx.List([Block(d, f, rngs) for _ in range(depth)])
        self.head = dense(d, CLASSES, ("embed", None), rngs)

    def __call__(self, images_bhwc: jax.Array) -> jax.Array:
        b = images_bhwc.shape[0]
        n = IMAGE // PATCH
        x = images_bhwc.reshape(b, n, PATCH, n, PATCH, 3).transpose(0, 1, 3, 2, 4, 5)
        x_bpd = self.patch(x.reshape(b, n * n, PATCH * PATCH * 3))  # (B, P, D)
        for block in self.blocks:
            x_bpd = block(x_bpd)
        return self.head(x_bpd.mean(axis=1))  # (B, classes)


class ConvNet(nnx.Module):
    """Two conv + BatchNorm + ReLU stages and a linear head; no sharding annotation."""

    def __init__(self, *, width: int = 16, rngs: nnx.Rngs):
        # no conv bias before BatchNorm (as ResNets): its gradient is zero, its Adam step noise
        self.conv1 = nnx.Conv(3, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, rngs=rngs)
        self.conv2 = nnx.Conv(width, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, CLASSES, rngs=rngs)

    def __call__(self, images_bhwc: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.bn1(self.conv1(images_bhwc)))
        x = jax.nn.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(axis=(1, 2)))


class DropoutMLP(nnx.Module):
    """An MLP classifier with dropout (an RNG stream in the model's state)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(IMAGE * IMAGE * 3, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(64, CLASSES, rngs=rngs)

    def __call__(self, images_bhwc: jax.Array) -> jax.Array:
        x = images_bhwc.reshape(images_bhwc.shape[0], -1)
        return self.out(self.drop(jax.nn.relu(self.up(x))))


class Linear(nnx.Module):
    """The smallest classifier: a linear map of the flattened image (compiles in a blink,
    for tests of the loop rather than of sharding)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.out = nnx.Linear(IMAGE * IMAGE * 3, CLASSES, rngs=rngs)

    def __call__(self, images_bhwc: jax.Array) -> jax.Array:
        return self.out(images_bhwc.reshape(images_bhwc.shape[0], -1))


def classify(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    """Mean cross-entropy over the rows, and the accuracy."""
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = (logits.argmax(-1) == batch["label"]).mean()
    return loss, {"accuracy": accuracy}


IMAGES = {"image": ("batch", None, None, None), "label": ("batch",)}


def vit(**kwargs) -> shardlib.Model:
    return shardlib.Model(build=lambda rngs: ViT(rngs=rngs, **kwargs), loss=classify,
                          batch=IMAGES, name="vit")


def convnet() -> shardlib.Model:
    return shardlib.Model(build=lambda rngs: ConvNet(rngs=rngs), loss=classify,
                          batch=IMAGES, name="convnet")


def linear() -> shardlib.Model:
    return shardlib.Model(build=lambda rngs: Linear(rngs=rngs), loss=classify,
                          batch=IMAGES, name="linear")


def dropout_mlp() -> shardlib.Model:
    return shardlib.Model(build=lambda rngs: DropoutMLP(rngs=rngs), loss=classify,
                          batch=IMAGES, name="dropout-mlp")


def image_batch(k: int, batch: int = 8) -> dict[str, np.ndarray]:
    """Batch ``k`` of images whose label is decided by their mean colour (learnable)."""
    rng = np.random.default_rng(k)
    labels = rng.integers(0, CLASSES, batch).astype(np.int32)
    images = rng.normal(0, 1, (batch, IMAGE, IMAGE, 3)).astype(np.float32)
    images += (labels[:, None, None, None] / CLASSES - 0.5).astype(np.float32)
    return {"image": images, "label": labels}


def jnp_batch(k: int, batch: int = 8) -> dict[str, jax.Array]:
    return {key: jnp.asarray(v) for key, v in image_batch(k, batch).items()}
