"""Batch arithmetic that verl checks only inside Ray, checked on the driver before Ray starts (the rules in words:
mix_src/config/README.md, "Batch arithmetic"). verl's driver-side ``validate_config`` (verl/utils/config.py 92-127,
``ActorConfig.validate``, verl/workers/config/actor.py 222-241) accepts them; they fail later, after a full rollout:

* mini-batches: the legacy trainer sends ``ppo_mini_batch_size x rollout.n`` rows (verl/trainer/ppo/ray_trainer.py
  1352-1363), the worker asserts ``mini_batch_size % dp == 0`` (verl/workers/engine_workers.py 267-270) and ``batch %
  mini_batch_size == 0`` (verl/utils/tensordict_utils.py 588); V1 pads instead (``_get_required_batch_multiple``,
  verl/trainer/ppo/v1/trainer_base.py 1589-1621);
* micro-batches: 0 is a ``ZeroDivisionError`` (engine_workers.py 287), and ``total_data_size %
  micro_batch_size_per_gpu == 0`` is asserted (verl/workers/engine/utils.py 125);
* steps: no epochs/steps exit 0 having trained nothing (ray_trainer.py 435-440, 1465); too few rows for one batch
  (the loader's ``drop_last=True``, ray_trainer.py 404-411) are the data check's (preflight slot 4), after its drops.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from mix_src.config.mix_config import MixConfigError

A = "actor_rollout_ref.actor"
MICRO_BATCH_KEYS = (f"{A}.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")


def check_batch_arithmetic(config: DictConfig) -> None:
    """Refuse, before Ray, the batch settings verl would fail on (or silently train nothing with) in Ray."""
    _check_positive(config)
    _check_training_length(config)
    _check_mini_batches(config)


def _check_positive(config: DictConfig) -> None:
    rollout, actor = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    if not int(rollout.n) >= 1:
        raise MixConfigError(f"actor_rollout_ref.rollout.n={rollout.n}: each prompt needs at least 1 sample; set it >= 1")
    if not int(config.data.train_batch_size) >= 1:
        raise MixConfigError(f"data.train_batch_size={config.data.train_batch_size}: set it >= 1 (prompts per step)")
    if not int(actor.ppo_mini_batch_size) >= 1:
        raise MixConfigError(f"{A}.ppo_mini_batch_size={actor.ppo_mini_batch_size}: set it >= 1 (prompts per optimiser step)")
    for key in MICRO_BATCH_KEYS:
        value = OmegaConf.select(config, key)
        if value is not None and not int(value) >= 1:
            raise MixConfigError(f"{key}={value}: a micro-batch of {value} rows divides by zero in the worker; "
                                 "set it >= 1 (or null with use_dynamic_bsz=true)")
    if not float(actor.optim.lr) > 0 and not bool(config.trainer.get("val_only", False)):
        raise MixConfigError(f"{A}.optim.lr={actor.optim.lr}: the actor would not learn (0) or would ascend its loss (< 0); "
                             "set it > 0, or trainer.val_only=true to only evaluate")
    if bool((config.get("critic") or {}).get("enable", False)) and not float(config.critic.optim.lr) > 0:
        raise MixConfigError(f"critic.optim.lr={config.critic.optim.lr}: set it > 0")


def _check_training_length(config: DictConfig) -> None:
    trainer = config.trainer
    if bool(trainer.get("val_only", False)):
        return  # only evaluates: no training step is asked for
    if not int(trainer.total_epochs) >= 1:
        raise MixConfigError(f"trainer.total_epochs={trainer.total_epochs}: the run would exit having trained nothing; "
                             "set it >= 1 (or trainer.val_only=true to only evaluate)")
    steps = trainer.get("total_training_steps")
    if steps is not None and not int(steps) >= 1:
        raise MixConfigError(f"trainer.total_training_steps={steps}: the run would exit having trained nothing; "
                             "set it >= 1, or null for total_epochs passes over the data")


def _check_mini_batches(config: DictConfig) -> None:
    actor, n = config.actor_rollout_ref.actor, int(config.actor_rollout_ref.rollout.n)
    batch, mini = int(config.data.train_batch_size), int(actor.ppo_mini_batch_size)
    if bool(config.trainer.get("use_v1", False)) or actor.get("strategy", "fsdp") == "megatron":
        return  # V1 pads the batch to a multiple of the mini-batch; megatron's split is verl's validate_config's
    if batch % mini:
        raise MixConfigError(f"{A}.ppo_mini_batch_size={mini} does not divide data.train_batch_size={batch}: each "
                             f"step's {batch} x rollout.n {n} = {batch * n} rows are cut into mini-batches of {mini} x "
                             f"{n} = {mini * n} rows (verl asserts {batch * n} % {mini * n} == 0 in the worker, after "
                             f"the rollout); use a divisor of {batch}")
    n_gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)  # FSDP's data-parallel ranks:
    dp = max(n_gpus // int(actor.get("ulysses_sequence_parallel_size", 1) or 1), 1)  # GPUs / sequence parallel
    if (mini * n) % dp:
        raise MixConfigError(f"{A}.ppo_mini_batch_size={mini} x actor_rollout_ref.rollout.n={n} = {mini * n} rows per "
                             f"mini-batch must divide over the actor's {dp} data-parallel ranks (trainer.nnodes x "
                             "n_gpus_per_node / ulysses_sequence_parallel_size); change the mini-batch or the GPU "
                             "count")
    micro = actor.get("ppo_micro_batch_size_per_gpu")
    if micro is not None and not bool(actor.get("use_dynamic_bsz", False)) and (mini * n // dp) % int(micro):
        raise MixConfigError(f"{A}.ppo_micro_batch_size_per_gpu={micro} does not divide a rank's mini-batch of "
                             f"{mini * n // dp} rows (ppo_mini_batch_size {mini} x rollout.n {n} / {dp} ranks; verl "
                             f"asserts it in the worker); use a divisor of {mini * n // dp}, or use_dynamic_bsz=true")

