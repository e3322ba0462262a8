# %% [markdown]
# # A tour of parallelism: DP, FSDP, TP, SP and a 3-D mix
#
# One model, five ways to spread it over 8 devices. In shardlib a **strategy is a mesh
# shape plus a rule set**: every weight and activation names its dims logically (`embed`,
# `mlp`, `heads`, `act_batch`, ...), and the rules map those names to mesh axes.
#
# | strategy | mesh | what is split | communication per step |
# |---|---|---|---|
# | DP (data parallel) | `data=8` | the batch | all-reduce of the gradients |
# | FSDP (ZeRO-3) | `fsdp=8` | the batch and every weight's `embed` dim | all-gather weights, reduce-scatter gradients |
# | TP (Megatron tensor parallel) | `data=2, tensor=4` | attention heads and MLP columns/rows | all-reduce of activations, twice per layer forward |
# | SP (Megatron sequence parallel) | TP + `sequence_parallel` | also the residual stream along the sequence | those all-reduces become reduce-scatter + all-gather |
# | 3-D | `data=2, fsdp=2, tensor=2` | all of the above at once | all of the above |
#
# For each strategy we draw where a weight and an activation live, list the collectives
# XLA put into the compiled train step (the table `shardlib inspect` prints), and measure
# the memory of one device. Nothing here is typed in by hand: every number comes from
# the compiled program. The step is compiled ahead of time from abstract inputs, so no
# memory is allocated and nothing is run.

# %% [setup]

# %% [parameters]
MODEL = "small"  # tiny (CI) or small (3.2M params): any preset whose heads divide by 4
BATCH_SIZE = 16
SEQ_LEN = 128

# %%
import dataclasses

import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

from shardlib import sharding
from shardlib.inspect import analyze, collectives_table, per_axis

STRATEGIES = {
    "DP": shardlib.MeshConfig(data=8),
    "FSDP": shardlib.MeshConfig(data=1, fsdp=8),
    "TP": shardlib.MeshConfig(data=2, tensor=4),
    "SP": shardlib.MeshConfig(data=2, tensor=4, sequence_parallel=True),
    "3-D": shardlib.MeshConfig(data=2, fsdp=2, tensor=2),
}
base = shardlib.Config(model=shardlib.get_preset(MODEL),
                       train=shardlib.TrainConfig(batch_size=BATCH_SIZE, seq_len=SEQ_LEN))
print(f"model {MODEL}: {shardlib.count_params(base.model):,} parameters, "
      f"batch {BATCH_SIZE} x {SEQ_LEN} tokens")
console = Console(width=150)

# %% [markdown]
# ## Drawing a layout
# `NamedSharding.devices_indices_map(shape)` tells which slice of an array each device
# holds. We draw one weight, the MLP input projection `w_in_df` of one layer
# (`embed x mlp`), and two activations: the residual stream `x` (`batch x seq`; its
# `embed` dim is never split) and the MLP hidden activation `h` (`batch x mlp`). Each box
# is one block; the label lists the devices that hold a copy of it.

# %%
from matplotlib.patches import Rectangle

SHAPES = {"embed": base.model.d_model, "mlp": base.model.d_ff, "act_batch": BATCH_SIZE,
          "act_res_seq": SEQ_LEN, "act_mlp": base.model.d_ff}
PANELS = [  # (title, logical dims of the full array, the two dims drawn)
    ("weight w_in_df (one layer)", ("embed", "mlp"), ("embed", "mlp")),
    ("residual stream x", ("act_batch", "act_res_seq", "act_embed"), ("act_batch", "act_res_seq")),
    ("MLP hidden h", ("act_batch", "act_seq", "act_mlp"), ("act_batch", "act_mlp")),
]
UNITS = {"embed": "embed (features)", "mlp": "mlp (hidden units)", "act_batch": "batch (sequences)",
         "act_res_seq": "seq (tokens)", "act_mlp": "mlp (hidden units)"}


def spec_2d(setup, logical, drawn):
    """The PartitionSpec of the two drawn dims of an array with these logical dims."""
    spec = sharding.logical_to_spec(logical, setup.rules, setup.sizes)
    entries = list(spec) + [None] * (len(logical) - len(spec))
    return P(*(entries[logical.index(d)] for d in drawn))


def draw_layout(ax, setup, title, logical, drawn):
    shape = tuple(SHAPES[d] for d in drawn)
    spec = spec_2d(setup, logical, drawn)
    blocks = {}
    for device, index in NamedSharding(setup.mesh, spec).devices_indices_map(shape).items():
        key = tuple((s.start or 0, s.stop or n) for s, n in zip(index, shape, strict=True))
        blocks.setdefault(key, []).append(DEVICES.index(device))
    colors = plt.get_cmap("tab10")
    for ((r0, r1), (c0, c1)), ids in blocks.items():
        ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=colors(min(ids) % 10),
                               edgecolor="black", alpha=0.55))
        label = "all 8" if len(ids) == 8 else ",".join(map(str, sorted(ids)))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=7)
    ax.set(xlim=(0, shape[1]), ylim=(shape[0], 0), xlabel=UNITS[drawn[1]],
           ylabel=UNITS[drawn[0]], title=f"{title}\nspec {tuple(spec)}")
    ax.title.set_fontsize(9)
    return len(blocks)

# %% [markdown]
# ## Compile every strategy
# `analyze(config)` is what `shardlib inspect` runs: build the mesh and shardings, compile
# one train step ahead of time, parse the collectives out of the compiled HLO and read
# XLA's memory plan. (On CPU each compile takes several seconds.)

# %%
results = {}
for name, mesh in STRATEGIES.items():
    ins = analyze(dataclasses.replace(base, mesh=mesh), DEVICES)
    results[name] = ins
    print(f"{name:5s} compiled in {ins.compile_s:5.1f} s: {ins.comm_bytes:>12,} bytes sent per "
          f"device per step, state {ins.memory.state_bytes_per_device:>10,} B per device")


def show(name):
    """Layout pictures, the collectives table and the memory of one strategy."""
    ins = results[name]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, (title, logical, drawn) in zip(axes, PANELS, strict=True):
        draw_layout(ax, ins.setup, title, logical, drawn)
    fig.suptitle(f"{name}: mesh {dict((k, v) for k, v in ins.setup.sizes.items() if v > 1)}"
                 f" (labels: device ids holding each block)")
    fig.tight_layout()
    plt.show()
    console.print(collectives_table(ins))
    for axes_key, row in per_axis(ins).items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"  over {axes_key:10s}: measured {row['measured']:>10,} B, theory "
              f"{row['theory']:>10,} B, measured/theory {ratio}; kinds {row['measured_by_kind']}")
    mem = ins.memory
    print(f"memory per device: params {mem.params_bytes:,} B, optimizer state "
          f"{mem.opt_state_bytes:,} B, temporaries {mem.temp_bytes:,} B, peak {mem.peak_bytes:,} B")

# %% [markdown]
# ## 1. Data parallelism (DP): `data=8`
# Every device holds the whole model and 1/8 of the batch. The only communication is the
# gradient **all-reduce** over `data` (ring cost `2 (n-1)/n` x gradient bytes per device).

# %%
show("DP")

# %% [markdown]
# ## 2. Fully sharded data parallelism (FSDP / ZeRO-3): `fsdp=8`
# Every weight's `embed` dim is split in 8: each device stores 1/8 of the parameters,
# gradients and optimizer state. Before a layer runs, its weights are **all-gathered**;
# after the backward pass the gradients are **reduce-scattered** so each device keeps
# only the slice it owns. The batch is split over `fsdp` as in DP.

# %%
show("FSDP")
dp, fsdp = results["DP"].memory, results["FSDP"].memory
print(f"FSDP state per device / DP state per device = {fsdp.state_bytes_per_device:,} / "
      f"{dp.state_bytes_per_device:,} = "
      f"{fsdp.state_bytes_per_device / dp.state_bytes_per_device:.4f} "
      f"(1/{dp.state_bytes_per_device / fsdp.state_bytes_per_device:.2f})")

# %% [markdown]
# ## 3. Tensor parallelism (TP, Megatron): `data=2, tensor=4`
# Attention heads and the MLP's hidden units are split over `tensor`: the first matmul of
# each block is split by columns, the second by rows, so each device computes a partial
# sum of the block's output and an **all-reduce** over `tensor` adds them up, once after
# attention and once after the MLP in the forward pass (and again in the backward pass).
# The residual stream stays whole on every tensor device: see the middle picture.

# %%
show("TP")

# %% [markdown]
# ## 4. Sequence parallelism (SP): TP + `mesh.sequence_parallel=true`
# Between the tensor-parallel regions (norms, residual adds) the activations are split
# along the sequence over `tensor` too, so they no longer sit 4 times on 4 devices. Each
# all-reduce becomes a **reduce-scatter** (into the sequence split) plus an **all-gather**
# (back to the full sequence before the next TP region): the same bytes, less activation
# memory. (shardlib writes these collectives out in a `shard_map`,
# `shardlib/parallel/tensor.py`, so they are real reduce-scatters even on CPU, where
# XLA's own would be an all-reduce + slice.)

# %%
show("SP")
tp, sp = results["TP"].memory, results["SP"].memory
print(f"temporaries per device: TP {tp.temp_bytes:,} B, SP {sp.temp_bytes:,} B "
      f"(SP / TP = {sp.temp_bytes / tp.temp_bytes:.3f})")

# %% [markdown]
# ## 5. A 3-D mix: `data=2, fsdp=2, tensor=2`
# The rules of the three axes combine: the batch splits over `data x fsdp`, weights over
# `fsdp` (embed) and `tensor` (heads, mlp). Each collective runs over its own axis.

# %%
show("3-D")

# %% [markdown]
# ## Comparison
# Per device: the persistent train state (parameters + AdamW moments), XLA's peak estimate
# for one step (arguments + outputs + temporaries), and the bytes each device sends per
# step, next to the theory's minimum.

# %%
names = list(results)
state = np.array([results[n].memory.state_bytes_per_device for n in names]) / 2**20
peak = np.array([results[n].memory.peak_bytes for n in names]) / 2**20
sent = np.array([results[n].comm_bytes for n in names]) / 2**20
theory = np.array([results[n].theory_comm_bytes for n in names]) / 2**20
x = np.arange(len(names))
fig, (ax_mem, ax_comm) = plt.subplots(1, 2, figsize=(12, 4))
ax_mem.bar(x - 0.2, state, 0.4, label="train state (params + AdamW)")
ax_mem.bar(x + 0.2, peak, 0.4, label="peak of one step (XLA plan)")
ax_mem.set(xticks=x, xticklabels=names, ylabel="MiB per device",
           title=f"memory per device, {MODEL} model, 8 devices")
ax_mem.legend()
ax_comm.bar(x - 0.2, sent, 0.4, label="measured (compiled HLO)")
ax_comm.bar(x + 0.2, theory, 0.4, label="theory (ring algorithms)")
ax_comm.set(xticks=x, xticklabels=names, ylabel="MiB sent per device per step",
            title="communication per train step")
ax_comm.legend()
fig.tight_layout()
plt.show()

dp_state, dp_comm = results["DP"].memory.state_bytes_per_device, results["DP"].comm_bytes
for n in names:
    ins = results[n]
    ratio = "-" if ins.comm_ratio is None else f"{ins.comm_ratio:.2f}"
    share = ins.memory.state_bytes_per_device / dp_state
    print(f"{n:5s} state {ins.memory.state_bytes_per_device / 2**20:7.3f} MiB = {share:.3f} of DP's"
          f" (1/{1 / share:.1f}), peak {ins.memory.peak_bytes / 2**20:6.2f} MiB, sends "
          f"{ins.comm_bytes / 2**20:6.3f} MiB/step = {ins.comm_bytes / dp_comm:.2f} x DP's, "
          f"{ratio} x its theory")
smallest = min(names, key=lambda n: results[n].memory.state_bytes_per_device)
cheapest = min(names, key=lambda n: results[n].comm_bytes)
print(f"least state per device: {smallest}; least communication: {cheapest}")

# %% [markdown]
# Reading the chart: DP keeps a full copy of everything; FSDP divides the state by the
# device count. shardlib's FSDP gathers each weight once per step and keeps it for the
# backward pass, so its traffic is an all-gather plus a reduce-scatter of the parameters,
# `2 (n-1)/n` x the parameter bytes, the same as DP's all-reduce (frameworks that gather
# again in the backward pass pay `3 (n-1)/n`). TP and SP move activations instead of
# weights, so their traffic grows with batch x sequence, not with the parameter count. On
# a real cluster `tensor` goes on the fastest links (inside a node), `data`/`fsdp` across
# nodes.
#
# From a terminal the same tables come from
# `shardlib inspect --model tiny --mesh fsdp=4,tensor=2 --batch-size 16 --seq-len 128`.
