"""Prefix-RFT (Huang et al., "Blending Supervised and Reinforcement Fine-Tuning with Prefix Sampling",
arXiv 2507.01679) as a mix_src plugin. Official code: https://github.com/ZeroYuHuang/prefix_rft, commit
5f5d2a1fb18f0efb6d5ac51839b2750490cefaf8, recipe/prefix_rft/ (the maths below is transcribed from it; the
file and function each piece comes from is named where it is defined).

Load with ``mix.plugins=[recipes/prefix_rft/prefix_rft.py]``; it registers three entries:

* prefix strategy ``prefix_rft_cosine`` (``mix.prefix_strategy``): a prefixed row's ratio is
  ``rho = lo + (hi(s) - lo) * Beta(1, 1)`` with ``lo = 0`` and ``hi(s)`` a cosine decay from
  ``mix.max_prefix_ratio`` to ``mix.min_prefix_ratio`` over ``mix.prefix_steps`` steps (s = global_step - 1)
  (official: scheduler/global_step.py CosineDecayController + BetaSampler, rl_dataset.py _get_prefix_ratio);
* advantage estimator ``dr_grpo_prefix`` (and ``dr_grpo_prefix_v2``) (``algorithm.adv_estimator``):
  core_algos.py compute_dr_grpo_prefix(_v2)_outcome_advantage, each prefixed row being its own prefix group
  and the prompt's on-policy rows the empty-prefix group;
* prefix token selection ``prefix_rft_entropy`` (``mix.loss.prefix_token_select``): in each micro-batch, the
  ``mix.plugin_options.prefix_rft_entropy.ratio`` (older spelling ``mix.loss.prefix_token_select_ratio``) fraction
  of prefix tokens with the lowest entropy (current policy) get advantage 0 (dp_actor.py reshape_func ``entropy``); prefix tokens then get the on-policy PPO-clip loss
  (core_algos.py compute_policy_loss with enable_clip=True), through the entry option
  ``prefix_tokens_on_policy=True``.

The pure maths (``cosine_decay``, ``beta_prefix_ratio``, ``entropy_keep_mask``, ``prefix_advantage``) uses
torch/numpy only; tests/test_prefix_rft.py checks it against the official lines.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

import numpy as np
import torch

from mix_src.trainer.adv_estimators import register_adv_estimator
from mix_src.algo.prefix import PrefixDraw, register_prefix_strategy
from mix_src.algo.prefix_select import PrefixTokenView, register_prefix_token_select
from mix_src.extend import EntryConfigError, number

EMPTY_PREFIX = "0000-0000-0000-0000"  # the official prefix_uid of rows without a prefix


# ---- pure maths ------------------------------------------------------------------------------------


def cosine_decay(step: int, init: float, target: float, n_steps: int, warmup_ratio: float = 0.0) -> float:
    """CosineDecayController.value (scheduler/global_step.py): linear warm-up from 0 to ``init`` over
    ``int(warmup_ratio * n_steps)`` steps, then init -> target along half a cosine over ``n_steps`` steps,
    then ``target``. ``init > target`` decays, ``init < target`` rises (init == target is refused)."""
    if init == target:
        raise ValueError("cosine_decay: init and target must differ")
    warmup_steps = int(warmup_ratio * n_steps)
    if step < warmup_steps:
        return (step / warmup_steps) * init
    after = step - warmup_steps
    if after > n_steps:
        return target
    decay_ratio = 0.5 * (1 + math.cos(math.pi * after / n_steps))
    if init > target:
        return target + decay_ratio * (init - target)
    return init + (1 - decay_ratio) * (target - init)


def beta_prefix_ratio(low: float, high: float, draw: np.ndarray) -> np.ndarray:
    """BetaSampler.value: ``min(low, high) + (max - min) * draw`` with ``draw ~ Beta(alpha, beta)``, any shape."""
    lower, higher = min(low, high), max(low, high)
    return lower + (higher - lower) * draw


def entropy_keep_mask(entropy: torch.Tensor, prefix_mask: torch.Tensor, mask_ratio: float) -> torch.Tensor:
    """The official ``entropy`` reshaper as a keep mask. entropy (B, L) float, prefix_mask (B, L) bool ->
    (B, L) bool: False on the ``int(n * mask_ratio)`` prefix tokens of lowest entropy (n = prefix tokens in
    the tensor, taken in row-major order, sorted ascending), True everywhere else."""
    prefix_mask = prefix_mask.bool()
    ent = entropy[prefix_mask]
    keep = torch.ones_like(prefix_mask)
    if ent.numel() == 0:
        return keep
    order = torch.sort(ent, stable=True).indices
    split_point = int(len(order) * mask_ratio)
    kept_prefix = torch.ones(ent.numel(), dtype=torch.bool, device=ent.device)
    kept_prefix[order[:split_point]] = False
    keep[prefix_mask] = kept_prefix
    return keep


@torch.no_grad()
def prefix_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    prefix_mask: torch.Tensor,
    index: Sequence,
    prefix_index: Sequence,
    num_rollouts_per_prefix: int,
    v2: bool = False,
) -> torch.Tensor:
    """compute_dr_grpo_prefix_outcome_advantage (v2=False) / compute_dr_grpo_prefix_v2_outcome_advantage
    (v2=True) of core_algos.py. Returns the (B, L) advantages.

    token_level_rewards, response_mask, prefix_mask: (B, L); index: (B,) prompt id per row; prefix_index:
    (B,) prefix id per row, ``EMPTY_PREFIX`` for rows without a prefix. With r_i the row's score, m_g the mean
    score of its (prompt, prefix) group (v1: 0 for a group of one row; v2: the row itself) and m_0 that of
    the prompt's empty-prefix group:
        continuation tokens: r_i - m_g;   prefix tokens: (r_i - m_g - m_0) / num_rollouts_per_prefix.
    """
    scores = token_level_rewards.sum(dim=-1).to(torch.float32)
    groups: dict = defaultdict(lambda: defaultdict(list))
    for i in range(len(scores)):
        groups[index[i]][prefix_index[i]].append(float(scores[i]))
    means: dict = defaultdict(dict)
    for idx, by_prefix in groups.items():
        for pid, vals in by_prefix.items():
            means[idx][pid] = 0.0 if (len(vals) == 1 and not v2) else float(torch.tensor(vals).mean())
    centred = torch.tensor([float(scores[i]) - means[index[i]][prefix_index[i]] for i in range(len(scores))])
    p_scores = torch.zeros_like(centred)
    for i in range(len(scores)):
        if prefix_index[i] != EMPTY_PREFIX:
            if EMPTY_PREFIX not in means[index[i]]:
                raise ValueError(
                    f"prompt {index[i]!r} has prefixed rows but no row without a prefix: Prefix-RFT's prefix "
                    "advantage is relative to the on-policy rows' mean score (set mix.n_prefix < rollout.n)"
                )
            p_scores[i] = centred[i] - means[index[i]][EMPTY_PREFIX]
    cont = centred.unsqueeze(-1) * response_mask
    pref = p_scores.unsqueeze(-1) / num_rollouts_per_prefix * prefix_mask
    return torch.where(prefix_mask.bool(), pref, cont)


# ---- registrations ---------------------------------------------------------------------------------


def _check_schedule(config: Any) -> None:
    mix = config.mix
    if not float(mix.min_prefix_ratio) < float(mix.max_prefix_ratio):
        raise EntryConfigError(
            f"mix.prefix_strategy=prefix_rft_cosine decays the upper prefix ratio from mix.max_prefix_ratio to "
            f"mix.min_prefix_ratio: needs min < max, got min={mix.min_prefix_ratio}, max={mix.max_prefix_ratio}"
        )


@register_prefix_strategy(
    "prefix_rft_cosine", check=_check_schedule,
    reads=("mix.min_prefix_ratio", "mix.max_prefix_ratio", "mix.prefix_steps"),
)  # fmt: skip
def prefix_rft_cosine(d: PrefixDraw) -> np.ndarray:
    """rho ~ 0 + (hi(s) - 0) * Beta(1, 1), hi(s) = cosine_decay(s, max_prefix_ratio -> min_prefix_ratio, prefix_steps)."""
    s = d.global_step - 1
    if d.min_prefix_ratio == d.max_prefix_ratio:  # the check refuses this before Ray; direct callers get a clear error
        raise ValueError("prefix_rft_cosine needs min_prefix_ratio < max_prefix_ratio")
    high = cosine_decay(s, d.max_prefix_ratio, d.min_prefix_ratio, d.prefix_steps)
    return beta_prefix_ratio(0.0, high, d.rng.beta(1.0, 1.0, size=d.shape))


def _check_prefix_adv(config: Any) -> None:
    n = int(config.actor_rollout_ref.rollout.n)
    k = int(config.mix.n_prefix)
    if k == -1 or k >= n or k == 0:
        raise EntryConfigError(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator}: the prefix tokens' advantage is relative to "
            f"the prompt's rows without a prefix, so mix.n_prefix must be in 1..rollout.n-1 = 1..{n - 1}, got {k}"
        )
    if bool(config.mix.get("prefix_share_across_samples", False)):
        raise EntryConfigError(
            "Prefix-RFT draws one prefix per prefixed row (each row is its own prefix group): set "
            "mix.prefix_share_across_samples=false"
        )


def _prefix_estimator(v2: bool):
    def estimator(token_level_rewards, response_mask, index, prefix_mask, config=None):
        prefixed = prefix_mask.bool().any(-1).tolist()
        prefix_index = [f"row{i}" if p else EMPTY_PREFIX for i, p in enumerate(prefixed)]
        idx = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        adv = prefix_advantage(token_level_rewards, response_mask, prefix_mask.to(response_mask.dtype), idx,
                               prefix_index, num_rollouts_per_prefix=1, v2=v2)  # fmt: skip
        return adv, adv

    return estimator


_ADV_ENTRY = dict(check=_check_prefix_adv, reads=("mix.n_prefix", "mix.prefix_share_across_samples", "actor_rollout_ref.rollout.n"))
dr_grpo_prefix = register_adv_estimator("dr_grpo_prefix", **_ADV_ENTRY)(_prefix_estimator(v2=False))
dr_grpo_prefix_v2 = register_adv_estimator("dr_grpo_prefix_v2", **_ADV_ENTRY)(_prefix_estimator(v2=True))


def _check_entropy_select(config: Any) -> None:
    actor, loss = config.actor_rollout_ref.actor, config.mix.loss
    if not (bool(actor.get("calculate_entropy", False)) or float(actor.entropy_coeff) != 0.0):
        raise EntryConfigError(
            "mix.loss.prefix_token_select=prefix_rft_entropy ranks prefix tokens by the policy's entropy, which the "
            "worker computes only with actor_rollout_ref.actor.calculate_entropy=true (or entropy_coeff != 0)"
        )
    if bool(loss.get("use_sft_multitask_loss", False)):
        raise EntryConfigError("mix.loss.prefix_token_select=prefix_rft_entropy needs the policy loss on prefix tokens: "
                               "set mix.loss.use_sft_multitask_loss=false")  # fmt: skip


@register_prefix_token_select(
    "prefix_rft_entropy", check=_check_entropy_select, prefix_tokens_on_policy=True,
    settings={"ratio": number(0.0, 0.0, 1.0)},  # the fraction of prefix tokens masked (official mask ratio)
    reads=("mix.plugin_options.prefix_rft_entropy.ratio", "mix.loss.prefix_token_select_ratio",
           "actor_rollout_ref.actor.calculate_entropy",
           "actor_rollout_ref.actor.entropy_coeff", "mix.loss.use_sft_multitask_loss"),
)  # fmt: skip
def prefix_rft_entropy(view: PrefixTokenView) -> torch.Tensor:
    """Keep all but the ``view.ratio`` lowest-entropy prefix tokens of the micro-batch (the official mask ratio)."""
    if view.entropy is None:
        raise ValueError("prefix_rft_entropy needs the entropy on the worker: set actor_rollout_ref.actor.calculate_entropy=true")
    return entropy_keep_mask(view.entropy, view.prefix_mask, view.ratio)
