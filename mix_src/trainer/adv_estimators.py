"""Advantage estimators that see ``prefix_mask``: a registry the trainer calls for ``algorithm.adv_estimator``.

verl's own estimators (``verl.trainer.ppo.core_algos.register_adv_est``) never see which tokens came from a
demonstration; one registered here does. Every other name falls back to verl's ``compute_advantage``.

Signature (one for all)::

    @register_adv_estimator("name")
    def fn(token_level_rewards, response_mask, index, prefix_mask, config) -> (advantages, returns)

    token_level_rewards: (B, L) float; response_mask: (B, L) 0/1; index: (B,) int64 tensor, group id per
    row (one per prompt); prefix_mask: (B, L) bool, True on demonstration (prefix) tokens; config: verl's
    ``algorithm`` section (e.g. ``config.get("norm_adv_by_std_in_grpo", True)``).
    Returns two (B, L) tensors.

The decorator also registers the name with verl's ``register_adv_est`` (called without a prefix mask:
every row on-policy), so verl's own config checks and any verl code path accept the name.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from verl.trainer.ppo import core_algos

from mix_src.compat import checked
from mix_src.algo.core_alg import compute_grpo_outcome_advantage_split, group_ids
from mix_src.extend import Registry

__all__ = ["ADV_ESTIMATORS", "grpo_split_estimator", "register_adv_estimator"]

AdvEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("prefix-aware advantage estimator", "algorithm.adv_estimator")


def register_adv_estimator(name: str, **entry) -> Callable[[AdvEstimator], AdvEstimator]:
    """``entry``: the self-description of :meth:`mix_src.extend.Registry.register`."""

    def deco(fn: AdvEstimator) -> AdvEstimator:
        ADV_ESTIMATORS.register(name, **entry)(fn)

        def verl_signature(token_level_rewards, response_mask, index=None, config=None, **kwargs):
            return fn(token_level_rewards, response_mask, group_ids(index),
                      torch.zeros(response_mask.shape, dtype=torch.bool), config if config is not None else {})  # fmt: skip

        verl_signature.__name__ = verl_signature.__qualname__ = f"{name}_verl_signature"
        verl_signature.mix_estimator = fn
        checked("adv_estimators.registry")
        old = getattr(core_algos.ADV_ESTIMATOR_REGISTRY.get(name), "mix_estimator", None)
        if old is not None and (old.__module__, old.__qualname__) == (fn.__module__, fn.__qualname__):
            core_algos.ADV_ESTIMATOR_REGISTRY[name] = verl_signature  # the same module imported again
        else:
            core_algos.register_adv_est(name)(verl_signature)
        return fn

    return deco


@register_adv_estimator("grpo_split")
def grpo_split_estimator(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any,
                         prefix_mask: Optional[torch.Tensor], config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO whose group baseline comes from the on-policy rows only (rows without a prefix token);
    see :func:`mix_src.algo.core_alg.compute_grpo_outcome_advantage_split`. ``config.norm_adv_by_std_in_grpo``
    (verl's key; LUFFY's grpo_use_std) picks division by the group std."""
    use_std = (config or {}).get("norm_adv_by_std_in_grpo", True)
    on_policy = torch.ones(token_level_rewards.shape[0], dtype=torch.bool) if prefix_mask is None else ~prefix_mask.any(-1)
    return compute_grpo_outcome_advantage_split(token_level_rewards, response_mask, index, on_policy, use_std=use_std)
