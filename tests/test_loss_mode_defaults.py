"""Every verl 0.9.1 policy-loss mode and rollout-correction mode with verl's own defaults (#51 item 2).

For each mode the README's main command is composed with only the mode set (every other value verl's or ours by
default), run through the key checks of the pre-Ray stage (``preflight.check_keys`` and verl's ``validate_config``),
and then either refused there naming the key to set, or its loss is called once here as the worker would call it:
the MIX worker loss (``MixPolicyLoss``, built from the composed actor section as ``trainer/common.py`` builds it)
through verl's micro-batch loop. A mode this file does not know fails: a new verl mode cannot slip through.
"""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf

from composed import compose_mix
from mix_src.config import preflight
from mix_src.config.mix_config import MixConfigError
from mix_src.worker.loss import MixPolicyLoss
from test_loss import BigramLM, make_batch, run_mini_batch

# What each mode needs beyond verl's defaults ({} = it runs on them), and the key its refusal must name.
POLICY_LOSS_MODES = {
    "vanilla": {}, "dppo_tv": {}, "dppo_kl": {}, "gspo": {}, "sapo": {}, "gpg": {}, "clip_cov": {}, "kl_cov": {},
    "geo_mean": {}, "cispo": {},
    "dro": {"actor_rollout_ref.actor.policy_loss.dro_beta": 0.1},
    "bypass_mode": None,  # refused whatever is set: verl selects it itself (mix_src/worker/onpolicy_losses.py)
}  # fmt: skip
ROLLOUT_IS = {"token": {}, "sequence": {}}
ROLLOUT_RS_NEEDS = {"algorithm.rollout_correction.rollout_rs_threshold": 2.0}
ROLLOUT_RS = {m: ROLLOUT_RS_NEEDS for m in ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                                            "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                                            "seq_max_k3")}  # fmt: skip
# the README's main command's sizes (README.md, "The main command with every size spelled out"); no paths are read here
MAIN = ["+backend=cpu", "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=32",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "mix.n_prefix=1",
        "algorithm.adv_estimator=grpo_split", "trainer.total_training_steps=2"]  # fmt: skip


def pre_ray(overrides: list[str]):
    """The composed config through the key checks of the pre-Ray stage; returns (config, MixConfig)."""
    cfg = compose_mix(MAIN + overrides)
    mix = preflight.check_keys(cfg)
    preflight.check_verl_config(cfg)
    return cfg, mix


def train_once(cfg, mix) -> float:
    """The MIX worker loss as trainer/common.py builds it from the composed config, one mini-batch of the test batch
    (a mixed prefix mask) through verl's micro-batch loop; returns the loss (finite) and checks a gradient."""
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    loss_fn = MixPolicyLoss(actor, mix.loss)
    model = BigramLM(seed=2)
    total, grad, _ = run_mini_batch(loss_fn, make_batch(seed=3, model=model), 3, model)
    assert torch.isfinite(torch.tensor(total)) and torch.isfinite(grad).all() and grad.abs().sum() > 0
    return total


def _setting(values: dict) -> list[str]:
    return [f"{k}={v}" for k, v in values.items()]


def test_every_registered_mode_is_known_here():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS

    assert set(POLICY_LOSS_REGISTRY) == set(POLICY_LOSS_MODES), "a verl policy-loss mode this test does not know"
    assert set(SUPPORTED_ROLLOUT_RS_OPTIONS) == set(ROLLOUT_RS), "a verl rollout_rs mode this test does not know"
    fields = OmegaConf.to_container(compose_mix(MAIN).algorithm.rollout_correction)
    assert set(fields) == {"rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode",
                           "loss_type", "rollout_is_batch_normalize"}, "verl's rollout correction has new keys"


@pytest.mark.parametrize("mode", sorted(POLICY_LOSS_MODES))
def test_policy_loss_mode_with_verls_defaults_trains_or_is_refused_naming_the_key(mode):
    setting = [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"]
    needs = POLICY_LOSS_MODES[mode]
    if needs is None:
        with pytest.raises(MixConfigError, match=re.escape(f"loss_mode={mode!r}")):
            pre_ray(setting)
        return
    for key in needs:
        with pytest.raises(MixConfigError, match=re.escape(key)):
            pre_ray(setting)
    train_once(*pre_ray(setting + _setting(needs)))


@pytest.mark.parametrize("key,mode", [("rollout_is", m) for m in ROLLOUT_IS] + [("rollout_rs", m) for m in ROLLOUT_RS])
def test_rollout_correction_mode_with_verls_defaults_runs_or_is_refused_naming_the_key(key, mode):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    setting = [f"algorithm.rollout_correction.{key}={mode}", "actor_rollout_ref.rollout.calculate_log_probs=true"]
    needs = (ROLLOUT_IS if key == "rollout_is" else ROLLOUT_RS)[mode]
    for name in needs:
        with pytest.raises(MixConfigError, match=re.escape(name.rsplit(".", 1)[1])):
            pre_ray(setting)
    cfg, mix = pre_ray(setting + _setting(needs))
    rc = cfg.algorithm.rollout_correction
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g)
    weights, mask, _ = compute_rollout_correction_and_rejection_mask(
        old, old + 0.05 * torch.randn(4, 5, generator=g), torch.ones(4, 5), rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold, rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)  # fmt: skip
    assert mask.shape == (4, 5) and (weights is not None) == (key == "rollout_is")
    train_once(cfg, mix)
