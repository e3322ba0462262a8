"""Shared test helpers: tiny configs, a few-step training run on any mesh, the comparison
against one device, and Hugging Face checkpoints to load."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from shardlib import data as data_lib
from shardlib.config import Config, MeshConfig, OptimConfig, TrainConfig
from shardlib.models import get_preset

TINY = get_preset("tiny")
TOL = 1e-5  # the equivalence suites' relative tolerance against one device, never loosened


def tiny_config(mesh: MeshConfig, steps: int = 3, **model_changes) -> Config:
    """fp32 tiny GPT, batch 8 x 32 tokens, no warm-up (so every step moves the params).

    Adam's first steps are ~lr * sign(grad): a gradient within ~eps of zero can flip
    sign under another reduction order (gradients agree to ~5e-7 relative) and move one
    element by 2 lr. eps=1e-6 keeps the update Lipschitz in the gradient (constant
    lr/eps), and lr=1e-3 keeps three steps' parameter error well inside 1e-5.
    """
    return Config(
        mesh=mesh,
        model=dataclasses.replace(TINY, **model_changes),
        optim=OptimConfig(lr=1e-3, eps=1e-6, warmup_steps=0),
        train=TrainConfig(steps=steps, batch_size=8, seq_len=32, data="synthetic",
                          eval_every=0, sample_tokens=0),
    )


def run_steps(config: Config, num_devices: int = 8, batches: list[dict] | None = None,
              history: list[dict] | None = None):
    """Train ``config.train.steps`` steps (on ``batches``, host arrays, if given; else the
    config's data); return (losses, host params by path, setup). ``history``, if given,
    receives each step's metrics as floats."""
    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import make_train_step

    setup = build_setup(config, jax.devices()[:num_devices])
    tc = config.train
    source, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state = init_state(setup, tc.seed)
    step = make_train_step(setup)
    losses = []
    for i in range(tc.steps):
        batch = (data_lib.global_batch(source, i, setup.batch_sharding) if batches is None
                 else {k: jax.device_put(v, setup.batch_sharding) for k, v in batches[i].items()})
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if history is not None:
            history.append({key: float(value) for key, value in metrics.items()})
    params = {".".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(state.params)}
    return np.array(losses), params, setup


def packed_batch(b: int = 8, t: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """A packed batch: random tokens, 1-3 documents per row, positions from 0 per document."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, t + 1), dtype=np.int32)
    seg, pos = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), rng.integers(0, 3), replace=False))
        bounds = [0, *cuts.tolist(), t]
        for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seg[row, lo:hi], pos[row, lo:hi] = d + 1, np.arange(hi - lo)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
            "positions": pos}


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||: the per-tensor relative error the equivalence tests bound."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_tensors_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                         tol: float = TOL) -> None:
    """Every tensor of ``want`` (by path) within ``tol`` relative error in norm in ``got``;
    the message names the worst one."""
    errors = {path: relative_error(got[path], want[path]) for path in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: relative error {errors[worst]:.2e}"


def assert_like_one_device(got: tuple, want: tuple, tol: float = TOL) -> None:
    """Two ``run_steps`` results: losses elementwise and every parameter tensor within
    ``tol``, and the steps really trained."""
    (losses, params, _), (ref_losses, ref_params, _) = got, want
    np.testing.assert_allclose(losses, ref_losses, rtol=tol)
    assert losses[-1] < losses[0]
    assert_tensors_close(params, ref_params, tol)


def loss_and_grads(config: Config, num_devices: int = 8):
    """Loss and gradients of the first batch at init, as host arrays by path."""
    from shardlib.train.state import build_setup, init_state
    from shardlib.train.step import loss_fn

    setup = build_setup(config, jax.devices()[:num_devices])
    tc = config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    state = init_state(setup, tc.seed)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(setup, p, b)),
                      in_shardings=(setup.state_shardings.params, setup.batch_sharding),
                      out_shardings=(None, setup.state_shardings.params))
    loss, grads = grad_fn(state.params, data_lib.global_batch(batches, 0, setup.batch_sharding))
    return float(loss), {".".join(map(str, p)): np.asarray(v.get_value())
                         for p, v in nnx.to_flat_state(grads)}


# --- Hugging Face checkpoints (callers importorskip torch and transformers first) --------

HF_TOL = 1e-4  # max |logit difference|; logits are O(1-10) with initializer_range 0.2
HF_TOKENS = np.random.default_rng(0).integers(0, 256, (8, 32)).astype(np.int32)
HF_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=64, initializer_range=0.2)


def perturbed_hf(model: Any) -> Any:
    """``model`` with random biases and norm weights in [0.5, 1.5] (they start at zero and
    one, where a mapping mistake hides), in eval mode."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            if name.endswith("_norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def torch_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    """The transformers model's logits on ``tokens`` (B, T), as a host array."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def save_hf_models(root: Path, build: Callable[[str], Any], kinds: Sequence[str],
                   tokens: np.ndarray, **save_options) -> dict[str, tuple[Path, np.ndarray]]:
    """``build(kind)`` saved under ``root / kind`` for each kind: {kind: (directory, its
    logits on ``tokens``)}; ``save_options`` go to ``save_pretrained``."""
    out = {}
    for kind in kinds:
        model = build(kind)
        model.save_pretrained(root / kind, **save_options)
        out[kind] = (root / kind, torch_logits(model, tokens))
    return out


def sharded_logits(setup: Any, params: nnx.State, tokens: np.ndarray) -> np.ndarray:
    """The forward pass as training runs it: jitted, activations pinned by the rules."""
    from shardlib.sharding import activation_rules

    def forward(params: nnx.State, tokens_bt: jax.Array) -> jax.Array:
        with activation_rules(setup.mesh, setup.rules):
            return nnx.merge(setup.graphdef, params)(tokens_bt)

    return np.asarray(jax.jit(forward)(params, jax.device_put(tokens, setup.batch_sharding)))


def assert_hf_round_trip(model: Any, reference: np.ndarray, tokens: np.ndarray, out: Path,
                         tol: float) -> None:
    """``model``'s logits equal ``reference``; changed weights, saved with
    ``save_pretrained`` to ``out``, load in transformers with the changed logits."""
    import transformers

    from shardlib.interop import hf

    forward = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(np.asarray(forward(model, tokens)), reference, rtol=0, atol=tol)
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape, np.float32),
                                   nnx.state(model, nnx.Param)))
    hf.save_pretrained(model, out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == hf.to_hf_config(model.cfg)["architectures"][0]
    ours = np.asarray(forward(model, tokens))
    assert np.abs(ours - reference).max() > 100 * tol  # the change is visible
    np.testing.assert_allclose(torch_logits(loaded, tokens), ours, rtol=0, atol=tol)


def assert_finetune_exports(result: Any, torch_model: Any, checkpoint_dir: Path,
                            out: Path) -> None:
    """A one-step ``train.init_from`` run ``result`` began at ``torch_model``'s loss on the
    first synthetic batch; ``export --format hf`` of its checkpoint loads in transformers
    with the trained model's logits."""
    import torch
    import transformers

    from shardlib.cli import main

    batch = data_lib.make_batches("synthetic", 8, 32, 0)[0].rows(0)
    expected = torch.nn.functional.cross_entropy(
        torch.tensor(torch_logits(torch_model, batch[:, :-1])).reshape(-1, 256),
        torch.tensor(batch[:, 1:], dtype=torch.long).reshape(-1))
    assert result.history[0]["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert main(["export", "--format", "hf", "--checkpoint-dir", str(checkpoint_dir),
                 "--out", str(out)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == type(torch_model).__name__
    ours = sharded_logits(result.setup, result.state.params, HF_TOKENS)
    np.testing.assert_allclose(torch_logits(loaded, HF_TOKENS), ours, rtol=0, atol=HF_TOL)
