"""Tokenizers, `data prepare` (formats, parallel workers, no-op re-runs, atomicity) and
its errors: one clear ShardlibError naming the file, line or field, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from shardlib.cli import main
from shardlib.data import (
    ByteTokenizer,
    PackedWindows,
    load_tokenizer,
    open_dataset,
    prepare,
    segments,
    tokenize_units,
    train_tokenizer,
)
from shardlib.data.prepare import describe, make_units
from shardlib.data.tokenize_units import Options
from shardlib.data.workers import run_parallel
from shardlib.errors import ConfigError, ShardlibError

WORDS = ["alpha", "beta", "gamma", "delta", "shard", "mesh", "token", "über", "naïve"]


def write_jsonl(path, docs: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(5, 60))) for _ in range(docs)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = write_jsonl(root / "a.jsonl", 300)
    (root / "b.txt").write_text("def f(x):\n    return x\n" * 40)
    tok = train_tokenizer([str(root / "a.jsonl"), str(root / "b.txt")], 300,
                          str(root / "tok" / "tokenizer.json"))
    return root, texts, tok


def test_bpe_tokenizer_round_trips_and_has_an_end_of_document(corpus):
    root, texts, tok = corpus
    assert tok.vocab_size == 300 and tok.decode([tok.eod_id]) == ""
    assert tok.decode(tok.encode(texts[0])) == texts[0]
    assert len(tok.encode(texts[0])) < len(texts[0].encode())  # merges learned
    again = load_tokenizer(str(root / "tok"))  # a model directory holding tokenizer.json
    assert again.fingerprint == tok.fingerprint and again.encode("gamma") == tok.encode("gamma")
    assert ByteTokenizer().decode(ByteTokenizer().encode("naïve")) == "naïve"


def test_prepare_counts_split_and_is_a_no_op_when_up_to_date(corpus, tmp_path):
    root, texts, tok = corpus
    out = tmp_path / "ds"
    inputs = [str(root / "a.jsonl"), str(root / "b.txt")]
    first = prepare(inputs, str(root / "tok"), str(out), val_fraction=0.1, unit_bytes=4096)
    m = first.manifest
    assert not first.up_to_date and m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 300
    assert m["splits"]["train"]["num_docs"] + m["splits"]["val"]["num_docs"] == len(texts) + 1
    assert 0 < m["splits"]["val"]["num_docs"] < 0.25 * len(texts)
    data = open_dataset(str(out))
    tokens = np.concatenate([np.asarray(s.tokens) for s in data.split("train") + data.split("val")])
    assert tokens.size == sum(len(tok.encode(t)) + 1 for t in texts) + \
        len(tok.encode((root / "b.txt").read_text())) + 1
    assert np.sum(tokens == tok.eod_id) == len(texts) + 1
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert prepare(inputs, str(root / "tok"), str(out), val_fraction=0.1).up_to_date
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    (root / "a.jsonl").touch()  # changed inputs: prepared again
    assert not prepare(inputs, str(root / "tok"), str(out), val_fraction=0.1).up_to_date


def test_two_workers_write_the_same_shards_as_one(corpus, tmp_path, monkeypatch):
    """...and start as fresh interpreters, never as forks of this process (its threads'
    locks would be copied in whatever state they are): no os.fork, no warning about it."""
    root, _, _ = corpus
    forks = []
    fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [prepare([str(root / "a.jsonl")], "bytes", str(tmp_path / f"w{n}"), workers=n,
                        val_fraction=0.1, unit_bytes=4096).manifest for n in (1, 2)]
    sums = [[s["checksum"] for s in m["splits"]["train"]["shards"]] for m in runs]
    assert len(sums[0]) > 2 and sums[0] == sums[1]
    assert forks == [] and [str(w.message) for w in caught if "fork" in str(w.message)] == []


def test_a_worker_imports_nothing_of_shardlib():
    """A worker is a fresh interpreter, so it must start in a fraction of a second: the
    module it runs imports numpy and tokenizers, never shardlib (and with it JAX)."""
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
            "print([m for m in ('shardlib', 'jax', 'flax', 'orbax') if m in sys.modules])")
    run = subprocess.run([sys.executable, "-P", "-c", code, tokenize_units.__file__],
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_a_failing_worker_is_one_clear_error(corpus, tmp_path):
    """Not bad input but a failure (here the output directory is gone): a ShardlibError
    naming the file, the workers stopped and waited for."""
    root, _, _ = corpus
    units = make_units([root / "a.jsonl"], 4096)
    opts = Options("", 0, "text", 0.0, "uint16", str(tmp_path / "gone"))
    with pytest.raises(ShardlibError, match=r"a\.jsonl \(unit \d+\) failed in a worker "
                       r"process: FileNotFoundError"):
        run_parallel(units, opts, 2, lambda i: None)


def test_few_documents_hold_out_their_last_tokens(tmp_path):
    """114 documents at the default --val-fraction 0.01: about one would be held out whole
    (none, a third of the time), so the split holds out the last 1% of the tokens, and the
    CLI line says so and how far eval reaches."""
    texts = write_jsonl(tmp_path / "few.jsonl", 114, seed=3)
    inputs = [str(tmp_path / "few.jsonl")]
    result = prepare(inputs, "bytes", str(tmp_path / "ds"), unit_bytes=4096)
    m, total = result.manifest, sum(len(t.encode()) + 1 for t in texts)
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert m["val_split"] == "tokens" and val["num_tokens"] == round(total * 0.01)
    assert train["num_docs"] + val["num_docs"] == 114 and val["num_docs"] <= 2
    assert abs(val["num_bytes"] - (val["num_tokens"] - val["num_docs"])) <= 3  # a cut UTF-8 char
    whole = prepare(inputs, "bytes", str(tmp_path / "all"), val_fraction=0, unit_bytes=4096)
    stream = lambda path, names: np.concatenate(
        [np.asarray(s.tokens) for name in names for s in open_dataset(str(path)).split(name)])
    np.testing.assert_array_equal(stream(result.path, ["train", "val"]),
                                  stream(whole.path, ["train"]))  # the tail, cut off
    rows = sum((s["num_tokens"] - 1) // 128 for s in val["shards"])
    longest = max(s["num_tokens"] for s in val["shards"]) - 1
    assert describe(result).splitlines()[-1] == (
        "val split: the last 1.00% of tokens: 114 documents are too few to hold out whole "
        "ones (~1.1 would fall in it; --val-split documents does it anyway); eval has "
        f"{rows:,} rows at --seq-len 128 and runs with --seq-len up to {longest:,}")
    many = prepare(inputs, "bytes", str(tmp_path / "docs"), val_fraction=0.2, unit_bytes=4096)
    assert many.manifest["val_split"] == "documents"  # ~23 documents held out whole
    assert "whole documents, ~23 of 114" in describe(many)


def test_parquet_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["one doc", "another doc", "third"] * 20}),
                   tmp_path / "t.parquet", row_group_size=20)
    m = prepare([str(tmp_path / "t.parquet")], "bytes", str(tmp_path / "ds"),
                text_field="body", val_fraction=0.2).manifest
    assert m["splits"]["train"]["num_docs"] + m["splits"]["val"]["num_docs"] == 60
    assert len(m["splits"]["train"]["shards"]) == 3  # one per row group
    with pytest.raises(ConfigError, match="no column 'text'.*--text-field"):
        prepare([str(tmp_path / "t.parquet")], "bytes", str(tmp_path / "ds2"))


@pytest.mark.parametrize("content, message, workers", [
    ('{"text": "ok"}\n{"text": "fine"}\nnot json\n', r"bad\.jsonl:3: not valid JSON", 1),
    ('{"text": "ok"}\n{"body": "x"}\n', r"bad\.jsonl:2: no string field 'text'.*--text-field",
     1),
    ('{"text": "ok"}\n{"text": "fine"}\nnot json\n', r"bad\.jsonl:3: not valid JSON", 2),
])
def test_bad_jsonl_names_the_line_and_leaves_nothing(tmp_path, content, message, workers):
    """With 2 workers the bad file comes first: a worker meets it, this process learns it."""
    write_jsonl(tmp_path / "good.jsonl", 50)
    (tmp_path / "bad.jsonl").write_text(content)
    inputs = [str(tmp_path / "good.jsonl"), str(tmp_path / "bad.jsonl")]
    if workers > 1:
        inputs.reverse()
    with pytest.raises(ConfigError, match=message):
        prepare(inputs, "bytes", str(tmp_path / "ds"), unit_bytes=512, workers=workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl"]


def test_missing_empty_and_too_small_inputs(tmp_path):
    with pytest.raises(ConfigError, match="nope.txt: no such file"):
        prepare([str(tmp_path / "nope.txt")], "bytes", str(tmp_path / "ds"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="empty.txt: the file is empty"):
        prepare([str(tmp_path / "empty.txt")], "bytes", str(tmp_path / "ds"))
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(ConfigError, match="no document of 1 fell in the validation split"):
        prepare([str(tmp_path / "one.txt")], "bytes", str(tmp_path / "ds"), val_fraction=0.01,
                val_split="documents")
    assert not (tmp_path / "ds").exists()
    with pytest.raises(ConfigError, match="--val-split 'words': must be one of auto, "):
        prepare([str(tmp_path / "one.txt")], "bytes", str(tmp_path / "ds"), val_split="words")
    one = prepare([str(tmp_path / "one.txt")], "bytes", str(tmp_path / "ds"))
    assert one.manifest["splits"]["val"]["num_tokens"] == 1  # the last of 18 tokens
    assert describe(one).endswith("too small for eval: raise --val-fraction, or train with "
                                  "--eval-every 0")
    with pytest.raises(ConfigError, match="--vocab-size 100: must be >= 257"):
        train_tokenizer([str(tmp_path / "one.txt")], 100, str(tmp_path / "t.json"))


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"caf\xe9 ok \xff\xfe end")
    m = prepare([str(tmp_path / "bin.txt")], "bytes", str(tmp_path / "ds"),
                val_fraction=0).manifest
    assert m["replaced_utf8"] == 3  # \xe9, \xff, \xfe: one U+FFFD each


def test_segments_restart_at_every_document():
    starts = np.array([0, 3, 4, 9])  # documents [0,3) [3,4) [4,9) [9,...)
    ids, pos = segments(starts, 2, 8)  # tokens 2..9
    np.testing.assert_array_equal(ids, [1, 2, 3, 3, 3, 3, 3, 4])
    np.testing.assert_array_equal(pos, [0, 0, 0, 1, 2, 3, 4, 0])  # a cut document: from 0


def test_windows_cover_every_token_once(corpus, tmp_path):
    root, _, _ = corpus
    prepare([str(root / "a.jsonl")], "bytes", str(tmp_path / "ds"), val_fraction=0,
            unit_bytes=4096)
    shards = open_dataset(str(tmp_path / "ds")).split("train")
    windows = PackedWindows(shards, seq_len=16)
    rows = windows.rows(range(len(windows)), with_segments=True)
    first = shards[0]
    count = (first.num_tokens - 1) // 16
    np.testing.assert_array_equal(rows["inputs"][:count].ravel(),
                                  np.asarray(first.tokens[:count * 16]))
    np.testing.assert_array_equal(rows["targets"][:count].ravel(),
                                  np.asarray(first.tokens[1:count * 16 + 1]))
    eod = rows["inputs"] == ByteTokenizer.eod_id
    after = np.roll(eod, 1, axis=1)
    after[:, 0] = False  # a token after an EOD starts a new segment at position 0
    assert np.all(rows["positions"][after] == 0)
    assert np.all(np.diff(rows["segment_ids"], axis=1)[eod[:, :-1]] == 1)


def test_cli_prepare_and_tokenizer_train(corpus, tmp_path, capsys):
    root, _, _ = corpus
    assert main(["tokenizer", "train", "--data", str(root / "a.jsonl"), "--vocab-size", "280",
                 "--out", str(tmp_path / "tok.json")]) == 0
    args = ["data", "prepare", "--input", str(root / "*.jsonl"), "--tokenizer",
            str(tmp_path / "tok.json"), "--out", str(tmp_path / "ds"), "--val-fraction", "0.1"]
    assert main(args) == 0 and main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert "vocab 280" in out[0] and "up to date" in out[-2]
    assert out[-1].startswith("val split: whole documents, ~30 of 300 held out by a hash; "
                              "eval has ")
    assert main(["data", "prepare", "--input", str(tmp_path / "x.jsonl"), "--out",
                 str(tmp_path / "ds2")]) == 2
    assert "x.jsonl: no such file" in capsys.readouterr().err


def test_train_flags_size_the_vocabulary_for_the_tokenizer(corpus, tmp_path, capsys):
    from shardlib.cli import build_parser, config_from_args

    root, _, tok = corpus
    prepare([str(root / "a.jsonl")], str(root / "tok"), str(tmp_path / "ds"), val_fraction=0.1)
    args = ["train", "--data", str(tmp_path / "ds"), "--model", "tiny"]
    config = config_from_args(build_parser().parse_args(args))
    assert config.model.vocab_size == 384 and config.data.tokenizer == ""  # 300 -> 3 x 128
    assert "model.vocab_size 256 -> 384" in capsys.readouterr().out
    fixed = config_from_args(build_parser().parse_args(args + ["--set", "model.vocab_size=512",
                                                                "data.packing_mask=true"]))
    assert fixed.model.vocab_size == 512 and fixed.data.packing_mask
