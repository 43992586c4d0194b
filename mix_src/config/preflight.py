"""The checks the driver runs before Ray starts (:func:`run`, called by ``python -m mix_src.main_mix_ppo`` before
``ray.init``), one stage that reads top to bottom; its order, errors and costs: mix_src/config/README.md.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mix_src.compat import check_all as check_patch_versions
from mix_src.config.resources import check_checkpoint_dir
from mix_src.config.run_identity import check_resume
from mix_src.config.data_check import check_data, data_files
from mix_src.config.batch_check import check_batch_arithmetic
from mix_src.cpu import CHECKPOINT_ENGINE as CPU_CHECKPOINT_ENGINE, ROLLOUT_ENV
from mix_src.config.mix_config import MixConfigError, validate_mix_config
from mix_src.config.model_context import check_attention, is_hub_id, resolve_max_model_len
from mix_src.planner.check import check_memory
from mix_src.extend import PLUGINS_ENV, check_selected_entries, load_plugins, load_verl_plugins, resolve_plugin
from mix_src.config.verl_parity import check_verl_keys


def run(config: DictConfig) -> Any:
    """Every check before Ray, in order. Returns the validated :class:`~mix_src.config.mix_config.MixConfig`."""
    check_patch_versions(MixConfigError)  # 0. installed verl (and others): the versions each patch was read against
    export_plugins(config)  # 0. plugins imported here and in every Ray process (the names they register are valid)
    _check_paths(config)  # 1. paths: data files, model, tokenizer
    mix = check_keys(config)  # 2. keys: ours, verl's our loop replaces, the backend's, the trainer base's, the context
    check_verl_config(config)  # 2. keys: verl's own validate_config, as its main_ppo runs it inside Ray
    check_selected_entries(config)  # 3. registry entries: trainer bases, settings (mix.plugin_options), own checks
    check_data(config)  # 4. data contents: bad files refused, bad rows dropped and counted (data_check.py)
    check_batch_arithmetic(config)  # 5. batch arithmetic verl checks only inside Ray (batch_check.py)
    check_checkpoint_dir(config)  # 6. resources: checkpoint directory created, written to, free space (resources.py)
    check_resume(config)  # 6. the checkpoint it would resume: this run's, steps left (run_identity.py)
    check_memory(config)  # 6. fp32 states vs GPU memory refused, the peak estimate printed (mix_src/planner/check.py)
    return mix


def prepare_config(config: DictConfig) -> Any:
    """Steps 0-3 of :func:`run` (plugins, paths, our keys, registry entries), without verl's validate_config."""
    export_plugins(config)
    _check_paths(config)
    mix = check_keys(config)
    check_selected_entries(config)
    return mix


def check_keys(config: DictConfig) -> Any:
    """Step 2 of :func:`run` (its comment lists the parts); returns the validated ``MixConfig``."""
    from mix_src.rollout.agent_loop_tools import check_config as check_tool_loop_config

    mix = validate_mix_config(config)
    check_verl_keys(config, mix)
    _check_backend(config)
    if bool(config.trainer.get("use_v1", False)):
        check_v1_config(config)
    try:
        check_tool_loop_config(config)
    except ValueError as e:
        raise MixConfigError(str(e)) from e
    resolve_max_model_len(config)  # the agent loop's clamp needs the model context (mix_src/config/model_context.py)
    check_attention(config)  # sdpa/eager need use_remove_padding=false; flash_attention_2 needs flash_attn
    return mix


def check_verl_config(config: DictConfig) -> None:
    """verl's own checks (verl/utils/config.py validate_config), on the device verl would pick."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def _check_backend(config: DictConfig) -> None:
    """``+backend=cpu`` (trainer.device=cpu) needs mix_src.cpu active from process start, as verl picks its
    platform when first imported; it is never switched on later (a GPU host must not end up half on CPU)."""
    import mix_src.cpu

    if config.trainer.get("device") == "cpu":
        if not mix_src.cpu.is_active():
            raise MixConfigError("trainer.device=cpu (+backend=cpu) but the CPU backend is off in this process: this "
                                 "machine shows an accelerator "
                                 f"({'; '.join(mix_src.cpu.accelerator_signs()) or 'VERL_PLATFORM is not cpu'}). Run "
                                 "with VERL_PLATFORM=cpu to train on CPU here, or drop +backend=cpu to use the "
                                 "accelerator.")
        from mix_src.cpu.config_check import check_worker_keys

        check_worker_keys(config)
    if mix_src.cpu.is_active():
        mix_src.cpu.log_active()  # again, now that the rollout is known (export_plugins set MIX_CPU_ROLLOUT)


def export_plugins(config: DictConfig) -> list[str]:
    """Make every Ray process load what this one did, and fail as loudly (mix_src/README.md, extending):
    ``mix_src.plugins`` into verl's ``VERL_USE_EXTERNAL_MODULES``, the ``mix.plugins`` specs into ``MIX_PLUGINS``,
    the rollout name into ``MIX_CPU_ROLLOUT`` (the CPU backend's "active" line), in this process's environment (a
    local Ray cluster inherits it) and ``ray_kwargs.ray_init.runtime_env.env_vars``. Returns the plugin specs."""
    load_verl_plugins()  # this process imported verl before the environment said so
    mix = config.get("mix") or {}
    specs = [resolve_plugin(s) for s in (mix.get("plugins") or [])]
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
        OmegaConf.update(config, "ray_kwargs.ray_init.runtime_env.env_vars", env, merge=True, force_add=True)
    for spec in specs:
        print(f"[mix_src] plugin loaded: {spec}")
    return specs


def _check_paths(config: DictConfig) -> None:
    model = config.actor_rollout_ref.model
    checks = {"data.train_files": config.data.train_files, "data.val_files": config.data.val_files,
              "actor_rollout_ref.model.path": model.path,
              "actor_rollout_ref.model.tokenizer_path": model.get("tokenizer_path") or None}  # fmt: skip
    for key, value in checks.items():
        for path in data_files(value):
            if not os.path.exists(path) and (key.startswith("data.") or not is_hub_id(path)):
                raise FileNotFoundError(f"{key}: '{path}' does not exist (cwd {os.getcwd()}); {_missing_hint(key, path)}")


def _missing_hint(key: str, path: str) -> str:
    """What builds a missing file: the tiny CPU assets, LUFFY's data (recipes/GPU_FIRST_DAY.md, Data), or a model."""
    if "tiny" in path:
        return "fix the path, or build the CPU demo's files: `python scripts/make_tiny_assets.py DIR`"
    if key.startswith("data."):
        return ("fix the path, or build LUFFY's data first (recipes/GPU_FIRST_DAY.md, '2. Data'): "
                "`python -m scripts.data.prepare_openr1 --input Elliott/Openr1-Math-46k-8192 --output data/openr1.parquet`, "
                "`python -m scripts.data.prepare_eval --input LUFFY/data/valid.parquet --output data/valid.parquet`")
    return "fix the path: a local Hugging Face model folder, or a hub id such as Qwen/Qwen2.5-Math-1.5B"


V1_MODES = ("sync", "colocate_async", "separate_async")


def check_separate_async(config: DictConfig) -> None:
    """What verl's ``PPOTrainerSeparateAsync.__init__`` asserts once Ray is up (``verl/trainer/ppo/v1/
    trainer_separate_async.py`` 55-70), checked before Ray starts; on the CPU backend also the checkpoint engine
    (``cpu_gloo``: each of verl's own needs an accelerator) and the fake Ray GPUs the standalone pool needs."""
    rollout = config.actor_rollout_ref.rollout
    sync_steps = config.trainer.v1.separate_async.parameter_sync_step
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    if config.data.train_batch_size != sync_steps * mini:
        raise MixConfigError(f"data.train_batch_size={config.data.train_batch_size} must equal trainer.v1."
                             f"separate_async.parameter_sync_step ({sync_steps}) x actor_rollout_ref.actor."
                             f"ppo_mini_batch_size ({mini}) in separate_async")
    for key in ("nnodes", "n_gpus_per_node"):
        if not int(rollout.get(key) or 0) > 0:
            raise MixConfigError(f"actor_rollout_ref.rollout.{key}={rollout.get(key)}: separate_async runs a "
                                 "standalone rollout pool of rollout.nnodes x rollout.n_gpus_per_node devices; set it > 0")
    backend = rollout.checkpoint_engine.backend
    if config.trainer.device == "cpu":
        if backend != CPU_CHECKPOINT_ENGINE:
            raise MixConfigError(f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}: on the CPU backend "
                                 "separate_async pushes weights to its standalone rollout pool with mix_src.cpu's "
                                 f"'{CPU_CHECKPOINT_ENGINE}' engine (verl refuses 'naive' there; nccl needs cupy/CUDA, "
                                 f"hccl Ascend, nixl/mooncake/kimi RDMA); set it to {CPU_CHECKPOINT_ENGINE}")
        needed = (config.trainer.nnodes * config.trainer.n_gpus_per_node
                  + int(rollout.nnodes) * int(rollout.n_gpus_per_node))  # fmt: skip
        have = (config.get("ray_kwargs") or {}).get("ray_init", {}).get("num_gpus")
        if have is not None and int(have) < needed:
            raise MixConfigError(f"ray_kwargs.ray_init.num_gpus={have}: the CPU backend's fake Ray GPUs must cover the "
                                 "trainer's (trainer.nnodes x n_gpus_per_node) and the standalone rollout pool's "
                                 f"(actor_rollout_ref.rollout.nnodes x n_gpus_per_node), {needed} in all, or Ray never "
                                 f"places the pool; set it to {needed}")


def check_v1_config(config: DictConfig) -> None:
    """Refuse, before Ray starts, the settings (not registry entries: those declare their own bases,
    :func:`check_selected_entries`) that LUFFY on verl's V1 trainer (mix_src/trainer/v1.py) cannot honour."""
    mode = config.trainer.v1.trainer_mode
    if mode not in V1_MODES:
        raise MixConfigError(f"trainer.v1.trainer_mode={mode!r}: use one of {', '.join(V1_MODES)}")
    if mode == "separate_async":
        check_separate_async(config)
    try:
        import transfer_queue  # noqa: F401
    except ImportError as e:
        raise MixConfigError("trainer.use_v1=true: verl's V1 trainer moves data through TransferQueue, which is not "
                             "installed; `pip install transferqueue==0.1.11`, or set trainer.use_v1=false") from e
    fg = config.algorithm.get("filter_groups") or {}
    if mode != "sync" and fg.get("enable", False) and int(fg.get("max_num_gen_batches", 0) or 0) > 0:
        raise MixConfigError(
            f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} is not supported on "
            "trainer.use_v1=true: in the async modes no step has generation batches of its own to count: verl's "
            "ReplayBufferAsync (verl/trainer/ppo/v1/replay_buffer.py wait_for_sampleable) refills each evicted group "
            "as it is evicted and the trainer dispatches a batch every step plus trainer.v1.<mode>.num_warmup_batches "
            "ahead (trainer_base.py prepare_step, _add_async_warmup_batches), so a step trains on groups dispatched "
            "in earlier steps; set it to 0 and bound generation with the off-policy sampler settings, or use "
            "trainer.v1.trainer_mode=sync")
