"""Mesh degree validation, config overrides and their error messages."""

import dataclasses

import pytest

from shardlib.config import Config, MeshConfig, apply_overrides, parse_mesh
from shardlib.errors import ConfigError, MeshError, ShardlibError
from shardlib.mesh import MESH_AXES, describe, make_mesh, resolve_degrees


def test_auto_fill_takes_the_remaining_devices():
    assert resolve_degrees({"data": 2, "fsdp": -1, "tensor": 2}, 8) == {
        "data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}


def test_product_mismatch_names_every_factor():
    with pytest.raises(MeshError) as err:
        resolve_degrees({"data": 3, "tensor": 2}, 8)
    message = str(err.value)
    for factor in ("data=3", "fsdp=1", "expert=1", "sequence=1", "tensor=2", "6 devices", "8"):
        assert factor in message


@pytest.mark.parametrize("degrees, needle", [
    ({"data": -1, "fsdp": -1}, "only one axis may be -1"),
    ({"data": 3, "fsdp": -1}, "cannot fill fsdp=-1"),
    ({"data": 0}, "data=0 is not a valid degree"),
    ({"pipe": 2}, "unknown axis 'pipe'"),
])
def test_bad_degrees(degrees, needle):
    with pytest.raises(MeshError, match=needle):
        resolve_degrees(degrees, 8)


def test_make_mesh_has_every_axis_in_order():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "sequence": 1,
                                "tensor": 2}
    assert describe(mesh).startswith(
        "mesh data=2 pipeline=1 fsdp=2 expert=1 sequence=1 tensor=2 (8 cpu")


def test_parse_mesh_and_errors():
    assert parse_mesh("data=2,fsdp=2,tensor=2") == MeshConfig(data=2, fsdp=2, sequence=1, tensor=2)
    assert parse_mesh("fsdp=-1").fsdp == -1
    with pytest.raises(ConfigError, match="expected AXIS=SIZE"):
        parse_mesh("stages=2")
    with pytest.raises(ConfigError, match="size must be an int"):
        parse_mesh("data=two")


def test_overrides_coerce_types():
    config = apply_overrides(Config(), ["model.num_layers=6", "optim.lr=1e-3",
                                        "mesh.sequence_parallel=true", "train.data=synthetic"])
    assert config.model.num_layers == 6 and config.optim.lr == 1e-3
    assert config.mesh.sequence_parallel is True and config.train.data == "synthetic"
    assert dataclasses.is_dataclass(config) and config.model.d_model == Config().model.d_model


@pytest.mark.parametrize("item, needle", [
    ("model.layers=3", "unknown field 'layers'"),
    ("modl.num_layers=3", "unknown section 'modl'"),
    ("model.num_layers=three", "expected a int"),
    ("num_layers=3", "use section.field=value"),
    ("mesh.sequence_parallel=maybe", "expected a bool"),
])
def test_bad_overrides(item, needle):
    with pytest.raises(ShardlibError, match=needle):
        apply_overrides(Config(), [item])
