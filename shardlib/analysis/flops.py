"""FLOPs of one train step: what XLA counts in the compiled program, and the model formula
``6 Psi + 12 L T d`` per token (DESIGN.md section 5).

XLA's ``cost_analysis()`` counts the program of one device, and counts a while-loop body
once: with ``model.scan_layers`` (the default) the layers' FLOPs appear once, not ``L``
times. The formula is the reference for MFU; the XLA count is a cross-check that is exact
only without scanned layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import jax

from shardlib.analysis.theory import param_counts
from shardlib.config import Config


@dataclass(frozen=True)
class FlopsReport:
    """FLOPs per device per step, counted by XLA and from the formula."""

    xla_flops_per_device: float | None
    model_flops_per_token: int
    model_flops_per_step: int
    model_flops_per_device: float
    scan_layers: bool  # True: the XLA count holds one layer's body, not L

    @property
    def xla_over_model(self) -> float | None:
        if self.xla_flops_per_device is None:
            return None
        return self.xla_flops_per_device / max(self.model_flops_per_device, 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "xla_over_model": self.xla_over_model}


def xla_flops(compiled: jax.stages.Compiled) -> float | None:
    """``cost_analysis()['flops']`` of one device's program (None if not reported)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def model_flops_per_token(config: Config) -> int:
    """``6 Psi`` (forward 2, backward 4 per parameter) ``+ 12 L T d`` (attention scores
    and the weighted sum, forward and backward, counted without the causal half). For a
    mixture of experts ``Psi`` counts the k experts a token uses, not all E."""
    m = config.model
    psi = param_counts(m).active
    return 6 * psi + 12 * m.num_layers * config.train.seq_len * m.d_model


def flops_report(config: Config, compiled: jax.stages.Compiled, num_devices: int) -> FlopsReport:
    """XLA's counted FLOPs of ``compiled`` next to the model's analytic count."""
    per_token = model_flops_per_token(config)
    per_step = per_token * config.train.batch_size * config.train.seq_len
    return FlopsReport(xla_flops(compiled), per_token, per_step, per_step / num_devices,
                       config.model.scan_layers)
