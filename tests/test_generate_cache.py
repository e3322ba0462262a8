"""KV-cache decoding: the cached logits equal the full forward pass, greedy tokens equal
the no-cache window path on data=2,fsdp=2,tensor=2 (prompts of different lengths in one
batch), and top-k / top-p / stop tokens behave."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardlib.config import MeshConfig
from shardlib.models.decode import forward_cached, init_cache, sample
from shardlib.models.gpt import GPT
from shardlib.train.generate import _window, compile_generate_cached, generate, generate_cached
from shardlib.train.state import build_setup, init_state
from tests.helpers import tiny_config

# GQA (4 q heads, 2 K/V heads) and a large init so greedy tokens vary from step to step
CHANGES = dict(num_kv_heads=2, init_std=0.3)
LOGIT_TOL = 1e-4  # fp32 rounding on logits O(10) (init 0.3); a wrong cache is off by O(1)
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 12)).astype(np.int32)


def one_device_model(**changes) -> GPT:
    """A random tiny GPT, initialised under jit (eager init is ~10 s here)."""
    cfg = dataclasses.replace(tiny_config(MeshConfig(data=1)).model, **{**CHANGES, **changes})
    graphdef = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))[0]
    return nnx.merge(graphdef, jax.jit(lambda: nnx.state(GPT(cfg, rngs=nnx.Rngs(0))))())


# MoE (slow: ~20-30 s each here; the Hugging Face MoE generate tests cover it fast): 4
# gated experts, top-2, a gated shared expert, every 2nd layer (then also after 2 dense
# layers, unscanned); capacity factor E / k = 2 gives every token a slot, so the prefill
# (8 tokens) routes as the full forward (12) does
MOE = dict(num_experts=4, moe_top_k=2, moe_every=2, moe_capacity_factor=2.0, mlp="gated",
           activation="silu", moe_shared_d_ff=32, moe_shared_gate=True)


@pytest.mark.parametrize("changes", [{}, dict(pos_embedding="learned", scan_layers=False,
                                             norm="layer", bias=True, num_kv_heads=0),
                                     pytest.param(MOE, marks=pytest.mark.slow),
                                     pytest.param(dict(MOE, scan_layers=False,
                                                       moe_first_dense=2, num_layers=4),
                                                  marks=pytest.mark.slow)])
def test_cached_logits_equal_the_full_forward(changes):
    """Prefill 8 tokens, then 4 one-token steps: every logit equals model(all 12)."""
    model = one_device_model(**changes)

    @nnx.jit  # one compile: the full forward, the prefill and the steps
    def run(model: GPT, tokens_bt: jax.Array):
        cache = init_cache(model, 2, 16)
        prefill_btv, cache = forward_cached(
            model, tokens_bt[:, :8], jnp.broadcast_to(jnp.arange(8), (2, 8)), cache)
        steps = []
        for t in range(8, 12):
            logits_b1v, cache = forward_cached(model, tokens_bt[:, t:t + 1],
                                               jnp.full((2, 1), t), cache)
            steps.append(logits_b1v)
        return model(tokens_bt), jnp.concatenate([prefill_btv, *steps], axis=1)

    full_btv, cached_btv = run(model, jnp.asarray(TOKENS))
    assert np.abs(np.asarray(full_btv)).max() > 1  # logits O(1-10): the tolerance means it
    np.testing.assert_allclose(np.asarray(cached_btv), np.asarray(full_btv), rtol=0,
                               atol=LOGIT_TOL)


def greedy_reference(model: GPT, prompt: np.ndarray, n: int) -> list[int]:
    """No cache: the whole (fixed-width) sequence through the model for every new token."""
    buf = jnp.zeros((1, len(prompt) + n), jnp.int32).at[0, : len(prompt)].set(prompt)

    def step(i, buf):
        pos = len(prompt) + i
        return buf.at[0, pos].set(jnp.argmax(model(buf)[0, pos - 1]).astype(jnp.int32))

    buf = nnx.jit(lambda m, b: jax.lax.fori_loop(0, n, step, b))(model, buf)
    return [int(t) for t in buf[0, len(prompt):]]


@pytest.fixture(scope="module")
def sharded():
    cfg = tiny_config(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **CHANGES))
    setup = build_setup(cfg)
    return setup, init_state(setup, 0).params


def test_greedy_tokens_equal_the_window_path_on_a_mesh(sharded):
    setup, params = sharded
    short, long = TOKENS[0, :5], TOKENS[1, :11]
    got = generate_cached(setup, params, [list(short), list(long)], 10)
    window = generate(setup, params, short, 10, temperature=0)[0, 5:]  # the no-cache path
    assert got[0] == [int(t) for t in window]
    model = nnx.merge(setup.graphdef, jax.device_get(params))
    assert got[1] == greedy_reference(model, long, 10)
    assert len(set(got[0])) > 3 and got[0] != got[1]  # real, varied continuations
    stop = got[1][2]  # a stop token ends that row (kept) and no other
    stopped = generate_cached(setup, params, [list(short), list(long)], 10, stop_tokens=(stop,))
    assert stopped[1] == got[1][: got[1].index(stop) + 1]
    assert stopped[0] == got[0][: got[0].index(stop) + 1] if stop in got[0] else got[0]


def test_the_no_cache_window_holds_the_sample_not_seq_len(sharded):
    """The window path runs prompt + new tokens (rounded up to 2 x 8 devices: any
    sequence split divides it), not ``seq_len`` per token: a 4096-token run's closing
    sample took over 300 s that way. Past ``seq_len`` it slides at ``seq_len``."""
    setup, _ = sharded
    assert setup.config.train.seq_len == 32
    assert [_window(setup, n) for n in (1, 15, 16, 17, 32, 100)] == [16, 16, 16, 32, 32, 32]


def test_compiled_cached_decode_runs_again_without_compiling(sharded, monkeypatch):
    """``compile_generate_cached`` compiles once; each call only runs (what decode_bench
    times), and gives what ``generate_cached`` gives."""
    setup, params = sharded
    prompts = [list(TOKENS[0, :5]), list(TOKENS[1, :11])]
    run = compile_generate_cached(setup, params, prompts, 6)
    with monkeypatch.context() as patch:
        patch.setattr(jax.stages.Lowered, "compile", lambda *a, **k: pytest.fail("compiled"))
        first, again = run(params, 0), run(params, 1)  # greedy: the seed changes nothing
    assert first == again == generate_cached(setup, params, prompts, 6)
    assert len(first) == 2 and all(len(row) == 6 for row in first)


def test_sampling_filters():
    logits = jax.random.normal(jax.random.key(0), (64, 50)) * 3
    draw = lambda key, **kw: jax.vmap(lambda k: sample(logits, k, **kw))(
        jax.random.split(key, 20))  # (20 draws, 64 rows)

    @jax.jit  # one compile for every filter
    def run(key):
        return (sample(logits, key), sample(logits, key, temperature=1.0, top_k=1),
                sample(logits, key, temperature=1.0, top_p=1e-6),
                draw(key, temperature=2.0, top_k=3), draw(key, temperature=2.0, top_p=0.5))

    greedy, top1, tiny_p, top3_draws, nucleus = (np.asarray(a) for a in run(jax.random.key(1)))
    np.testing.assert_array_equal(top1, greedy)
    np.testing.assert_array_equal(tiny_p, greedy)
    top3 = np.asarray(jax.lax.top_k(logits, 3)[1])
    assert all(set(top3_draws[:, r]) <= set(top3[r]) for r in range(64))
    assert len(set(top3_draws.ravel())) > 3  # really sampled, not argmax
    # top_p=0.5 keeps the smallest set of best tokens with at least half the mass
    probs = np.asarray(jax.nn.softmax(logits / 2.0))
    for r in range(64):
        order = np.argsort(-probs[r])
        kept = order[: np.searchsorted(np.cumsum(probs[r][order]), 0.5) + 1]
        assert set(nucleus[:, r]) <= set(kept)
