"""Explicit Megatron TP / SP (``shardlib.parallel.tensor``): loss and gradients equal to
one device's for every model option the hooks touch, real reduce-scatters in the HLO,
and the automatic path kept where the explicit one does not apply.

Parameters are perturbed away from their init (biases non-zero, norm scales not one), so
a bias added before Megatron's g, or a position row taken from the wrong slice, shows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardlib import data as data_lib
from shardlib.config import Config, MeshConfig
from shardlib.parallel import tensor
from shardlib.sharding import parse_rule
from shardlib.train.state import build_setup, init_state
from shardlib.train.step import explicit_tensor_applies, loss_fn
from tests.helpers import relative_error, tiny_config
from tests.inspect_cases import inspection

TOL = 1e-5
GPT2 = {"norm": "layer", "bias": True, "pos_embedding": "learned", "tie_embeddings": False,
        "norm_eps": 1e-5}
MODELS = {
    "rope-tied": {},
    "heads8": {"num_heads": 8},
    "learned-untied": {"pos_embedding": "learned", "tie_embeddings": False},
    "gpt2": GPT2,
    "llama": {"mlp": "gated", "activation": "silu", "num_kv_heads": 2, "bias": True,
              "tie_embeddings": False},
    "remat": {"remat": "full"},
}
CASES = {  # name: (mesh, model)
    "tensor=2": (MeshConfig(data=1, tensor=2), "rope-tied"),
    "tensor=4,sp": (MeshConfig(data=1, tensor=4, sequence_parallel=True), "rope-tied"),
    "tensor=8": (MeshConfig(data=1, tensor=8), "heads8"),
    "tensor=8,sp": (MeshConfig(data=1, tensor=8, sequence_parallel=True), "heads8"),
    "fsdp=2,tensor=2": (MeshConfig(data=1, fsdp=2, tensor=2), "rope-tied"),
    "data=2,fsdp=2,tensor=2": (MeshConfig(data=2, fsdp=2, tensor=2), "rope-tied"),
    "tensor=2,learned": (MeshConfig(data=1, tensor=2), "learned-untied"),
    "tensor=4,sp,learned": (MeshConfig(data=1, tensor=4, sequence_parallel=True),
                            "learned-untied"),
    "fsdp=2,tensor=2,sp,gpt2": (MeshConfig(data=1, fsdp=2, tensor=2, sequence_parallel=True),
                                "gpt2"),
    "data=2,tensor=2,gpt2": (MeshConfig(data=2, tensor=2), "gpt2"),
    "tensor=2,sp,llama": (MeshConfig(data=1, tensor=2, sequence_parallel=True), "llama"),
    "tensor=2,sp,remat": (MeshConfig(data=1, tensor=2, sequence_parallel=True), "remat"),
}


def devices_of(mesh: MeshConfig) -> int:
    return mesh.data * mesh.fsdp * mesh.tensor * mesh.sequence * mesh.expert * mesh.pipeline


def perturbed(setup, params: nnx.State) -> nnx.State:
    """``params`` + N(0, 0.05), the same numbers on any mesh, laid out as ``setup`` says."""
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(params)
    shardings = jax.tree.leaves(setup.state_shardings.params)
    moved = [jax.device_put(np.asarray(x) + 0.05 * rng.standard_normal(x.shape, np.float32),
                            sh) for x, sh in zip(leaves, shardings, strict=True)]
    return jax.tree.unflatten(treedef, moved)


def loss_and_grads(config: Config, num_devices: int) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients at perturbed parameters on the first synthetic batch."""
    setup = build_setup(config, jax.devices()[:num_devices])
    assert explicit_tensor_applies(setup) == (setup.sizes["tensor"] > 1)
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    params = perturbed(setup, init_state(setup, tc.seed).params)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(setup, p, b)),
                      in_shardings=(setup.state_shardings.params, setup.batch_sharding),
                      out_shardings=(None, setup.state_shardings.params))
    loss, grads = grad_fn(params, data_lib.global_batch(batches, 0, setup.batch_sharding))
    return float(loss), {".".join(map(str, p)): np.asarray(v.get_value())
                         for p, v in nnx.to_flat_state(grads)}


@functools.cache
def reference(model: str) -> tuple[float, dict[str, np.ndarray]]:
    return loss_and_grads(tiny_config(MeshConfig(data=1), **MODELS[model]), 1)


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_match_one_device(name):
    mesh, model = CASES[name]
    ref_loss, ref_grads = reference(model)
    loss, grads = loss_and_grads(tiny_config(mesh, **MODELS[model]), devices_of(mesh))
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
    # The K bias's gradient is zero in exact arithmetic (it shifts each score row by a
    # constant, which softmax ignores): only rounding noise, held to an absolute bound.
    noise = {path for path in ref_grads if path.endswith("b_k_hk")}
    scale = max(np.linalg.norm(g) for g in ref_grads.values())
    for path in noise:
        assert np.linalg.norm(grads[path] - ref_grads[path]) <= TOL * scale, path
    errors = {path: relative_error(grads[path], ref_grads[path])
              for path in ref_grads if path not in noise}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("case", ["sp", "fsdp_tp"])
def test_hlo_reduce_scatters_are_real_and_weights_stay_split(case):
    ins = inspection(case)  # the contract tests' compiled train step (cached)
    assert [c for c in ins.collectives if c.kind == "reduce-scatter"]
    assert not [c for c in ins.collectives if c.emulated_reduce_scatter]
    assert not [c for c in ins.collectives if c.kind == "all-to-all"]
    tc, d = ins.setup.config.train, ins.setup.config.model.d_model
    b = tc.batch_size // (ins.setup.sizes["data"] * ins.setup.sizes["fsdp"])
    gathered = {s.dims for c in ins.collectives if c.axes == ("tensor",)
                and c.kind == "all-gather" for s in c.result_shapes}
    assert gathered <= {(b, tc.seq_len, d)}, f"only SP activations are gathered: {gathered}"
    assert ins.comm_bytes <= 1.05 * ins.theory_comm_bytes


@pytest.mark.parametrize("mesh, changes, rules", [
    (MeshConfig(data=1, sequence=2, tensor=2), {}, []),  # context parallelism: automatic
    (MeshConfig(data=2, tensor=2),
     {"num_experts": 4, "num_layers": 2, "moe_every": 2, "d_ff": 128}, []),  # MoE
    (MeshConfig(data=2, tensor=2), {}, ["vocab=none"]),  # the hooks need vocab over tensor
    (MeshConfig(data=8), {}, []),  # no tensor axis: the fsdp / automatic paths
])
def test_falls_back_where_explicit_tp_does_not_apply(mesh, changes, rules):
    config = dataclasses.replace(tiny_config(mesh, **changes),
                                 rules=tuple(parse_rule(r) for r in rules))
    assert not explicit_tensor_applies(build_setup(config, jax.devices()[:devices_of(mesh)]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_is_optaxs_with_the_same_gradient(dtype):
    """``tensor.cross_entropy`` picks the target's logit by a one-hot sum, not a gather
    (so no compiler materializes the whole logits for it): the loss and its gradient are
    optax's, bit for bit, in fp32 and in bf16 logits."""
    logits_btv = jax.random.normal(jax.random.key(0), (2, 16, 300), dtype) * 4
    targets_bt = jax.random.randint(jax.random.key(1), (2, 16), 0, 300)
    ours = lambda x: tensor.cross_entropy(x, targets_bt)  # noqa: E731
    reference = lambda x: optax.softmax_cross_entropy_with_integer_labels(x, targets_bt)  # noqa: E731
    np.testing.assert_array_equal(ours(logits_btv), reference(logits_btv))
    grad = lambda f: jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))(logits_btv)  # noqa: E731
    np.testing.assert_array_equal(grad(ours), grad(reference))
