"""Rule presets, their PartitionSpecs per parameter, and every rule error."""

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

from shardlib.config import Config, MeshConfig
from shardlib.errors import ShardingError
from shardlib.models import get_preset
from shardlib.sharding import logical_to_spec, make_rules, parse_rule
from shardlib.train.state import build_setup, param_table

TINY = get_preset("tiny")


def specs_for(mesh: MeshConfig, rules=(), model=TINY) -> dict[str, P]:
    config = Config(mesh=mesh, model=model, rules=tuple(rules))
    return {row.path: row.spec for row in param_table(build_setup(config))}


def test_dp_replicates_every_parameter():
    specs = specs_for(MeshConfig(data=8))
    assert all(all(e is None for e in spec) for spec in specs.values())


def test_fsdp_shards_the_embed_dim_of_every_parameter():
    specs = specs_for(MeshConfig(data=1, fsdp=8))
    assert specs["blocks.attn.w_q_dhk"] == P(None, "fsdp", None, None)
    assert specs["blocks.attn.w_o_hkd"] == P(None, None, None, "fsdp")
    assert specs["blocks.mlp.w_in_df"] == P(None, "fsdp", None)
    assert specs["blocks.mlp.w_out_fd"] == P(None, None, "fsdp")
    assert specs["embed.w_vd"] == P(None, "fsdp")
    assert specs["final_norm.scale_d"] == P("fsdp")


def test_tp_splits_columns_then_rows():
    specs = specs_for(MeshConfig(data=2, tensor=4))
    assert specs["blocks.attn.w_q_dhk"] == P(None, None, "tensor", None)  # column split
    assert specs["blocks.attn.w_o_hkd"] == P(None, "tensor", None, None)  # row split
    assert specs["blocks.mlp.w_in_df"] == P(None, None, "tensor")  # column split
    assert specs["blocks.mlp.w_out_fd"] == P(None, "tensor", None)  # row split
    assert specs["embed.w_vd"] == P("tensor", None)  # vocab-parallel
    assert specs["final_norm.scale_d"] == P(None)


def test_mixed_mesh_combines_presets():
    specs = specs_for(MeshConfig(data=2, fsdp=2, tensor=2))
    assert specs["blocks.mlp.w_in_df"] == P(None, "fsdp", "tensor")
    assert specs["embed.w_vd"] == P("tensor", "fsdp")


def test_activation_rules_per_strategy():
    sizes = {"data": 1, "fsdp": 4, "sequence": 1, "tensor": 2}
    rules = make_rules(MeshConfig(data=1, fsdp=4, tensor=2, sequence_parallel=True), sizes)
    assert logical_to_spec(("act_batch", "act_res_seq", "act_embed"), rules, sizes) == P(
        "fsdp", "tensor", None)
    assert logical_to_spec(("act_batch", "act_seq", "act_mlp"), rules, sizes) == P(
        "fsdp", None, "tensor")
    sizes = {"data": 2, "fsdp": 1, "sequence": 4, "tensor": 1}
    rules = make_rules(MeshConfig(data=2, sequence=4), sizes)
    assert logical_to_spec(("act_batch", "act_seq"), rules, sizes) == P("data", "sequence")


def test_user_override_replaces_a_rule():
    specs = specs_for(MeshConfig(data=2, tensor=4), rules=[parse_rule("vocab=none")])
    assert specs["embed.w_vd"] == P(None, None)


def test_conflicting_rules_name_the_parameter():
    with pytest.raises(ShardingError, match=r"blocks\.mlp\.w_in_df: mesh axis 'fsdp' is used by "
                       r"both dims 'embed' and 'mlp'"):
        specs_for(MeshConfig(data=1, fsdp=8), rules=[("mlp", ("fsdp",))])


@pytest.mark.parametrize("text, needle", [
    ("non-sense=tensor", "a logical dim must be a name"),
    ("mlp=pipe", "unknown mesh axis 'pipe'"),
    ("mlp", "use LOGICAL_DIM=AXIS"),
])
def test_unknown_names(text, needle):
    with pytest.raises(ShardingError, match=needle):
        parse_rule(text)


def test_indivisible_dim_names_path_shape_and_axes():
    model = dataclasses.replace(TINY, d_ff=250)
    with pytest.raises(ShardingError) as err:
        specs_for(MeshConfig(data=2, tensor=4), model=model)
    message = str(err.value)
    assert "blocks.mlp.w_in_df" in message and "(2, 64, 250)" in message
    assert "('tensor',)" in message


def test_batch_must_divide_over_batch_axes():
    config = Config(mesh=MeshConfig(data=8), model=TINY)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=12))
    with pytest.raises(ShardingError,
                       match=r"batch\['inputs'\] .* a dim of size 12 over axes \('data',\)"):
        build_setup(config)


def test_sequence_parallel_needs_a_tensor_axis():
    with pytest.raises(ShardingError, match="sequence_parallel=true needs tensor > 1"):
        specs_for(MeshConfig(data=8, sequence_parallel=True))


# --- mesh.fsdp_attention: the attention weights' FSDP split on heads instead of embed ----

def test_a_heads_split_over_fsdp_takes_it_from_embed_in_the_attention_weights_only():
    sizes = {"fsdp": 4, "data": 2}
    rules = make_rules(MeshConfig(data=2, fsdp=4, fsdp_attention="heads"), sizes)
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), rules, sizes) == \
        P(None, None, "fsdp", None)
    assert logical_to_spec(("heads", "head_dim", "embed"), rules, sizes) == P("fsdp", None, None)
    assert logical_to_spec(("layers", "embed", "mlp"), rules, sizes) == P(None, "fsdp", None)
    plain = make_rules(MeshConfig(data=2, fsdp=4, fsdp_attention="embed"), sizes)
    assert logical_to_spec(("embed", "heads", "head_dim"), plain, sizes) == P("fsdp", None, None)
    with pytest.raises(ShardingError, match="used by both dims"):  # yielding is embed's alone
        logical_to_spec(("embed", "mlp"), make_rules(MeshConfig(fsdp=4), {"fsdp": 4},
                                                     [("mlp", ("fsdp",))]), {"fsdp": 4})


@pytest.fixture(scope="module")
def one_device_run():
    from tests.helpers import run_steps, tiny_config
    return run_steps(tiny_config(MeshConfig(data=1), steps=3), 1)


@pytest.mark.parametrize("mesh", [MeshConfig(data=2, fsdp=4, fsdp_attention="heads"),
                                  MeshConfig(data=1, pipeline=2, fsdp=4, fsdp_attention="heads")],
                         ids=["data=2,fsdp=4", "pipeline=2,fsdp=4"])
def test_attention_heads_split_over_fsdp_trains_like_one_device(mesh, one_device_run):
    """The explicit per-layer gathers (and a stage's) find the heads dim from the rules."""
    from tests.helpers import assert_like_one_device, run_steps, tiny_config
    sharded = run_steps(tiny_config(mesh, steps=3))
    spec = sharded[2].state_shardings.params["blocks"]["attn"]["w_q_dhk"].get_value().spec
    assert spec[1:3] == (None, "fsdp")  # (layers, embed, heads, head_dim)
    assert_like_one_device(sharded, one_device_run)


def test_a_heads_split_beside_tensor_is_refused():
    from shardlib.errors import ConfigError
    config = Config(mesh=MeshConfig(data=1, fsdp=4, tensor=2, fsdp_attention="heads"),
                    model=get_preset("tiny"))
    with pytest.raises(ConfigError, match="mesh.fsdp_attention=heads with --mesh tensor=2"):
        build_setup(config, jax.devices()[:8])
