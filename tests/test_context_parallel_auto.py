"""``attention.context_parallel=auto`` (the default) picks a method that works for the mesh
and says which (issue 45 part 6): the old default, ``none``, was refused beside
``pipeline`` and ``sequence``. Builds setups only: nothing compiles."""

from __future__ import annotations

import dataclasses

import pytest

from shardlib.config import AttentionConfig, MeshConfig
from shardlib.parallel.context import resolve_method
from shardlib.train.state import build_setup
from tests.helpers import tiny_config

PIPE_SEQ = MeshConfig(data=2, pipeline=2, sequence=2)


def test_the_default_builds_a_pipeline_by_sequence_mesh_and_says_what_it_chose():
    setup = build_setup(tiny_config(PIPE_SEQ))  # refused before: "set ... ulysses or allgather"
    assert setup.config.attention.context_parallel == "ulysses"  # 4 heads split over 2
    assert setup.notes == ("attention.context_parallel=auto chose ulysses for pipeline=2 x "
                           "sequence=2; set attention.context_parallel=none|ring|ulysses|"
                           "allgather to choose",)


@pytest.mark.parametrize("method", ["allgather", "ulysses"])
def test_an_explicit_choice_is_kept_and_not_announced(method):
    config = dataclasses.replace(tiny_config(PIPE_SEQ),
                                 attention=AttentionConfig(context_parallel=method))
    setup = build_setup(config)
    assert setup.config.attention.context_parallel == method and setup.notes == ()


@pytest.mark.parametrize("sizes, heads, picked", [
    ({"pipeline": 2, "sequence": 2}, 4, "ulysses"),
    ({"pipeline": 2, "sequence": 4, "tensor": 2}, 4, "allgather"),  # 2 heads over 4
    ({"pipeline": 2, "sequence": 2}, None, "allgather"),  # heads unknown: a user's model
    ({"data": 4, "sequence": 2}, 4, "none"),  # no stages: XLA's partitioner runs it
    ({"pipeline": 4}, 4, "none"),
])
def test_auto_picks_what_the_mesh_and_heads_allow(sizes, heads, picked):
    assert resolve_method("auto", sizes=sizes, num_heads=heads) == picked
    assert resolve_method("ring", sizes=sizes, num_heads=heads) == "ring"


def test_auto_on_a_plain_sequence_mesh_keeps_xlas_attention_and_says_so():
    setup = build_setup(tiny_config(MeshConfig(data=4, sequence=2)))
    assert setup.config.attention.context_parallel == "none"
    assert setup.notes and "auto chose none for sequence=2" in setup.notes[0]
