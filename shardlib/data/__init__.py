"""Training data: built-in byte corpora, tokenizers, prepared (tokenized) datasets,
document packing and the grain input pipeline.

- ``corpus``: stdlib / synthetic / a text file as bytes, no preparation (the default)
- ``tokenizer``: bytes or a Hugging Face ``tokenizer.json``; local BPE training
- ``prepare`` + ``shards``: ``shardlib data prepare`` and the memory-mapped shard format;
  ``split`` its validation split, ``tokenize_units`` + ``workers`` its worker processes
- ``packing``: documents -> fixed-length rows with segment ids and positions
- ``chat`` + ``sft``: chat JSONL for supervised fine-tuning: the chat template, the
  assistant mask, conversations packed into rows with loss weights
- ``loader``: per-process rows via grain, prefetch, global arrays, resumable state
"""

from shardlib.data.corpus import (
    STDLIB_MAX_BYTES,
    VAL_FRACTION,
    Batches,
    decode,
    encode,
    file_corpus,
    global_batch,
    load_corpus,
    local_row_range,
    make_batches,
    split_corpus,
    stdlib_corpus,
    synthetic_corpus,
)
from shardlib.data.loader import Loader, Source, make_loader, open_source, padded_vocab
from shardlib.data.packing import PackedWindows, segments
from shardlib.data.prepare import Prepared, prepare
from shardlib.data.shards import PreparedDataset, is_prepared, open_dataset
from shardlib.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "STDLIB_MAX_BYTES", "VAL_FRACTION", "Batches", "ByteTokenizer", "HFTokenizer", "Loader",
    "PackedWindows", "Prepared", "PreparedDataset", "Source", "Tokenizer", "decode", "encode",
    "file_corpus", "global_batch", "is_prepared", "load_corpus", "local_row_range",
    "make_batches", "make_loader", "open_dataset", "open_source", "padded_vocab", "prepare",
    "segments", "split_corpus", "stdlib_corpus", "synthetic_corpus", "load_tokenizer",
    "train_tokenizer",
]
