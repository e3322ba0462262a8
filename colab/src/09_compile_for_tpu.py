# %% [markdown]
# # Compile for a TPU pod slice from a CPU runtime
#
# Does my model fit on a `v5litepod-8`, and which mesh should it use there? We can ask the
# real TPU compiler without owning a TPU: with `libtpu` installed, JAX describes a TPU
# slice's chips as compile-only devices (`jax.experimental.topologies`), and shardlib
# builds its mesh over them. `jax.jit(...).lower(...).compile()` then runs the TPU
# compiler: per-chip memory, the TPU's own collectives (asynchronous, overlapped with
# compute), its kernels. Nothing is allocated and nothing runs, so this works on Colab's
# free CPU runtime.
#
# We compile the same model for two meshes of the slice side by side, then ask for a model
# that does not fit and let the compiler say so.

# %% [setup]

# %% [parameters]
MODEL = "small"  # a shardlib preset
TARGET = "v5litepod-8"  # a Cloud TPU accelerator type, or a JAX topology such as "v5e:2x4"
MESHES = ["data=8", "fsdp=8"]  # two ways to lay the model over the slice's 8 chips
BATCH_SIZE = 16
SEQ_LEN = 256

# %%
# The TPU compiler comes with libtpu (`pip install "shardlib[tpu]"`; ~700 MB): on Colab,
# install it at the version matching the runtime's jax.
import importlib.util

if importlib.util.find_spec("libtpu") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    f"jax[tpu]=={jax.__version__}"], check=True)

from shardlib.target import parse_target

target = parse_target(TARGET)
print(target.describe())
print("devices:", target.devices()[:2], "...")

# %% [markdown]
# ## The same model, two meshes, one compiler
#
# `shardlib.inspect.analyze(config, target=...)` builds the mesh over the slice's chips,
# compiles one train step and reads its memory and collectives. `data=8` keeps a whole copy
# of the model and its optimizer state on every chip; `fsdp=8` splits them eight ways and
# gathers one layer's weights at a time.

# %%
import dataclasses

from shardlib import Config, TrainConfig, get_preset
from shardlib.config import parse_mesh
from shardlib.inspect import analyze, per_axis
from shardlib.units import format_bytes

inspections = {}
for mesh in MESHES:
    config = Config(mesh=parse_mesh(mesh), model=get_preset(MODEL),
                    train=TrainConfig(batch_size=BATCH_SIZE, seq_len=SEQ_LEN))
    inspections[mesh] = analyze(config, target=target)

print(f"{'':38}" + "".join(f"{mesh:>18}" for mesh in MESHES))
rows = [("compiled in", lambda i: f"{i.compile_s:.1f} s"),
        ("precision (auto on TPU)", lambda i: i.setup.policy.compute.name),
        ("arguments per chip (state + batch)", lambda i: format_bytes(i.memory.argument_bytes)),
        ("temporaries per chip", lambda i: format_bytes(i.memory.temp_bytes)),
        ("peak per chip", lambda i: format_bytes(i.memory.peak_bytes)),
        ("fits in the chip's HBM", lambda i: str(i.fits)),
        ("bytes sent per chip per step", lambda i: format_bytes(i.comm_bytes)),
        ("asynchronous collectives",
         lambda i: f"{i.kernels.async_collectives} of {i.kernels.collectives}"),
        ("attention kernel", lambda i: i.attention)]
for label, value in rows:
    print(f"{label:38}" + "".join(f"{value(inspections[m]):>18}" for m in MESHES))

# %% [markdown]
# Per mesh axis, the collectives the TPU compiler kept, next to shardlib's theory:

# %%
for mesh, ins in inspections.items():
    for axes, row in per_axis(ins).items():
        kinds = ", ".join(f"{kind} {format_bytes(b)}" for kind, b in
                          row["measured_by_kind"].items())
        print(f"{mesh:8} over {axes:14} {kinds}   (theory {format_bytes(row['theory'])})")

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 2.6))
for y, ins in enumerate(inspections.values()):
    args, temps = ins.memory.argument_bytes / 2**20, ins.memory.temp_bytes / 2**20
    ax.barh(y, args, color="C0", label="arguments (state + batch)" if y == 0 else None)
    ax.barh(y, temps, left=args, color="C1", label="temporaries" if y == 0 else None)
ax.set(yticks=range(len(inspections)), yticklabels=list(inspections),
       xlabel=f"MiB per chip on {target.name}", title=f"{MODEL}: per-chip memory, TPU compiler")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## When it does not fit
#
# The TPU compiler refuses a program that needs more memory than a chip has. shardlib turns
# that into one readable verdict, with the compiler's own figures: here the 7B preset,
# cut to 8 layers, on the same 8 chips.

# %%
from shardlib.errors import OutOfMemoryError
from shardlib.inspect import inspect

big = Config(mesh=parse_mesh("fsdp=8"), model=dataclasses.replace(get_preset("7b"),
             num_layers=8), train=TrainConfig(batch_size=8, seq_len=2048))
try:
    report = inspect(big, target=target)
    print(report["target"])
except OutOfMemoryError as err:  # only when no target is given; with one, inspect reports
    print(err)
