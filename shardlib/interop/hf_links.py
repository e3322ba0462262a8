"""A ``Link`` ties one group of Hugging Face tensors to one group of shardlib parameters
and converts between them both ways; the layouts (``hf_layout``, ``hf_moe``) are lists
of links built from these few shapes of conversion.

Layers: HF names carry ``{i}``, the HF layer index. shardlib stacks its layers in groups
(an MoE model scans over groups of ``moe_every`` layers: ``dense.0``, ..., ``moe``), so a
link also says where its sub-block sits in a group: HF layer ``i = g * every + at`` for
group ``g``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

Arrays = list[np.ndarray]


@dataclass(frozen=True)
class Link:
    """HF tensors ``hf`` (names with ``{i}`` for the layer) <-> shardlib params ``ours``
    (paths inside a layer group when ``layered``, else from the model root)."""

    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    ours: tuple[str, ...]
    to_ours: Callable[[Arrays], Arrays]
    to_hf: Callable[[Arrays], Arrays]
    layered: bool = True
    every: int = 1  # layers per shardlib layer group
    at: int = 0  # this link's layer within the group

    def names(self, group: int | None) -> list[str]:
        """The HF tensor names of layer group ``group`` (None: not layered)."""
        i = None if group is None else group * self.every + self.at
        return [name.format(i=i) for name in self.hf]


def placed(links: list[Link], prefix: str, every: int, at: int) -> list[Link]:
    """``links`` of one sub-block moved to ``prefix`` (e.g. ``moe.``) at layer ``at`` of
    groups of ``every`` layers."""
    return [replace(link, ours=tuple(prefix + o for o in link.ours), every=every, at=at)
            for link in links]


def same(hf: str, shape: Sequence[int], ours: str, layered: bool = True) -> Link:
    """One HF tensor that is one shardlib parameter as it is."""
    ident = lambda xs: list(xs)
    return Link((hf,), (tuple(shape),), (ours,), ident, ident, layered)


def transposed(hf: str, shape: Sequence[int], ours: str, layered: bool = True) -> Link:
    """One torch ``Linear`` weight (out, in) that is a shardlib (in, out) matrix."""
    flip = lambda xs: [xs[0].T]
    return Link((hf,), (tuple(shape),), (ours,), flip, flip, layered)


def reshaped(hf: str, hf_shape: Sequence[int], ours: str, our_shape: Sequence[int],
             transpose: bool = False) -> Link:
    """One HF tensor that is a (transposed) reshape of one shardlib parameter."""
    t = (lambda x: x.T) if transpose else (lambda x: x)
    inner = tuple(hf_shape[::-1]) if transpose else tuple(hf_shape)
    return Link((hf,), (tuple(hf_shape),), (ours,),
                lambda xs: [t(xs[0]).reshape(our_shape)], lambda xs: [t(xs[0].reshape(inner))])


def stacked_transposed(hf: Sequence[str], shape: Sequence[int], ours: str) -> Link:
    """One torch ``Linear`` weight (out, in) per expert that together are one shardlib
    (E, in, out) parameter."""
    return Link(tuple(hf), (tuple(shape),) * len(hf), (ours,),
                lambda xs: [np.stack([x.T for x in xs])], lambda xs: [w.T for w in xs[0]])


def gated_mlp_links(hf: str, ours: str, d: int, f: int, bias: bool = False,
                    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                    ) -> list[Link]:
    """A gated MLP of width ``f`` under HF prefix ``hf`` and shardlib prefix ``ours``
    (Llama's ``gate_proj``/``up_proj``/``down_proj`` unless ``names`` says otherwise)."""
    gate, up, down = names
    table = [transposed(f"{hf}{gate}.weight", (f, d), f"{ours}w_gate_df"),
             transposed(f"{hf}{up}.weight", (f, d), f"{ours}w_in_df"),
             transposed(f"{hf}{down}.weight", (d, f), f"{ours}w_out_fd")]
    if bias:
        table += [same(f"{hf}{gate}.bias", (f,), f"{ours}b_gate_f"),
                  same(f"{hf}{up}.bias", (f,), f"{ours}b_in_f"),
                  same(f"{hf}{down}.bias", (d,), f"{ours}b_out_d")]
    return table
