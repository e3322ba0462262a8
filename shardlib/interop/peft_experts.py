"""A mixture of experts' adapters in PEFT's format: transformers 5 keeps each MoE layer's
router and experts as bare parameters, which PEFT adapts through ``target_parameters``.

Per MoE layer (``model.layers.{L}.mlp.``, Mixtral, Qwen2-MoE and Qwen3-MoE alike):

- the router ``gate.weight`` (E, d): PEFT's ``lora_A.weight`` (r, d) and ``lora_B.weight``
  (E, r), as a ``Linear``'s: ours (``w_router_de``) transposed.
- the experts' ``gate_up_proj`` (E, 2f, d: the gate's rows, then up's) and ``down_proj``
  (E, d, f). PEFT's adapter of such a parameter has rank ``R`` per expert:
  ``lora_A.weight`` (E R, in) holds expert e's (R, in) at rows e R ... (e + 1) R, and
  ``lora_B.weight`` (out, R E) expert e's (out, R) at columns e, E + e, 2E + e, ...
  shardlib gives the gate (``w_gate_edf``) and up (``w_in_edf``) adapters of their own,
  each of rank r; side by side they are one adapter of ``gate_up_proj`` of rank 2r whose
  B is block-diagonal (the gate's rank dims write the gate's rows only), so the file says
  ``rank_pattern`` / ``alpha_pattern`` for it (the same scale s). An adapter PEFT trained on
  ``gate_up_proj`` (rank r, one A for both halves) reads as gate and up adapters sharing A.

With both of the experts' parameters adapted PEFT nests its wrappers (``gate_up_proj``
under ``experts.base_layer.``, ``down_proj`` under ``experts.``).
"""

from __future__ import annotations

import re

import numpy as np

from shardlib.config import LoRAConfig
from shardlib.errors import CheckpointError

ROUTER, GATE, UP, DOWN = "mlp.w_router_de", "mlp.w_gate_edf", "mlp.w_in_edf", "mlp.w_out_efd"
OURS = (ROUTER, GATE, UP, DOWN)  # our weights (inside a layer group's MoE block) they adapt
PARAMS = {ROUTER: "gate.weight", GATE: "experts.gate_up_proj", UP: "experts.gate_up_proj",
          DOWN: "experts.down_proj"}  # each one's parameter, under ``mlp.``
GATE_UP = "gate_up_proj"

Factors = tuple[np.ndarray, np.ndarray]  # one layer's (A, B), our layout


def is_param(rel: str) -> bool:
    """Whether an adapter of ours (``moe.mlp.w_gate_edf``) is one of a bare parameter."""
    return any(rel.endswith(name) for name in OURS)


def weight(rel: str) -> str:
    """Which of ``OURS`` an adapter of ours is."""
    return next(name for name in OURS if rel.endswith(name))


_TENSOR = re.compile(r"\.mlp\.(experts(\.base_layer)?|gate)\.lora_[AB]\.weight$")


def names_of(tensors: dict[str, np.ndarray]) -> list[str]:
    """The names among PEFT's ``tensors`` that adapt a router or experts parameter."""
    return [name for name in tensors if _TENSOR.search(name)]


def layer_prefix(hf_name: str) -> str:
    """'model.layers.3.block_sparse_moe.experts.0.w1.weight' -> 'model.layers.3.mlp.'."""
    found = re.match(r"(.*layers\.\d+\.)", hf_name)
    if found is None:
        raise CheckpointError(f"{hf_name}: no layer index in the name")
    return found.group(1) + "mlp."


def _names(mlp: str, nested: bool, param: str) -> tuple[str, str]:
    """PEFT's lora_A / lora_B tensor names of ``param`` (``experts.gate_up_proj``)."""
    module, short = param.rsplit(".", 1)
    inner = ".base_layer" if nested and short == GATE_UP else ""
    return tuple(f"{mlp}{module}{inner}.lora_{x}.weight" for x in "AB")


def to_peft(mlp: str, layer: dict[str, Factors]) -> dict[str, np.ndarray]:
    """One MoE layer's adapters (our weight -> (A, B) of this layer) as PEFT's tensors,
    under the module prefix ``mlp`` (``model.layers.3.mlp.``)."""
    nested = (GATE in layer or UP in layer) and DOWN in layer
    out: dict[str, np.ndarray] = {}
    if ROUTER in layer:
        a, b = layer[ROUTER]  # (d, r), (r, E)
        out.update(zip(_names(mlp, nested, PARAMS[ROUTER]), (a.T, b.T), strict=True))
    halves = [layer.get(GATE), layer.get(UP)]
    if any(h is not None for h in halves):
        out.update(zip(_names(mlp, nested, PARAMS[GATE]), _gate_up(halves), strict=True))
    if DOWN in layer:
        a, b = layer[DOWN]  # (E, f, r), (E, r, d)
        out.update(zip(_names(mlp, nested, PARAMS[DOWN]), _experts_to_peft(a, b), strict=True))
    return out


def _experts_to_peft(a_eir: np.ndarray, b_ero: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our per-expert A (E, in, R) and B (E, R, out) as PEFT's (E R, in) and (out, R E)."""
    e, _, r = a_eir.shape
    return (a_eir.transpose(0, 2, 1).reshape(e * r, -1),
            b_ero.transpose(2, 1, 0).reshape(b_ero.shape[-1], r * e))


def _experts_from_peft(a: np.ndarray, b: np.ndarray, experts: int) -> Factors:
    """PEFT's (E R, in) and (out, R E) as our A (E, in, R) and B (E, R, out)."""
    a_eri = a.reshape(experts, -1, a.shape[-1])
    b_ore = b.reshape(b.shape[0], -1, experts)
    return a_eri.transpose(0, 2, 1), b_ore.transpose(2, 1, 0)


def _gate_up(halves: list[Factors | None]) -> tuple[np.ndarray, np.ndarray]:
    """The gate's and up's adapters (either may be None) as one of ``gate_up_proj``: their
    rank dims side by side, each half's B writing its own rows."""
    present = [h for h in halves if h is not None]
    experts, d, _ = present[0][0].shape
    f = present[0][1].shape[-1]
    a = np.concatenate([h[0] for h in present], axis=-1)  # (E, d, R)
    b = np.zeros((experts, a.shape[-1], 2 * f), a.dtype)  # (E, R, 2f)
    start = 0
    for half, factors in enumerate(halves):
        if factors is not None:
            r = factors[0].shape[-1]
            b[:, start:start + r, half * f:(half + 1) * f] = factors[1]
            start += r
    return _experts_to_peft(a, b)


def read_layer(tensors: dict[str, np.ndarray], mlp: str, views: dict[str, Factors]
               ) -> set[str]:
    """Fill one MoE layer's adapters (our weight -> host (A, B) views, written in place)
    from PEFT's ``tensors`` under the module prefix ``mlp``; the names it read. A weight
    the file lacks keeps its values."""
    nested = f"{mlp}experts.base_layer.lora_A.weight" in tensors
    used: set[str] = set()
    for param in dict.fromkeys(PARAMS.values()):
        names = _names(mlp, nested, param)
        if names[0] not in tensors:
            continue
        used |= set(names)
        a, b = (tensors[n] for n in names)
        mine = [w for w, p in PARAMS.items() if p == param and w in views]
        if not mine:
            continue
        if param == PARAMS[ROUTER]:
            found = {ROUTER: (a.T, b.T)}
        elif param == PARAMS[DOWN]:
            found = {DOWN: _experts_from_peft(a, b, views[DOWN][0].shape[0])}
        else:
            experts, rank = views[mine[0]][0].shape[0], views[mine[0]][0].shape[-1]
            found = _split_gate_up(*_experts_from_peft(a, b, experts), rank, names[0])
        for w in mine:
            for view, value, name in zip(views[w], found[w], names, strict=True):
                if view.shape != value.shape:
                    raise CheckpointError(f"{name}: {value.shape} per expert does not fit the "
                                          f"adapter {view.shape}; is lora.rank the adapter's r?")
                view[...] = value
    return used


def _split_gate_up(a: np.ndarray, b: np.ndarray, rank: int, name: str) -> dict[str, Factors]:
    """``gate_up_proj``'s A (E, d, R) and B (E, R, 2f) as the gate's and up's adapters:
    R = rank, one A for both (as PEFT trains it); R = 2 rank, ours side by side."""
    f = b.shape[-1] // 2
    gate_b, up_b = b[..., :f], b[..., f:]
    if a.shape[-1] == rank:
        return {GATE: (a, gate_b), UP: (a, up_b)}
    if a.shape[-1] == 2 * rank and not gate_b[:, rank:].any() and not up_b[:, :rank].any():
        return {GATE: (a[..., :rank], gate_b[:, :rank]), UP: (a[..., rank:], up_b[:, rank:])}
    raise CheckpointError(f"{name}: rank {a.shape[-1]} for r={rank}: shardlib reads a "
                          f"gate_up_proj adapter of rank r (one A for both halves) or 2r with "
                          "each half's B writing its own rows (as it writes them)")


def patterns(adapted: set[str], cfg: LoRAConfig) -> dict[str, dict]:
    """``rank_pattern`` and ``alpha_pattern`` of the file: where both the gate and up are
    ``adapted`` (our weights), ``gate_up_proj`` has rank 2r at the same scale s (alpha / r,
    or alpha / sqrt(r) with rsLoRA)."""
    if not {GATE, UP} <= {weight(rel) for rel in adapted if is_param(rel)}:
        return {"rank_pattern": {}, "alpha_pattern": {}}
    factor = 2 ** 0.5 if cfg.rslora else 2.0
    return {"rank_pattern": {GATE_UP: 2 * cfg.rank},
            "alpha_pattern": {GATE_UP: cfg.alpha * factor}}


def targets(adapted: set[str]) -> list[str]:
    """PEFT's ``target_parameters`` for our ``adapted`` weights (``mlp.experts.down_proj``)."""
    return sorted({"mlp." + PARAMS[weight(rel)] for rel in adapted if is_param(rel)})


def weights_of(target_parameters: list[str]) -> set[str]:
    """Our weights (``mlp.w_gate_edf``) a file's ``target_parameters`` adapt."""
    return {w for w, param in PARAMS.items()
            if any(t == "mlp." + param or t.endswith("." + param) or t == param
                   for t in target_parameters)}
