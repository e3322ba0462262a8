"""Attention kernels (``models.attention``, ``models.flash``) and packed-document masks.

The chunked kernel equals the textbook one (values and gradients, fp32) for causal,
grouped-query and document-masked attention, with lengths that do not divide the block;
its compiled temporaries at T=2048 are a fraction of the textbook kernel's; training with
it on a data/fsdp/tensor mesh equals one device with the textbook kernel; a packed row's
documents do not see each other (each document's logits equal running it alone); bad
kernel choices are ConfigErrors; the GPU XLA flags are never applied on CPU. Ring
attention (which runs the chunked kernel per block, merging by its log-sum-exp) keeps
packed documents apart too.
"""

import dataclasses
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlib import accelerator
from shardlib.config import AttentionConfig, MeshConfig
from shardlib.errors import ConfigError
from shardlib.mesh import make_mesh
from shardlib.models import GPT
from shardlib.models.attention import (
    attend,
    check_kernel,
    cudnn_attention,
    manual_everywhere,
    resolve,
    textbook_attention,
    using_kernel,
)
from shardlib.models.flash import chunked_attention, chunked_attention_with_lse
from shardlib.models.splash import splash_attention
from shardlib.train.state import build_setup, init_state
from shardlib.train.step import loss_fn, make_train_step
from tests.helpers import packed_batch, relative_error, tiny_config

TOL = 1e-5  # the equivalence suites' tolerance
KERNEL_TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 kernels: summation order only


def qkv(t, heads=4, kv_heads=4, b=2, d=16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(keys[0], (b, t, heads, d)),
            jax.random.normal(keys[1], (b, t, kv_heads, d)),
            jax.random.normal(keys[2], (b, t, kv_heads, d)))


def packed_segments(t, lengths_per_row):
    """(B, T) int32 segment ids from 1, one row per list of document lengths."""
    rows = [np.repeat(np.arange(1, len(ls) + 1), ls) for ls in lengths_per_row]
    assert all(len(r) == t for r in rows)
    return jnp.asarray(np.stack(rows).astype(np.int32))


def value_and_grads(fn):
    """One jitted function: fn's output and the gradients of a weighted sum of it."""
    def both(q, k, v):
        weight = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32))  # a non-uniform dO
        loss = lambda q, k, v: jnp.sum(fn(q, k, v) * weight)
        return fn(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)
    return jax.jit(both)


CASES = {  # name: (T, heads, kv heads, document lengths per row or None, causal)
    "causal-gqa-ragged": (70, 4, 2, None, True),  # T divides neither block
    "causal-segments": (96, 4, 4, [[30, 50, 16], [96]], True),
    "full-gqa-segments": (64, 4, 1, [[20, 30, 14], [5, 59]], False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_equals_textbook(name):
    t, h, g, lengths, causal = CASES[name]
    q, k, v = qkv(t, h, g)
    seg = None if lengths is None else packed_segments(t, lengths)
    ref = value_and_grads(lambda q, k, v: textbook_attention(q, k, v, causal=causal,
                                                             segment_ids=seg))
    got = value_and_grads(lambda q, k, v: chunked_attention(q, k, v, causal=causal,
                                                            segment_ids=seg, block_q=16,
                                                            block_k=8))
    (out_ref, grads_ref), (out, grads) = ref(q, k, v), got(q, k, v)
    np.testing.assert_allclose(out, out_ref, **KERNEL_TOL)
    for name_, g_, r_ in zip("qkv", grads, grads_ref, strict=True):
        np.testing.assert_allclose(g_, r_, **KERNEL_TOL, err_msg=f"d{name_}")


def lse_reference(q, k, v, causal, seg):
    """fp32 output and row log-sum-exp (B, T, H) with the scores materialised."""
    h, g = q.shape[2], k.shape[2]
    k, v = (jnp.repeat(a, h // g, axis=2) for a in (k, v))
    scores = jnp.einsum("bthk,bshk->bhts", q, k) * q.shape[-1] ** -0.5
    t = q.shape[1]
    keep = jnp.ones((1, 1, t, t), bool)
    if causal:
        keep = keep & (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :])
    if seg is not None:
        keep = keep & (seg[:, None, :, None] == seg[:, None, None, :])
    scores = jnp.where(keep, scores, -jnp.inf)
    lse_bht = jax.nn.logsumexp(scores, axis=-1)
    out = jnp.einsum("bhts,bshk->bthk", jnp.exp(scores - lse_bht[..., None]), v)
    return out, jnp.swapaxes(lse_bht, 1, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_lse_and_its_gradient_equal_the_reference(name):
    """What ring attention merges by: output and log-sum-exp, and the gradients of both
    (a cotangent on the log-sum-exp enters the kernel's backward as well)."""
    t, h, g, lengths, causal = CASES[name]
    q, k, v = qkv(t, h, g)
    seg = None if lengths is None else packed_segments(t, lengths)
    ct_out, ct_lse = qkv(t, h, h, seed=1)[0], qkv(t, h, h, d=1, seed=2)[0][..., 0]

    def run(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp((ct_out, ct_lse))

    got = run(lambda q, k, v: chunked_attention_with_lse(q, k, v, causal=causal,
                                                         segment_ids=seg, block_q=16,
                                                         block_k=8))
    ref = run(lambda q, k, v: lse_reference(q, k, v, causal, seg))
    for label, a, b in zip(["out", "lse", "dq", "dk", "dv"], [*got[0], *got[1]],
                           [*ref[0], *ref[1]], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=label)


def temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temporaries_far_below_textbook_at_2048():
    """Compile only: forward + backward temporaries at T=2048, one device."""
    q = k = v = jax.ShapeDtypeStruct((1, 2048, 2, 16), jnp.float32)

    def grads(kernel):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v, kernel=kernel, chunk=256))
        return jax.grad(loss, (0, 1, 2))

    textbook, chunked = temp_bytes(grads("xla"), q, k, v), temp_bytes(grads("chunked"), q, k, v)
    scores = 2 * 2048 * 2048 * 4  # one (H, T, T) fp32 score matrix
    assert textbook >= scores  # the textbook kernel materialises it (at least once)
    assert chunked * 8 <= textbook, (chunked, textbook)


def test_splash_equals_textbook_in_pallas_interpreter():
    """The TPU splash kernel (run by Pallas' interpreter on CPU): causal, grouped-query,
    packed documents; values and gradients equal the textbook kernel's."""
    q, k, v = qkv(128, heads=2, kv_heads=1, b=1, d=16)
    seg = packed_segments(128, [[50, 78]])
    got = value_and_grads(lambda q, k, v: splash_attention(
        q, k, v, segment_ids=seg, interpret=True))(q, k, v)
    want = value_and_grads(lambda q, k, v: textbook_attention(q, k, v, segment_ids=seg))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **KERNEL_TOL)
    with pytest.raises(ConfigError, match="not a multiple of 128"):
        splash_attention(*qkv(100, b=1), interpret=True)


@pytest.mark.parametrize("degrees, spec, manual", [
    ({"fsdp": 8}, P("fsdp"), {"fsdp"}),  # explicit FSDP: manual over the batch axes
    ({"fsdp": 4, "tensor": 2}, P("fsdp", None, "tensor"), None),  # TP: manual over all
])
def test_splash_inside_a_shard_map_that_checks_varying_axes(degrees, spec, manual):
    """Inside the train step's kind of shard_map (``check_vma=True``) splash's output and
    q/k/v gradients (grouped-query, packed documents) equal the textbook kernel's."""
    mesh = make_mesh(degrees)
    q, k, v = qkv(128, heads=4, kv_heads=2, b=8, d=16)
    seg = packed_segments(128, [[50, 78]] * 8)
    kv_spec = P(spec[0], None, *spec[2:])

    def sharded(kernel):
        def local(q, k, v, seg):
            return kernel(q, k, v, segment_ids=seg)
        axes = {} if manual is None else {"axis_names": manual}
        return lambda q, k, v: jax.shard_map(
            local, mesh=mesh, in_specs=(spec, kv_spec, kv_spec, P(spec[0])), out_specs=spec,
            **axes)(q, k, v, seg)

    got = value_and_grads(sharded(lambda *a, **kw: splash_attention(*a, **kw, interpret=True)))
    want = value_and_grads(lambda q, k, v: textbook_attention(q, k, v, segment_ids=seg))
    for a, b in zip(jax.tree.leaves(got(q, k, v)), jax.tree.leaves(want(q, k, v)), strict=True):
        np.testing.assert_allclose(a, b, **KERNEL_TOL)


def test_auto_rule():
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert resolve("auto", backend="cpu", seq_len=512, dtype=f32, head_dim=64) == "xla"
    assert resolve("auto", backend="cpu", seq_len=4096, dtype=f32, head_dim=64) == "chunked"
    assert resolve("auto", backend="tpu", seq_len=4096, dtype=bf16, head_dim=64) == "splash"
    assert resolve("auto", backend="tpu", seq_len=4000, dtype=bf16, head_dim=64) == "chunked"
    assert resolve("auto", backend="tpu", seq_len=512, dtype=bf16, head_dim=128) == "splash"
    assert resolve("auto", backend="tpu", seq_len=512, dtype=bf16, head_dim=64) == "xla"
    assert resolve("auto", backend="gpu", seq_len=512, dtype=bf16, head_dim=64) == "cudnn"
    assert resolve("auto", backend="gpu", seq_len=4096, dtype=f32, head_dim=64) == "chunked"
    assert resolve("chunked", backend="gpu", seq_len=8, dtype=bf16, head_dim=64) == "chunked"


@pytest.mark.parametrize("capability, picked", [((7, 5), "xla"), ((8, 0), "cudnn"),
                                                ((9, 0), "cudnn"), (None, "cudnn")])
def test_auto_picks_cudnn_only_from_ampere(capability, picked):
    """cuDNN's fused attention needs sm80+: a T4 (7.5) gets the portable kernel. jax's own
    check asks the host's backend, so compiling for a GPU target it never runs."""
    assert resolve("auto", backend="gpu", seq_len=512, dtype=jnp.bfloat16, head_dim=64,
                   capability=capability) == picked


def test_manual_everywhere_inside_a_partly_manual_shard_map():
    """cuDNN's attention runs manual over every mesh axis (its custom partitioner fails
    beside manual axes): inside explicit FSDP's shard_map the size-1 axes are added. A
    kernel with a custom VJP that keeps computed residuals (as cuDNN's keeps its softmax
    statistics) differentiates there: q, k, v's gradients are the plain function's."""
    mesh, seen = make_mesh({"fsdp": 8}), []

    @jax.custom_vjp
    def kernel(q, k, v, scale):
        seen.append(set(jax.sharding.get_abstract_mesh().manual_axes))
        return jnp.sin(q) * k + v * scale

    def kernel_fwd(q, k, v, scale):
        return kernel(q, k, v, scale), (jnp.cos(q) * k, jnp.sin(q), scale)

    def kernel_bwd(saved, d_out):
        dq, dk, scale = saved
        return d_out * dq, d_out * dk, d_out * scale, None

    kernel.defvjp(kernel_fwd, kernel_bwd)
    assert manual_everywhere(kernel) is kernel  # outside shard_map

    def loss(wrap, q, k, v, scale):
        local = lambda q, k, v: jnp.sum(wrap(kernel)(q, k, v, scale) ** 2)[None]  # noqa: E731
        return jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"),) * 3, out_specs=P("fsdp"),
                             axis_names={"fsdp"})(q, k, v).sum()

    q, k, v = (jnp.linspace(-1.0, 1.0, 16) + i for i in range(3))
    scale = jnp.float32(0.5)
    got = jax.jit(jax.grad(partial(loss, manual_everywhere), argnums=(0, 1, 2)))(q, k, v, scale)
    assert seen[-1] == set(mesh.axis_names)
    want = jax.grad(lambda q, k, v: jnp.sum((jnp.sin(q) * k + v * scale) ** 2),
                    argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_cudnn_is_refused_before_ampere_and_wide_heads_before_hopper():
    check_kernel("cudnn", 512, backend="gpu", capability=(8, 0))
    with pytest.raises(ConfigError, match=r"attention.impl=cudnn: .*sm_75 \(7.5\)"):
        check_kernel("cudnn", 512, backend="gpu", capability=(7, 5))
    q = jnp.zeros((1, 8, 2, 192), jnp.bfloat16)
    with pytest.raises(ConfigError, match="head dim 192 .* up to 128 on sm_80"):
        cudnn_attention(q, q, q, capability=(8, 0))
    with pytest.raises(ConfigError, match="head dim 60 .* multiple of 8"):
        cudnn_attention(q[..., :60], q[..., :60], q[..., :60], capability=(9, 0))


@pytest.mark.parametrize("attn, match", [
    (AttentionConfig(impl="flash"), "attention.impl='flash'"),
    (AttentionConfig(impl="cudnn"), "attention.impl=cudnn needs a GPU"),
    (AttentionConfig(impl="splash"), "attention.impl=splash needs a TPU"),
    (AttentionConfig(impl="chunked", chunk=0), "attention.chunk=0"),
])
def test_bad_kernel_choice_is_a_config_error(attn, match):
    config = dataclasses.replace(tiny_config(MeshConfig(data=1)), attention=attn)
    with pytest.raises(ConfigError, match=match):
        build_setup(config, jax.devices()[:1])


def test_packed_document_logits_equal_document_alone():
    """Through the whole model (chunked kernel, RoPE positions restarting per document):
    each document's logits in a packed row equal its logits at the start of a row of its
    own, unmasked, textbook kernel (causal: later tokens cannot change them)."""
    model = GPT(tiny_config(MeshConfig(data=1)).model, rngs=nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in packed_batch(b=2, t=32, seed=3).items()}
    with using_kernel("chunked", 8):
        packed = jax.jit(lambda b: model(b["inputs"], b["segment_ids"], b["positions"]))(batch)
    row, seg = 0, np.asarray(batch["segment_ids"][0])
    docs = [np.flatnonzero(seg == d) for d in np.unique(seg)]
    assert len(docs) > 1
    alone_rows = np.stack([np.roll(np.asarray(batch["inputs"][row]), -idx[0]) for idx in docs])
    alone = jax.jit(model)(jnp.asarray(alone_rows))  # document first, then anything
    for n, idx in enumerate(docs):
        np.testing.assert_allclose(packed[row, idx], alone[n, : len(idx)], rtol=1e-5,
                                   atol=1e-5, err_msg=f"document {n}")


def grads_of(config, batch, num_devices):
    setup = build_setup(config, jax.devices()[:num_devices])
    state = init_state(setup, config.train.seed)
    batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in batch.items()}
    fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(setup, p, b)),
                 in_shardings=(setup.state_shardings.params, setup.batch_sharding),
                 out_shardings=(None, setup.state_shardings.params))
    loss, grads = fn(state.params, batch)
    return float(loss), {".".join(map(str, p)): np.asarray(v.get_value())
                         for p, v in nnx.to_flat_state(grads)}


def test_chunked_on_mesh_matches_textbook_on_one_device():
    """data=2,fsdp=2,tensor=2 (explicit FSDP gathers and Megatron TP: the kernel runs in
    shard_map on local heads) with the chunked kernel, blocks of 8 in T=32, GQA and a
    packed batch, against one device with the textbook kernel: loss and every gradient
    within the suites' 1e-5."""
    assert_packed_batch_matches_one_device(MeshConfig(data=2, fsdp=2, tensor=2),
                                           AttentionConfig(impl="chunked", chunk=8), seed=1)


def assert_packed_batch_matches_one_device(mesh: MeshConfig, attention: AttentionConfig,
                                           seed: int) -> None:
    """A packed GQA batch on ``mesh`` with ``attention`` against one device with the
    textbook kernel: loss and every gradient within the suites' 1e-5."""
    batch = packed_batch(seed=seed)
    ref_cfg = tiny_config(MeshConfig(data=1), num_kv_heads=2)
    mesh_cfg = dataclasses.replace(tiny_config(mesh, num_kv_heads=2), attention=attention)
    ref_loss, ref_grads = grads_of(ref_cfg, batch, 1)
    loss, grads = grads_of(mesh_cfg, batch, 8)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    errors = {path: relative_error(grads[path], ref_grads[path]) for path in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: relative error {errors[worst]:.2e}"


def test_train_step_takes_packed_batches():
    """make_train_step's batch sharding covers segment_ids/positions; two steps train."""
    config = tiny_config(MeshConfig(data=8), steps=2)
    setup = build_setup(config, jax.devices())
    state, step = init_state(setup, 0), make_train_step(setup)
    batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in packed_batch().items()}
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[1] < losses[0]


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_keeps_packed_documents_apart(method):
    """Ring attention runs the chunked kernel per block (blocks of 4: several tiles per
    zig-zag half at sequence=2) with the documents' segment ids travelling with K/V;
    Ulysses all-gathers the ids and runs the chunked kernel on its heads. GQA and a packed
    batch against one device with the textbook kernel, loss and gradients within 1e-5."""
    assert_packed_batch_matches_one_device(
        MeshConfig(data=2, fsdp=2, sequence=2),
        AttentionConfig(impl="chunked", chunk=4, context_parallel=method), seed=2)


def test_allgather_context_parallel_refuses_document_masks():
    method = "allgather"
    config = dataclasses.replace(tiny_config(MeshConfig(data=2, sequence=4)),
                                 attention=AttentionConfig(context_parallel=method))
    setup = build_setup(config, jax.devices())
    params = jax.eval_shape(lambda: init_state(setup, 0)).params
    with pytest.raises(ConfigError, match=f"context_parallel={method}: document masks"):
        jax.eval_shape(lambda p, b: loss_fn(setup, p, b), params, packed_batch())


def test_gpu_flags_never_applied_on_cpu():
    env = {"JAX_PLATFORMS": "cpu"}
    assert accelerator.gpu_flags_to_apply(env) == []
    assert accelerator.apply_gpu_flags(env) == []
    assert "XLA_FLAGS" not in env
    # on a GPU the user's own setting of a flag wins; the others are added
    gpu = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    added = accelerator.apply_gpu_flags(gpu)
    assert added and all(f in gpu["XLA_FLAGS"] for f in added)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in gpu["XLA_FLAGS"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in gpu["XLA_FLAGS"]


def test_gpu_flags_are_known_to_this_xla():
    """XLA aborts on an unknown flag in XLA_FLAGS; the GPU flags parse (on CPU too)."""
    env = {"JAX_PLATFORMS": "cuda"}
    accelerator.apply_gpu_flags(env)
    run = subprocess.run([sys.executable, "-c", "import jax.numpy as j; print(j.ones(2).sum())"],
                         env={**os.environ, "JAX_PLATFORMS": "cpu",
                              "XLA_FLAGS": env["XLA_FLAGS"]},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
