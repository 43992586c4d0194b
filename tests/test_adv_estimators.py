"""The prefix-aware estimator registry: grpo_split is one of its entries, is also registered with verl's
registry (called there without a prefix mask), and agrees with the pure function."""

import numpy as np
import torch

from verl.trainer.ppo import core_algos


def test_grpo_split_is_registered_with_verl():
    import mix_src.trainer.adv_estimators as adv

    assert adv.ADV_ESTIMATORS.get("grpo_split") is adv.grpo_split_estimator
    assert core_algos.get_adv_estimator_fn("grpo_split").mix_estimator is adv.grpo_split_estimator


def test_registered_estimator_matches_core_and_verl_grpo_when_all_rows_on_policy():
    from mix_src.trainer.adv_estimators import grpo_split_estimator
    from mix_src.algo.core_alg import compute_grpo_outcome_advantage_split

    torch.manual_seed(0)
    rewards = torch.zeros(8, 5)
    rewards[torch.arange(8), 4] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    mask = torch.ones(8, 5)
    uids = np.array(["a"] * 4 + ["b"] * 4, dtype=object)
    adv, ret = core_algos.get_adv_estimator_fn("grpo_split")(rewards, mask, uids)  # verl's call: no prefix mask
    ref, _ = compute_grpo_outcome_advantage_split(rewards, mask, torch.tensor([0] * 4 + [1] * 4), torch.ones(8, dtype=torch.bool))
    assert torch.equal(adv, ref) and torch.equal(adv, ret)
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(adv, verl_adv, rtol=1e-5, atol=1e-5)  # no zero-std group here: same as grpo
    # with the on-policy mask: group a's baseline from rows 1-3 only
    prefix = torch.zeros(8, 5, dtype=torch.bool)
    prefix[0, :2] = True  # row 0 starts with a demonstration prefix
    adv_split, _ = grpo_split_estimator(rewards, mask, torch.tensor([0] * 4 + [1] * 4), prefix, {})
    r = torch.tensor([0.0, 1.0, 1.0])
    expected_row0 = (1.0 - r.mean()) / (r.std() + 1e-6)
    torch.testing.assert_close(adv_split[0, -1], expected_row0)
