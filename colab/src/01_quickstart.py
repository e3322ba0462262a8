# %% [markdown]
# # shardlib quickstart: train a GPT on 8 devices
#
# shardlib trains a decoder-only transformer (a small GPT) **sharded over several devices**.
# You describe *what* to parallelize with a **mesh**: named device axes such as `data`,
# `fsdp` or `tensor`, each with a size. shardlib turns that into a sharding for every
# weight and activation, and `jax.jit` inserts the communication between devices.
#
# This notebook runs on any Colab runtime. Without 8 accelerators it *simulates* 8 devices
# on the CPU: the program, the sharding and the communication are the same as on 8 real
# GPUs, only slower. Run the cells top to bottom.

# %% [setup]

# %% [markdown]
# ## Parameters
# The defaults train the default model (`small`, 3.2M parameters) for a few minutes on a CPU
# runtime. CI runs this notebook with the `tiny` model and a handful of steps.

# %% [parameters]
MODEL = "small"  # a preset: tiny (115K params), small (3.2M), medium (25M), gpt2-small (124M)
STEPS = 200  # optimizer steps
BATCH_SIZE = 16  # global batch, in sequences (split over the devices)
SEQ_LEN = 128  # tokens (bytes) per sequence

# %% [markdown]
# ## Train in a few lines
# A `Config` has one section per concern. `MeshConfig(data=8)` is plain **data
# parallelism**: every device holds a full copy of the model and sees 1/8 of each batch; the
# gradients are averaged across devices (an *all-reduce*) before every update. The data is
# the Python standard library's own source code, read as bytes: nothing to download.

# %%
import time

config = shardlib.Config(
    mesh=shardlib.MeshConfig(data=8),
    model=shardlib.get_preset(MODEL),
    train=shardlib.TrainConfig(steps=STEPS, batch_size=BATCH_SIZE, seq_len=SEQ_LEN,
                               eval_every=max(STEPS // 4, 1), log_every=5, sample_tokens=100),
)
started = time.perf_counter()
result = shardlib.train(config, devices=DEVICES)
seconds = time.perf_counter() - started

summary = result.summary
print(f"model {MODEL}: {shardlib.count_params(config.model):,} parameters on {len(DEVICES)} "
      f"devices")
print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} in {summary['steps']} "
      f"steps (eval loss {summary['eval_loss']:.3f})")
print(f"{seconds:.1f} s in all, of which compiling the step {summary['compile_time_s']:.1f} s")
print("sample:", repr(result.sample))

# %% [markdown]
# ## The loss curve
# `result.history` has one row per optimizer step (loss, gradient norm, learning rate,
# throughput) and, on eval steps, the held-out loss.

# %%
import matplotlib.pyplot as plt

steps = [row["step"] for row in result.history]
evals = [(row["step"], row["eval_loss"]) for row in result.history if "eval_loss" in row]
fig, (ax, ax_lr) = plt.subplots(1, 2, figsize=(11, 3.8))
ax.plot(steps, [row["loss"] for row in result.history], label="train loss")
ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
ax.set(title=f"{MODEL} GPT, data=8: cross-entropy", xlabel="optimizer step",
       ylabel="loss (nats per byte)")
ax.legend()
ax_lr.plot(steps, [row["lr"] for row in result.history])
ax_lr.set(title="learning-rate schedule (warm-up, cosine)", xlabel="optimizer step",
          ylabel="learning rate")
fig.tight_layout()
plt.show()

drop = summary["first_loss"] - summary["final_loss"]
print(f"the loss fell by {drop:.3f} nats per byte ({drop / summary['first_loss']:.0%} of its "
      f"start); a uniform guess over 256 bytes is ln 256 = {__import__('math').log(256):.3f}")

# %% [markdown]
# ## Where does each weight live?
# `param_table` lists every parameter with its **logical dims** (the names the model gives
# them), the `PartitionSpec` the mesh turns them into, and the bytes one device holds.
# Under `data=8` every spec is replicated (`None` everywhere), so each device holds the whole
# model.

# %%
setup = result.setup
total = 0
for row in shardlib.param_table(setup):
    total += row.bytes_per_device
    print(f"{row.path:24s} {str(row.shape):16s} {', '.join(row.logical):32s} "
          f"{str(tuple(row.spec)):28s} {row.bytes_per_device:>10,} B")
print(f"parameters per device: {total:,} bytes = {total / 4:,.0f} fp32 values "
      f"(the model has {shardlib.count_params(config.model):,})")

# %% [markdown]
# ## Another strategy is one line
# Change the mesh and nothing else. `fsdp=4, tensor=2` splits every weight over the 8
# devices (FSDP over 4, Megatron tensor parallelism over 2). We only *build* the setup here
# (nothing is allocated) and compare what one device holds.

# %%
import dataclasses

sharded = shardlib.build_setup(
    dataclasses.replace(config, mesh=shardlib.MeshConfig(data=1, fsdp=4, tensor=2)), DEVICES)
held = sum(row.bytes_per_device for row in shardlib.param_table(sharded))
print(f"data=8:          {total:>10,} parameter bytes per device")
print(f"fsdp=4,tensor=2: {held:>10,} parameter bytes per device "
      f"({held / total:.3f} of data=8, i.e. 1/{total / held:.1f})")

# %% [markdown]
# ## Next
# - `02_parallelism_tour`: DP, FSDP, TP, SP and a 3-D mix, with pictures of the layouts.
# - `03_collectives`: the communication primitives underneath.
# - From a terminal: `shardlib train --mesh data=2,fsdp=2,tensor=2 --model tiny --steps 200`.
