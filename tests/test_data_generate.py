"""Corpora, deterministic batches, global batch assembly, and sampling."""

import jax
import numpy as np
import pytest

from shardlib import data as data_lib
from shardlib.config import MeshConfig
from shardlib.errors import ConfigError
from shardlib.train.generate import generate, sample_logits
from shardlib.train.state import build_setup, init_state
from tests.helpers import tiny_config


def test_stdlib_corpus_is_python_source():
    corpus = data_lib.stdlib_corpus(max_bytes=200_000)
    assert len(corpus) == 200_000 and corpus.dtype == np.uint8
    assert "def " in data_lib.decode(corpus)


def test_batches_depend_only_on_seed_and_index():
    tokens = data_lib.synthetic_corpus(num_bytes=10_000)
    a = data_lib.Batches(tokens, batch_size=4, seq_len=16, seed=3)
    b = data_lib.Batches(tokens, batch_size=4, seq_len=16, seed=3)
    np.testing.assert_array_equal(a.rows(7), b.rows(7))
    assert not np.array_equal(a.rows(7), a.rows(8))
    np.testing.assert_array_equal(a.rows(7, 1, 3), a.rows(7)[1:3])  # a process's slice
    assert a.rows(0).shape == (4, 17) and a.rows(0).dtype == np.int32


def test_global_batch_is_sharded_and_shifted():
    setup = build_setup(tiny_config(MeshConfig(data=2, fsdp=2, tensor=2)))
    batches, _ = data_lib.make_batches("synthetic", 8, 32, seed=0)
    batch = data_lib.global_batch(batches, 0, setup.batch_sharding)
    assert batch["inputs"].shape == (8, 32) and batch["inputs"].sharding == setup.batch_sharding
    rows = batches.rows(0)
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), rows[:, :-1])
    np.testing.assert_array_equal(np.asarray(batch["targets"]), rows[:, 1:])


def test_short_file_is_a_clear_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("too short")
    with pytest.raises(ConfigError, match="too short for seq_len=32"):
        data_lib.make_batches(str(path), 8, 32, seed=0)


def test_top_k_sampling_only_picks_the_top_k():
    logits = jax.numpy.array([[0.0, 5.0, 4.0, -1.0, 3.0]])
    picks = {int(sample_logits(logits, jax.random.key(i), 1.0, 2)[0]) for i in range(50)}
    assert picks == {1, 2}
    assert int(sample_logits(logits, jax.random.key(0), 0.0, 0)[0]) == 1  # greedy


def test_generate_is_sharded_and_deterministic():
    setup = build_setup(tiny_config(MeshConfig(data=2, fsdp=2, tensor=2)))
    params = init_state(setup, seed=0).params
    prompt = data_lib.encode("abc=")
    out = generate(setup, params, prompt, 40, temperature=0.8, top_k=10, seed=1)
    assert out.shape == (4, 4 + 40)  # one row per batch shard (data x fsdp)
    np.testing.assert_array_equal(out[:, :4], np.broadcast_to(prompt, (4, 4)))
    again = generate(setup, params, prompt, 40, temperature=0.8, top_k=10, seed=1)
    np.testing.assert_array_equal(out, again)
    assert out.min() >= 0 and out.max() < 256
