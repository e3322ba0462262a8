"""One process of a 2-process run of a user's model (the ViT of ``tests/user_models.py``)
through ``shardlib.train``: 2 steps saving a checkpoint, then a resume to step 4; the
losses go to ``OUT/losses-<process>.json``. ``tests/test_multiprocess.py`` starts two.

    python -m tests.multiprocess_user PORT PROCESS_ID OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MESH = "data=2,fsdp=4"  # explicit per-unit FSDP gathers, both batch axes across processes
STEPS = 4


def config(steps: int, checkpoint_dir: str | None = None, resume: bool = False):
    """fp32, batch 8, a constant lr (a 2-step run and its resume to 4 see the same lr)."""
    from shardlib.config import (
        CheckpointConfig,
        Config,
        OptimConfig,
        TrainConfig,
        parse_mesh,
    )

    ckpt = CheckpointConfig(dir=checkpoint_dir, every=2, resume=resume) \
        if checkpoint_dir else CheckpointConfig()
    return Config(mesh=parse_mesh(MESH), checkpoint=ckpt,
                  optim=OptimConfig(lr=1e-3, eps=1e-6, warmup_steps=0, min_lr_ratio=1.0),
                  train=TrainConfig(steps=steps, batch_size=8, eval_every=0, sample_tokens=0,
                                    log_every=1))


def local_rows(k: int) -> dict:
    """This process's half of batch ``k`` (``to_global`` puts it on its 4 devices)."""
    import jax

    from tests.user_models import image_batch

    rows = image_batch(k)
    half = len(rows["label"]) // jax.process_count()
    start = jax.process_index() * half
    return {key: value[start:start + half] for key, value in rows.items()}


def main(port: int, process_id: int, out: Path) -> None:
    from shardlib import distributed

    distributed.initialize(distributed.Plan("explicit", 2, process_id, f"127.0.0.1:{port}"),
                           timeout_s=120, label="multiprocess_user")
    import shardlib
    from tests.user_models import vit

    ckpt = str(out / "ckpt")
    first = shardlib.train(config(2, ckpt), model=vit(), data=local_rows)
    second = shardlib.train(config(STEPS, ckpt, resume=True), model=vit(), data=local_rows)
    losses = [row["loss"] for row in first.history + second.history]
    (out / f"losses-{process_id}.json").write_text(json.dumps(
        {"losses": losses, "resumed_from": second.resumed_from}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
