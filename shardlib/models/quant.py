"""Quantized frozen weights (QLoRA's base, Dettmers et al. 2023): a weight stored in 4 or 8
bits and dequantized where the layer reads it, inside the step.

qwix (``qwix.quantize`` / ``qwix.dequantize`` / ``qwix.QArray``) does the quantizing: its
``nf4`` qtype is the paper's NormalFloat4 (uint4 indices into the 16-value codebook of the
paper's Appendix E), ``int8`` and ``float8_e4m3fn`` are absmax-scaled, and ``tiled_axes``
gives one scale per block. Blocks run along the weight's last dim (``block`` values each),
so the scales take the weight's logical dims and shard by its rules whenever the block
count of a sharded dim divides by the mesh axis.

NF4's 4-bit codes are stored two to a byte (``pack_nibbles``), in ``uint8``: with jax's own
``uint4`` arrays the loop's ahead-of-time compiled step rejects its own output on XLA CPU
(a sub-byte layout), so the packing is done here and undone inside the step. The two codes
of a byte come from one block, so a device's bytes unpack to its own codes however the
blocks are split over the mesh (Megatron's split of an MLP's last dim inside a pipeline
stage, where the step unpacks them by hand).

What qwix lacks is the paper's *double quantization* (the block scales themselves
quantized); ``double_quantize`` adds it on top of qwix's arrays: the scales minus their
mean, in 8-bit floats with one fp32 scale per ``SCALE_BLOCK`` of them (the paper's
blocksize 256), 0.127 bits per weight instead of 0.5 (block 64). The second-level scales
are kept whole on every device; inside a ``shard_map`` whose first-level scales are split
over ``SPLIT_AXIS`` (a pipeline stage's Megatron split) each device reads its own part of
them (``local_second_level``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.errors import ConfigError, ShardlibError
from shardlib.sharding import compute_platform, constrain_weight

FORMATS: dict[str, Any] = {"nf4": "nf4", "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
CODE_BITS = {"nf4": 4, "int8": 8, "fp8": 8}
SCALE_BLOCK = 256  # scales per second-level scale (the paper's double quantization)
SCALE_CODE = jnp.float8_e4m3fn  # the paper's 8-bit floats for the first-level scales
# the one mesh axis a weight's dims stay split over inside a manual region that reads it
# (a pipeline stage gathers the fsdp split, and keeps Megatron's)
SPLIT_AXIS = "tensor"


def qwix_module() -> Any:
    """qwix, imported when a base is quantized (the ``qlora`` extra)."""
    try:
        import qwix
    except ImportError:
        raise ConfigError("lora.base_quant: needs qwix; pip install -e \".[qlora]\" (or set "
                          "lora.base_quant=none)") from None
    return qwix


class QuantCodes(nnx.Variable):
    """A quantized weight's codes (nf4 indices, int8, fp8), or its scales' codes:
    frozen, non-trained state."""


class QuantScale(nnx.Variable):
    """A quantized weight's fp32 scales (first level, or the second level's)."""


def bytes_per_weight(fmt: str, block: int, double_quant: bool) -> float:
    """Bytes one weight takes in ``fmt`` with its share of the scales (the formula the
    compiled sizes are checked against; the mean offsets, one per weight, are left out)."""
    scales = 1 / block + 4 / (block * SCALE_BLOCK) if double_quant else 4 / block
    return CODE_BITS[fmt] / 8 + scales


def _tiles(shape: tuple[int, ...], lead: int, budget: int) -> dict[int, int]:
    """Tile sizes over the dims after ``lead`` whose product is ``budget`` at most: each
    dim takes the largest part of what is left that divides it, first dim first."""
    tiles = {}
    for axis in range(lead, len(shape)):
        size = math.gcd(shape[axis], budget)
        if size > 1:
            tiles[axis], budget = size, budget // size
    return tiles


def pack_nibbles(codes: jax.Array, block: int) -> jax.Array:
    """4-bit codes (..., n) as bytes (..., n / 2), within each ``block`` of the last dim:
    its first half in the low nibbles, its second half in the high ones. A byte never
    pairs codes of two blocks, so any split of the blocks over devices is a split of the
    bytes; no dim of size 2 appears (which a TPU would pad to 128 lanes)."""
    *lead, n = codes.shape
    blocks = codes.astype(jnp.uint8).reshape(*lead, n // block, block)
    low, high = jnp.split(blocks, 2, axis=-1)
    return (low | (high << 4)).reshape(*lead, n // 2)


def unpack_nibbles(packed: jax.Array, block: int) -> jax.Array:
    """``pack_nibbles`` undone: (..., n / 2) bytes -> (..., n) codes (``uint8``)."""
    *lead, half = packed.shape
    pairs = packed.reshape(*lead, 2 * half // block, block // 2)
    return jnp.concatenate([pairs & 0xF, pairs >> 4], axis=-1).reshape(*lead, 2 * half)


@dataclass(frozen=True)
class DoubleQuantized:
    """First-level scales as 8-bit codes, their second-level fp32 scales and the mean
    taken off before quantizing (one per stacked layer)."""
    codes: jax.Array
    scale: jax.Array
    offset: jax.Array


def second_level_tiles(shape: tuple[int, ...], lead: int) -> tuple[int, ...]:
    """The tile of first-level scales (of ``shape``, stacked over ``lead`` dims) that
    each second-level scale covers, per dim after the stacking dims."""
    tiles = _tiles(shape, lead, SCALE_BLOCK)
    return tuple(tiles.get(axis, 1) for axis in range(lead, len(shape)))


def double_quantize(scale: jax.Array, lead: int) -> DoubleQuantized:
    """The paper's double quantization of first-level ``scale`` (stacked over its first
    ``lead`` dims): minus its mean, in ``SCALE_CODE`` with blocks of ``SCALE_BLOCK``."""
    rest = tuple(range(lead, scale.ndim))
    offset = jnp.mean(scale, axis=rest, keepdims=True)
    tiles = {lead + i: t for i, t in enumerate(second_level_tiles(scale.shape, lead)) if t > 1}
    q = qwix_module().quantize(scale - offset, SCALE_CODE, tiled_axes=tiles,
                      channelwise_axes=[a for a in range(scale.ndim) if a not in tiles])
    return DoubleQuantized(q.qvalue, q.scale, offset)


def local_second_level(whole: jax.Array, local_shape: tuple[int, ...],
                       tiles: tuple[int, ...]) -> jax.Array:
    """This device's part of second-level scales ``whole`` (kept whole everywhere) for its
    first-level scales of ``local_shape``: along a dim split over ``SPLIT_AXIS`` (local
    smaller than whole) one second-level value per first-level scale, sliced at this
    device's offset; ``whole`` itself where nothing is split. ``tiles``: per trailing dim,
    as ``second_level_tiles``."""
    for axis in range(whole.ndim - len(tiles), whole.ndim):
        tile = tiles[axis - whole.ndim]
        local = local_shape[axis]
        if whole.shape[axis] * tile == local:
            continue
        if SPLIT_AXIS not in jax.sharding.get_abstract_mesh().manual_axes:
            raise ShardlibError(f"quantized scales of shape {tuple(local_shape)} read outside "
                                f"a region manual over {SPLIT_AXIS!r}: a split the step "
                                "does not know")
        per_scale = jnp.repeat(whole, tile, axis=axis)
        whole = jax.lax.dynamic_slice_in_dim(
            per_scale, jax.lax.axis_index(SPLIT_AXIS) * local, local, axis=axis)
    return whole


def double_dequantize(dq: DoubleQuantized) -> jax.Array:
    """The first-level scales back (fp32)."""
    qwix = qwix_module()
    return qwix.dequantize(qwix.QArray(dq.codes, dq.scale, None, SCALE_CODE)) + dq.offset


class Quantized(nnx.Module):
    """A frozen weight in ``fmt`` (``FORMATS``), one scale per ``block`` values of its last
    dim (double-quantized when ``double_quant``); reads (``[...]``) as the dequantized
    weight in ``dtype``. No full-precision copy is kept."""

    def __init__(self, w: jax.Array, dims: tuple[str | None, ...], *, fmt: str, block: int,
                 double_quant: bool, lead: int, dtype: Any = None):
        if w.shape[-1] % block or (fmt == "nf4" and block % 2):
            raise ConfigError(f"lora.quant_block={block}: does not divide the last dim "
                              f"({w.shape[-1]}) of a weight of shape {tuple(w.shape)}; choose a "
                              "block size that divides it (nf4: an even one; 64 is the "
                              "paper's)")
        q = qwix_module().quantize(w.astype(jnp.float32), FORMATS[fmt],
                                   tiled_axes={w.ndim - 1: block},
                                   channelwise_axes=tuple(range(w.ndim - 1)))
        self.packed = fmt == "nf4"  # two 4-bit codes per byte
        codes = pack_nibbles(q.qvalue, block) if self.packed else q.qvalue
        self.codes = QuantCodes(codes, logical=dims)
        if double_quant:
            dq = double_quantize(q.scale, lead)
            self.tiles = second_level_tiles(q.scale.shape, lead)
            self.scale_codes = QuantCodes(dq.codes, logical=dims)
            # tiny (1 / 16384 of the weight): kept whole on every device
            whole = (*dims[:lead], *(None,) * (w.ndim - lead))
            self.scale_scale = QuantScale(dq.scale, logical=whole)
            self.scale_offset = QuantScale(dq.offset, logical=whole)
        else:
            self.scale = QuantScale(q.scale, logical=dims)
        self.fmt, self.block, self.double_quant = fmt, block, double_quant
        self.out_dtype = jnp.dtype(dtype or w.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, last = self.codes.shape
        return (*lead, last * 2 if self.packed else last)

    @property
    def dtype(self) -> Any:
        return self.out_dtype

    def pinned(self, var: nnx.Variable) -> jax.Array:
        """``var`` gathered to its compute layout (``gathered``), except packed NF4 codes
        compiled for a TPU: there the TPU compiler kept every layer's gathered codes alive
        at once (Llama-3-8B on v5litepod-8: 3.24 GiB more temporaries), so the compiler
        places those gathers itself (docs/results/post-training.md)."""
        if self.packed and compute_platform() == "tpu":
            return var[...]
        return gathered(var)

    def scales(self) -> jax.Array:
        """The first-level fp32 scales (dequantized when double-quantized)."""
        if not self.double_quant:
            return self.pinned(self.scale)
        codes = self.pinned(self.scale_codes)
        second = local_second_level(self.pinned(self.scale_scale), codes.shape, self.tiles)
        return double_dequantize(DoubleQuantized(codes, second, self.pinned(self.scale_offset)))

    def __getitem__(self, index: Any) -> jax.Array:
        return self.dequantized()[index]

    def get_value(self) -> jax.Array:
        return self.dequantized()

    def dequantized(self) -> jax.Array:
        """The weight, dequantized (in ``dtype``)."""
        qwix = qwix_module()
        codes = self.pinned(self.codes)
        codes = unpack_nibbles(codes, self.block) if self.packed else codes
        q = qwix.QArray(codes, self.scales(), None, FORMATS[self.fmt])
        return qwix.dequantize(q).astype(self.out_dtype)


def gathered(var: nnx.Variable) -> jax.Array:
    """A code, scale or adapter array in its compute layout (FSDP's split gathered), so
    that the step's all-gathers move codes and scales, never the dequantized weight."""
    return constrain_weight(var[...], var.get_metadata().get("logical") or ())
