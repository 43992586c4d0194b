"""The features verl's GPU recipes use, with LUFFY on, trained end to end on the CPU backend (the feature matrix).

Two runs carry them all (the CI budget): the legacy one in the legacy batch (tests/e2e.py ``batch_run``: one
process and one Ray cluster for several tests' runs), the V1 one in its own process (its test reads its log):

* legacy trainer: reference policy for the KL loss (``actor.use_kl_loss``) and the KL in the reward
  (``algorithm.use_kl_in_reward``) + GAE with verl's critic (``AutoModelForTokenClassification``);
* V1 trainer (``trainer.use_v1=true``, sync): LoRA (verl's adapter sync to the hf rollout; the reference policy is
  the adapter-disabled actor) + dynamic batch sizes + GAE with the critic + the KL loss.

LoRA through verl's own vLLM rollout on vLLM's CPU build (``rollout.name=vllm``) rides on the vLLM runs of
``tests/test_vllm_cpu.py`` (``test_luffy_lora_through_verls_vllm_rollout_twice_seeded``).

Each fails on a crash (``run_verl`` fails the test on a non-zero exit) and checks that the feature did its work.
"""

from __future__ import annotations

import math
import re

import pytest

from e2e import MIX_CPU, batch_result, batch_run, run_verl, tiny_overrides

pytestmark = pytest.mark.ray

MIX = "mix_src.main_mix_ppo"
LUFFY = ["mix.n_prefix=1", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0"]


def critic(tiny_assets) -> list[str]:
    return [
        "algorithm.adv_estimator=gae",
        f"critic.model.path={tiny_assets['model']}",
        f"++critic.model.tokenizer_path={tiny_assets['tokenizer']}",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "critic.optim.lr=1e-3",
    ]


def overrides(tiny_assets, *extra) -> list[str]:
    return MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=4, batch_size=4, response_length=24) + LUFFY + list(extra)


def run(tiny_assets, tmp_path, *extra):
    return run_verl(MIX, overrides(tiny_assets, *extra), tmp_path, timeout=480)


def legacy_kl_gae(assets, batch_dir) -> list[str]:
    return overrides(assets, *critic(assets),
                     "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
                     "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1")  # fmt: skip


KL_GAE = batch_run("legacy", "kl_gae", legacy_kl_gae,
                   ["test_cpu_features_e2e.py::test_legacy_kl_loss_kl_in_reward_and_gae"])  # fmt: skip


def assert_luffy_and_critic_step(m: dict) -> None:
    """LUFFY's shaped loss on the target tokens, and GAE from the critic's values."""
    assert m["batch/off_policy_rows"] == 4 and m["batch/off_solved"] == 1.0  # one full expert row per prompt
    for key in ("actor/off_policy_prob", "actor/off_pg_loss", "actor/grad_norm", "critic/vf_loss",
                "critic/values/mean", "critic/returns/mean", "critic/vf_explained_var"):  # fmt: skip
        assert key in m and math.isfinite(m[key]), key
    assert 0.0 < m["actor/off_policy_prob"] < 1.0 and m["actor/off_pg_loss"] != 0.0
    assert m["critic/vf_loss"] > 0 and m["critic/values/max"] != m["critic/values/min"]  # the critic's values
    assert m["actor/grad_norm"] > 0


def test_legacy_kl_loss_kl_in_reward_and_gae(legacy_batch):
    result = batch_result(legacy_batch, KL_GAE)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert_luffy_and_critic_step(m)
        assert m["actor/kl_coef"] == pytest.approx(0.1) and m["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    first, second = result.metrics
    # step 1 scores rows with the reference = the initial policy; after one update the policy has moved from it
    assert abs(first["actor/kl_loss"]) < 1e-4 and abs(first["actor/reward_kl_penalty"]) < 1e-4
    assert second["actor/kl_loss"] > 1e-6 and second["actor/reward_kl_penalty"] != 0.0


def lora_adapter_norms(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"hf rollout 0 loaded LoRA adapter #\d+ \(\d+ tensors, r=8, \|lora_B\|=(\S+)\)", log)]


def test_v1_lora_dynamic_bsz_gae_and_kl_loss(tiny_assets, tmp_path):
    result = run(
        tiny_assets, tmp_path, *critic(tiny_assets),
        "trainer.use_v1=true", "trainer.v1.trainer_mode=sync",
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
    )  # fmt: skip
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert_luffy_and_critic_step(m)
    log = result.log_path.read_text()
    # verl's adapter sync: the hf rollout got the adapter at every sync, and it changed with training (peft starts
    # lora_B at zero, so the first is 0)
    norms = lora_adapter_norms(log)
    assert len(norms) >= 2 and norms[0] == 0.0 and norms[-1] > 0.0, norms
    # the reference is the adapter-disabled actor (verl: ref_in_actor): identical to the policy while lora_B = 0,
    # away from it once the adapter moved
    first, second = result.metrics
    assert abs(first["actor/kl_loss"]) < 1e-6 and second["actor/kl_loss"] > 1e-6
