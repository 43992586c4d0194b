"""Guidance on failure, as a mix_src plugin: prefixes only for prompts whose on-policy samples all failed.

The idea behind BREAD (arXiv 2506.17211), Scaf-GRPO (arXiv 2510.19807) and NuRL (arXiv 2509.25666): an
expert prefix is a crutch that biases the policy towards the expert, so use it only where on-policy
sampling gives no learning signal. Per generation batch:

1. first pass: all ``n`` samples of every prompt on-policy (ratio 0);
2. for each prompt whose ``n`` samples all failed (and which has a target), samples ``0 .. k-1``
   (``k = mix.n_prefix``; -1 = all n) are generated again, each starting from a prefix of the target
   whose ratio comes from ``mix.prefix_strategy`` (e.g. ``linear``: the prefix shrinks over training);
   the new rows replace the failed ones, so a group keeps ``n`` rows.

Everything else is mix_src's: the guided rows carry a ``prefix_mask`` and get the shaped off-policy loss,
advantages come from ``algorithm.adv_estimator``. Load it with
``mix.plugins=[recipes/guide_on_failure/guide_on_failure.py] mix.rollout_policy=guide_on_failure``.

Metrics: the trainer's ``batch/off_policy_rows`` counts the guided rows of the step's training batch.
"""

from __future__ import annotations

import numpy as np

from mix_src.trainer.rollout_policy import RolloutContext, group_all_failed, register_rollout_policy, replace_rows


@register_rollout_policy("guide_on_failure")
def guide_on_failure(ctx: RolloutContext):
    n = ctx.n
    first = ctx.generate(np.zeros(len(ctx.batch)))  # pass 1: on-policy
    k = n if ctx.mix.n_prefix == -1 else ctx.mix.n_prefix
    failed = group_all_failed(first, n)  # (num_prompts,)
    ratios = ctx.prefix_ratios()  # the schedule's ratios; 0 where a prompt has no target
    row_failed = np.repeat(failed, n) & (np.arange(len(first)) % n < k) & (ratios > 0)
    rows = np.flatnonzero(row_failed)
    if k == 0 or rows.size == 0:
        return first
    second = ctx.generate(ratios[rows], rows)  # pass 2: the first k samples of all-fail prompts, guided
    return replace_rows(first, rows, second)
