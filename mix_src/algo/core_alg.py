"""LUFFY's algorithm core in pure torch/numpy (no verl, no GPU): advantages, the mixed on/off-policy token loss's old
entry, aggregation, prefix advantage weights and the adaptive entropy coefficient.

Reference: the LUFFY paper (arXiv 2504.14945, section 3) and the original code (https://github.com/ElliottYan/LUFFY:
luffy/verl/verl/mix_src/mix_core_alg.py, mix_actor.py); the original's bugs are not copied.

Shapes: B rows (responses), L response width (padded), G groups (prompts); the loss's notation: loss_terms.py.

Departures from the original (each one is a bug fix of the original or a documented choice):
    * grpo_split: a group with no on-policy row falls back to statistics over all its rows (the original
      raises KeyError); "std == 0" is decided by exact equality of the group's scores.
    * every metric over an empty token set is 0 (never NaN); the clip fraction is measured before the max
      (the original's stock version is always 0) and over on-policy tokens only.
    * the p/(p+gamma) shaping constant gamma is a number; "p_div_p_0.1/0.3/0.5" are accepted as aliases.
    * loss aggregation follows verl's `agg_loss` exactly (including its global-batch normalisation), plus
      "luffy-token-sum-norm" (the original's loss_remove_token_mean).
    * the adaptive entropy coefficient is capped by projecting log(alpha) after each step, so it can come
      back down from the cap (the original clamps alpha itself, which zeroes the gradient at the cap).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import numpy as np
import torch

from mix_src.algo.token_maths import (  # re-exported: their import paths from here stay (plugins, tests)
    LOG_RATIO_CLAMP, LOSS_AGG_MODES, OFF_POLICY_RESHAPES, ON_POLICY_RESHAPES, P_DIV_P_ALIASES, ReshapeParams,
    _bool_mask, _check_same_shape, agg_loss, masked_mean, masked_sum, register_off_policy_reshape,
    register_on_policy_reshape,
)  # fmt: skip
from mix_src.algo.loss_terms import TokenBatch, TokenLossConfig, token_loss

__all__ = ["LOG_RATIO_CLAMP", "P_DIV_P_ALIASES", "LOSS_AGG_MODES", "OFF_POLICY_RESHAPES", "ON_POLICY_RESHAPES",
           "ReshapeParams", "AdaptiveEntropyCoef", "agg_loss", "kept_tokens_per_mini_batch",
           "apply_prefix_advantage_weights", "compute_grpo_outcome_advantage_split", "compute_sft_pure_loss",
           "compute_token_on_off_policy_loss", "masked_mean", "masked_sum", "register_off_policy_reshape",
           "register_on_policy_reshape"]  # fmt: skip


def group_ids(index: Any, num_rows: int | None = None) -> torch.Tensor:
    """index: (B,) group id per row (numpy array of str/int, list, or tensor) -> (B,) long ids in [0, G), vectorised
    (no Python loop over rows); B must be num_rows (default len(index))."""
    if isinstance(index, torch.Tensor):
        _, inverse = torch.unique(index.reshape(-1), return_inverse=True)
    else:
        ids = np.asarray(index).reshape(-1)
        inverse = None
        if ids.dtype == object:
            # verl's uids are strings, slow for np.unique: group by hash, np.unique only if two ids share one
            hashes = np.fromiter(map(hash, ids), dtype=np.int64, count=ids.size)
            _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
            if not np.all(ids[first][inverse.reshape(-1)] == ids):
                inverse = None
        if inverse is None:
            _, inverse = np.unique(ids, return_inverse=True)
        inverse = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
    num_rows = len(index) if num_rows is None else num_rows
    if inverse.numel() != num_rows:
        raise ValueError(f"index has {inverse.numel()} entries but there are {num_rows} rows")
    return inverse


@torch.no_grad()
def compute_grpo_outcome_advantage_split(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any,
                                         on_policy_mask: torch.Tensor, epsilon: float = 1e-6,
                                         use_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages whose group statistics come from the on-policy rows only (the original's
    `compute_grpo_outcome_advantage_split`, mix_core_alg.py).

    token_level_rewards: (B, L), a row's score R_i is their sum; response_mask: (B, L) (any dtype, multiplied as
    verl does); index: (B,) group ids (verl's `uid`); on_policy_mask: (B,) bool, rows without a prefix.

    Per group g with statistic rows S (its on-policy rows; all its rows when it has none, where the
    original raises KeyError): mu = mean(R_S), sigma = unbiased std(R_S); |S| = 1 -> mu = 0, sigma = 1;
    all R_S exactly equal -> A = 0 for S (sigma treated as 1, mu = that value). Every row of the group,
    on- or off-policy, gets A_i = (R_i - mu) / (sigma + epsilon) (R_i - mu without use_std, LUFFY's grpo_use_std).
    Returns (advantages, returns): the same (B, L) tensor twice, A_i on valid tokens and 0 elsewhere.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    num_rows = token_level_rewards.shape[0]
    if tuple(on_policy_mask.shape) != (num_rows,):
        raise ValueError(f"on_policy_mask must have shape ({num_rows},), got {tuple(on_policy_mask.shape)}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")

    scores = token_level_rewards.sum(dim=-1)  # (B,)
    gid = group_ids(index, num_rows).to(scores.device)
    num_groups = int(gid.max()) + 1 if num_rows else 0
    stat_dtype = torch.float64  # per-row statistics are cheap; compute them in double
    r = scores.to(stat_dtype)

    zeros = torch.zeros(num_groups, dtype=stat_dtype, device=r.device)
    on = _bool_mask(on_policy_mask).to(scores.device)
    stat_row = on | (zeros.index_add(0, gid, on.to(stat_dtype)) == 0)[gid]  # (B,) rows that define their group's stats
    w = stat_row.to(stat_dtype)
    count = zeros.index_add(0, gid, w)
    mean = zeros.index_add(0, gid, r * w) / count
    dev = (r - mean[gid]) * w
    var = zeros.index_add(0, gid, dev * dev) / (count - 1).clamp(min=1)
    std = var.sqrt()
    inf = torch.tensor(float("inf"), dtype=stat_dtype, device=r.device)
    gmax = zeros.scatter_reduce(0, gid, torch.where(stat_row, r, -inf), "amax", include_self=False)
    gmin = zeros.scatter_reduce(0, gid, torch.where(stat_row, r, inf), "amin", include_self=False)

    single = count == 1
    all_equal = (gmax == gmin) & ~single
    mean = torch.where(single, 0.0, torch.where(all_equal, gmax, mean))
    std = torch.where(single | all_equal, 1.0, std)

    centred = r - mean[gid]
    adv_row = centred / (std[gid] + epsilon) if use_std else centred
    advantages = _rows_times_mask(adv_row.to(scores.dtype), response_mask)
    return advantages, advantages


def _rows_times_mask(row_values: torch.Tensor, mask: torch.Tensor, block_elems: int = 1 << 18) -> torch.Tensor:
    """(B,) per-row values, (B, L) mask -> (B, L) values[:, None] * mask (in values' dtype), written in blocks of
    ~256K elements so verl's int64 mask is converted while in cache, not into a full-size temporary."""
    out = torch.empty(mask.shape, dtype=row_values.dtype, device=row_values.device)
    block = max(1, block_elems // max(1, mask.shape[1]))
    column = row_values[:, None]
    for start in range(0, mask.shape[0], block):
        rows = slice(start, start + block)
        torch.mul(mask[rows].to(row_values.dtype), column[rows], out=out[rows])
    return out


def apply_prefix_advantage_weights(advantages: torch.Tensor, prefix_mask: torch.Tensor, alpha: float,
                                   beta: float) -> torch.Tensor:
    """LUFFY's alpha/beta prefix weighting (the original's mix_trainer.py, advantage stage): A * (alpha * g + beta *
    (1 - g)); advantages, prefix_mask: (B, L) -> a new (B, L) tensor, prefix tokens scaled by alpha, others by beta."""
    _check_same_shape(advantages=advantages, prefix_mask=prefix_mask)
    return torch.where(_bool_mask(prefix_mask), advantages * alpha, advantages * beta)


def kept_tokens_per_mini_batch(kept_mask: torch.Tensor, dp_size: int, mini_batch_rows: int) -> torch.Tensor:
    """kept_mask (B, L) -> (B,) float64: the kept tokens of each row's global mini-batch (as `agg_loss`'s
    `batch_num_tokens`: a token mean over a subset, whatever the micro-batch split), under verl's layout
    (`engine_workers.train_mini_batch`, `shuffle=False`): B rows split into `dp_size` contiguous chunks, each into
    mini-batches of `mini_batch_rows // dp_size` rows; mini-batch j of every rank makes global mini-batch j."""
    rows = kept_mask.shape[0]
    if dp_size < 1 or mini_batch_rows < dp_size or mini_batch_rows % dp_size or rows % dp_size \
            or (rows // dp_size) % (mini_batch_rows // dp_size):
        raise ValueError(f"{rows} rows cannot be split into {dp_size} DP ranks x mini-batches of {mini_batch_rows} "
                         "rows (verl needs each to divide the next)")
    per_rank, per_mini = rows // dp_size, mini_batch_rows // dp_size
    mini_batch = (torch.arange(rows, device=kept_mask.device) % per_rank) // per_mini  # (B,) global mini-batch j
    counts = _bool_mask(kept_mask).sum(dim=-1).to(torch.float64)
    totals = torch.zeros(per_rank // per_mini, dtype=torch.float64, device=kept_mask.device)
    return totals.index_add_(0, mini_batch, counts)[mini_batch]


def compute_token_on_off_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                     response_mask: torch.Tensor, prefix_mask: torch.Tensor,
                                     **options: Any) -> dict[str, torch.Tensor]:
    """Deprecated: :func:`mix_src.algo.loss_terms.token_loss` (the same numbers); each keyword goes to the
    ``TokenBatch`` field of its name, every other one to ``TokenLossConfig``."""
    warnings.warn("mix_src.algo.core_alg.compute_token_on_off_policy_loss is deprecated; use mix_src.algo.loss_terms.token_loss "
                  "with a TokenBatch and a TokenLossConfig", DeprecationWarning, stacklevel=2)  # fmt: skip
    batch_keys = {f.name for f in dataclasses.fields(TokenBatch)}
    batch = TokenBatch(old_log_prob, log_prob, advantages, response_mask, prefix_mask,
                       **{k: v for k, v in options.items() if k in batch_keys})  # fmt: skip
    return token_loss(batch, TokenLossConfig(**{k: v for k, v in options.items() if k not in batch_keys}))


def compute_sft_pure_loss(log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood sum(-l * m) / sum(m), 0 when the mask is empty: (B, L), (B, L) -> ()."""
    _check_same_shape(log_prob=log_prob, mask=mask)
    return masked_mean(-log_prob, _bool_mask(mask))


class AdaptiveEntropyCoef:
    """Learned entropy-bonus coefficient alpha (LUFFY's use_adaptive_temperature, the original's mix_actor.py).

    log(alpha) starts at log(init_coef) and is trained by AdamW on alpha_loss = (H - H*) * alpha: alpha falls while
    the entropy H is above the target H* and rises below it; max_coef caps alpha by projecting log(alpha). Use
    `ac.coef` during a mini-batch, then `ac.update(mean_entropy)` once per optimiser step. init_coef, lr, max_coef
    > 0: checked as actor.entropy_coeff (worker/loss.py), mix.loss.alpha_lr and entropy_coeff_max (config).
    """

    def __init__(self, init_coef: float, target_entropy: float, lr: float = 1e-2, max_coef: float | None = None):
        self.target_entropy = float(target_entropy)
        self.max_coef = max_coef
        start = init_coef if max_coef is None else min(init_coef, max_coef)
        self.log_alpha = torch.tensor(math.log(start), dtype=torch.float64, requires_grad=True)
        self.optimizer = torch.optim.AdamW([self.log_alpha], lr=lr)  # betas (0.9, 0.999), weight_decay 1e-2

    @property
    def coef(self) -> float:  # alpha = exp(log_alpha)
        return float(self.log_alpha.detach().exp())

    def state(self) -> dict[str, float]:
        """What a resumed run needs, as plain floats: log_alpha and AdamW's step and moments."""
        adam = self.optimizer.state.get(self.log_alpha, {})
        return {"log_alpha": float(self.log_alpha.detach()), "step": float(adam.get("step", 0.0)),
                "exp_avg": float(adam.get("exp_avg", 0.0)), "exp_avg_sq": float(adam.get("exp_avg_sq", 0.0))}

    def load_state(self, state: dict[str, float]) -> None:
        """Continue from a `state()` (the options stay this object's)."""
        with torch.no_grad():
            self.log_alpha.fill_(float(state["log_alpha"]))
        if float(state.get("step", 0.0)) > 0:
            dtype = self.log_alpha.dtype
            self.optimizer.load_state_dict({
                "state": {0: {"step": torch.tensor(float(state["step"])),
                              "exp_avg": torch.tensor(float(state["exp_avg"]), dtype=dtype),
                              "exp_avg_sq": torch.tensor(float(state["exp_avg_sq"]), dtype=dtype)}},
                "param_groups": self.optimizer.state_dict()["param_groups"]})

    def update(self, entropy: float) -> dict[str, float]:
        """One AdamW step on alpha_loss; returns alpha_loss, the new entropy_coeff and log_alpha."""
        alpha_loss = (float(entropy) - self.target_entropy) * self.log_alpha.exp()
        self.optimizer.zero_grad()
        alpha_loss.backward()
        self.optimizer.step()
        if self.max_coef is not None:
            with torch.no_grad():
                self.log_alpha.clamp_(max=math.log(self.max_coef))
        return {"alpha_loss": float(alpha_loss.detach()), "entropy_coeff": self.coef,
                "log_alpha": float(self.log_alpha.detach())}
