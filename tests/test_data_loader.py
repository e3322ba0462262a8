"""The grain loader: deterministic, per-process rows, epochs reshuffled, a position that
resumes exactly on another mesh, and a training run that resumes bit for bit."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from shardlib.config import CheckpointConfig, Config, DataConfig, MeshConfig, TrainConfig
from shardlib.data import Loader, make_loader, open_source, prepare, train_tokenizer
from shardlib.data.loader import eval_plan
from shardlib.errors import ConfigError
from shardlib.run.evaluation import evaluate
from shardlib.run.loop import train
from shardlib.train.state import build_setup, init_state
from shardlib.train.step import make_eval_step
from tests.helpers import tiny_config

BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(1)
    words = ["ab", "cd", "efg", "hij", "k", "lmnop"]
    lines = [json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(3, 30)))})
             for _ in range(400)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([str(root / "docs.jsonl")], "bytes", str(root / "ds"), val_fraction=0.1,
            unit_bytes=8192)
    return str(root / "ds")


def config_for(data: str, mesh: MeshConfig, **data_changes) -> Config:
    base = tiny_config(mesh)
    train_cfg = dataclasses.replace(base.train, data=data, batch_size=BATCH, seq_len=SEQ)
    return dataclasses.replace(base, train=train_cfg, data=DataConfig(**data_changes))


def loader_for(data: str, mesh: MeshConfig, **data_changes) -> Loader:
    config = config_for(data, mesh, **data_changes)
    setup = build_setup(config)
    return make_loader(config, open_source(config), setup.batch_sharding)


def host(batch: dict) -> dict:
    return {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}


def test_batches_are_deterministic_and_rows_are_per_process(dataset):
    loader = loader_for(dataset, MeshConfig(data=8), packing_mask=True)
    batches = [host(next(loader)) for _ in range(3)]
    assert set(batches[0]) == {"inputs", "targets", "segment_ids", "positions"}
    assert batches[0]["inputs"].shape == (BATCH, SEQ)
    again = loader_for(dataset, MeshConfig(data=8), packing_mask=True, prefetch=0)
    for batch in batches:
        for key, value in host(next(again)).items():
            np.testing.assert_array_equal(value, batch[key])
    rows = loader.source.train(0, 2, 5)  # what a process holding rows 2:5 reads
    np.testing.assert_array_equal(rows["inputs"], batches[0]["inputs"][2:5])
    loader.close()


def test_epochs_are_permutations_reshuffled(dataset):
    source = loader_for(dataset, MeshConfig(data=8)).source
    n = source.train_windows
    order = [source.train(0, 0, 2 * n)["inputs"]]  # two epochs as one long batch
    first, second = order[0][:n], order[0][n:]
    key = lambda rows: sorted(map(bytes, rows.astype(np.int32)))
    assert key(first) == key(second)  # every window once per epoch
    assert not np.array_equal(first, second)  # in another order


def test_state_resumes_exactly_on_another_mesh(dataset):
    straight = loader_for(dataset, MeshConfig(data=8))
    expected = [host(next(straight)) for _ in range(5)]
    first = loader_for(dataset, MeshConfig(data=8))
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state()))  # what a checkpoint holds
    first.close()
    other = loader_for(dataset, MeshConfig(data=2, fsdp=2, tensor=2))
    other.restore(state)
    for want in expected[3:]:
        got = next(other)
        assert got["inputs"].sharding.mesh.shape["fsdp"] == 2
        np.testing.assert_array_equal(host(got)["inputs"], want["inputs"])
    assert 0 < state["epoch"] < 1
    bad = loader_for(dataset, MeshConfig(data=8), shuffle=False)
    with pytest.raises(ConfigError, match="--resume: the checkpoint's data position"):
        bad.restore(state)
    for loader in (straight, other, bad):
        loader.close()


def test_wrong_tokenizer_vocab_and_size_errors(dataset, tmp_path):
    tok = train_tokenizer([dataset.replace("/ds", "/docs.jsonl")], 300,
                          str(tmp_path / "t.json"))
    with pytest.raises(ConfigError, match="was prepared with another tokenizer"):
        open_source(config_for(dataset, MeshConfig(data=8), tokenizer=str(tmp_path / "t.json")))
    prepare([dataset.replace("/ds", "/docs.jsonl")], str(tmp_path / "t.json"),
            str(tmp_path / "bpe"), val_fraction=0.1)
    with pytest.raises(ConfigError, match=r"model.vocab_size=256: smaller than the "
                       rf"tokenizer's vocabulary \({tok.vocab_size}"):
        open_source(config_for(str(tmp_path / "bpe"), MeshConfig(data=8)))
    big = config_for(dataset, MeshConfig(data=8))
    big = dataclasses.replace(big, train=dataclasses.replace(big.train, batch_size=4096))
    with pytest.raises(ConfigError, match="fewer than one batch of 4096"):
        open_source(big)
    with pytest.raises(ConfigError, match="data.workers=-1: must be >= 0"):
        DataConfig(workers=-1)


def with_val_tokens(dataset: str, out, tokens: int) -> str:
    """The fixture's documents prepared again, the last ``tokens`` tokens held out (one
    shard: ``tokens - 1`` // SEQ rows)."""
    docs = dataset.replace("/ds", "/docs.jsonl")
    texts = [json.loads(line)["text"] for line in open(docs)]
    total = sum(len(t.encode()) + 1 for t in texts)  # bytes, and an EOD per document
    prepare([docs], "bytes", str(out), val_fraction=tokens / total, val_split="tokens")
    return str(out)


def test_eval_plan_takes_every_row_once_or_in_equal_copies():
    assert eval_plan(100, 8, 2, 8) == [(0, 8, 1), (8, 8, 1)]  # a large split: as before
    assert eval_plan(12, 8, 2, 8) == [(0, 8, 1), (8, 4, 2)]  # rows 8-11, twice each
    assert eval_plan(11, 16, 2, 8) == [(0, 8, 1)]  # 11 rows fit no batch of <= 16: 8 of them
    assert eval_plan(3, 8, 2, 8) == [(0, 2, 4)]
    assert eval_plan(1, 16, 2, 8) == [(0, 1, 8)]
    assert eval_plan(5, 16, 1, 1) == [(0, 5, 1)]  # one device: a smaller last batch


def test_a_val_split_smaller_than_a_batch_is_evaluated(dataset, tmp_path):
    """3 held-out rows, batches of 8 over 8 devices: no longer refused; rows 0 and 1, four
    copies each, fill one batch (3 copies of 3 rows would not split over 8 devices). No
    row at all is refused with the fixes, unless eval is off."""
    config = config_for(with_val_tokens(dataset, tmp_path / "ds", 3 * SEQ + 1),
                        MeshConfig(data=8))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, eval_every=10))
    source = open_source(config)  # refused before: "fewer than one batch of 8"
    loader = make_loader(config, source, build_setup(config).batch_sharding)
    assert source.val_windows == 3 and loader.eval_rows(2) == 2
    [(batch, rows)] = loader.eval_batches(2)
    want = source.val_rows([0, 0, 0, 0, 1, 1, 1, 1])
    assert rows == 2 and set(batch) == set(want)
    for key, value in host(batch).items():
        np.testing.assert_array_equal(value, want[key])
    none = config_for(with_val_tokens(dataset, tmp_path / "ds0", SEQ), MeshConfig(data=8))
    assert open_source(none).val_windows == 0  # eval off (tiny_config): nothing to check
    with pytest.raises(ConfigError, match=r"the val split has no row of 17 tokens .* lower "
                       "--seq-len, prepare with a larger --val-fraction, or pass --eval-every 0"):
        open_source(dataclasses.replace(none, train=dataclasses.replace(none.train,
                                                                        eval_every=10)))


@pytest.fixture(scope="module")
def small_val(dataset, tmp_path_factory) -> str:
    """The same documents, the last 12 rows' worth of tokens held out (12 x 16 + 8)."""
    return with_val_tokens(dataset, tmp_path_factory.mktemp("small_val") / "ds", 12 * SEQ + 8)


def test_a_small_val_split_is_evaluated_whole_and_exactly(small_val):
    """12 held-out rows, 2 eval batches of 8: the eval loss is the mean over the 12 rows,
    each once (each row's loss computed alone), where the old eval read rows 0-3 twice."""
    config = config_for(small_val, MeshConfig(data=8))
    setup = build_setup(config)
    params = init_state(setup, 0).params
    source = open_source(config)
    loader = make_loader(config, source, setup.batch_sharding)
    eval_step = make_eval_step(setup)
    loss = evaluate(eval_step, params, loader, setup, 2)
    alone = [float(eval_step(params, loader.to_global(source.val_rows([i] * BATCH))))
             for i in range(source.val_windows)]
    assert len(alone) == 12 and loader.eval_rows(2) == 12
    assert loss == pytest.approx(np.mean(alone), rel=1e-6)


def test_training_resumes_bit_for_bit(small_val, tmp_path):
    """4 steps saving at 2, evaluating at 4 on a held-out split smaller than the 2 eval
    batches; a run resumed from step 2 sees the same batches: same losses, same eval."""
    ckpt = tmp_path / "ckpt"
    config = config_for(small_val, MeshConfig(data=8), packing_mask=True)
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, steps=4, log_every=1, eval_every=4),
        checkpoint=CheckpointConfig(dir=str(ckpt), every=2))
    full = train(config)
    shutil.rmtree(ckpt / "4")
    resumed = train(dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint, resume=True)))
    assert resumed.resumed_from == 2
    want = {r["step"]: r["loss"] for r in full.history}
    got = {r["step"]: r["loss"] for r in resumed.history}
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got)
    assert full.summary["eval_rows"] == resumed.history[-1]["eval_rows"] == 12
    assert resumed.summary["eval_loss"] == full.summary["eval_loss"]
    saved = json.loads((ckpt / "4" / "data" / "metadata").read_text())
    assert saved["next_batch"] == 4


def test_builtin_corpora_keep_their_batches():
    """stdlib/synthetic/text still need no preparation: the loader yields data.Batches'."""
    from shardlib import data as data_lib

    config = config_for("synthetic", MeshConfig(data=8))
    setup = build_setup(config)
    loader = make_loader(config, open_source(config), setup.batch_sharding)
    rows = data_lib.Batches(data_lib.split_corpus(data_lib.load_corpus("synthetic"), SEQ,
                                                  "synthetic")[0], BATCH, SEQ, 0).rows(1)
    next(loader)
    np.testing.assert_array_equal(host(next(loader))["targets"], rows[:, 1:])
    loader.close()
    with pytest.raises(ConfigError, match="x/tokenizer.json: no such tokenizer.json"):
        open_source(config_for("synthetic", MeshConfig(data=8), tokenizer="x/tokenizer.json"))


def test_a_text_file_through_a_tokenizer(dataset, tmp_path):
    """--init-from a model with its own tokenizer (or data.tokenizer) on a plain text file:
    tokenized in memory, eval bits per byte scaled by its tokens per byte."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    tok = train_tokenizer([str(text)], 300, str(tmp_path / "hf" / "tokenizer.json"))
    config = config_for(str(text), MeshConfig(data=8))
    config = dataclasses.replace(config, train=dataclasses.replace(
        config.train, init_from=str(tmp_path / "hf")), model=dataclasses.replace(
        config.model, vocab_size=384))
    source = open_source(config)
    assert source.tokenizer.fingerprint == tok.fingerprint and source.tokens_per_byte < 0.5
    row = source.train(0, 0, 1)["inputs"][0]
    assert row.max() >= 256 and tok.decode(row) in text.read_text()


def test_train_config_fields_exist():
    assert TrainConfig().data == "stdlib" and Config().data == DataConfig()
