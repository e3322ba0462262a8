"""``shardlib data prepare`` and ``shardlib tokenizer train``; fitting the model's
vocabulary to the run's tokenizer. Imports stay inside functions: ``--help`` stays fast."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from shardlib.config import Config


def add_data_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the ``data`` and ``tokenizer`` subcommands."""
    data = sub.add_parser("data", help="prepare a tokenized dataset for `train --data DIR`")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenize .txt/.jsonl/.parquet files into "
                               "memory-mapped shards (a no-op when already up to date)")
    prep.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB",
                      help="files, globs or directories (.txt: one document per file; "
                      ".jsonl: one per line; .parquet: one per row)")
    prep.add_argument("--tokenizer", default="bytes", help="bytes (default), a "
                      "tokenizer.json, or a Hugging Face model directory")
    prep.add_argument("--out", required=True, help="the dataset directory to write")
    prep.add_argument("--text-field", default="text", help="the .jsonl/.parquet field "
                      "holding the text (default text)")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="share held out for "
                      "eval (default 0.01): of documents or of tokens, see --val-split")
    prep.add_argument("--val-split", choices=("auto", "documents", "tokens"), default="auto",
                      help="hold out whole documents (by a hash) or the last tokens; auto "
                      "(default): documents when about 20 or more would be held out")
    prep.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer locally")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    fit = tok_sub.add_parser("train", help="fit a byte-level BPE on .txt/.jsonl files")
    fit.add_argument("--data", nargs="+", required=True, metavar="FILE", help=".txt/.jsonl")
    fit.add_argument("--vocab-size", type=int, required=True, help="e.g. 4096")
    fit.add_argument("--out", required=True, help="the tokenizer.json to write")
    fit.add_argument("--text-field", default="text", help=".jsonl field (default text)")


def run_data(args: argparse.Namespace) -> int:
    """``shardlib data prepare``: tokenize files into a prepared dataset."""
    from shardlib.data.prepare import describe, prepare

    show = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show:
            print(f"\rtokenizing: {done / 2**20:.1f} / {total / 2**20:.1f} MB", end="",
                  file=sys.stderr, flush=True)

    result = prepare(args.input, args.tokenizer, args.out, text_field=args.text_field,
                     val_fraction=args.val_fraction, val_split=args.val_split,
                     workers=args.workers, progress=progress)
    if show and not result.up_to_date:
        print(file=sys.stderr)
    print(describe(result), flush=True)
    return 0


def run_tokenizer(args: argparse.Namespace) -> int:
    """``shardlib tokenizer train``: fit and write a BPE tokenizer."""
    from shardlib.data.tokenizer import train_tokenizer

    tok = train_tokenizer(args.data, args.vocab_size, args.out, text_field=args.text_field)
    short = (f" (of {args.vocab_size} asked: the text holds no more merges; give more text "
             "for a larger vocab)" if tok.vocab_size < args.vocab_size else "")
    print(f"trained a byte-level BPE: vocab {tok.vocab_size}{short}, end of document "
          f"{tok.eod_id} -> {args.out}", flush=True)
    return 0


def fit_vocab(config: Config, overrides: list[str], quiet: bool = False) -> Config:
    """With a tokenizer bigger than the preset's vocabulary (and no ``--init-from`` or
    ``--set model.vocab_size``), size the embedding for it, padded to a multiple of 128."""
    from shardlib.data.loader import padded_vocab, pick_tokenizer
    from shardlib.data.shards import is_prepared, open_dataset

    tc = config.train
    if tc.init_from or any(o.strip().startswith("model.vocab_size") for o in overrides):
        return config
    if not is_prepared(tc.data) and config.data.tokenizer in ("", "bytes"):
        return config
    dataset = open_dataset(tc.data) if is_prepared(tc.data) else None
    vocab = pick_tokenizer(config, dataset).vocab_size
    if vocab <= config.model.vocab_size:
        return config
    model = dataclasses.replace(config.model, vocab_size=padded_vocab(vocab))
    if not quiet:
        print(f"model.vocab_size {config.model.vocab_size} -> {model.vocab_size}: the "
              f"tokenizer's {vocab} tokens, padded to a multiple of 128 (embed.w_vd in the "
              "table)", flush=True)
    return dataclasses.replace(config, model=model)
