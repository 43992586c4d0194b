"""Entry point: ``python -m mix_src.main_mix_ppo key=value ...`` (Hydra; config ``mix_src/config/mix_ppo_trainer.yaml``,
composed through the primary ``mix_ppo.yaml``; a recipe passes ``--config-path recipes/NAME --config-name config``).

On the driver, before Ray starts: validate the ``mix:`` section and its ties to verl's keys, refuse the
verl settings the MIX trainer cannot honour (:mod:`mix_src.verl_parity`, each error names the key), check
that the data and model paths exist and that ``+backend=cpu`` has the CPU backend active, resolve
``rollout.max_model_len`` from the model's context (:mod:`mix_src.model_context`), then run verl's
own ``run_ppo`` with :class:`MixTaskRunner`, which builds :class:`~mix_src.mix_trainer.MIXRayPPOTrainer`, or with
``trainer.use_v1=true`` :class:`~mix_src.mix_trainer_v1.MixTaskRunnerV1` (LUFFY on verl's V1 trainer).
The ``prefix_guided`` agent loop needs no config path: it registers itself in each AgentLoopWorker
(see :mod:`mix_src.agent_loop`).
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from pprint import pprint
from typing import Any, Callable

import hydra
import ray
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from verl.trainer.main_ppo_v0 import BaseTaskRunner

from mix_src.luffy_keys import translate_overrides
from mix_src.mix_config import MixConfigError, validate_mix_config
from mix_src.cpu import CHECKPOINT_ENGINE as CPU_CHECKPOINT_ENGINE, ROLLOUT_ENV
from mix_src.model_context import check_attention, resolve_max_model_len
from mix_src.registry import PLUGINS_ENV, check_selected_entries, load_plugins, load_verl_plugins, resolve_plugin
from mix_src.verl_parity import check_verl_keys


def prepare_config(config: DictConfig) -> Any:
    """Check the composed config on the driver, before Ray starts. Raises on bad input, naming the key."""
    export_plugins(config)
    mix = validate_mix_config(config)
    check_selected_entries(config)  # each selected registry entry: its trainer bases and its own checks
    check_verl_keys(config, mix)
    _check_backend(config)
    _check_paths(config)
    resolve_max_model_len(config)  # the agent loop's clamp needs the model context (mix_src/model_context.py)
    check_attention(config)  # sdpa/eager need use_remove_padding=false; flash_attention_2 needs flash_attn
    return mix


def _check_backend(config: DictConfig) -> None:
    """``+backend=cpu`` (trainer.device=cpu) needs mix_src.cpu active from process start, as verl picks its
    platform when first imported; it is never switched on later (a GPU host must not end up half on CPU)."""
    import mix_src.cpu

    if config.trainer.get("device") == "cpu" and not mix_src.cpu.is_active():
        raise MixConfigError(
            "trainer.device=cpu (+backend=cpu) but the CPU backend is off in this process: this machine shows "
            f"an accelerator ({'; '.join(mix_src.cpu.accelerator_signs()) or 'VERL_PLATFORM is not cpu'}). "
            "Run with VERL_PLATFORM=cpu to train on CPU here, or drop +backend=cpu to use the accelerator."
        )
    if config.trainer.get("device") == "cpu":
        from mix_src.cpu.config_check import check_worker_keys

        check_worker_keys(config)
    if mix_src.cpu.is_active():
        mix_src.cpu.log_active()  # again, now that the rollout is known (export_plugins set MIX_CPU_ROLLOUT)


def export_plugins(config: DictConfig) -> list[str]:
    """Make every Ray process load what this one did, and fail as loudly: ``mix_src.plugins`` goes into verl's
    ``VERL_USE_EXTERNAL_MODULES`` (imported by verl/__init__.py in each process, where it imports verl's
    ``verl.plugins`` entry points raising on a failure, :func:`mix_src.registry.load_verl_plugins`, and the
    ``mix.plugins``); ``mix.plugins`` are imported here and their specs (paths made absolute) go into
    ``MIX_PLUGINS``; the rollout name goes into ``MIX_CPU_ROLLOUT`` (the CPU backend's "active" line). All
    of it in this process's environment (inherited by a local Ray cluster) and in
    ``ray_kwargs.ray_init.runtime_env.env_vars``. Returns the plugin specs."""
    load_verl_plugins()  # this process imported verl before the environment said so
    mix = config.get("mix") or {}
    specs = [resolve_plugin(s) for s in (mix.get("plugins") or [])]
    if specs:
        load_plugins(specs)
    external = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    env = {"VERL_USE_EXTERNAL_MODULES": ",".join(dict.fromkeys([*external, "mix_src.plugins"]))}
    if specs:
        env[PLUGINS_ENV] = ",".join(specs)
    rollout = OmegaConf.select(config, "actor_rollout_ref.rollout.name", default=None)
    if rollout:
        env[ROLLOUT_ENV] = str(rollout)
    os.environ.update(env)
    with open_dict(config):
        if specs:
            config.mix.plugins = specs
        ray_init = config.setdefault("ray_kwargs", {}).setdefault("ray_init", {})
        runtime_env = ray_init.setdefault("runtime_env", {})
        runtime_env.setdefault("env_vars", {})
        runtime_env.env_vars.update(env)
    for spec in specs:
        print(f"[mix_src] plugin loaded: {spec}")
    return specs


def _local_paths(value) -> list[str]:
    values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    return [str(v) for v in values if v is not None and "://" not in str(v)]


def _check_paths(config: DictConfig) -> None:
    checks = {
        "data.train_files": _local_paths(config.data.train_files),
        "data.val_files": _local_paths(config.data.val_files),
        "actor_rollout_ref.model.path": _local_paths(config.actor_rollout_ref.model.path),
    }
    tok = config.actor_rollout_ref.model.get("tokenizer_path")
    if tok:
        checks["actor_rollout_ref.model.tokenizer_path"] = _local_paths(tok)
    for key, paths in checks.items():
        for path in paths:
            if not os.path.exists(os.path.expanduser(path)) and (key.startswith("data.") or not _is_hub_id(path)):
                raise FileNotFoundError(
                    f"{key}: '{path}' does not exist (cwd {os.getcwd()}); fix the path, or build the files first "
                    "(e.g. `python scripts/make_tiny_assets.py DIR` for the CPU demo)"
                )


def _is_hub_id(path: str) -> bool:
    """'Qwen/Qwen2.5-Math-7B'-style model ids are resolved by transformers, not checked here."""
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1


class MixTaskRunner(BaseTaskRunner):
    """verl's legacy TaskRunner flow (``main_ppo_v0.TaskRunner.run``) with MIXRayPPOTrainer.

    ``main_ppo_v0.TaskRunner`` is already a Ray actor class and cannot be subclassed, so this subclasses
    its ``BaseTaskRunner`` (worker/resource-pool set-up) and keeps ``run`` short.
    """

    def run(self, config: DictConfig) -> None:
        from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass, validate_config
        from verl.utils.dataset.rl_dataset import collate_fn
        from verl.workers.config import HFModelConfig

        from mix_src.mix_trainer import MIXRayPPOTrainer

        print(f"MixTaskRunner hostname: {socket.gethostname()}, PID: {os.getpid()}")
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        mix = validate_mix_config(config)

        _, ray_worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_resource_pool(config)
        self.add_teacher_model_resource_pool(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))

        model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        tokenizer, processor = model_config.tokenizer, model_config.processor

        # the training set gets the mix settings (targets); validation rows never get a prefix
        train_data_cfg = copy.deepcopy(config.data)
        with open_dict(train_data_cfg):
            train_data_cfg.mix = copy.deepcopy(config.mix)
        train_dataset = create_rl_dataset(
            config.data.train_files, train_data_cfg, tokenizer, processor, is_train=True,
            max_samples=config.data.get("train_max_samples", -1),
        )  # fmt: skip
        val_dataset = create_rl_dataset(
            config.data.val_files, config.data, tokenizer, processor, is_train=False,
            max_samples=config.data.get("val_max_samples", -1),
        )  # fmt: skip

        trainer = MIXRayPPOTrainer(
            config=config,
            tokenizer=tokenizer,
            processor=processor,
            role_worker_mapping=self.role_worker_mapping,
            resource_pool_manager=self.init_resource_pool_mgr(config),
            ray_worker_group_cls=ray_worker_group_cls,
            train_dataset=train_dataset,
            val_dataset=val_dataset,
            collate_fn=collate_fn,
            train_sampler=create_rl_sampler(config.data, train_dataset),
            mix_config=mix,
        )
        trainer.init_workers()
        trainer.fit()


def config_stage(config: DictConfig) -> None:
    """Everything the driver checks before Ray starts (ours, then verl's own validate_config)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    mix = prepare_config(config)  # the mix: section validated (LUFFY's "off" values such as -1 translated)
    if bool(config.trainer.get("use_v1", False)):
        check_v1_config(config, mix)
    from mix_src.agent_loop_tools import check_config as check_tool_loop_config  # the tool loop's own refusals

    try:
        check_tool_loop_config(config)
    except ValueError as e:
        raise MixConfigError(str(e)) from e
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def run_mix_ppo(config: DictConfig) -> None:
    """Validate on the driver, then start Ray and train (verl's V1 trainer with trainer.use_v1=true)."""
    from verl.trainer.main_ppo import run_ppo

    config_stage(config)
    if bool(config.trainer.get("use_v1", False)):
        from mix_src.mix_trainer_v1 import MixTaskRunnerV1

        run_ppo(config, task_runner_class=ray.remote(MixTaskRunnerV1))
    else:
        run_ppo(config, task_runner_class=ray.remote(num_cpus=1)(MixTaskRunner))


V1_MODES = ("sync", "colocate_async", "separate_async")


def check_separate_async(config: DictConfig) -> None:
    """What verl's ``PPOTrainerSeparateAsync.__init__`` asserts once Ray is up (``verl/trainer/ppo/v1/
    trainer_separate_async.py`` 55-70), checked before Ray starts; on the CPU backend also the checkpoint engine
    (``cpu_gloo``: each of verl's own needs an accelerator) and the fake Ray GPUs the standalone pool needs."""
    rollout = config.actor_rollout_ref.rollout
    sync_steps = config.trainer.v1.separate_async.parameter_sync_step
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    if config.data.train_batch_size != sync_steps * mini:
        raise MixConfigError(
            f"data.train_batch_size={config.data.train_batch_size} must equal trainer.v1.separate_async."
            f"parameter_sync_step ({sync_steps}) x actor_rollout_ref.actor.ppo_mini_batch_size ({mini}) in separate_async"
        )
    for key in ("nnodes", "n_gpus_per_node"):
        if not int(rollout.get(key) or 0) > 0:
            raise MixConfigError(
                f"actor_rollout_ref.rollout.{key}={rollout.get(key)}: separate_async runs a standalone rollout pool "
                f"of rollout.nnodes x rollout.n_gpus_per_node devices; set it > 0"
            )
    backend = rollout.checkpoint_engine.backend
    if config.trainer.device == "cpu":
        if backend != CPU_CHECKPOINT_ENGINE:
            raise MixConfigError(
                f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}: on the CPU backend separate_async "
                f"pushes weights to its standalone rollout pool with mix_src.cpu's '{CPU_CHECKPOINT_ENGINE}' engine "
                "(verl refuses 'naive' there; nccl needs cupy/CUDA, hccl Ascend, nixl/mooncake/kimi RDMA); set it to "
                f"{CPU_CHECKPOINT_ENGINE}"
            )
        needed = (config.trainer.nnodes * config.trainer.n_gpus_per_node
                  + int(rollout.nnodes) * int(rollout.n_gpus_per_node))  # fmt: skip
        have = (config.get("ray_kwargs") or {}).get("ray_init", {}).get("num_gpus")
        if have is not None and int(have) < needed:
            raise MixConfigError(
                f"ray_kwargs.ray_init.num_gpus={have}: the CPU backend's fake Ray GPUs must cover the trainer's "
                f"(trainer.nnodes x n_gpus_per_node) and the standalone rollout pool's (actor_rollout_ref.rollout."
                f"nnodes x n_gpus_per_node), {needed} in all, or Ray never places the pool; set it to {needed}"
            )


def check_v1_config(config: DictConfig, mix: Any) -> None:
    """Refuse, before Ray starts, what LUFFY on verl's V1 trainer (mix_src/mix_trainer_v1.py) cannot honour.
    ``mix``: the validated :class:`~mix_src.mix_config.MixConfig` (values as the trainers read them). Registry
    entries (rollout policies, group filters, ...) declare their own bases (:func:`check_selected_entries`);
    the settings are in :data:`V1_REFUSALS`."""
    mode = config.trainer.v1.trainer_mode
    if mode not in V1_MODES:
        raise MixConfigError(f"trainer.v1.trainer_mode={mode!r}: use one of {', '.join(V1_MODES)}")
    if mode == "separate_async":
        check_separate_async(config)
    try:
        import transfer_queue  # noqa: F401
    except ImportError as e:
        raise MixConfigError(
            "trainer.use_v1=true: verl's V1 trainer moves data through TransferQueue, which is not installed; "
            "`pip install transferqueue==0.1.11`, or set trainer.use_v1=false"
        ) from e
    for key, refused, reason in V1_REFUSALS:
        value = refused(config, mix)
        if value is not None:
            raise MixConfigError(f"{key}={value} is not supported on trainer.use_v1=true: {reason}")


def _fg_enabled(config: DictConfig) -> bool:
    return bool((config.algorithm.get("filter_groups") or {}).get("enable", False))


# The settings (not registry entries: those declare their own bases) that LUFFY on verl's V1 trainer refuses:
# (key, refused(config, mix) -> the refused value or None, why). check_v1_config reads only this table.
V1_REFUSALS: list[tuple[str, Callable[[DictConfig, Any], Any], str]] = [
    ("algorithm.filter_groups.max_num_gen_batches",
     lambda c, m: (c.algorithm.filter_groups.max_num_gen_batches if _fg_enabled(c) and c.trainer.v1.trainer_mode != "sync"
                   and int(c.algorithm.filter_groups.get("max_num_gen_batches", 0) or 0) > 0 else None),
     "in the async modes no step has generation batches of its own to count: verl's ReplayBufferAsync "
     "(verl/trainer/ppo/v1/replay_buffer.py wait_for_sampleable) refills each evicted group as it is evicted and the "
     "trainer dispatches a batch every step plus trainer.v1.<mode>.num_warmup_batches ahead (trainer_base.py "
     "prepare_step, _add_async_warmup_batches), so a step trains on groups dispatched in earlier steps; set it to 0 "
     "and bound generation with the off-policy sampler settings, or use trainer.v1.trainer_mode=sync"),
]


@hydra.main(config_path="config", config_name="mix_ppo", version_base=None)
def main(config: DictConfig) -> None:
    run_mix_ppo(config)


if __name__ == "__main__":
    sys.argv[1:] = translate_overrides(sys.argv[1:])  # the original LUFFY's key names (mix_src/luffy_keys.py)
    main()
