"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``
that ``peft.PeftModel.from_pretrained`` loads onto the Hugging Face model, and back.

PEFT keeps, per adapted torch ``Linear`` (out, in), ``lora_A.weight`` (r, in) and
``lora_B.weight`` (out, r), named after the module under ``base_model.model.``; its delta
is s B A. shardlib's adapter of a weight (in dims, out dims) is A (in dims, r) and B (r,
out dims), so PEFT's A is ours flattened to (in, r) and transposed, its B ours flattened
to (r, out) and transposed, in the flattening the Hugging Face layout uses (heads major).
Llama, Qwen2 and Qwen3 layouts, and the mixtures of experts Mixtral, Qwen2-MoE and
Qwen3-MoE, whose routers and experts are bare parameters (``interop.peft_experts``); a
scanned model's adapter is one per layer (group).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from shardlib.checkpoint import Checkpointer
from shardlib.config import LoRAConfig, ModelConfig
from shardlib.errors import CheckpointError, ConfigError
from shardlib.export import good_step, read_array
from shardlib.interop import hf, peft_experts
from shardlib.interop.hf_layout import family, links
from shardlib.interop.hf_links import Link
from shardlib.models import lora
from shardlib.models.gpt import GPT
from shardlib.train.setup import TrainSetup, TrainState

PREFIX = "base_model.model."  # PeftModel around the *ForCausalLM
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FAMILIES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


def linear_links(cfg: ModelConfig) -> dict[str, Link]:
    """Each torch ``Linear`` of a layer, by the shardlib weight it is (``attn.w_q_dhk``)."""
    kind = family(cfg)
    if kind not in FAMILIES:
        raise ConfigError(f"model {cfg.name!r} is {kind}: PEFT adapters are read and written "
                          f"for the {', '.join(FAMILIES)} layouts only")
    return {link.ours[0]: link for link in links(cfg)
            if link.layered and len(link.hf) == 1 and len(link.hf_shapes[0]) == 2
            and not peft_experts.is_param(link.ours[0])}


def param_links(cfg: ModelConfig) -> dict[str, Link]:
    """Each MoE layer's router and experts (``peft_experts``), by the shardlib weight."""
    return {link.ours[0]: link for link in links(cfg)
            if link.layered and peft_experts.is_param(link.ours[0])}


def _layers(path: str, groups: int) -> tuple[str, list[tuple[int | None, int]]]:
    """'blocks.attn.w_q_dhk' -> ('attn.w_q_dhk', [(0, 0), (1, 1), ...]): the weight inside
    a layer group and, per group, (its index in the adapter's ``groups`` stacked arrays or
    None where the layers are not stacked, the group)."""
    parts = path.split(".")
    if parts[0] != "blocks":
        raise ConfigError(f"LoRA adapter on {path}: PEFT adapters cover the layers' "
                          "projections only; drop it from lora.targets")
    if parts[1].isdigit():
        return ".".join(parts[2:]), [(None, int(parts[1]))]
    return ".".join(parts[1:]), [(i, i) for i in range(groups)]


def _module(link: Link, layer: int) -> str:
    return PREFIX + link.names(layer)[0].removesuffix(".weight")


def _host(node: lora.Adapted) -> tuple[np.ndarray, np.ndarray]:
    return tuple(np.array(jax.device_get(v.get_value())) for v in (node.lora_a, node.lora_b))


def _mlp(link: Link, layer: int) -> str:
    """PEFT's name of the ``mlp.`` module that holds a router or experts parameter."""
    return PREFIX + peft_experts.layer_prefix(link.names(layer)[0])


def adapter_tensors(model: GPT) -> dict[str, np.ndarray]:
    """Every adapter of ``model`` as PEFT's tensors (``...q_proj.lora_A.weight``)."""
    return tensors_of(model.cfg, {path: _host(node) for path, node in lora.adapters(model)})


def tensors_of(cfg: ModelConfig, factors: dict[str, tuple[np.ndarray, np.ndarray]]
               ) -> dict[str, np.ndarray]:
    """Adapters (their path, ``blocks.attn.w_q_dhk`` -> host A and B) of a model ``cfg``
    as PEFT's tensors."""
    table, params, out = linear_links(cfg), param_links(cfg), {}
    moe: dict[str, dict[str, peft_experts.Factors]] = {}  # per MoE layer's mlp: its factors
    for path, (a, b) in factors.items():
        rel, layers = _layers(path, a.shape[0])
        if rel in params:
            for i, layer in layers:
                moe.setdefault(_mlp(params[rel], layer), {})[peft_experts.weight(rel)] = \
                    (a, b) if i is None else (a[i], b[i])
            continue
        if rel not in table:
            raise ConfigError(f"LoRA adapter on {path}: no Hugging Face Linear or expert "
                              f"parameter holds it; PEFT adapters cover {', '.join(table)}"
                              f"{', ' + ', '.join(params) if params else ''}")
        for i, layer in layers:
            a_in, b_out = (a, b) if i is None else (a[i], b[i])
            rank = a_in.shape[-1]
            name = _module(table[rel], layer)
            out[f"{name}.lora_A.weight"] = a_in.reshape(-1, rank).T
            out[f"{name}.lora_B.weight"] = b_out.reshape(rank, -1).T
    for mlp, layer_factors in moe.items():
        out.update(peft_experts.to_peft(mlp, layer_factors))
    return out


def adapter_config(tensors: dict[str, np.ndarray], cfg: LoRAConfig, num_layers: int,
                   base_model: str = "", adapted: frozenset[str] = frozenset()
                   ) -> dict[str, Any]:
    """PEFT's ``adapter_config.json``: the Linear modules by their short names (``q_proj``)
    when every layer has them, else by full name; the MoE parameters of ``adapted`` (our
    weights, ``moe.mlp.w_gate_edf``) as ``target_parameters``."""
    params = set(peft_experts.names_of(tensors))
    names = sorted({n.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for n in tensors
                    if n not in params})
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    modules = short if len(names) == len(short) * num_layers else names
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "use_rslora": cfg.rslora,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model or None,
            "target_parameters": peft_experts.targets(adapted) or None,
            **peft_experts.patterns(adapted, cfg)}


def save_adapter(model: GPT, path: str | os.PathLike, cfg: LoRAConfig,
                 base_model: str = "") -> Path:
    """Write ``model``'s adapters as a PEFT adapter directory; ``cfg`` is the LoRA config
    they were built with (its rank, alpha and rsLoRA go into adapter_config.json)."""
    factors = {path_: _host(node) for path_, node in lora.adapters(model)}
    return write_adapter(path, model.cfg, cfg, factors, base_model)


def write_adapter(path: str | os.PathLike, model_cfg: ModelConfig, cfg: LoRAConfig,
                  factors: dict[str, tuple[np.ndarray, np.ndarray]], base_model: str = ""
                  ) -> Path:
    """Adapters (path -> host A and B, ``tensors_of``) as a PEFT adapter directory."""
    out = Path(path).expanduser()
    tensors = tensors_of(model_cfg, factors)
    if not tensors:
        raise ConfigError("save_adapter: the model has no LoRA adapters (lora.rank=0?)")
    out.mkdir(parents=True, exist_ok=True)
    hf.write_safetensors(out / WEIGHTS, tensors)
    adapted = frozenset(_layers(path_, 1)[0] for path_ in factors)
    config = adapter_config(tensors, cfg, model_cfg.num_layers, base_model, adapted)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_adapter(directory: str | os.PathLike, out: str | os.PathLike,
                   step: int | None = None) -> tuple[int, Path]:
    """A LoRA training checkpoint's adapters (default: its newest good step) as a PEFT
    adapter directory, read on the host: no devices, no mesh."""
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        step = good_step(checkpointer, step)
        saved = checkpointer.saved_config(step)
        model_cfg, cfg = hf.saved_model(saved), hf.saved_lora(saved)
        keys = {path.split(".", 1)[1]: key
                for path, (key, _) in checkpointer.saved_arrays(step).items()
                if path.startswith("params.") and path.endswith(lora.FACTORS)}
        if not cfg.rank or not keys:
            raise ConfigError(f"{directory}: step {step} has no LoRA adapters (lora.rank="
                              f"{cfg.rank}); export the whole model with --format hf")
        reader = ocp.PyTreeCheckpointer()
        adapted = dict.fromkeys(name.rsplit(".", 1)[0] for name in keys)  # each A, B pair once
        factors = {path: tuple(read_array(reader, checkpointer, step, keys[f"{path}.{f}"])
                               for f in lora.FACTORS) for path in adapted}
        return step, write_adapter(out, model_cfg, cfg, factors, saved.get("train", {}).get(
            "init_from", ""))
    finally:
        checkpointer.close()


# --- reading -----------------------------------------------------------------------------

_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None}


def read_config(path: str | os.PathLike, cfg: ModelConfig) -> LoRAConfig:
    """The ``LoRAConfig`` of a PEFT adapter directory for model ``cfg``: rank, alpha,
    rsLoRA, and targets naming the shardlib weights of its ``target_modules``. Dropout, a
    training option, is not applied (shardlib's adapters take none)."""
    file = Path(path).expanduser() / CONFIG
    if not file.is_file():
        raise CheckpointError(f"lora.adapter={path}: no {CONFIG}; point at a directory "
                              "written by peft's save_pretrained")
    conf = json.loads(file.read_text())
    if conf.get("peft_type") != "LORA":
        raise ConfigError(f"{file}: peft_type={conf.get('peft_type')!r}; only LORA is read")
    for key, want in _REFUSED.items():
        if conf.get(key, want) not in (want, [], {}):
            raise ConfigError(f"{file}: {key}={conf[key]!r} is not supported (needs {want!r})")
    ours = LoRAConfig(rank=int(conf["r"]), alpha=float(conf["lora_alpha"]),
                      rslora=bool(conf.get("use_rslora", False)))
    own = peft_experts.patterns(frozenset({peft_experts.GATE, peft_experts.UP}), ours)
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key) and conf[key] != own[key]:
            raise ConfigError(f"{file}: {key}={conf[key]} is not supported (per-module ranks "
                              f"are read only as shardlib writes them: {own[key]})")
    wanted = conf.get("target_modules") or []
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    table = linear_links(cfg)
    chosen = [rel for rel, link in table.items()
              if any(_targets(link, layer, wanted) for layer in range(cfg.num_layers))]
    params = peft_experts.weights_of(conf.get("target_parameters") or [])
    chosen += [rel for rel in param_links(cfg) if peft_experts.weight(rel) in params]
    if not chosen:
        raise ConfigError(f"{file}: target_modules={wanted}, target_parameters="
                          f"{conf.get('target_parameters')} name no weight of this model")
    return replace(ours, targets=",".join(re.escape(rel) + "$" for rel in chosen))


def _targets(link: Link, layer: int, wanted: list[str]) -> bool:
    """PEFT's match: a module is targeted when its name is, or ends in ``.`` + a target
    (a single string target is a regular expression over the whole name)."""
    name = _module(link, layer).removeprefix(PREFIX)
    if len(wanted) == 1 and re.fullmatch(wanted[0], name):
        return True
    return any(name == t or name.endswith("." + t) for t in wanted)


def load_adapter(model: GPT, path: str | os.PathLike) -> GPT:
    """``model`` (with adapters, e.g. from ``add_adapters(read_config(...))``) with the
    adapter weights of a PEFT directory; adapters of layers the file lacks keep theirs."""
    file = Path(path).expanduser() / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"lora.adapter={path}: no {WEIGHTS}")
    tensors = hf.read_safetensors(file)
    table, params, used = linear_links(model.cfg), param_links(model.cfg), set()
    moe: dict[str, dict[str, peft_experts.Factors]] = {}  # per MoE layer's mlp: host views
    placed = []
    for path_, node in lora.adapters(model):
        a, b = _host(node)
        placed.append((node, a, b))
        rel, layers = _layers(path_, a.shape[0])
        for i, layer in layers:
            a_in, b_out = (a, b) if i is None else (a[i], b[i])
            if rel in params:
                moe.setdefault(_mlp(params[rel], layer), {})[peft_experts.weight(rel)] = \
                    (a_in, b_out)
                continue
            name = _module(table[rel], layer)
            if f"{name}.lora_A.weight" not in tensors:
                continue
            used |= {f"{name}.lora_A.weight", f"{name}.lora_B.weight"}
            a_in[...] = _fit(tensors, f"{name}.lora_A.weight", a_in.shape)
            b_out[...] = _fit(tensors, f"{name}.lora_B.weight", b_out.shape)
    for mlp, views in moe.items():
        used |= peft_experts.read_layer(tensors, mlp, views)
    for node, a, b in placed:  # the host copies, filled through their views above
        for var, host in ((node.lora_a, a), (node.lora_b, b)):
            var.set_value(jax.device_put(host, var.get_value().sharding))
    left = sorted(set(tensors) - used)
    if left:
        raise ConfigError(f"{file}: {len(left)} tensors have no adapter in the model (first: "
                          f"{left[0]}); lora.targets must name every module the adapter has")
    return model


def _fit(tensors: dict[str, np.ndarray], name: str, ours: tuple[int, ...]) -> np.ndarray:
    """PEFT tensor ``name`` (r, in) or (out, r), transposed into our shape, checked."""
    x = tensors[name]
    if x.ndim != 2 or x.shape[::-1] != (int(np.prod(ours[:-1])), ours[-1]) and \
            x.shape[::-1] != (ours[0], int(np.prod(ours[1:]))):
        raise CheckpointError(f"{name}: shape {x.shape} does not fit the adapter {ours}; "
                              "is lora.rank the adapter's r?")
    return x.T.reshape(ours)


def from_pretrained(base: str | os.PathLike, adapter: str | os.PathLike,
                    **kwargs: Any) -> GPT:
    """The GPT of a Hugging Face directory (``hf.from_pretrained``, same keywords) with the
    PEFT adapter of ``adapter`` on it, ready to generate or to merge."""
    model = hf.from_pretrained(base, **kwargs)
    lora.add_adapters(model, read_config(adapter, model.cfg), nnx.Rngs(0))
    return load_adapter(model, adapter)


def adapter_state(setup: TrainSetup, state: TrainState, path: str | os.PathLike
                  ) -> TrainState:
    """``state`` with its adapters read from a PEFT directory and a fresh optimizer state."""
    theirs, ours = read_config(path, setup.config.model), setup.config.lora
    for field in ("rank", "alpha", "rslora"):
        if getattr(theirs, field) != getattr(ours, field):
            raise ConfigError(f"lora.{field}={getattr(ours, field)!r}, but the adapter "
                              f"{path} has {getattr(theirs, field)!r}; set --set "
                              f"lora.{field}={getattr(theirs, field)}")
    module = nnx.merge(setup.graphdef, state.params, state.model_state)
    params = nnx.state(load_adapter(module, path), nnx.LoRAParam)
    params = jax.device_put(params, setup.state_shardings.params)
    opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params)
    return TrainState(state.step, params, opt_state, state.rng, state.loss_scale, state.comm,
                      state.model_state)
