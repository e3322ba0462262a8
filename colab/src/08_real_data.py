# %% [markdown]
# # Real data: a tokenizer, a prepared dataset, packed documents, an exact resume
#
# Until now every token was a byte of a built-in corpus. This notebook goes from a folder
# of `.jsonl` files to a sharded training run the way a real corpus is trained:
# 1. train a byte-level BPE tokenizer on the files (locally, nothing downloaded);
# 2. `data prepare`: tokenize them into memory-mapped shards with a manifest;
# 3. look at a packed batch: documents cut into rows, with segment ids and positions;
# 4. train on `data=8`, stop half-way, resume on `data=2, fsdp=2, tensor=2` from the
#    checkpoint, and check the resumed run reads exactly the batches that come next;
# 5. fine-tune a Hugging Face model directory with its own tokenizer, and read its
#    sample as text.

# %% [setup]

# %% [parameters]
MODEL = "small"  # tiny (CI) or small
STEPS = 60  # the run saves at STEPS // 2 and at STEPS
SEQ_LEN = 128
BATCH_SIZE = 16
CORPUS_MB = 2.0  # JSON Lines of Python standard library source
VOCAB = 1024  # BPE vocabulary
FINETUNE = True  # section 5 needs transformers and torch

# %%
import dataclasses
import json
import re
import shutil
import sysconfig
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from shardlib.config import CheckpointConfig, DataConfig
from shardlib.data import (
    load_tokenizer,
    make_loader,
    open_source,
    padded_vocab,
    prepare,
    train_tokenizer,
)

WORK = Path("runs/notebook08").absolute()  # runs/ is git-ignored
shutil.rmtree(WORK, ignore_errors=True)
(WORK / "corpus").mkdir(parents=True)

# a folder of .jsonl files: one document per top-level def/class of the stdlib's modules
files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
budget = int(CORPUS_MB * 2**20)
for i, path in enumerate(files):
    if budget <= 0:
        break
    docs = re.split(r"\n(?=def |class )", path.read_text(errors="replace"))
    with open(WORK / "corpus" / f"part{i % 4}.jsonl", "a") as out:
        out.writelines(json.dumps({"text": d, "file": path.name}) + "\n" for d in docs)
    budget -= sum(map(len, docs))
print(sorted(p.name for p in (WORK / "corpus").iterdir()))

# %% [markdown]
# ## 1. A tokenizer trained here
# `shardlib tokenizer train --data corpus/*.jsonl --vocab-size N --out tok.json` does
# the same from a terminal. The end-of-document token is `<|endoftext|>`.

# %%
inputs = sorted(str(p) for p in (WORK / "corpus").glob("*.jsonl"))
tok = train_tokenizer(inputs, VOCAB, str(WORK / "tok.json"))
sample_text = "def parse(line):\n    return line.split()"
ids = tok.encode(sample_text)
print(f"vocab {tok.vocab_size}, end of document id {tok.eod_id}")
print(f"{len(sample_text.encode())} bytes -> {len(ids)} tokens:",
      [tok.decode([i]) for i in ids])

# %% [markdown]
# ## 2. Prepare: tokenize once, train many times
# Worker processes tokenize the files into shards; the manifest records the tokenizer,
# counts and checksums. The shards are memory-mapped at training time, so a corpus larger
# than memory trains the same way. Running it again with the same inputs does nothing.

# %%
done = prepare(inputs, str(WORK / "tok.json"), str(WORK / "ds"), workers=2, val_fraction=0.1)
again = prepare(inputs, str(WORK / "tok.json"), str(WORK / "ds"), workers=2, val_fraction=0.1)
m = done.manifest
print(f"prepared in {done.seconds:.1f} s; second run up to date: {again.up_to_date}")
for split in ("train", "val"):
    s = m["splits"][split]
    print(f"  {split}: {s['num_tokens']:,} tokens, {s['num_docs']} documents, "
          f"{len(s['shards'])} shards, {s['num_bytes'] / max(s['num_tokens'], 1):.2f} "
          "bytes/token")
print(sorted(p.name for p in (WORK / "ds").iterdir())[:6], "...")

# %% [markdown]
# ## 3. A packed batch
# Rows are `SEQ_LEN + 1`-token windows of the concatenated documents. With
# `data.packing_mask=true` each row carries `segment_ids` (a new id where a document
# starts) and `positions` (restarting at 0), so the attention can keep every token
# within its own document.

# %%
config = shardlib.Config(
    mesh=shardlib.MeshConfig(data=8),
    model=dataclasses.replace(shardlib.get_preset(MODEL), vocab_size=padded_vocab(VOCAB)),
    train=shardlib.TrainConfig(data=str(WORK / "ds"), steps=STEPS, batch_size=BATCH_SIZE,
                               seq_len=SEQ_LEN, eval_every=STEPS // 2, log_every=5,
                               sample_tokens=40),
    data=DataConfig(packing_mask=True),
)
setup = shardlib.build_setup(config, DEVICES)
loader = make_loader(config, open_source(config), setup.batch_sharding)
batch = {k: np.asarray(v) for k, v in next(loader).items()}
loader.close()
print({k: (v.shape, v.dtype.name) for k, v in batch.items()})
row = int(np.argmax(batch["segment_ids"].max(axis=1)))  # the row with most documents
print(f"row {row} holds pieces of {batch['segment_ids'][row].max()} documents")
cuts = np.flatnonzero(np.diff(batch["segment_ids"][row])) + 1
if cuts.size:
    cut = cuts[0]
    print(f"a document starts at token {cut} (positions {batch['positions'][row, cut - 2:cut + 3]}"
          "):", repr(load_tokenizer(str(WORK / "ds")).decode(batch["inputs"][row, cut - 6:cut + 6])))

fig, (ax_s, ax_p) = plt.subplots(1, 2, figsize=(12, 3))
ax_s.imshow(batch["segment_ids"], aspect="auto", cmap="tab20", interpolation="nearest")
ax_s.set(title="segment_ids (one colour per document piece)", xlabel="position in row",
         ylabel="row")
ax_p.imshow(batch["positions"], aspect="auto", interpolation="nearest")
ax_p.set(title="positions (restart at each document)", xlabel="position in row")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Train, stop, resume on another mesh
# Each checkpoint also holds the loader's position. `shardlib train --resume` restores
# it; here the run saved at `STEPS // 2` is continued on `data=2, fsdp=2, tensor=2`.

# %%
ckpt = WORK / "ckpt"
saving = dataclasses.replace(config, checkpoint=CheckpointConfig(dir=str(ckpt),
                                                                 every=STEPS // 2))
full = shardlib.train(saving, devices=DEVICES)
print(f"loss {full.summary['first_loss']:.3f} -> {full.summary['final_loss']:.3f}; eval "
      f"{full.summary['eval_loss']:.3f} nats/token = "
      f"{full.summary['eval_bits_per_byte']:.3f} bits/byte")
print("sample:", repr(full.sample[:200]))
print("saved data position at step", STEPS // 2, ":",
      json.loads((ckpt / str(STEPS // 2) / "data" / "metadata").read_text()))

# %%
shutil.rmtree(ckpt / str(STEPS))  # as if the run had stopped after the half-way save
other = dataclasses.replace(
    saving, mesh=shardlib.MeshConfig(data=2, fsdp=2, tensor=2),
    checkpoint=dataclasses.replace(saving.checkpoint, resume=True))
resumed = shardlib.train(other, devices=DEVICES)
ref = {r["step"]: r["loss"] for r in full.history}
got = {r["step"]: r["loss"] for r in resumed.history}
rel = max(abs(got[s] - ref[s]) / ref[s] for s in got)
print(f"resumed from step {resumed.resumed_from} on fsdp=2,tensor=2: largest relative loss "
      f"difference {rel:.1e} (same batches; sums in another order)")
assert rel < 1e-3

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(list(ref), list(ref.values()), lw=3, alpha=0.4, label="data=8, uninterrupted")
ax.plot(list(got), list(got.values()), "x", label="resumed on data=2,fsdp=2,tensor=2")
ax.axvline(STEPS // 2, color="gray", ls="--")
ax.set(xlabel="step", ylabel="loss (nats/token)", title="BPE tokens, packed documents")
ax.legend()
plt.show()

# %% [markdown]
# ## 5. Fine-tune a Hugging Face model on your text, with its own tokenizer
# A download would give a directory with `config.json`, weights and `tokenizer.json`.
# Here one is made locally: a random-init transformers Llama with the tokenizer above.
# `--init-from DIR` loads the weights and picks DIR's tokenizer; the data is prepared
# with the same tokenizer (another one is refused).

# %%
if FINETUNE:
    import transformers

    hf_dir = WORK / "hf_model"
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=168, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=256,
        bos_token_id=tok.eod_id, eos_token_id=tok.eod_id))
    llama.save_pretrained(hf_dir)
    shutil.copy(WORK / "tok.json", hf_dir / "tokenizer.json")
    from shardlib.interop.hf import load_config

    tuned = shardlib.train(dataclasses.replace(
        config, model=load_config(hf_dir),
        train=dataclasses.replace(config.train, init_from=str(hf_dir), eval_every=STEPS)),
        devices=DEVICES)
    print(f"fine-tuned: loss {tuned.summary['first_loss']:.3f} -> "
          f"{tuned.summary['final_loss']:.3f}, eval {tuned.summary['eval_bits_per_byte']:.3f} "
          "bits/byte")
    print("sample, decoded by the model's tokenizer:", repr(tuned.sample[:200]))

# %% [markdown]
# From a terminal: `shardlib tokenizer train ...`, `shardlib data prepare ...`, then
# `shardlib train --data DIR [--init-from HF_DIR] --checkpoint-dir C` and `--resume`.
# See docs/data.md for the format, the errors and the measured loader throughput.
