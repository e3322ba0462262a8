"""Checkpoints: bitwise exact resume, restore onto other meshes, crash safety (SIGKILL
mid-save, SIGTERM, damaged files), config mismatch, bad directories, safetensors export."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from shardlib import data as data_lib
from shardlib.checkpoint import Checkpointer, CheckpointWarning
from shardlib.config import CheckpointConfig, Config, MeshConfig, to_dict
from shardlib.errors import CheckpointError, DamagedCheckpointError
from shardlib.export import export_safetensors
from shardlib.mesh import make_mesh
from shardlib.reporting import NullReporter
from shardlib.run.loop import train
from shardlib.train.state import build_setup
from shardlib.train.step import make_train_step
from tests.helpers import relative_error, tiny_config

STEPS = 20
# The CLI spelling of ckpt_config(): same model, optimizer, data and mesh (data=8).
CLI_RUN = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--data",
           "synthetic", "--lr", "1e-3", "--set", "optim.eps=1e-6", "optim.warmup_steps=0",
           "train.eval_every=0", "train.sample_tokens=0"]


def ckpt_config(directory: Path | None, *, every: int = 10, resume: bool = False,
                steps: int = STEPS, **model_changes) -> Config:
    config = tiny_config(MeshConfig(), steps=steps, **model_changes)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, log_every=1))
    if directory is None:
        return config
    return dataclasses.replace(config, checkpoint=CheckpointConfig(
        dir=str(directory), every=every, keep=3, resume=resume))


def host_leaves(state) -> list[np.ndarray]:
    """Host copies (not views: a later donating step may reuse the device buffers)."""
    return [np.array(x, copy=True) for x in jax.tree.leaves(state)]


def assert_bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        if x.tobytes() != y.tobytes():
            diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
            raise AssertionError(f"leaf {i} {x.shape}: {np.count_nonzero(diff)} elements "
                                 f"differ, max |diff| {diff.max():.3g}")


def losses(result) -> list[float]:
    return [row["loss"] for row in result.history]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 20-step run that saves at steps 10 and 20."""
    directory = tmp_path_factory.mktemp("reference") / "ckpt"
    result = train(ckpt_config(directory))
    return result, directory


def copy_of(directory: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(directory, tmp_path / "copy"))


def test_saved_config_is_the_runs_config(reference):
    """The config the run trained with: as given, with start-up's picks (the method
    ``attention.context_parallel=auto`` chose, the layout ``model.scan_layers=auto``
    chose, the attention weights' FSDP dim ``mesh.fsdp_attention=auto`` chose) filled in."""
    result, ref_dir = reference
    saved = Checkpointer(ref_dir).saved_config(20)
    assert saved == json.loads(json.dumps(to_dict(result.setup.config)))
    given = json.loads(json.dumps(to_dict(ckpt_config(ref_dir))))
    assert given["attention"]["context_parallel"] == "auto"
    assert (given["model"]["scan_layers"], saved["model"]["scan_layers"]) == ("auto", True)
    assert (given["mesh"]["fsdp_attention"], saved["mesh"]["fsdp_attention"]) == ("auto",
                                                                                 "embed")
    picks = {("attention", "context_parallel"), ("model", "scan_layers"),
             ("mesh", "fsdp_attention")}

    def unpicked(config: dict) -> dict:
        return {section: {k: v for k, v in fields.items() if (section, k) not in picks}
                if isinstance(fields, dict) else fields for section, fields in config.items()}

    assert unpicked(saved) == unpicked(given)


def test_saves_handed_over_after_the_next_dispatch_hold_their_steps(reference, tmp_path,
                                                                    monkeypatch):
    """With the non-donating step ready from the start, every in-loop save skips the copy
    and starts only once the next step is dispatched; the steps saved are bitwise the
    reference run's, and so are the losses."""
    from shardlib.run import loop

    def ready_at_once(setup, state, batch, checkpointer, exits):
        step_fn = make_train_step(setup, donate=False).lower(state, batch).compile()
        return lambda: step_fn

    calls, save = [], Checkpointer.save

    def recording_save(self, step, state, config, **kwargs):
        calls.append((step, kwargs.get("copy", True)))
        return save(self, step, state, config, **kwargs)

    monkeypatch.setattr(loop, "_keeping_step", ready_at_once)
    monkeypatch.setattr(Checkpointer, "save", recording_save)
    result = train(ckpt_config(tmp_path / "ckpt", every=5))
    ref_result, ref_dir = reference
    assert losses(result) == losses(ref_result)
    assert [(5, False), (10, False), (15, False), (20, False)] == calls[:4]
    setup = build_setup(ckpt_config(None), jax.devices()[:8])
    for step in (10, 20):
        assert_bitwise(host_leaves(Checkpointer(tmp_path / "ckpt").restore(setup, step)),
                       host_leaves(Checkpointer(ref_dir).restore(setup, step)))


# -- restore onto another mesh --------------------------------------------------------


def run_on(setup, step_fn, state, start: int, count: int):
    """``count`` train steps from batch ``start``: (state, losses)."""
    tc = setup.config.train
    batches, _ = data_lib.make_batches(tc.data, tc.batch_size, tc.seq_len, tc.seed)
    out = []
    for i in range(start, start + count):
        state, metrics = step_fn(state, data_lib.global_batch(batches, i, setup.batch_sharding))
        out.append(float(metrics["loss"]))
    return state, out


HOPS = [  # the reference trained on data=8; each hop restores the previous hop's checkpoint
    (MeshConfig(data=1, fsdp=4, tensor=2), 8, 2),
    (MeshConfig(data=1), 1, 2),
    (MeshConfig(data=1, fsdp=8), 8, 6),
]


def test_restore_onto_other_meshes_continues_like_the_original(reference, tmp_path):
    """data=8 -> fsdp=4,tensor=2 -> 1 device -> fsdp=8: each restore is bitwise the saved
    state, placed in the new shardings; continued losses match the data=8 run's. On each
    mesh an async save is followed at once by donating steps: it still holds its step."""
    full, directory = reference
    saved, step, continued = None, 10, []
    for hop, (mesh, num_devices, count) in enumerate(HOPS):
        setup = build_setup(dataclasses.replace(ckpt_config(None), mesh=mesh),
                            jax.devices()[:num_devices])
        state = Checkpointer(directory).restore(setup, step)
        if saved is not None:
            assert_bitwise(host_leaves(state), saved)  # params, opt state, step, rng, ...
        for array, sharding in zip(jax.tree.leaves(state),
                                   jax.tree.leaves(setup.state_shardings), strict=True):
            assert array.sharding.is_equivalent_to(sharding, array.ndim), (hop, sharding)
        step_fn = make_train_step(setup)
        state, first_loss = run_on(setup, step_fn, state, step, 1)
        snapshot, side = host_leaves(state), Checkpointer(tmp_path / f"async{hop}")
        side.save(step + 1, state, setup.config)  # returns at once; the next steps donate
        state, rest = run_on(setup, step_fn, state, step + 1, count - 1)
        side.wait()
        assert_bitwise(host_leaves(side.restore(setup, step + 1)), snapshot)
        continued += first_loss + rest
        step, directory = step + count, tmp_path / f"hop{hop}"
        saved = host_leaves(state)
        Checkpointer(directory).save(step, state, setup.config, wait=True)
    assert step == STEPS
    np.testing.assert_allclose(continued, losses(full)[10:], rtol=1e-5)
    for (path, value), (_, want) in zip(nnx.to_flat_state(state.params),
                                        nnx.to_flat_state(full.state.params), strict=True):
        error = relative_error(np.asarray(value.get_value()), np.asarray(want.get_value()))
        assert error < 1e-5, path


# -- crash safety ---------------------------------------------------------------------


def largest_data_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["delete", "truncate", "delete-unlisted"])
def test_damaged_checkpoint_is_named_and_resume_falls_back(damage, reference, tmp_path):
    directory = copy_of(reference[1], tmp_path)
    victim = largest_data_file(directory / "20")
    if damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    if damage == "delete-unlisted":  # no file list: orbax's read error is wrapped
        (directory / "20" / "shardlib_files.json").unlink()
    setup = build_setup(ckpt_config(directory))
    checkpointer = Checkpointer(directory)
    with pytest.raises(DamagedCheckpointError, match="step 20") as err:
        checkpointer.restore(setup, 20)
    if damage != "delete-unlisted":
        assert str(victim.relative_to(directory / "20")) in str(err.value)
        assert ("expected" if damage == "truncate" else "missing") in str(err.value)
    with pytest.warns(CheckpointWarning, match="step 20"):
        state = checkpointer.restore_latest(setup)
    assert int(state.step) == 10


def test_other_model_config_names_parameter_and_shapes(reference):
    setup = build_setup(ckpt_config(None, d_ff=128))
    with pytest.raises(CheckpointError) as err:
        Checkpointer(reference[1]).restore_latest(setup)
    message = str(err.value)
    assert not isinstance(err.value, DamagedCheckpointError)
    assert "params.blocks.mlp.w_in_df" in message
    assert "(2, 64, 256)" in message and "(2, 64, 128)" in message
    assert "model.d_ff=256" in message


def test_any_pytree_saves_and_restores_onto_another_layout(tmp_path):
    """Issue 31, part 7: checkpoints know nothing of the trainer (as Levanter's): a plain dict
    of sharded arrays saves without a config and restores into abstract arrays laid out on
    another mesh, each read straight into its new sharding."""
    saved_on, read_on = make_mesh({"data": 8}), make_mesh({"fsdp": 2, "tensor": 4})
    host = {"w_df": np.arange(16 * 8, dtype=np.float32).reshape(16, 8),
            "step": np.asarray(7, np.int32)}
    tree = {"w_df": jax.device_put(host["w_df"], NamedSharding(saved_on, P("data", None))),
            "step": jax.device_put(host["step"], NamedSharding(saved_on, P()))}
    Checkpointer(tmp_path / "tree", keep=1).save(7, tree, wait=True)
    target = {"w_df": jax.ShapeDtypeStruct((16, 8), jnp.float32,
                                           sharding=NamedSharding(read_on, P("fsdp", "tensor"))),
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(read_on, P()))}
    checkpointer = Checkpointer(tmp_path / "tree", read_only=True)
    for restored in (checkpointer.restore(target), checkpointer.restore_latest(target)):
        assert set(restored) == set(host)
        for key, value in host.items():
            assert restored[key].sharding == target[key].sharding, key
            assert_bitwise([np.asarray(restored[key])], [value])


def unwritable_directory(tmp_path: Path) -> Path:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    for candidate in (locked, Path("/sys")):  # root ignores modes; sysfs refuses root too
        try:
            tempfile.NamedTemporaryFile(dir=candidate).close()
        except OSError:
            return candidate
    pytest.skip("no unwritable directory available")


@pytest.mark.parametrize("case, needle", [
    ("missing-parent", "parent directory"),
    ("a-file", "not a directory"),
    ("unwritable", "not writable"),
])
def test_bad_directory_fails_before_training(case, needle, tmp_path):
    (tmp_path / "file").write_text("x")
    path = {"missing-parent": tmp_path / "no" / "such", "a-file": tmp_path / "file",
            "unwritable": None}[case] or unwritable_directory(tmp_path)

    class Started(NullReporter):
        def on_start(self, setup, info):
            raise AssertionError("training started")

    with pytest.raises(CheckpointError, match=needle):
        train(ckpt_config(path), reporter=Started())


# -- subprocesses: SIGKILL mid-save, SIGTERM, CLI export ----------------------------------

STALL_SAVE = """
import sys, time
from shardlib import checkpoint
write = checkpoint.Checkpointer._write_file_list
def stall(self):  # runs after the files are written, before the step folder is renamed
    if self._saving == 4:
        print("SAVING 4", flush=True)
        time.sleep(600)
    write(self)
checkpoint.Checkpointer._write_file_list = stall
from shardlib.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start(args: list[str], code: str | None = None) -> subprocess.Popen:
    command = [sys.executable, "-c", code, *args] if code else [
        sys.executable, "-m", "shardlib", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test, never blocks it
    watchdog.daemon = True
    watchdog.start()
    return proc


def wait_for_line(proc: subprocess.Popen, prefix: str, accept=lambda line: True) -> str:
    for line in proc.stdout:
        if line.startswith(prefix) and accept(line):
            return line
    raise AssertionError(f"no {prefix!r} line; stderr:\n{proc.stderr.read()}")


def test_sigkill_mid_save_then_resume_skips_the_half_written_step(reference, tmp_path):
    directory = tmp_path / "ckpt"
    proc = start([*CLI_RUN, "--steps", str(STEPS), "--checkpoint-dir", str(directory),
                  "--checkpoint-every", "2"], code=STALL_SAVE)
    wait_for_line(proc, "SAVING 4")
    proc.kill()
    proc.wait()
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "2", "4.orbax-checkpoint-tmp"]
    config = ckpt_config(directory, every=2, resume=True)
    with pytest.warns(CheckpointWarning) as caught:
        resumed = train(config)
    lines = [str(w.message) for w in caught]
    assert any(re.search("step 4 .* never finished", line) for line in lines), lines
    assert any(f"taking over the lock of pid {proc.pid}" in line for line in lines), lines
    assert resumed.resumed_from == 2
    assert losses(resumed) == losses(reference[0])[2:]  # crash recovery is exact too
    assert_bitwise(host_leaves(resumed.state), host_leaves(reference[0].state))
    assert Checkpointer(directory).steps() == [16, 18, 20]


def test_sigterm_mid_run_saves_exits_0_and_resume_is_bitwise_exact(reference, tmp_path):
    """20 steps uninterrupted == about 10 steps, SIGTERM, then --resume for the rest."""
    full, _ = reference
    directory = tmp_path / "ckpt"
    proc = start([*CLI_RUN, "--steps", str(STEPS), "--checkpoint-dir", str(directory),
                  "--checkpoint-every", "4", "--log-every", "1"])
    wait_for_line(proc, "step ", lambda line: line.split()[1] == f"10/{STEPS}")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = Checkpointer(directory).latest_step()
    assert 10 <= stopped < STEPS, "the signal should stop the run in the middle"
    assert f"stopped by SIGTERM; checkpoint step {stopped} saved" in err and "--resume" in err
    assert not [p for p in directory.iterdir() if "tmp" in p.name]

    resumed = train(ckpt_config(directory, every=4, resume=True))
    assert resumed.resumed_from == stopped and resumed.stopped_by is None
    assert [row["step"] for row in resumed.history] == list(range(stopped + 1, STEPS + 1))
    assert losses(resumed) == losses(full)[stopped:]  # exact float equality
    assert_bitwise(host_leaves(resumed.state), host_leaves(full.state))  # every field
    assert Checkpointer(directory).steps()[-1] == STEPS
    assert len(Checkpointer(directory).steps()) == 3  # keep=3


def test_export_safetensors_equals_params(reference, tmp_path):
    full, ref_dir = reference
    done = export_safetensors(ref_dir, tmp_path / "model.safetensors")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    params = {".".join(map(str, p)): np.asarray(v.get_value())
              for p, v in nnx.to_flat_state(full.state.params)}
    assert done.step == 20 and sorted(tensors) == sorted(params)
    assert_bitwise([tensors[k] for k in sorted(params)], [params[k] for k in sorted(params)])
    assert done.params == sum(v.size for v in params.values())

    out = tmp_path / "step10.safetensors"  # the CLI, an older step
    run = subprocess.run([sys.executable, "-m", "shardlib", "export", "--checkpoint-dir",
                          str(ref_dir), "--out", str(out), "--step", "10"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "exported step 10" in run.stdout
    older = load_file(str(out))
    assert sorted(older) == sorted(params)
    assert not np.array_equal(older["embed.w_vd"], tensors["embed.w_vd"])
