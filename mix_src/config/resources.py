"""Resources checked before Ray starts (preflight slot 6): the checkpoint directory, which a 7B actor's checkpoints
(~91 GB each with AdamW state, :func:`mix_src.planner.checkpoint_bytes`) would otherwise fill hours in.

verl 0.9.1's count (verl/trainer/ppo/ray_trainer.py fit, _save_checkpoint; verl/utils/checkpoint/
checkpoint_manager.py ensure_checkpoint_capacity, register_checkpoint): none when ``trainer.save_freq <= 0``; else
one every ``save_freq`` steps and at the last; ``max_actor_ckpt_to_keep = k`` deletes all but the newest ``k - 1``
before a save (``k >= 2``), with ``k = 1`` the old one only after the new one is written (so ``max(k, 2)`` at once),
``null`` keeps all. Checkpoints already in the directory (a resumed run's) are never deleted and already use space,
so free space must hold the new ones. The critic's (GAE only) are not counted; the line says so.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from mix_src.config.data_check import data_files
from mix_src.config.mix_config import MixConfigError
from mix_src.planner import checkpoint_bytes, count_params
from mix_src.planner.check import load_model_config

GB = 10**9


def check_checkpoint_dir(config: DictConfig) -> Optional[dict]:
    """Create ``trainer.default_local_dir``, probe it with a write, print the number and size of the checkpoints
    the run writes, and refuse a directory whose free space cannot hold those it keeps at once. Returns the plan it
    printed (None when the run saves none)."""
    trainer = config.trainer
    save_freq = int(trainer.get("save_freq", -1) or -1)
    if save_freq <= 0:
        return None  # verl saves only when save_freq > 0 (ray_trainer.py fit)
    directory = os.path.abspath(os.path.expanduser(str(trainer.default_local_dir)))
    probe = os.path.join(directory, f".mix_src_write_probe_{uuid.uuid4().hex}")
    try:  # created, and a small file written and deleted there
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"mix_src checkpoint directory probe\n")
        os.remove(probe)
    except OSError as e:
        raise MixConfigError(f"trainer.default_local_dir={directory}: cannot write checkpoints there "
                             f"({type(e).__name__}: {e}). Point trainer.default_local_dir (or OUTPUT_DIR for a recipe) "
                             "at a writable directory") from e
    steps = total_steps(config)
    saves = None if steps is None else steps // save_freq + (1 if steps % save_freq else 0)
    keep = trainer.get("max_actor_ckpt_to_keep")
    kept = kept_at_once(saves, None if keep is None else int(keep))
    hf_config, _ = load_model_config(config.actor_rollout_ref.model.path)  # nothing is downloaded
    contents = OmegaConf.select(config, "actor_rollout_ref.actor.checkpoint.save_contents", default=None)
    with_optimizer = contents is None or "optimizer" in list(contents)
    each = None if hf_config is None else checkpoint_bytes(count_params(hf_config), with_optimizer=with_optimizer)
    free = shutil.disk_usage(directory).free
    plan = {"dir": directory, "steps": steps, "saves": saves, "kept": kept, "bytes_each": each, "free": free}
    print(f"[mix_src] checkpoints: {describe(plan, save_freq, keep, with_optimizer)}")
    if kept is not None and each is not None and kept * each > free:
        raise MixConfigError(f"trainer.default_local_dir={directory}: {free / GB:.1f} GB free, but the run keeps "
                             f"{kept} checkpoint(s) of {each / GB:.1f} GB there at once ({kept * each / GB:.1f} GB). "
                             "Point trainer.default_local_dir (or OUTPUT_DIR for a recipe) at a larger disk, lower "
                             "trainer.max_actor_ckpt_to_keep, or raise trainer.save_freq")
    return plan


def kept_at_once(saves: Optional[int], keep: Optional[int]) -> Optional[int]:
    """Checkpoints of this run on disk at the fullest moment (None: unknown, i.e. unbounded and uncounted)."""
    if keep is not None and keep > 0:
        peak = max(keep, 2)  # k = 1 keeps the old one until the new one is written (register_checkpoint)
        return peak if saves is None else min(peak, saves)
    return saves


def rows_of(paths: Iterable[str]) -> Optional[int]:
    """Rows of these parquet files (or directories of them) together, from the footers without reading them; None
    when there are none or one cannot be read as parquet (the data check names that)."""
    import pyarrow.parquet as pq

    try:
        counts = [pq.ParquetDataset(p).count_rows() if os.path.isdir(p) else pq.ParquetFile(p).metadata.num_rows
                  for p in paths]
    except Exception:  # noqa: BLE001  (format errors are the data check's, slot 4)
        return None
    return sum(counts) if counts else None


def total_steps(config: DictConfig) -> Optional[int]:
    """The run's step count as verl computes it (``_create_dataloader``): ``trainer.total_training_steps`` when
    set, else batches per epoch (rows // train_batch_size, verl drops the last partial batch) x total_epochs,
    counted from the parquet footers. None when the training files cannot be counted here."""
    steps = config.trainer.get("total_training_steps")
    if steps is not None and int(steps) > 0:
        return int(steps)
    rows = rows_of(data_files(config.data.train_files, remote=True))
    return None if rows is None else rows // int(config.data.train_batch_size) * int(config.trainer.total_epochs)


def describe(plan: dict, save_freq: int, keep: Any, with_optimizer: bool) -> str:
    steps = "?" if plan["steps"] is None else plan["steps"]
    saves = "an uncounted number of" if plan["saves"] is None else str(plan["saves"])
    size = "size unknown (model config.json not readable here)" if plan["bytes_each"] is None else \
        f"{plan['bytes_each'] / GB:.2f} GB each ({'model + optimizer' if with_optimizer else 'model only'})"
    kept = "all of them (max_actor_ckpt_to_keep=null)" if keep is None else f"at most {plan['kept']} on disk at once"
    need = "" if plan["kept"] is None or plan["bytes_each"] is None else \
        f", needs {plan['kept'] * plan['bytes_each'] / GB:.1f} GB"
    return (f"{saves} actor checkpoint(s) (save_freq {save_freq} over {steps} steps), {size}, {kept}{need}; "
            f"{plan['free'] / GB:.1f} GB free in {plan['dir']} (critic checkpoints not counted)")
