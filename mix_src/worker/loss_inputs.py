"""What the trainer adds to the batch before ``update_actor`` for the worker loss (mix_src/worker/loss.py), on the driver.

The worker loss sees one micro-batch at a time; the numbers it needs from the whole global mini-batch are counted
here per row (``core_alg.kept_tokens_per_mini_batch``) and travel in the batch. Also the field names and the
learned entropy coefficient's state, which comes back in the update's metrics. Re-exported by mix_src.worker.loss.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from mix_src.algo.core_alg import kept_tokens_per_mini_batch
from mix_src.config.mix_config import LossConfig as MixLossConfig
from mix_src.algo.row_loss import ROW_LOSSES, SFT_ROW, SFT_TOKENS, row_marks

__all__ = ["COMBINE_FIELDS", "ENTROPY_STATE", "KEPT_TOKENS", "REMOVE_CLIP", "add_combine_inputs", "add_kept_token_counts",
           "add_sft_token_counts", "pop_entropy_state", "uses_kept_token_counts"]  # fmt: skip

KEPT_TOKENS = "mix_kept_tokens"  # (bsz,) float: all_max_clip's kept tokens in the row's global mini-batch
# mix.loss.combine's per-row inputs (add_combine_inputs): the row's global mini-batch counts, the global step
ON_TOKENS, ON_ROWS = "mix_on_tokens", "mix_on_rows"
EXPERT_TOKENS, EXPERT_ROWS = "mix_expert_tokens", "mix_expert_rows"
GLOBAL_STEP = "mix_global_step"
COMBINE_FIELDS = (ON_TOKENS, ON_ROWS, EXPERT_TOKENS, EXPERT_ROWS, GLOBAL_STEP)
# (bsz,) float 0/1 set by a rollout policy in place of mix.loss.loss_remove_clip (recipes/exgrpo's warm-up)
REMOVE_CLIP = "mix_loss_remove_clip"
ENTROPY_STATE = "mix_entropy_state/"  # metric keys carrying the learned entropy coefficient's state


def pop_entropy_state(metrics: dict) -> dict[str, float] | None:
    """Pop the `mix_entropy_state/*` entries (any "actor/" prefix) from the metrics: the latest state, or None."""
    state = {}
    for key in [k for k in metrics if ENTROPY_STATE in k]:
        values = metrics.pop(key)
        while isinstance(values, (list, tuple)) and values:  # per mini-batch / micro-batch / DP-rank lists
            values = values[-1]
        if not isinstance(values, (list, tuple)):
            state[key.split(ENTROPY_STATE, 1)[1]] = float(values)
    return state or None


def uses_kept_token_counts(mix: MixLossConfig, loss_agg_mode: str) -> bool:
    return mix.all_max_clip is not None and loss_agg_mode == "token-mean" and not mix.use_sft_multitask_loss


def add_kept_token_counts(batch, config, mix: MixLossConfig, dp_size: Callable[[], int]) -> None:
    """Driver side, before update_actor: put `mix_kept_tokens` (bsz,) into the DataProto ``batch`` when
    all_max_clip is on with token-mean, and `mix_sft_tokens` when mix.loss.row_loss is set (add_sft_token_counts).
    ``config``: the whole trainer config; ``dp_size()``: the actor's data-parallel size (asked only when needed)."""
    if mix.row_loss is not None:
        add_sft_token_counts(batch, config, mix, dp_size)
    if mix.all_max_clip is None or not uses_kept_token_counts(
            mix, mix.loss_agg_mode or config.actor_rollout_ref.actor.get("loss_agg_mode", "token-mean")):
        return
    kept = batch.batch["response_mask"].bool() & (batch.batch["old_log_probs"] <= math.log(mix.all_max_clip))
    batch.batch[KEPT_TOKENS] = _per_mini_batch(kept, config, dp_size())


def _per_mini_batch(mask: torch.Tensor, config, dp: int) -> torch.Tensor:
    """(bsz, L) mask -> (bsz,) float32: its count in each row's global mini-batch (kept_tokens_per_mini_batch)."""
    rows = int(config.actor_rollout_ref.actor.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n)
    return kept_tokens_per_mini_batch(mask, dp, rows).to(torch.float32)


def add_sft_token_counts(batch, config, mix: MixLossConfig, dp_size: Callable[[], int]) -> None:
    """As add_kept_token_counts, for ``mix.loss.row_loss``: `mix_sft_tokens` (bsz,), the row loss's SFT tokens of each
    row's global mini-batch, from the rollout policy's `sft_row` (bsz,)."""
    if SFT_ROW not in batch.batch.keys():
        raise KeyError(f"mix.loss.row_loss={mix.row_loss!r} needs the per-row field '{SFT_ROW}' in the batch; it is "
                       "set by a rollout policy that marks SFT rows (e.g. recipes/hpt: mix.rollout_policy=hpt)")
    live, sft_row = row_marks(batch.batch[SFT_ROW])  # SFT_COPY rows carry no token
    response_mask = batch.batch["response_mask"].bool() & live[:, None]
    _, sft_mask = ROW_LOSSES.get(mix.row_loss)(response_mask, batch.batch["prefix_mask"].bool() & response_mask,
                                               sft_row)  # fmt: skip
    batch.batch[SFT_TOKENS] = _per_mini_batch(sft_mask, config, dp_size())


def add_combine_inputs(batch, config, mix: MixLossConfig, dp_size: Callable[[], int], global_step: int) -> None:
    """Driver side, before update_actor: with ``mix.loss.combine`` set, put COMBINE_FIELDS into the DataProto
    ``batch`` (rows with a prefix token are expert rows; counts per global mini-batch under verl's layout,
    see core_alg.kept_tokens_per_mini_batch); a no-op otherwise."""
    if mix.combine is None:
        return
    response_mask = batch.batch["response_mask"].bool()
    expert = batch.batch["prefix_mask"].bool() & response_mask
    on = response_mask & ~expert.any(dim=-1, keepdim=True)
    dp = dp_size()
    for key, mask in ((ON_TOKENS, on), (ON_ROWS, on.any(-1, keepdim=True)), (EXPERT_TOKENS, expert),
                      (EXPERT_ROWS, expert.any(-1, keepdim=True))):  # fmt: skip
        batch.batch[key] = _per_mini_batch(mask, config, dp)
    batch.batch[GLOBAL_STEP] = torch.full((len(response_mask),), float(global_step))
