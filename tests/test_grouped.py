"""Dropless experts (``shardlib.models.grouped``): the grouped matmuls against a dense
per-token reference in values and gradients (fp32), blocks straddling experts, empty
experts and padding rows, and the CPU kernel's compiled memory flat in the expert count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardlib.models.grouped import blockwise_gmm, dropless_ffn, plan_tiles, ragged_gmm
from tests.helpers import relative_error

TOL = 1e-5


def dense_ffn(x_nd, experts_nk, gates_nk, w_in_edf, w_gate_edf, w_out_efd, activation):
    """Every token through every expert, weighted by its gate there (0 if not chosen)."""
    weight_ne = jnp.einsum("nk,nke->ne", gates_nk, jax.nn.one_hot(experts_nk, w_in_edf.shape[0]))
    h_nef = jnp.einsum("nd,edf->nef", x_nd, w_in_edf)
    if w_gate_edf is None:
        h_nef = activation(h_nef)
    else:
        h_nef = activation(jnp.einsum("nd,edf->nef", x_nd, w_gate_edf)) * h_nef
    y_ned = jnp.einsum("nef,efd->ned", h_nef, w_out_efd)
    return jnp.einsum("ned,ne->nd", y_ned, weight_ne)


def case(n: int, k: int, experts: int, gated: bool, seed: int = 0, d: int = 8, f: int = 12):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / 3, jnp.float32)  # noqa: E731
    # Skewed routing: the first experts are popular, some get nothing.
    logits = rng.normal(size=(n, experts)) - np.arange(experts) / 4
    experts_nk = jnp.asarray(np.argsort(-logits, axis=1)[:, :k], jnp.int32)
    weights = (normal(experts, d, f), normal(experts, d, f) if gated else None,
               normal(experts, f, d))
    return normal(n, d), experts_nk, jnp.asarray(rng.random((n, k)), jnp.float32), weights


@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # blockwise scan; ragged_dot
@pytest.mark.parametrize("n, k, experts, gated", [(40, 2, 8, False), (33, 3, 16, True),
                                                  (24, 8, 64, True), (10, 1, 64, False)])
def test_dropless_ffn_equals_dense_reference(n, k, experts, gated, platform):
    x_nd, experts_nk, gates_nk, weights = case(n, k, experts, gated)
    r_nd = jax.random.normal(jax.random.key(0), x_nd.shape)
    activation = jax.nn.silu if gated else jax.nn.gelu

    def objective(fn, x_nd, gates_nk, weights):
        return jnp.sum(fn(x_nd, experts_nk, gates_nk, *weights) * r_nd)

    grouped = lambda *a: dropless_ffn(*a, activation=activation, platform=platform)  # noqa: E731
    dense = lambda *a: dense_ffn(*a, activation)  # noqa: E731
    got = jax.jit(jax.value_and_grad(lambda *a: objective(grouped, *a), argnums=(0, 1, 2)))(
        x_nd, gates_nk, weights)
    want = jax.value_and_grad(lambda *a: objective(dense, *a), argnums=(0, 1, 2))(
        x_nd, gates_nk, weights)
    np.testing.assert_allclose(got[0], want[0], rtol=TOL)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert relative_error(np.asarray(g), np.asarray(w)) < TOL


@pytest.mark.parametrize("gmm", [lambda x, w, s: blockwise_gmm(x, w, s, block=4), ragged_gmm],
                         ids=["blockwise-4", "ragged"])
def test_grouped_matmul_handles_straddling_blocks_and_padding(gmm):
    """Groups of 3, 0, 9, 1, 0, 2 rows (blocks of 4 straddle up to 3 experts) and 3 rows
    past the groups, which must come out 0; gradients as for row-by-row matmuls."""
    sizes = np.array([3, 0, 9, 1, 0, 2])
    rng = np.random.default_rng(1)
    x_ak = jnp.asarray(rng.normal(size=(18, 5)), jnp.float32)
    w_ekn = jnp.asarray(rng.normal(size=(6, 5, 7)), jnp.float32)
    expert_a = np.concatenate([np.repeat(np.arange(6), sizes), [-1] * 3])
    mask_a = jnp.asarray(expert_a >= 0)

    def rowwise(x_ak, w_ekn):
        w_akn = jnp.take(w_ekn, jnp.asarray(np.maximum(expert_a, 0)), axis=0)
        return jnp.where(mask_a[:, None], jnp.einsum("ak,akn->an", x_ak, w_akn), 0)

    r_an = jnp.asarray(rng.normal(size=(18, 7)), jnp.float32)
    got_y = gmm(x_ak, w_ekn, jnp.asarray(sizes))
    np.testing.assert_allclose(got_y, rowwise(x_ak, w_ekn), atol=1e-5)
    assert not np.asarray(got_y[15:]).any()
    grads = [jax.grad(lambda x, w, f=f: jnp.sum(f(x, w) * r_an), argnums=(0, 1))(x_ak, w_ekn)
             for f in (lambda x, w: gmm(x, w, jnp.asarray(sizes)), rowwise)]
    for g, w in zip(*grads, strict=True):
        assert relative_error(np.asarray(g), np.asarray(w)) < TOL


def test_tile_plan_visits_each_row_once():
    sizes = jnp.asarray([3, 0, 9, 1, 0, 2])
    tiles = plan_tiles(sizes, rows=18, block=4)
    visits = np.zeros(20, int)
    for b, e, valid in zip(*(np.asarray(t) for t in tiles[1:]), strict=True):
        rows = np.arange(4 * b, 4 * b + 4)
        visits[rows] += valid * (np.asarray(tiles.expert_p)[rows] == e)
    np.testing.assert_array_equal(visits, [1] * 15 + [0] * 5)
    assert len(tiles.block_t) == 5 + 6 - 1  # blocks + E - 1


def test_blockwise_memory_is_flat_in_experts():
    """Forward + backward of one grouped MLP (1024 assignments, d=64, f=128) compiled for
    the CPU: temporaries at 256 experts within 1.25x those at 8 (a dense expansion or a
    one-hot dispatch grows ~32x)."""
    def temp_bytes(experts: int) -> int:
        x_nd, experts_nk, gates_nk, _ = case(512, 2, experts, False)
        x_nd = jnp.zeros((512, 64))
        weights = (jnp.zeros((experts, 64, 128)), None, jnp.zeros((experts, 128, 64)))

        def loss(x_nd, weights):
            return jnp.sum(dropless_ffn(x_nd, experts_nk, gates_nk, *weights,
                                        activation=jax.nn.gelu, platform="cpu"))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x_nd, weights).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(8), temp_bytes(256)
    assert large < 1.25 * small, (small, large)
