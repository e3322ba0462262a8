# %% [markdown]
# # The planner: let shardlib pick the strategy
#
# Which mesh should a model use on N devices? The planner enumerates every way to factor
# the devices over the mesh axes (`data`, `fsdp`, `tensor`, `sequence`, ...), times every
# remat policy and microbatch count; drops what does not divide (saying why); prices the
# rest with the communication and memory formulas and a device profile (peak FLOP/s,
# link bandwidth, memory); compiles the most promising candidates ahead of time for exact
# memory and collective bytes; and ranks what fits by predicted step time.
#
# We plan twice: for this runtime (8 devices) and for a cluster we do not have (256 H100
# GPUs), where every figure is analytic.

# %% [setup]

# %% [parameters]
MODEL = "small"  # the model to plan for on this runtime
BATCH_SIZE = 16
SEQ_LEN = 128
COMPILE_TOP = 4  # candidates compiled ahead of time for exact figures (0: analytic only)

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from rich.console import Console

from shardlib.planner import get_profile
from shardlib.planner.report import render, train_command
from shardlib.planner.resolve import profile_for

console = Console(width=150)


def chart(plan, top, title):
    """Predicted step time (compute vs exposed communication) and memory of the best
    ``top`` candidates, against the memory budget."""
    rows = plan.ranked[:top]
    labels = [f"{s.candidate.mesh_text}\nremat={s.candidate.remat}, mb={s.candidate.microbatches}"
              for s in rows]
    compute = np.array([s.estimate.compute_s for s in rows]) * 1e3
    total = np.array([s.estimate.step_s for s in rows]) * 1e3
    memory = np.array([s.figures.memory_bytes for s in rows]) / 2**20
    y = np.arange(len(rows))[::-1]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 0.5 * len(rows) + 1.6), sharey=True)
    ax_t.barh(y, compute, label="compute")
    ax_t.barh(y, total - compute, left=compute, label="communication and overhead not hidden")
    ax_t.set(yticks=y, yticklabels=labels, xlabel="predicted step time (ms)",
             title=f"{title}: predicted step time")
    ax_t.legend(fontsize=8)
    ax_m.barh(y, memory, color=["C2" if s.compiled else "C7" for s in rows])
    ax_m.axvline(plan.budget_bytes / 2**20, color="C3", ls="--", label="memory budget")
    ax_m.set(xscale="log", xlabel="memory per device (MiB, log scale); green: compiled, "
             "grey: analytic", title="memory per device")
    ax_m.legend(fontsize=8)
    for label in ax_t.get_yticklabels():
        label.set_fontsize(7)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## On this runtime
# The device profile of a CPU runtime is *measured* (a matmul for FLOP/s, an all-reduce for
# the link) and cached; GPU and TPU runtimes use the published figures of their chip.

# %%
config = shardlib.Config(model=shardlib.get_preset(MODEL),
                         train=shardlib.TrainConfig(batch_size=BATCH_SIZE, seq_len=SEQ_LEN))
profile = profile_for(DEVICES[0])
print(f"profile {profile.name}: {profile.source}; peak {max(profile.peak_flops.values()):.3g} "
      f"FLOP/s, {profile.memory_bytes / 2**30:.1f} GiB per device")
here = shardlib.plan(config, len(DEVICES), profile, devices=DEVICES, compile_top=COMPILE_TOP)
render(here, top=8, console=console)
chart(here, 8, f"{MODEL} on {len(DEVICES)} x {profile.name}")

# %% [markdown]
# How good is the prediction? We run a few steps of the pick and compare the measured
# step time with the prediction. (Simulated CPU devices share the host's cores, and a
# shared Colab CPU is noisy: expect the right order of magnitude, not a match.)

# %%
best = here.best
print("pick:", train_command(here, best))
picked = best.candidate.apply(config)  # the candidate's mesh, remat and microbatches
setup = shardlib.build_setup(picked, DEVICES)
state = shardlib.init_state(setup, seed=0)
train_step = shardlib.make_train_step(setup)
tokens = jax.random.randint(jax.random.key(0), (BATCH_SIZE, SEQ_LEN), 0, 256)
batch = jax.device_put({"inputs": tokens, "targets": tokens}, setup.batch_sharding)
state, metrics = train_step(state, batch)  # compile and warm up
jax.block_until_ready(state)
times = []
for _ in range(3):
    started = time.perf_counter()
    state, metrics = train_step(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - started)
measured = float(np.median(times))
print(f"predicted {best.estimate.step_s * 1e3:.1f} ms per step, measured {measured * 1e3:.1f} ms"
      f" (median of 3; measured / predicted = {measured / best.estimate.step_s:.2f})")

# %% [markdown]
# ## On 256 H100 GPUs
# A 7-billion-parameter model (Llama-2-7B's shape), bf16, a global batch of 256 sequences
# of 4096 tokens. This process has 8 devices, not 256, so nothing is compiled: the figures
# come from the formulas and the H100 profile printed below (NVLink inside a node,
# InfiniBand between nodes). The same from a terminal:
#
# `shardlib plan --model 7b --devices 256 --device-profile h100 --precision bf16 --batch-size 256 --seq-len 4096`

# %%
from shardlib.config import PrecisionConfig

big = shardlib.Config(model=shardlib.get_preset("7b"),
                      train=shardlib.TrainConfig(batch_size=256, seq_len=4096),
                      precision=PrecisionConfig(policy="bf16"))
h100 = get_profile("h100")
print(f"h100 profile: {h100.flops('bfloat16') / 1e12:.0f} TFLOP/s bf16 peak, "
      f"{h100.memory_bytes / 2**30:.0f} GiB, {h100.node_size} GPUs per node; links "
      f"{h100.intra.bandwidth / 1e9:.0f} GB/s inside a node, {h100.inter.bandwidth / 1e9:.0f} "
      f"GB/s between nodes; {h100.compute_efficiency:.0%} of peak assumed sustained")
cluster = shardlib.plan(big, 256, h100)
render(cluster, top=8, console=console)
chart(cluster, 8, "7b on 256 x H100")

# %%
pick = cluster.best
counts = {"fits": len(cluster.ranked), "over the memory budget": len(cluster.over_budget),
          "rejected (does not divide)": len(cluster.rejected)}
print(f"{shardlib.count_params(big.model):,} parameters; candidates: {counts}")
print(f"pick {pick.candidate.mesh_text}, remat {pick.candidate.remat}, "
      f"{pick.candidate.microbatches} microbatch(es): predicted {pick.estimate.step_s:.3f} s per "
      f"step, {pick.figures.memory_bytes / 2**30:.1f} GiB per device")
tokens = big.train.batch_size * big.train.seq_len
flops = 6 * shardlib.count_params(big.model) * tokens
print(f"that is {tokens / pick.estimate.step_s:,.0f} tokens/s, or "
      f"{flops / pick.estimate.step_s / (256 * h100.flops('bfloat16')):.0%} of the cluster's "
      "peak bf16 FLOP/s on the 6 Psi FLOPs per token (no attention term)")
by_tensor = {}
for s in cluster.ranked:
    t = s.candidate.sizes.get("tensor", 1)
    by_tensor[t] = min(by_tensor.get(t, np.inf), s.estimate.step_s)
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(list(by_tensor), list(by_tensor.values()), "o-")
ax.set(xscale="log", xticks=list(by_tensor), xticklabels=list(by_tensor),
       xlabel="tensor-parallel degree", ylabel="best predicted step time (s)",
       title="7b on 256 x H100: best plan per tensor degree")
plt.show()
