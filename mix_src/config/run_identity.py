"""Resume only what is yours (preflight slot 6): the run's identity saved with each checkpoint, and checked before Ray.

verl 0.9.1 names a checkpoint folder only by ``trainer.default_local_dir`` (``checkpoints/<project>/<experiment>``) and,
with ``trainer.resume_mode=auto`` (its default), resumes the newest ``global_step_<n>`` it finds there
(``verl/trainer/ppo/ray_trainer.py`` ``_load_checkpoint``; ``find_latest_ckpt_path``), whatever run wrote it. So a
second run with one knob changed silently continued the first run's weights and optimizer under the new setting, and
a re-run of a finished run trained nothing and exited 0.

Each checkpoint now holds ``mix_run.json`` (the trainers' ``_save_checkpoint``, both bases): the run's identity
(``IDENTITY`` below, resolved) and its whole resolved config. Before Ray, :func:`check_resume` finds the folder verl
would resume, prints one line naming it and its step, and refuses when the identity differs (naming each key) or
when the checkpoint's step already reaches the run's step count ("nothing to train"). A checkpoint without
``mix_run.json`` (written before this check) resumes as before, with a warning.

The identity: what makes a checkpoint's weights, optimizer and loop state belong to the run -- the model and
tokenizer, the LoRA shape, the training files, the batch and group sizes, the estimator and its options, the actor's
loss settings (policy loss, aggregation, clips, entropy and KL terms, learning rate, epochs), the sampling
temperature, the trainer base, the seeds, and every ``mix`` setting (prefix, data, loss, rollout policy, plugins,
group filter) but ``NOT_IDENTITY``. Not in it: what only says how long or where a run goes (step counts, epochs,
save/test frequencies, the FLOPs budget, logging, paths of checkpoints and validation files) or how it is laid out
on the hardware (micro-batch sizes, dynamic batching, offloading, parallelism), which may change between a stop and
its resume.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from mix_src.config.mix_config import MixConfigError
from mix_src.config.resources import total_steps

RUN_FILE = "mix_run.json"  # in each global_step_<n> folder, beside verl's actor/ and data.pt
IDENTITY = (
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora", "data.train_files", "data.train_batch_size", "data.seed", "data.prompt_key",
    "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.temperature", "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo", "algorithm.gamma", "algorithm.lam", "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty", "algorithm.filter_groups", "actor_rollout_ref.actor.policy_loss",
    "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.clip_ratio_c", "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.data_loader_seed", "trainer.use_v1", "mix",
)  # fmt: skip
NOT_IDENTITY = ("mix.flops_budget", "mix.flops_count", "mix.planner")
WAYS_OUT = ("trainer.resume_mode=disable (start afresh in the same folder), a new trainer.experiment_name (or "
            "trainer.default_local_dir), or trainer.resume_from_path=<a global_step_N folder of this run> with "
            "trainer.resume_mode=resume_path")


def _flat(prefix: str, value: Any, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def identity(config: DictConfig) -> dict:
    """{dotted key: resolved value} of ``IDENTITY``'s keys (sections flattened to their leaves; a missing key is
    None), ``NOT_IDENTITY`` left out; local paths made absolute."""
    out: dict = {}
    for key in IDENTITY:
        node = OmegaConf.select(config, key, default=None)
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        _flat(key, value, out)
    for key in [k for k in out if k.startswith(NOT_IDENTITY)]:
        del out[key]
    for key in ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path"):
        if isinstance(out.get(key), str) and os.path.exists(out[key]):
            out[key] = os.path.abspath(out[key])
    files = out.get("data.train_files")
    paths = files if isinstance(files, list) else [files]
    out["data.train_files"] = [os.path.abspath(p) if isinstance(p, str) and os.path.exists(p) else p for p in paths]
    return json.loads(json.dumps(out, default=str))  # what a JSON file gives back (tuples -> lists)


def write_run_file(folder: str, config: DictConfig) -> str:
    """``mix_run.json`` in a checkpoint folder: the identity and the whole config (resolved where it resolves)."""
    try:
        whole = OmegaConf.to_container(config, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation only the workers resolve: keep it as written
        whole = OmegaConf.to_container(config, resolve=False)
    path = os.path.join(folder, RUN_FILE)
    with open(path, "w") as f:
        json.dump({"identity": identity(config), "config": whole}, f, indent=1, sort_keys=True, default=str)
    return path


def resumed_folder(config: DictConfig) -> Optional[str]:
    """The ``global_step_<n>`` folder verl's ``_load_checkpoint`` would resume (None: it starts afresh)."""
    trainer = config.trainer
    mode = str(trainer.get("resume_mode", "auto"))
    if mode == "disable":
        return None
    if mode == "resume_path":
        folder = trainer.get("resume_from_path")
        return None if not isinstance(folder, str) else os.path.abspath(folder)
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    root = os.path.abspath(os.path.expanduser(str(trainer.default_local_dir)))
    return find_latest_ckpt_path(root) if os.path.isdir(root) else None


def check_resume(config: DictConfig, count_steps: Callable[[DictConfig], Optional[int]] = total_steps) -> Optional[str]:
    """Before Ray: the folder a run would resume, checked (module docstring). Prints one line when it resumes;
    returns that folder (None: the run starts afresh). The run's steps (``count_steps``: resources.total_steps, which
    may read the training files' footers) are counted only when there is a checkpoint to resume."""
    folder = resumed_folder(config)
    if folder is None:
        return None
    try:
        step = int(folder.rstrip("/").split("global_step_")[-1])
    except ValueError:
        return folder  # verl refuses a resume path without global_step_ itself
    total_steps = count_steps(config)
    of = "" if total_steps is None else f" of {total_steps}"
    print(f"[mix_src] resuming from {folder} (step {step}{of}; trainer.resume_mode={config.trainer.resume_mode})")
    record = os.path.join(folder, RUN_FILE)
    if not os.path.exists(record):
        print(f"[mix_src] WARNING: {folder} has no {RUN_FILE} (written before mix_src saved each run's identity): "
              "resumed as before, without checking that it was written by this run's settings")
    else:
        with open(record) as f:
            saved = json.load(f)["identity"]
        now = identity(config)
        differ = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
        if differ:
            listed = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in
                               ((k, *v) for k, v in list(differ.items())[:12]))  # fmt: skip
            more = f" (and {len(differ) - 12} more)" if len(differ) > 12 else ""
            raise MixConfigError(f"trainer.resume_mode={config.trainer.resume_mode} would resume {folder} (step {step}), "
                                 f"written by a run with other settings: {listed}{more}. Its weights and optimizer "
                                 f"would continue under this run's settings. Use {WAYS_OUT}.")
    if total_steps is not None and step >= total_steps:
        raise MixConfigError(f"nothing to train: trainer.resume_mode={config.trainer.resume_mode} resumes {folder} at "
                             f"step {step}, and this run has {total_steps} steps (trainer.total_training_steps or the "
                             "data's batches x trainer.total_epochs). Raise trainer.total_training_steps to train on, or "
                             f"start another run: {WAYS_OUT}.")
    return folder
