"""HPT (Hybrid Post-Training), as a mix_src plugin: per prompt, SFT on the expert solution or RL on the
model's own samples, chosen by how often those samples solve the prompt.

Paper: Lv et al., "Towards a Unified View of Large Language Model Post-Training" (arXiv 2509.04419).
Official code: github.com/TsinghuaC3I/Unify-Post-Training, ``hpt/verl/verl/mix_src/mix_trainer.py``
(``select_on_off_ada_balance`` and the ``unify_strategy == 'switch'`` branch of ``fit``) and
``mix_actor.py`` (``offline_loss_type == "sft"``), commit ae332f5fa4dc8b4c3d3cd77ebc9cff3a3abab2d0.

Per generation batch:

1. all ``n`` samples of every prompt on-policy (the official ``n_verify`` first pass);
2. ``k`` = the prompt's solved samples; if ``k <= switch_gate`` (official default 0) and the prompt has a
   target, its ``n`` rows are replaced by the whole target + EOS (ratio 1.0) and marked ``sft_row`` = 1;
   the other prompts keep their ``n`` on-policy rows (``sft_row`` = 0).

The loss is the core's row loss ``mix.loss.row_loss=sft_rows`` (mix_src/algo/row_loss.py): the policy loss on the
RL rows + ``sft_loss_coef`` x the token-mean NLL of the SFT rows. The official code keeps one target row per SFT
prompt (its trainer removes the prompt's on-policy rows and adds one off-policy row). verl's batch keeps ``n`` rows
per prompt, so the group keeps its ``n`` rows, but only the first is an SFT row: the other ``n - 1`` (copies of it)
are marked ``sft_row`` = SFT_COPY, which no loss term or count sees (mix_src/algo/row_loss.py), so wherever verl's
balancing puts them each SFT prompt weighs one row's tokens in one micro-batch, as the official (README: every difference). Settings: ``mix.plugin_options.hpt.switch_gate`` (default 0).
Load it with ``mix.plugins=[recipes/hpt/hpt.py] mix.rollout_policy=hpt mix.loss.row_loss=sft_rows``.
"""

from __future__ import annotations

import numpy as np
import torch

from mix_src.extend import EntryConfigError, integer
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES, RolloutContext, register_rollout_policy, replace_rows, solved
from mix_src.algo.row_loss import SFT_COPY, SFT_ROW

NAME = "hpt"
SETTINGS = {"switch_gate": integer(0, -1)}  # the official exp_scripts/train.sh (Qwen2.5-Math): SWITCH_GATE=0


def options(mix) -> dict:
    """The plugin's settings, ``mix.plugin_options.hpt`` over the defaults of :data:`SETTINGS`."""
    return ROLLOUT_POLICIES.settings(NAME, mix.plugin_options.get(NAME))


def switch_to_sft(solved_counts: np.ndarray, has_target: np.ndarray, switch_gate: int) -> np.ndarray:
    """HPT's switch (official ``select_on_off_ada_balance``, 'switch'): (P,) solved samples per prompt,
    (P,) bool target present -> (P,) bool, True = train the prompt with SFT on its target."""
    return (np.asarray(solved_counts) <= switch_gate) & np.asarray(has_target, dtype=bool)


def _check(config) -> None:
    mix = config.mix
    gate, n = mix.plugin_options[NAME]["switch_gate"], int(config.actor_rollout_ref.rollout.n)  # resolved: registry.py
    if gate > n:
        raise EntryConfigError(f"mix.plugin_options.{NAME}.switch_gate={gate!r} must be an integer in [-1, "
                               f"rollout.n={n}] (-1: never SFT, i.e. GRPO; n: always SFT)")
    if mix.loss.get("row_loss") != "sft_rows":
        raise EntryConfigError(f"mix.rollout_policy={NAME!r} marks SFT rows for mix.loss.row_loss=sft_rows (got "
                               f"{mix.loss.get('row_loss')!r}); set mix.loss.row_loss=sft_rows")
    if not (mix.n_prefix == -1 and mix.prefix_strategy == "random" and mix.min_prefix_ratio == 1.0
            and mix.max_prefix_ratio == 1.0):  # fmt: skip
        raise EntryConfigError(
            f"mix.rollout_policy={NAME!r} trains SFT prompts on the whole target: set mix.n_prefix=-1, "
            f"mix.prefix_strategy=random, mix.min_prefix_ratio=1.0, mix.max_prefix_ratio=1.0 (got n_prefix="
            f"{mix.n_prefix}, prefix_strategy={mix.prefix_strategy}, ratios=[{mix.min_prefix_ratio}, "
            f"{mix.max_prefix_ratio}])"
        )


@register_rollout_policy(
    NAME,
    check=_check,
    settings=SETTINGS,
    reads=("mix.plugin_options.hpt.switch_gate", "mix.loss.row_loss", "mix.n_prefix", "mix.prefix_strategy",
           "mix.min_prefix_ratio", "mix.max_prefix_ratio", "actor_rollout_ref.rollout.n"),
)  # fmt: skip
def hpt(ctx: RolloutContext):
    n = ctx.n
    first = ctx.generate(np.zeros(len(ctx.batch)))  # pass 1: all on-policy
    ratios = ctx.prefix_ratios()  # n_prefix=-1, ratio 1.0: 1.0 on every row with a target, 0 elsewhere
    has_target = (ratios.reshape(-1, n) > 0).all(axis=1)
    sft_prompts = switch_to_sft(solved(first).reshape(-1, n).sum(axis=1), has_target, options(ctx.mix)["switch_gate"])
    rows = np.flatnonzero(np.repeat(sft_prompts, n))
    out = replace_rows(first, rows, ctx.generate(ratios[rows], rows)) if rows.size else first
    out.batch[SFT_ROW] = torch.as_tensor(np.repeat(sft_prompts, n), dtype=torch.float32)
    return drop_copies(out, sft_prompts, n)


def drop_copies(batch, sft_prompts: np.ndarray, n: int):
    """The official keeps one target row per SFT prompt: the rows 1..n-1 of each SFT prompt's group (copies of row 0)
    are marked SFT_COPY in ``sft_row`` (a per-row field both trainer bases carry to the worker loss)."""
    copies = np.flatnonzero((np.arange(len(sft_prompts) * n) % n > 0) & np.repeat(sft_prompts, n))
    if copies.size:
        batch.batch[SFT_ROW][torch.as_tensor(copies)] = SFT_COPY
    return batch
