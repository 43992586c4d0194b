"""Entry point: ``python -m mix_src.main_mix_ppo key=value ...`` (Hydra; ``mix_src/config/mix_ppo_trainer.yaml``
through the primary ``mix_ppo.yaml``; a recipe passes ``--config-path recipes/NAME --config-name config``). On the
driver, every check before Ray (:func:`mix_src.config.preflight.run`); then verl's ``run_ppo`` with
:class:`MixTaskRunner` (building :class:`~mix_src.trainer.legacy.MIXRayPPOTrainer`) or, with ``trainer.use_v1=true``,
:class:`~mix_src.trainer.v1.MixTaskRunnerV1` (LUFFY on verl's V1 trainer).
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from pprint import pprint

import hydra
import ray
from omegaconf import DictConfig, OmegaConf, open_dict

from verl.trainer.main_ppo_v0 import BaseTaskRunner

from mix_src.config.preflight import (  # noqa: F401  (the checks before Ray; these names stay importable from here)
    V1_MODES, check_separate_async, check_v1_config, export_plugins, prepare_config,
    run as config_stage,  # config_stage: every check before Ray
)
from mix_src.trainer.failure import report_failure
from mix_src.config.luffy_keys import translate_overrides
from mix_src.config.mix_config import validate_mix_config


class MixTaskRunner(BaseTaskRunner):
    """verl's legacy TaskRunner flow (``main_ppo_v0.TaskRunner.run``) with MIXRayPPOTrainer (``TaskRunner`` is
    already a Ray actor class and cannot be subclassed, hence its ``BaseTaskRunner``)."""

    def run(self, config: DictConfig) -> None:
        from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass, validate_config
        from verl.utils.dataset.rl_dataset import collate_fn

        from mix_src.trainer.legacy import MIXRayPPOTrainer

        print(f"MixTaskRunner hostname: {socket.gethostname()}, PID: {os.getpid()}")
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        mix = validate_mix_config(config)

        _, ray_worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_resource_pool(config)
        self.add_teacher_model_resource_pool(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))

        model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)  # verl's HFModelConfig
        tokenizer, processor = model_config.tokenizer, model_config.processor

        # the training set gets the mix settings (targets); validation rows never get a prefix
        train_data_cfg = copy.deepcopy(config.data)
        with open_dict(train_data_cfg):
            train_data_cfg.mix = copy.deepcopy(config.mix)
        train_dataset = create_rl_dataset(config.data.train_files, train_data_cfg, tokenizer, processor, is_train=True,
                                          max_samples=config.data.get("train_max_samples", -1))
        val_dataset = create_rl_dataset(config.data.val_files, config.data, tokenizer, processor, is_train=False,
                                        max_samples=config.data.get("val_max_samples", -1))
        trainer = MIXRayPPOTrainer(
            config=config, tokenizer=tokenizer, processor=processor, role_worker_mapping=self.role_worker_mapping,
            resource_pool_manager=self.init_resource_pool_mgr(config), ray_worker_group_cls=ray_worker_group_cls,
            train_dataset=train_dataset, val_dataset=val_dataset, collate_fn=collate_fn,
            train_sampler=create_rl_sampler(config.data, train_dataset), mix_config=mix,
        )
        trainer.init_workers()
        trainer.fit()


def run_mix_ppo(config: DictConfig) -> None:
    """Validate on the driver, then start Ray and train (verl's V1 trainer with trainer.use_v1=true)."""
    from verl.trainer.main_ppo import run_ppo

    config_stage(config)
    with report_failure():  # a failure in Ray: its worker and exception in the driver's last line (mix_src/trainer/failure.py)
        if bool(config.trainer.get("use_v1", False)):
            from mix_src.trainer.v1 import MixTaskRunnerV1

            run_ppo(config, task_runner_class=ray.remote(MixTaskRunnerV1))
        else:
            run_ppo(config, task_runner_class=ray.remote(num_cpus=1)(MixTaskRunner))


main = hydra.main(config_path="config", config_name="mix_ppo", version_base=None)(run_mix_ppo)


if __name__ == "__main__":
    sys.argv[1:] = translate_overrides(sys.argv[1:])  # the original LUFFY's key names (mix_src/config/luffy_keys.py)
    main()
