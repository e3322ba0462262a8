"""Export a checkpoint's parameters to one safetensors file, for inference or sharing.

Tensors keep shardlib's names (``blocks.attn.w_q_dhk``, layers stacked on the first dim)
and are gathered on the host one at a time, straight from the checkpoint files: no mesh,
no devices, and peak memory is the largest tensor. The header's ``__metadata__`` holds
the step and the training config as JSON.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from shardlib.checkpoint import Checkpointer, CheckpointWarning, leaf_path
from shardlib.errors import CheckpointError, DamagedCheckpointError

_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
                       "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
                       "bool": "BOOL"}


@dataclass(frozen=True)
class ExportResult:
    """What ``export_safetensors`` wrote: the file, the step and its size."""
    path: Path
    step: int
    tensors: int
    params: int
    bytes: int


def export_safetensors(directory: str | os.PathLike, out: str | os.PathLike,
                       step: int | None = None) -> ExportResult:
    """Write the parameters of ``step`` (default: the newest good one) to one safetensors
    file, gathering one tensor at a time on the host: peak memory is the largest tensor."""
    out = check_out(out)
    checkpointer = Checkpointer(directory, read_only=True)
    step = good_step(checkpointer, step)
    arrays = {path.removeprefix("params."): entry
              for path, entry in checkpointer.saved_arrays(step).items()
              if path.startswith("params.")}
    metadata = {"step": str(step), "config": json.dumps(checkpointer.saved_config(step))}
    header = _safetensors_header({name: meta for name, (_, meta) in arrays.items()}, metadata)
    reader = ocp.PyTreeCheckpointer()
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for name in sorted(arrays):  # the header's order; little-endian, like every host
                value = read_array(reader, checkpointer, step, arrays[name][0])
                f.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed export leaves nothing behind
        raise
    count = sum(math.prod(meta.shape) for _, meta in arrays.values())
    return ExportResult(out, step, len(arrays), count, out.stat().st_size)


def check_out(out: str | os.PathLike) -> Path:
    """``--out`` as an absolute path: a file to write, in a folder that exists."""
    path = Path(out).expanduser().absolute()
    if path.is_dir():
        raise CheckpointError(f"--out {path}: a directory; name the file to write, e.g. --out "
                              f"{path / 'model.safetensors'} (or use --format hf)")
    if not path.parent.is_dir():
        raise CheckpointError(f"--out {path}: directory {path.parent} does not exist")
    return path


def good_step(checkpointer: Checkpointer, step: int | None) -> int:
    """``step`` verified, or the newest step that verifies (warning past damaged ones)."""
    if step is not None:
        checkpointer.verify(checkpointer.resolve_step(step))
        return step
    for candidate in reversed(checkpointer.steps()):
        try:
            checkpointer.verify(candidate)
            return candidate
        except DamagedCheckpointError as err:
            warnings.warn(f"{err}; falling back to an older checkpoint", CheckpointWarning,
                          stacklevel=3)
    raise CheckpointError(f"{checkpointer.directory}: no finished, undamaged checkpoint")


def _safetensors_header(arrays: dict[str, Any], metadata: dict[str, str]) -> bytes:
    """The JSON header: tensors in name order, back to back, padded to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(arrays):
        meta = arrays[name]
        dtype = np.dtype(meta.dtype)
        if dtype.name not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"export: {name} has dtype {dtype}, which safetensors lacks")
        size = math.prod(meta.shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype.name], "shape": list(meta.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def read_array(reader: ocp.PyTreeCheckpointer, checkpointer: Checkpointer, step: int,
                key_path: tuple) -> np.ndarray:
    """One saved array, whole, as a host NumPy array (orbax reads only that array)."""
    keys = [jax.tree_util.keystr((key,), simple=True) for key in key_path]
    item: Any = 0
    restore_args: Any = ocp.RestoreArgs(restore_type=np.ndarray)
    for key in reversed(keys):
        item, restore_args = {key: item}, {key: restore_args}
    folder = checkpointer.directory / str(step) / "state"
    restore = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    tree = checkpointer.guarded_read(step, leaf_path(key_path),
                                     lambda: reader.restore(folder, restore))
    for key in keys:
        tree = tree[key]
    return np.asarray(tree)
