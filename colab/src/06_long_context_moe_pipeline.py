# %% [markdown]
# # Long context, mixture of experts and pipelines
#
# Three strategies where XLA cannot find the communication on its own, so shardlib writes
# it by hand inside `jax.shard_map`:
# 1. **Context parallelism** (`sequence` axis): a sequence too long for one device is split
#    over devices; *ring attention* passes key/value blocks around a ring of devices.
# 2. **Expert parallelism** (`expert` axis): a mixture-of-experts layer sends each token to
#    the device that holds its expert with an *all-to-all*, and back.
# 3. **Pipeline parallelism** (`pipeline` axis): the layers are cut into stages on
#    different devices and microbatches stream through them (GPipe, 1F1B).

# %% [setup]

# %% [parameters]
SEQ_LEN = 1024  # tokens per sequence for the attention experiments
STEPS = 30  # training steps for the MoE and pipeline runs
HEADS, HEAD_DIM = 8, 32

# %%
import dataclasses

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.analysis import parse_collectives
from shardlib.inspect import analyze
from shardlib.parallel import context

# %% [markdown]
# ## 1. Ring attention
# With the sequence split over `n = 8` devices, each device holds `T/n` queries, keys and
# values. Attention needs every query to see every (earlier) key. Ring attention keeps the
# queries in place and passes K/V blocks to the next device `n-1` times, merging each block
# into a running softmax (log-sum-exp), so no device ever holds the whole `T x T` score
# matrix. The alternatives: **all-gather** K/V (simple, every device holds all K/V) and
# **Ulysses** (all-to-all from a sequence split to a head split and back).

# %%
cp_config = shardlib.Config(mesh=shardlib.MeshConfig(data=1, sequence=8),
                            model=dataclasses.replace(shardlib.get_preset("tiny"),
                                                      num_heads=HEADS, max_seq_len=SEQ_LEN),
                            train=shardlib.TrainConfig(batch_size=1, seq_len=SEQ_LEN))
cp = shardlib.build_setup(cp_config, DEVICES)
n = cp.sizes["sequence"]
keys = jax.random.split(jax.random.key(0), 3)
shape = (1, SEQ_LEN, HEADS, HEAD_DIM)  # (B, T, H, K)
qkv_sharding = NamedSharding(cp.mesh, P(None, "sequence"))
q, k, v = (jax.device_put(jax.random.normal(key, shape), qkv_sharding) for key in keys)
reference = context.reference_attention(q, k, v, causal=True)  # plain attention


def attention_grad(method):
    """Forward + backward of causal attention with ``method``, compiled for the mesh."""
    def loss(q, k, v):
        out = shardlib.sequence_attention(q, k, v, method=method, mesh=cp.mesh, rules=cp.rules)
        return jnp.sum(out * jnp.cos(out)), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


block_bytes = SEQ_LEN // n * HEADS * HEAD_DIM * 4  # one device's q block, fp32
cp_rows = {}
for method in ("ring", "ulysses", "allgather"):
    fn = attention_grad(method)
    compiled = fn.lower(q, k, v).compile()
    grads, out = fn(q, k, v)
    colls = parse_collectives(compiled.as_text(), cp.mesh)
    sent = sum(c.total_bytes_per_device for c in colls)
    theory = float(context.attention_comm_blocks(method, n)) * block_bytes
    kinds = {}
    for c in colls:
        kinds[c.kind] = kinds.get(c.kind, 0) + c.count
    err = float(jnp.max(jnp.abs(out - reference)))
    temp = compiled.memory_analysis().temp_size_in_bytes
    cp_rows[method] = (sent, theory, temp)
    print(f"{method:9s} max |out - reference| = {err:.1e}; collectives {kinds}; sends "
          f"{sent:,} B/device (theory {theory:,.0f}); temporaries {temp:,} B/device")

one = jax.jit(lambda q, k, v: jax.grad(lambda *a: jnp.sum(
    context.reference_attention(*a, causal=True)), argnums=(0, 1, 2))(q, k, v))
host = [jax.device_put(a, DEVICES[0]) for a in (q, k, v)]
single_temp = one.lower(*host).compile().memory_analysis().temp_size_in_bytes
print(f"one device, whole sequence: temporaries {single_temp:,} B "
      f"(ring needs {cp_rows['ring'][2] / single_temp:.3f} of that per device)")

# %% [markdown]
# ### Zig-zag: balancing causal work
# With causal attention, the device holding the *last* part of the sequence does the most
# work (its queries see every key) and the first does the least. shardlib's ring cuts the
# sequence into `2n` chunks and gives device `j` chunks `j` and `2n-1-j`. We run
# `context.to_zigzag` on the token positions to see where they go, then count the
# (query, key) pairs each device computes under the causal mask.

# %%
positions = jax.device_put(jnp.arange(SEQ_LEN, dtype=jnp.int32)[None], NamedSharding(
    cp.mesh, P(None, "sequence")))
zig = jax.jit(jax.shard_map(lambda x: context.to_zigzag(x, n), mesh=cp.mesh,
                            in_specs=P(None, "sequence"), out_specs=P(None, "sequence")))
held = np.asarray(zig(positions)).reshape(n, -1)  # row j: positions device j holds
chunk = SEQ_LEN // (2 * n)
print("chunks held (zig-zag):", [sorted({int(p) // chunk for p in row}) for row in held])
contiguous = np.arange(SEQ_LEN).reshape(n, -1)
work = {name: [int(sum(p + 1 for p in row)) for row in layout]  # keys each query sees
        for name, layout in (("contiguous", contiguous), ("zig-zag", held))}
for name, w in work.items():
    print(f"{name:10s}: busiest / average device work = {max(w) / np.mean(w):.3f}")

fig, (ax_work, ax_ring) = plt.subplots(1, 2, figsize=(12, 3.8))
x = np.arange(n)
ax_work.bar(x - 0.2, work["contiguous"], 0.4, label="contiguous split")
ax_work.bar(x + 0.2, work["zig-zag"], 0.4, label="zig-zag split")
ax_work.set(title=f"causal attention work per device, T = {SEQ_LEN}", xlabel="device",
            ylabel="(query, key) pairs computed")
ax_work.legend()
ring = np.array([[(j - s) % n for j in range(n)] for s in range(n)])
ax_ring.imshow(ring, cmap="tab10", vmin=0, vmax=9, aspect="auto")
for (s, j), src in np.ndenumerate(ring):
    ax_ring.text(j, s, str(src), ha="center", va="center", color="white")
ax_ring.set(title="ring timeline: whose K/V block each device attends",
            xlabel="device", ylabel="ring step (one K/V send per step)")
fig.tight_layout()
plt.show()

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
names = list(cp_rows)
ax.bar(np.arange(3) - 0.2, [cp_rows[m][0] / 2**10 for m in names], 0.4,
       label="sent per device (compiled)")
ax.bar(np.arange(3) + 0.2, [cp_rows[m][2] / 2**10 for m in names], 0.4,
       label="temporaries per device")
ax.axhline(single_temp / 2**10, color="gray", ls="--", label="temporaries, one device")
ax.set(xticks=range(3), xticklabels=names, ylabel="KiB",
       title=f"attention forward + backward, T = {SEQ_LEN} over {n} devices")
ax.legend()
plt.show()

# %% [markdown]
# In a full model the method is a config field:
# `--mesh data=2,sequence=4 --set attention.context_parallel=ring`.

# %% [markdown]
# ## 2. Mixture of experts with expert parallelism
# `moe-tiny` has 8 experts (top-2 routing) in every second layer. With `expert=4` each
# device holds 2 experts; each device sorts its own (token, choice) pairs by expert
# (dropless routing, the default: no token is dropped), and an all-to-all over `expert`
# sends each expert's rows to the device that holds it (and another brings the results
# back): 5 all-to-alls per MoE layer (rows and their expert ids there, outputs back, and
# the rows' two in backward). `model.moe_dispatch=capacity` gives GShard's capacity
# buffers instead (4 all-to-alls, overflow dropped).

# %%
moe_config = shardlib.Config(
    mesh=shardlib.MeshConfig(data=2, expert=4), model=shardlib.get_preset("moe-tiny"),
    train=shardlib.TrainConfig(steps=STEPS, batch_size=16, seq_len=64, eval_every=0,
                               log_every=1, sample_tokens=0))
moe_run = shardlib.train(moe_config, devices=DEVICES)
ins = analyze(moe_config, DEVICES)
a2a = [c for c in ins.collectives if c.kind == "all-to-all"]
theory = sum(t.bytes_per_device for t in ins.terms if t.kind == "all-to-all")
measured = sum(c.total_bytes_per_device for c in a2a)
print(f"all-to-alls over {sorted({a for c in a2a for a in c.axes})}: "
      f"{sum(c.count for c in a2a)} per step, {measured:,} B per device "
      f"(theory {theory:,}, ratio {measured / theory:.3f})")
print(f"parameters per device: {ins.memory.params_bytes:,} B; "
      f"loss {moe_run.summary['first_loss']:.3f} -> {moe_run.summary['final_loss']:.3f}")

hist = moe_run.history
fig, (ax, ax_moe) = plt.subplots(1, 2, figsize=(12, 3.8))
ax.plot([r["step"] for r in hist], [r["loss"] for r in hist])
ax.set(title="moe-tiny on expert=4, data=2: cross-entropy", xlabel="optimizer step",
       ylabel="loss (nats per byte)")
for key, label in (("moe_dropped_frac", "tokens dropped (capacity full)"),
                   ("moe_aux_loss", "load-balancing loss (1.0 = balanced)")):
    if key in hist[0]:
        ax_moe.plot([r["step"] for r in hist], [r[key] for r in hist], label=label)
ax_moe.set(title="routing statistics", xlabel="optimizer step", ylabel="fraction / loss value")
ax_moe.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Pipeline parallelism: GPipe and 1F1B
# The layers are split into `P` stages on `P` devices; the batch is cut into `M`
# microbatches that flow through the stages. A stage waits at the start (nothing has
# reached it yet) and at the end (nothing is left): the **bubble**, a fraction
# `(P-1)/(M+P-1)` of the time under GPipe and 1F1B alike. 1F1B runs each backward as soon
# as it can, so a stage keeps at most `P` microbatches' activations instead of `M`.
#
# This part needs `shardlib.train.pipeline`, which is new; the cell checks for it and
# says so if this version of shardlib does not have it.

# %%
try:
    from shardlib.train import pipeline, pipeline_schedule  # noqa: F401
    HAVE_PIPELINE = True
except ImportError as err:
    HAVE_PIPELINE = False
    print(f"SKIPPED: this shardlib has no pipeline parallelism ({err}); the rest of this "
          "notebook needs shardlib.train.pipeline")

# %%
if HAVE_PIPELINE:
    STAGES, MICRO = 4, 8
    fig, axes = plt.subplots(2, 1, figsize=(12, 5))
    for ax, name in zip(axes, ("gpipe", "1f1b"), strict=True):
        sched = pipeline_schedule.build(name, STAGES, MICRO)
        print(sched.timeline(), "\n")
        ops, mbs = sched.op_ts.T, sched.mb_ts.T  # (stages, ticks)
        ax.imshow(ops, cmap="Pastel1_r", aspect="auto", vmin=0, vmax=2)
        for (stage, tick), op in np.ndenumerate(ops):
            if op != pipeline_schedule.IDLE:
                label = f"{'F' if op == pipeline_schedule.FWD else 'B'}{mbs[stage, tick]}"
                ax.text(tick, stage, label, ha="center", va="center", fontsize=7)
        ax.set(title=f"{name}: {STAGES} stages, {MICRO} microbatches: bubble "
               f"{sched.bubble_fraction():.3f} of stage time (theory "
               f"{sched.theory_bubble():.3f}); stage inputs kept <= {sched.act_slots}",
               xlabel="tick (one microbatch forward F or backward B per stage)",
               ylabel="pipeline stage", yticks=range(STAGES))
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ### Pipeline training
# The same 4-layer model trained with its layers on 4 pipeline stages (`pipeline=4`, one
# layer each) times `data=2`, under 1F1B, against plain data parallelism over the 8
# devices: the losses agree, because a pipeline only changes *where* each layer runs. From
# a terminal: `shardlib train --mesh pipeline=4,data=2 --set pipeline.schedule=1f1b
# pipeline.microbatches=8`.

# %%
if HAVE_PIPELINE:
    from shardlib.config import PipelineConfig

    pp_base = shardlib.Config(
        model=dataclasses.replace(shardlib.get_preset("tiny"), num_layers=STAGES),
        train=shardlib.TrainConfig(steps=STEPS, batch_size=16, seq_len=64, eval_every=0,
                                   log_every=1, sample_tokens=0))
    pipelined = dataclasses.replace(
        pp_base, mesh=shardlib.MeshConfig(data=2, pipeline=STAGES),
        pipeline=PipelineConfig(schedule="1f1b", microbatches=MICRO))
    flat = shardlib.train(dataclasses.replace(pp_base, mesh=shardlib.MeshConfig(data=8)),
                          devices=DEVICES)
    piped = shardlib.train(pipelined, devices=DEVICES)
    diff = max(abs(a["loss"] - b["loss"]) / a["loss"]
               for a, b in zip(flat.history, piped.history, strict=True))
    print(f"{STEPS} steps, pipeline=4 x data=2 (1F1B) vs data=8: largest relative loss "
          f"difference {diff:.1e}")
    fig, (ax, ax_mem) = plt.subplots(1, 2, figsize=(12, 3.8))
    ax.plot([r["step"] for r in flat.history], [r["loss"] for r in flat.history], lw=3,
            alpha=0.4, label="data=8")
    ax.plot([r["step"] for r in piped.history], [r["loss"] for r in piped.history], "x",
            label="pipeline=4, data=2 (1F1B)")
    ax.set(title="4-layer model: loss with and without a pipeline", xlabel="optimizer step",
           ylabel="loss (nats per byte)")
    ax.legend()
    slots = {name: pipeline_schedule.build(name, STAGES, MICRO).act_slots
             for name in ("gpipe", "1f1b")}
    ax_mem.bar(list(slots), list(slots.values()))
    ax_mem.set(title=f"stage inputs kept per stage, {STAGES} stages x {MICRO} microbatches",
               ylabel="microbatch inputs held (count)", xlabel="schedule")
    fig.tight_layout()
    plt.show()
