"""Row losses: a per-row choice between the policy loss and SFT (NLL), made by a rollout policy.

A rollout policy marks SFT rows with the per-row field ``sft_row`` ((bsz,) float 0/1, e.g. HPT: every row of a
prompt the model could not solve, recipes/hpt), which travels with the batch like ``prefix_mask``.
``mix.loss.row_loss=name`` picks ``fn(response_mask (bsz, L) bool, prefix_mask (bsz, L) bool, sft_row (bsz,) bool)
-> (rl_mask, sft_mask)``, two (bsz, L) bool masks within response_mask; the worker loss then computes

    loss = PG(rl_mask)  +  sft_loss_coef * NLL(sft_mask)

PG: the mixed loss (prefix tokens inside rl_mask keep LUFFY's off-policy term) aggregated with
``mix.loss.loss_agg_mode`` over the whole mini-batch (SFT rows' tokens included). NLL: aggregated by the entry
``mix.loss.sft_loss_agg`` of :data:`SFT_AGGS`, also used by ``use_sft_multitask_loss`` on the prefix tokens (LUFFY's
official RL+SFT baseline: ``micro_batch_token_mean``, recipes/rl_with_sft_loss). Torch only (no verl).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mix_src.extend import Registry

__all__ = ["ROW_LOSSES", "SFT_AGGS", "SFT_COPY", "SFT_ROW", "SFT_TOKENS", "SftScale", "register_row_loss", "sft_micro_batch_mean",
           "sft_rows"]

SFT_ROW = "sft_row"  # (bsz,) float 0/1: the row is trained with SFT (set by a rollout policy); SFT_COPY: see below
# sft_row = SFT_COPY: a copy of an SFT row that no term counts (its response_mask is taken as all zero by the worker
# loss and the driver's counts): HPT's official keeps one target row per SFT prompt where verl's batch keeps n rows
SFT_COPY = -1.0
SFT_TOKENS = "mix_sft_tokens"  # (bsz,) float: the SFT tokens of the row's global mini-batch

RowLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ROW_LOSSES: Registry[RowLoss] = Registry("row loss", "mix.loss.row_loss")
register_row_loss = ROW_LOSSES.register


def row_marks(sft_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(live, sft) (bsz,) bool of a ``sft_row`` field: live = not an SFT_COPY, sft = an SFT row (value > 0)."""
    sft_row = sft_row.reshape(-1)
    return sft_row != SFT_COPY, sft_row > 0


@register_row_loss("sft_rows", reads=("mix.loss.sft_loss_coef", "mix.loss.loss_agg_mode"))
def sft_rows(response_mask: torch.Tensor, prefix_mask: torch.Tensor, sft_row: torch.Tensor):
    """SFT on every response token of an SFT row, the policy loss on every token of the other rows."""
    sft = sft_row.to(torch.bool).unsqueeze(-1)
    response_mask = response_mask.to(torch.bool)
    return response_mask & ~sft, response_mask & sft


@dataclass(frozen=True)
class SftScale:
    """The numbers an SFT aggregation may read, for one micro-batch on one DP rank."""

    sft_tokens: Optional[float]  # the global mini-batch's SFT tokens (mix_sft_tokens; None without a row loss)
    dp_size: int
    # the official gradient-accumulation divisor (ppo_mini_batch_size // ppo_micro_batch_size per GPU: the rank's
    # rows / micro-batch rows with static micro-batches, 1 with dynamic ones, as in the official runs)
    grad_accum: float
    policy_agg: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the policy loss's aggregation


SftAgg = Callable[[torch.Tensor, torch.Tensor, SftScale], torch.Tensor]
SFT_AGGS: Registry[SftAgg] = Registry("SFT aggregation", "mix.loss.sft_loss_agg")


@SFT_AGGS.register("global_token_mean", reads=("mix.loss.row_loss",))
def _global_token_mean(log_prob: torch.Tensor, sft_mask: torch.Tensor, scale: SftScale) -> torch.Tensor:
    """The default: this micro-batch's share of the global mini-batch's token mean of -log p over the SFT tokens
    (summed over micro-batches and averaged over DP ranks, as verl's engine does): independent of the split."""
    if scale.sft_tokens is None:
        raise KeyError("mix.loss.sft_loss_agg=global_token_mean needs the SFT-token count 'mix_sft_tokens' of a row "
                       "loss (mix.loss.row_loss; mix_src.worker.loss.add_sft_token_counts)")
    m = sft_mask.to(log_prob.dtype)
    return (-log_prob * m).sum() / max(float(scale.sft_tokens), 1.0) * scale.dp_size


@SFT_AGGS.register("policy_loss_agg", reads=("mix.loss.loss_agg_mode", "actor_rollout_ref.actor.loss_scale_factor"))
def _policy_loss_agg(log_prob: torch.Tensor, sft_mask: torch.Tensor, scale: SftScale) -> torch.Tensor:
    """Aggregated exactly like the policy loss (same mode, same global normalisation: e.g. token sum / W), so the two
    terms share one scale and the sum stays micro-batch invariant. log_prob, sft_mask: (bsz, L) -> scalar."""
    return scale.policy_agg(-log_prob, sft_mask)


@SFT_AGGS.register("micro_batch_token_mean", reads=("mix.loss.row_loss", "actor_rollout_ref.actor.use_dynamic_bsz"))
def sft_micro_batch_mean(log_prob: torch.Tensor, sft_mask: torch.Tensor, scale: SftScale) -> torch.Tensor:
    """HPT's official SFT term: this micro-batch's token mean of -log p over its SFT tokens / grad_accum (0 when
    it holds none), no DP factor: FSDP's average over ranks then gives sum_{(rank, micro-batch)} mean / (dp * GA),
    as ``compute_sft_pure_loss`` per micro-batch, then ``loss = policy_loss / self.gradient_accumulation``
    (Unify-Post-Training ae332f5, hpt/verl/verl/mix_src/mix_actor.py:136-165 and :477-478). (bsz, L) -> ()."""
    m = sft_mask.to(log_prob.dtype)
    count = m.sum()
    if not count > 0:
        return (log_prob * 0.0).sum()  # keeps the graph; the official skips a NaN (no SFT row) term
    return (-log_prob * m).sum() / count / scale.grad_accum
