"""Registers mix_src's advantage estimators with verl's ``register_adv_est`` registry.

Import this module (the trainer and the entry point do) and ``algorithm.adv_estimator=grpo_split`` becomes
a valid verl estimator name: ``core_algos.get_adv_estimator_fn("grpo_split")`` returns
:func:`grpo_split_estimator`.

verl's own ``compute_advantage`` calls estimators without ``prefix_mask``; called that way every row
counts as on-policy, i.e. plain GRPO with LUFFY's ``std == 0 -> 1`` rule. ``MIXRayPPOTrainer`` calls
:func:`mix_src.core_alg.compute_grpo_outcome_advantage_split` itself with the on-policy mask.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from verl.trainer.ppo.core_algos import register_adv_est

from mix_src.core_alg import compute_grpo_outcome_advantage_split

GRPO_SPLIT = "grpo_split"


@register_adv_est(GRPO_SPLIT)
def grpo_split_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
    on_policy_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl-signature wrapper of ``compute_grpo_outcome_advantage_split``.

    Args:
        token_level_rewards: (bs, response_len) float.
        response_mask: (bs, response_len) 0/1.
        index: (bs,) group id per row (verl passes the uid strings).
        on_policy_mask: (bs,) bool, rows whose group baseline counts; None = every row.
    Returns:
        (advantages, returns), each (bs, response_len).
    """
    if config is not None:
        norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    group_ids = np.unique(np.asarray(index).astype(str), return_inverse=True)[1]
    if on_policy_mask is None:
        on_policy_mask = torch.ones(token_level_rewards.shape[0], dtype=torch.bool)
    return compute_grpo_outcome_advantage_split(
        token_level_rewards,
        response_mask,
        torch.as_tensor(group_ids, dtype=torch.long),
        on_policy_mask,
        epsilon=epsilon,
        use_std=norm_adv_by_std_in_grpo,
    )
