"""Worker keys the CPU backend cannot honour are refused before Ray starts, naming the key
(mix_src/cpu/config_check.py); what it can honour (reference policy, critic, LoRA, dynamic batch size) passes."""

from __future__ import annotations

import pytest

import composed
from e2e import MIX_CPU, run_verl, tiny_overrides
from mix_src.cpu.config_check import CHECKS, check_worker_keys
from mix_src.config.mix_config import MixConfigError


def compose_cpu(*overrides):
    return composed.compose_mix(MIX_CPU + list(overrides))  # tests/composed.py: the YAML read once per session


def test_the_cpu_fragment_and_the_features_it_runs_pass():
    check_worker_keys(compose_cpu())
    check_worker_keys(compose_cpu(
        "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true", "algorithm.adv_estimator=gae",
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    ))  # fmt: skip


@pytest.mark.parametrize(
    "override,key",
    [
        ("actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.strategy=fsdp"),
        ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy=megatron"),
        ("actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
         "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2"),
        ("actor_rollout_ref.model.use_liger=true", "actor_rollout_ref.model.use_liger=true"),
    ],
)
def test_refused_worker_keys_name_the_key(override, key):
    with pytest.raises(MixConfigError, match=key.replace("[", r"\[")):
        check_worker_keys(compose_cpu(override))


def test_critic_keys_checked_only_when_a_critic_is_built():
    flash_critic = "critic.model.override_config.attn_implementation=flash_attention_2"
    check_worker_keys(compose_cpu(flash_critic))  # grpo: no critic
    with pytest.raises(MixConfigError, match=r"critic\.model\.override_config\.attn_implementation"):
        check_worker_keys(compose_cpu(flash_critic, "algorithm.adv_estimator=gae"))
    with pytest.raises(MixConfigError, match=r"critic\.strategy=fsdp"):
        check_worker_keys(compose_cpu("critic.strategy=fsdp", "critic.enable=true"))


def test_every_listed_refusal_refuses():
    for setting, check in CHECKS.items():
        assert check(compose_cpu(setting)), setting


def test_entry_point_refuses_before_ray(tiny_assets, tmp_path):
    """Through ``python -m mix_src.main_mix_ppo +backend=cpu``: the message, and no Ray start."""
    overrides = MIX_CPU + tiny_overrides(tiny_assets) + ["actor_rollout_ref.actor.strategy=fsdp"]
    result = run_verl("mix_src.main_mix_ppo", overrides, tmp_path, timeout=180, check=False)
    log = result.log_path.read_text()
    assert result.returncode != 0 and "actor_rollout_ref.actor.strategy=fsdp: the CPU backend runs FSDP2" in log
    assert "ray init kwargs" not in log and "Started a local Ray instance" not in log
