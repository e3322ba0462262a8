"""Read and write Hugging Face ``save_pretrained`` directories (GPT-2, Llama, Qwen2/3,
Mixtral, Qwen2-MoE, Qwen3-MoE).

Loading reads config.json into a ``ModelConfig`` and the safetensors files (one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``) one tensor at
a time: each shardlib parameter is assembled on the host from its HF tensors (all layers
of one parameter at most) and placed with ``jax.make_array_from_callback`` straight into
its ``NamedSharding``, so every device receives only its own shard and no device ever
holds the whole model. Saving writes config.json + model.safetensors that
``transformers`` loads, one parameter gathered to the host at a time. The layouts
themselves are in ``interop.hf_layout``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from shardlib import sharding
from shardlib.checkpoint import Checkpointer
from shardlib.config import LoRAConfig, MeshConfig, ModelConfig
from shardlib.errors import CheckpointError, ConfigError, ShardlibError
from shardlib.export import good_step, read_array
from shardlib.interop.hf_layout import layer_groups, links, to_hf_config, to_model_config
from shardlib.interop.hf_links import Link
from shardlib.mesh import MESH_AXES, make_mesh
from shardlib.models import lora
from shardlib.models.gpt import GPT
from shardlib.train.setup import TrainSetup, TrainState
from shardlib.train.state import (
    abstract_state,
    build_setup,
    init_state,
    named_tree,
    param_specs,
    path_str,
    start_state,
)

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}
_CODES = {np.dtype(v).name: k for k, v in _DTYPES.items()}
# Fields that change the function a checkpoint computes (max_seq_len only with learned
# positions, where it is the position table's size).
_ARCH_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "kv_heads", "head_dim", "d_ff",
                "pos_embedding", "norm", "norm_eps", "mlp", "activation", "bias",
                "tie_embeddings", "rope_theta", "qkv_bias", "qk_norm", "rope_scaling",
                "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                "rope_original_max_len", "num_experts", "moe_top_k", "moe_every", "moe_d_ff",
                "moe_shared_d_ff", "moe_shared_gate", "moe_score", "moe_norm_topk",
                "moe_route_scale", "moe_first_dense")


# --- reading ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of the tensor's first byte in the file


class TensorFiles:
    """The tensors of a save_pretrained directory, read one at a time from disk."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(
                f"{self.path}: no model.safetensors or model.safetensors.index.json; shardlib "
                "reads safetensors only (re-save with save_pretrained(..., "
                "safe_serialization=True))")
        self.entries: dict[str, _Entry] = {}
        for name in files:
            self.entries.update(_read_header(self.path / name))

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name``, checked to have ``shape`` (else an error naming both)."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(
                f"{self.path}: tensor {name} is missing ({len(self.entries)} tensors in "
                f"{', '.join(sorted({e.file.name for e in self.entries.values()}))}); "
                "is the checkpoint complete and does config.json describe it?")
        if entry.shape != shape:
            raise CheckpointError(
                f"{name}: shape {entry.shape} in {entry.file.name}, but config.json implies "
                f"{shape}; the weights and config.json disagree")
        count = math.prod(shape)
        data = np.fromfile(entry.file, dtype=_DTYPES[entry.dtype], count=count,
                           offset=entry.offset)
        return data.reshape(shape)


def _read_header(file: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file holds; a CheckpointError naming the file for one that
    is not safetensors (its header size past its end, a header that is not JSON)."""
    total = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        if not 0 < size <= total - 8:
            raise _not_safetensors(file, f"a header of {size} bytes in a {total}-byte file")
        try:
            header = json.loads(f.read(size))
        except ValueError as err:  # not UTF-8 or not JSON
            raise _not_safetensors(file, f"its header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise _not_safetensors(file, "its header is not a JSON object")
    header.pop("__metadata__", None)
    return {name: _entry(file, name, info, 8 + size, total) for name, info in header.items()}


def _entry(file: Path, name: str, info: Any, start: int, total: int) -> _Entry:
    """One header entry, checked: a known dtype, and data inside the file."""
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise _not_safetensors(file, f"tensor {name!r} lacks dtype, shape or data_offsets"
                               ) from None
    if dtype not in _DTYPES:
        raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}, which "
                              f"shardlib cannot read ({', '.join(_DTYPES)})")
    if start + end > total:
        raise _not_safetensors(file, f"tensor {name!r} ends at byte {start + end} of "
                               f"{total}: truncated?")
    return _Entry(file, dtype, shape, start + begin)


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, on the host (for small files: adapters)."""
    return {name: np.fromfile(e.file, dtype=_DTYPES[e.dtype], count=math.prod(e.shape),
                              offset=e.offset).reshape(e.shape)
            for name, e in _read_header(file).items()}


def write_safetensors(file: Path, tensors: dict[str, np.ndarray], dtype: str = "float32"
                      ) -> None:
    """``tensors`` as one safetensors file, each cast to ``dtype``."""
    order = [(name, tuple(x.shape)) for name, x in tensors.items()]
    header = _header(order, np.dtype(dtype))
    with file.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x.astype(dtype)).tobytes())


def _not_safetensors(file: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{file}: not a readable safetensors file ({why}); download or "
                           "save it again")


def _read_config_json(path: str | os.PathLike) -> tuple[dict[str, Any], Path]:
    """A save_pretrained directory's config.json as a dict, or a ShardlibError naming it."""
    folder = Path(path).expanduser()
    file = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"--init-from {path}: no such directory; point at a directory "
                              "written by transformers' save_pretrained")
    if not file.is_file():
        raise CheckpointError(f"--init-from {path}: the directory has no config.json; point at "
                              "a directory written by transformers' save_pretrained")
    try:
        hf = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--init-from {path}: {file} is not readable JSON ({err}); write it "
                          "again with save_pretrained") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"--init-from {path}: {file} holds a {type(hf).__name__}, not a "
                          "JSON object; write it again with save_pretrained")
    return hf, file


def load_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a save_pretrained directory's config.json; a missing folder, a
    file that is not JSON, a missing field or one of the wrong type is a ShardlibError."""
    hf, file = _read_config_json(path)
    fix = "write it again with save_pretrained"
    try:
        cfg = to_model_config(hf, where=str(file))
    except ShardlibError:
        raise
    except KeyError as err:
        raise ConfigError(f"--init-from {path}: {file} has no {err.args[0]!r}, which a "
                          f"{hf.get('model_type', '?')} config needs; {fix}") from None
    except (TypeError, ValueError) as err:  # e.g. "num_attention_heads": "12"
        raise ConfigError(f"--init-from {path}: {file} has a field of the wrong type ({err}); "
                          f"{fix}") from None
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.type in ("int", "float") and (isinstance(value, bool) or
                                           not isinstance(value, int | float)):
            raise ConfigError(f"--init-from {path}: {file} has a field of the wrong type: it "
                              f"gives model.{f.name}={value!r}, not a number; {fix}")
    return cfg


def _table(cfg: ModelConfig, files: TensorFiles) -> list[Link]:
    """The links of ``cfg``, with the module prefix the files use (the original GPT-2
    checkpoints name ``wte.weight``, transformers ``transformer.wte.weight``)."""
    table = links(cfg)
    if table[0].hf[0] not in files.entries and table[0].hf[0].split(".", 1)[-1] in files.entries:
        table = links(cfg, prefix="")
    return table


def _split_path(name: str, var: Any) -> tuple[str, list[int] | int | None]:
    """'blocks.attn.w_q_dhk' -> ('attn.w_q_dhk', [0..L-1]) when stacked over layers,
    'blocks.3.attn.w_q_dhk' -> ('attn.w_q_dhk', 3), 'embed.w_vd' -> ('embed.w_vd', None)."""
    parts = name.split(".")
    if parts[0] != "blocks":
        return name, None
    if parts[1].isdigit():
        return ".".join(parts[2:]), int(parts[1])
    assert var.get_metadata("logical")[0] == "layers", name
    return ".".join(parts[1:]), list(range(var.shape[0]))


def _host_param(files: TensorFiles, owner: dict[str, tuple[Link, int]], rel: str,
                layers: list[int] | int | None) -> np.ndarray:
    """One shardlib parameter assembled on the host from its HF tensors."""
    if rel not in owner:
        raise ConfigError(f"parameter {rel} has no Hugging Face counterpart")
    link, j = owner[rel]

    def one(group: int | None) -> np.ndarray:
        hf = [files.read(n, s) for n, s in zip(link.names(group), link.hf_shapes, strict=True)]
        return link.to_ours(hf)[j]

    return np.stack([one(i) for i in layers]) if isinstance(layers, list) else one(layers)


def load_params(path: str | os.PathLike, cfg: ModelConfig, abstract_params: nnx.State,
                shardings: nnx.State, dtype: Any = jnp.float32) -> nnx.State:
    """The parameters of ``abstract_params`` read from ``path``, each placed straight into
    its sharding in ``shardings`` (a State of NamedShardings of the same structure)."""
    check_matches(load_config(path), cfg, path)
    files = TensorFiles(path)
    owner = {ours: (link, j) for link in _table(cfg, files) for j, ours in enumerate(link.ours)}
    is_var = lambda x: isinstance(x, nnx.Variable)

    def place(key: tuple, var: nnx.Variable, target: nnx.Variable) -> nnx.Variable:
        name = lora.base_path(path_str(key))  # a LoRA-adapted weight's frozen base
        host = _host_param(files, owner, *_split_path(name, var)).astype(dtype)
        assert host.shape == tuple(var.shape), (path_str(key), host.shape, var.shape)
        array = jax.make_array_from_callback(host.shape, target.get_value(),
                                             lambda index: host[index])
        return var.replace(value=array)

    return jax.tree_util.tree_map_with_path(place, abstract_params, shardings, is_leaf=is_var)


def check_matches(theirs: ModelConfig, ours: ModelConfig, path: str | os.PathLike) -> None:
    """Raise naming every field where the run's model differs from config.json's."""
    fields = _ARCH_FIELDS + (("max_seq_len",) if ours.pos_embedding == "learned" else ())
    diffs = [f"model.{f}={getattr(theirs, f)!r} there, {getattr(ours, f)!r} here"
             for f in fields if getattr(theirs, f) != getattr(ours, f)]
    if diffs:
        raise ConfigError(f"{path}: config.json does not describe this model: {'; '.join(diffs)}"
                          "; build the model config with shardlib.interop.hf.load_config(path) "
                          "(`shardlib train --init-from` does)")


def pretrained_state(setup: TrainSetup, path: str | os.PathLike) -> TrainState:
    """A fresh TrainState (step 0, new AdamW state) whose parameters come from ``path``;
    with LoRA (``lora.rank``) the frozen base does, and the adapters start fresh (the
    loop then reads ``lora.adapter``: ``interop.peft.adapter_state``)."""
    if setup.config.lora.rank:
        return _pretrained_lora_state(setup, path)
    params = load_params(path, setup.config.model, setup.abstract_params,
                         setup.state_shardings.params, dtype=setup.policy.param)
    state_key = jax.random.split(jax.random.key(setup.config.train.seed))[1]

    init = lambda params: start_state(setup, params, state_key)  # noqa: E731
    return jax.jit(init, out_shardings=setup.state_shardings, donate_argnums=0)(params)


def _pretrained_lora_state(setup: TrainSetup, path: str | os.PathLike) -> TrainState:
    """A fresh LoRA TrainState: the frozen base read from ``path`` in the compute dtype
    (QLoRA, ``lora.base_quant``: then quantized on the device, in one jit whose output
    is sharded as the quantized base); the dropout salts as initialised."""
    state = init_state(setup, setup.config.train.seed)
    cfg = setup.config.lora
    plain = setup if cfg.base_quant == "none" else build_setup(
        dataclasses.replace(setup.config, lora=dataclasses.replace(cfg, base_quant="none")),
        list(setup.mesh.devices.flat))  # the built-in GPT, its base unquantized
    frozen = lambda tree: nnx.filter_state(tree, nnx.Param)  # noqa: E731
    base = load_params(path, setup.config.model, frozen(abstract_state(plain).model_state),
                       frozen(plain.state_shardings.model_state), dtype=setup.policy.compute)
    kept = [(k, v) for k, v in nnx.to_flat_state(state.model_state)
            if isinstance(v, lora.DropoutSalt)]
    base = nnx.from_flat_state([*nnx.to_flat_state(base), *kept])
    if plain is setup:
        return dataclasses.replace(state, model_state=base)

    def quantize(params: nnx.State, base: nnx.State) -> dict[tuple, jax.Array]:
        module = lora.quantize_bases(nnx.merge(plain.graphdef, params, base), cfg)
        return {k: v.get_value() for k, v in nnx.to_flat_state(
            nnx.state(module, nnx.Not(nnx.LoRAParam)))}

    fresh = nnx.to_flat_state(state.model_state)
    shardings = {k: v.get_value() for k, v in nnx.to_flat_state(
        setup.state_shardings.model_state)}
    values = jax.jit(quantize, out_shardings=shardings, donate_argnums=1)(state.params, base)
    model_state = nnx.from_flat_state([(k, v.replace(value=values[k])) for k, v in fresh])
    return dataclasses.replace(state, model_state=model_state)


def from_pretrained(path: str | os.PathLike, *, mesh: Mesh | None = None,
                    rules: sharding.Rules | None = None, dtype: Any = jnp.float32) -> GPT:
    """A GPT with the weights of a save_pretrained directory, sharded over ``mesh`` (default:
    one device) by ``rules`` (default: the presets of the mesh's axes > 1)."""
    cfg = load_config(path)
    mesh = mesh or make_mesh(dict.fromkeys(MESH_AXES, 1), jax.devices()[:1])
    sizes = dict(mesh.shape)
    rules = sharding.make_rules(MeshConfig(), sizes) if rules is None else rules
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    shardings = named_tree(param_specs(abstract, rules, sizes), mesh)
    return nnx.merge(graphdef, load_params(path, cfg, abstract, shardings, dtype))


# --- writing ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Saved:
    """What ``save_pretrained`` wrote: the directory, tensor and parameter counts, bytes."""
    path: Path
    tensors: int
    params: int
    bytes: int


def save_pretrained(model: GPT, path: str | os.PathLike, *, dtype: str = "float32") -> Saved:
    """Write ``model`` as config.json + model.safetensors that transformers loads (the
    architecture of ``hf_layout.family``), gathering one parameter at a time; LoRA
    adapters are merged into their weights (``models.lora.merged_weights``)."""
    arrays = lora.merged_weights(model)
    return write_pretrained(model.cfg, lambda name: np.asarray(jax.device_get(arrays[name])),
                            arrays, path, dtype=dtype)


def write_pretrained(cfg: ModelConfig, get: Callable[[str], np.ndarray], names: Iterable[str],
                     path: str | os.PathLike, *, dtype: str = "float32") -> Saved:
    """Write config.json + model.safetensors from ``get(name)``, which returns one
    shardlib parameter (by path, e.g. ``blocks.attn.w_q_dhk``) as a host array. Checked
    before anything is written; a failed write leaves no folder it created behind."""
    out = Path(path).expanduser().absolute()
    if not out.parent.is_dir() or out.is_file():
        raise CheckpointError(f"--out {out}: must be a directory in an existing folder")
    if np.dtype(dtype).name not in ("float32", "float16", "bfloat16"):
        raise ConfigError(f"dtype={dtype!r}: use float32, float16 or bfloat16")
    table, names = links(cfg), set(names)  # a model HF cannot hold fails here
    order = [(n, s) for link in table for g in _layers(cfg, link)
             for n, s in zip(link.names(g), link.hf_shapes, strict=True)]
    header = _header(order, np.dtype(dtype))
    created = not out.exists()
    out.mkdir(exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for link in table:  # one link's parameters on the host at a time
                ours = [_gather(cfg, get, names, rel, link.layered) for rel in link.ours]
                for i in _layers(cfg, link):
                    hf = link.to_hf([x[i] if link.layered else x for x in ours])
                    for array, shape in zip(hf, link.hf_shapes, strict=True):
                        assert array.shape == shape, (link.hf, array.shape, shape)
                        f.write(np.ascontiguousarray(array.astype(dtype)).tobytes())
    except BaseException:
        tmp.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2) + "\n")
    count = sum(math.prod(s) for _, s in order)
    return Saved(out, len(order), count, (out / "model.safetensors").stat().st_size)


def _layers(cfg: ModelConfig, link: Link) -> range | list[None]:
    """The layer groups ``link`` has tensors in ([None]: not layered)."""
    return range(layer_groups(cfg)) if link.layered else [None]


def _gather(cfg: ModelConfig, get: Callable[[str], np.ndarray], names: set[str], rel: str,
            layered: bool) -> np.ndarray:
    """A parameter, stacked over layers when ``layered`` (scanned or per-layer storage)."""
    if not layered or f"blocks.{rel}" in names:
        return get(rel if not layered else f"blocks.{rel}")
    return np.stack([get(f"blocks.{i}.{rel}") for i in range(layer_groups(cfg))])


def _header(order: list[tuple[str, tuple[int, ...]]], dtype: np.dtype) -> bytes:
    """The safetensors JSON header, tensors back to back in write order, padded to 8."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in order:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype.name], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def export_pretrained(directory: str | os.PathLike, out: str | os.PathLike,
                      step: int | None = None, *, dtype: str = "float32") -> tuple[int, Saved]:
    """A training checkpoint (default: its newest good step) as a save_pretrained
    directory, read one parameter at a time on the host: no devices, no mesh."""
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        step = good_step(checkpointer, step)
        cfg = saved_model(checkpointer.saved_config(step))
        keys = {path.split(".", 1)[1]: key
                for path, (key, _) in checkpointer.saved_arrays(step).items()
                if path.startswith(("params.", "model_state."))}  # LoRA: the base is state
        if saved_lora(checkpointer.saved_config(step)).base_quant != "none":
            raise ConfigError(f"{directory}: a QLoRA checkpoint (lora.base_quant); its base is "
                              "quantized and this export merges on the host; merge in Python "
                              "(models.lora.merge_adapters, then hf.save_pretrained)")
        reader = ocp.PyTreeCheckpointer()
        read = lambda name: read_array(reader, checkpointer, step, keys[name])
        get = _merging(read, keys, saved_lora(checkpointer.saved_config(step)))
        names = {lora.base_path(name) for name in keys}
        return step, write_pretrained(cfg, get, names, out, dtype=dtype)
    finally:
        checkpointer.close()


def saved_model(saved: dict[str, Any]) -> ModelConfig:
    """The model section of a checkpoint's saved config (fields this version knows)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.get("model", {}).items() if k in known})


def saved_lora(saved: dict[str, Any]) -> LoRAConfig:
    """The LoRA section of a checkpoint's saved config (rank 0 when it has none)."""
    known = {f.name for f in dataclasses.fields(LoRAConfig)}
    return LoRAConfig(**{k: v for k, v in saved.get("lora", {}).items() if k in known})


def _merging(read: Callable[[str], np.ndarray], keys: Iterable[str], cfg: LoRAConfig
             ) -> Callable[[str], np.ndarray]:
    """``read`` by the base model's names, each LoRA-adapted weight merged on the host."""
    keys = set(keys)

    def get(name: str) -> np.ndarray:
        if f"{name}.{lora.BASE}" not in keys:
            return read(name)
        return lora.merge_host(read(f"{name}.{lora.BASE}"), read(f"{name}.lora_a"),
                               read(f"{name}.lora_b"), lora.scale(cfg))

    return get
