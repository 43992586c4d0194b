"""LUFFY's algorithm core in pure torch: advantages, the mixed on/off-policy token loss, aggregation,
prefix advantage weights and the adaptive entropy coefficient.

This module imports only torch/numpy, so it can be read and tested without verl or a GPU.
Reference: the LUFFY paper (arXiv 2504.14945, section 3) and the original code (https://github.com/ElliottYan/LUFFY:
luffy/verl/verl/mix_src/mix_core_alg.py, mix_actor.py); the original's bugs are not copied.

Notation (shapes): B = rows (responses), L = response width (padded), G = number of groups (prompts).
    log_prob, old_log_prob, advantages, response_mask, prefix_mask: (B, L)
    l = log_prob, l_old = old_log_prob, d = l - l_old, p = exp(l), A = advantages
    valid = response_mask != 0, off = prefix_mask & valid (demonstration tokens), on = valid & ~off

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

import math
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from mix_src.registry import Registry

__all__ = [
    "LOSS_AGG_MODES",
    "OFF_POLICY_RESHAPES",
    "ON_POLICY_RESHAPES",
    "ReshapeParams",
    "AdaptiveEntropyCoef",
    "agg_loss",
    "kept_tokens_per_mini_batch",
    "apply_prefix_advantage_weights",
    "compute_grpo_outcome_advantage_split",
    "compute_sft_pure_loss",
    "compute_token_on_off_policy_loss",
    "masked_mean",
    "masked_sum",
    "register_off_policy_reshape",
    "register_on_policy_reshape",
]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "luffy-token-sum-norm",
)
# The original baked gamma into the option name; these names stay accepted as aliases.
P_DIV_P_ALIASES = {"p_div_p_0.1": 0.1, "p_div_p_0.3": 0.3, "p_div_p_0.5": 0.5}
LOG_RATIO_CLAMP = 20.0  # |l - l_old| is clamped before exp, as verl's vanilla PPO loss does


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """(any shape) bool/int/float mask -> bool mask of the same shape (non-zero = valid)."""
    return mask if mask.dtype == torch.bool else mask.bool()


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")


def _check_same_shape(**tensors: torch.Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"expected tensors of one shape (B, L), got {shapes}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero, exactly as verl's `masked_sum` (NaN outside the mask is
    ignored; a non-binary numeric mask also weights the values). values, mask: same shape; returns the
    sum over `axis` (all elements when None)."""
    if mask.dtype == torch.bool:  # same numbers as verl's where(...) * mask, without the bool multiply
        return torch.where(mask, values, 0.0).sum(dim=axis)
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=axis)


def _count(mask: torch.Tensor) -> torch.Tensor:
    """sum(mask) as a scalar tensor; for a bool mask without the int64 copy that `.sum()` makes."""
    return torch.count_nonzero(mask) if mask.dtype == torch.bool else mask.sum()


def _nonzero(count: torch.Tensor) -> torch.Tensor:
    """A denominator: `count`, or 1 where it is 0 (the numerator is then 0 too, so the result is 0)."""
    return torch.where(count == 0, torch.ones_like(count), count)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the non-zero entries of `mask` (same shape); 0 (not NaN) when the mask is
    empty. Returns a scalar tensor."""
    return masked_sum(values, mask) / _nonzero(_count(mask))


def group_ids(index: Any) -> torch.Tensor:
    """index: (B,) group id per row (numpy array of str/int, list, or tensor) -> (B,) long ids in [0, G)."""
    return _group_ids(index, len(index))[0]


def _group_ids(index: Any, num_rows: int) -> tuple[torch.Tensor, int]:
    """index: (B,) group id per row (numpy array of str/int, list, or tensor) -> ((B,) long ids in
    [0, G), G). Vectorised, no Python loop over rows."""
    if isinstance(index, torch.Tensor):
        _, inverse = torch.unique(index.reshape(-1), return_inverse=True)
    else:
        ids = np.asarray(index).reshape(-1)
        inverse = None
        if ids.dtype == object:
            # verl's uids are Python strings, which np.unique sorts slowly: group by their hash instead,
            # then check that no two different ids share a hash (else fall back to np.unique).
            hashes = np.fromiter(map(hash, ids), dtype=np.int64, count=ids.size)
            _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
            if not np.all(ids[first][inverse.reshape(-1)] == ids):
                inverse = None
        if inverse is None:
            _, inverse = np.unique(ids, return_inverse=True)
        inverse = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
    if inverse.numel() != num_rows:
        raise ValueError(f"index has {inverse.numel()} entries but there are {num_rows} rows")
    num_groups = int(inverse.max()) + 1 if num_rows else 0
    return inverse, num_groups


# --------------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_grpo_outcome_advantage_split(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    on_policy_mask: torch.Tensor,
    epsilon: float = 1e-6,
    use_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages whose group statistics come from the on-policy rows only (the original's
    `compute_grpo_outcome_advantage_split`, mix_core_alg.py).

    Args:
        token_level_rewards: (B, L) rewards; a row's score is their sum R_i.
        response_mask: (B, L) 1 on valid response tokens, 0 elsewhere (any dtype; multiplied, as verl does).
        index: (B,) group id per row (verl's `uid`: numpy array of str, or an int tensor).
        on_policy_mask: (B,) bool, True for rows without a prefix (`~prefix_mask.any(-1)`).
        epsilon: added to the std before dividing.
        use_std: divide by the group std (False: A_i = R_i - mu, LUFFY's grpo_use_std=False).

    Per group g with statistic rows S (its on-policy rows; all its rows when it has none, where the
    original raises KeyError): mu = mean(R_S), sigma = unbiased std(R_S); |S| = 1 -> mu = 0, sigma = 1;
    all R_S exactly equal -> A = 0 for S (sigma treated as 1, mu = that value). Every row of the group,
    on- or off-policy, gets A_i = (R_i - mu) / (sigma + epsilon) (or R_i - mu).

    Returns:
        (advantages, returns): the same (B, L) tensor twice, A_i on valid tokens and 0 elsewhere.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    num_rows = token_level_rewards.shape[0]
    if tuple(on_policy_mask.shape) != (num_rows,):
        raise ValueError(f"on_policy_mask must have shape ({num_rows},), got {tuple(on_policy_mask.shape)}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")

    scores = token_level_rewards.sum(dim=-1)  # (B,)
    gid, num_groups = _group_ids(index, num_rows)
    gid = gid.to(scores.device)
    stat_dtype = torch.float64  # per-row statistics are cheap; compute them in double
    r = scores.to(stat_dtype)

    on = _bool_mask(on_policy_mask).to(scores.device)
    on_count = torch.zeros(num_groups, dtype=stat_dtype, device=r.device).index_add_(0, gid, on.to(stat_dtype))
    stat_row = on | (on_count == 0)[gid]  # (B,) rows that define their group's statistics
    w = stat_row.to(stat_dtype)

    zeros = torch.zeros(num_groups, dtype=stat_dtype, device=r.device)
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
    """(B,) per-row values, (B, L) mask -> (B, L) values[:, None] * mask (in values' dtype).

    The product is written block by block (about 256K elements each): verl's int64 mask is converted
    while it is in cache instead of into a full-size temporary, which makes this ~15% faster on CPU for
    8192 x 1024 (a loop over a few dozen blocks, not over rows)."""
    out = torch.empty(mask.shape, dtype=row_values.dtype, device=row_values.device)
    block = max(1, block_elems // max(1, mask.shape[1]))
    column = row_values[:, None]
    for start in range(0, mask.shape[0], block):
        rows = slice(start, start + block)
        torch.mul(mask[rows].to(row_values.dtype), column[rows], out=out[rows])
    return out


def apply_prefix_advantage_weights(
    advantages: torch.Tensor, prefix_mask: torch.Tensor, alpha: float, beta: float
) -> torch.Tensor:
    """LUFFY's alpha/beta prefix weighting (the original's mix_trainer.py, advantage stage): A * (alpha * g + beta * (1 - g)).

    advantages, prefix_mask: (B, L). Returns a new (B, L) tensor: prefix tokens scaled by alpha, the
    others by beta."""
    _check_same_shape(advantages=advantages, prefix_mask=prefix_mask)
    return torch.where(_bool_mask(prefix_mask), advantages * alpha, advantages * beta)


# --------------------------------------------------------------------------------------------------
# loss aggregation (verl's agg_loss semantics + LUFFY's sum / L)
# --------------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, L) per-token loss into a scalar, with exactly the semantics of verl 0.9.1's
    `core_algos.agg_loss` (same arguments; when the global-batch numbers are given, the micro-batch
    losses summed over micro-batches and averaged over DP ranks give the global-batch loss).

    Modes (m = loss_mask, N = batch_num_tokens or sum(m), S = global_batch_size or #rows with a token,
    W = loss_scale_factor or L; one deliberate difference: with no valid token and no global numbers the
    result is 0, where verl divides 0 by 0 and returns NaN):
        token-mean              sum(m*l) / N * dp_size
        token-sum               sum(m*l) * dp_size
        seq-mean-token-sum      sum_i [sum_t m*l] / S * dp_size
        seq-mean-token-sum-norm the above / W
        seq-mean-token-mean     sum_i [sum_t m*l / (sum_t m + 1e-8)] / S * dp_size
        luffy-token-sum-norm    sum(m*l) / W * dp_size   (LUFFY's loss_remove_token_mean: divide the token
                                sum by the response width, not by a token or sequence count)
    """
    _check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("batch_num_tokens (global) is required for token-mean when dp_size > 1")
            batch_num_tokens = _nonzero(_count(loss_mask))
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode == "luffy-token-sum-norm":
        horizon = loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1]
        return masked_sum(loss_mat, loss_mask) / horizon * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
        seq_mask = (loss_mask.sum(dim=-1) > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"global_batch_size is required for {loss_agg_mode} when dp_size > 1")
            global_batch_size = _nonzero(seq_mask.sum())
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    # seq-mean-token-mean
    seq_tokens = loss_mask.sum(dim=-1)
    seq_losses = masked_sum(loss_mat, loss_mask, axis=-1) / (seq_tokens + 1e-8)
    seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required for seq-mean-token-mean when dp_size > 1")
        global_batch_size = _nonzero(seq_mask.sum())
    return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size


def kept_tokens_per_mini_batch(kept_mask: torch.Tensor, dp_size: int, mini_batch_rows: int) -> torch.Tensor:
    """The token count of each row's global mini-batch, for a token-mean over a subset of the tokens.

    kept_mask: (B, L) the tokens that stay in the loss (e.g. `all_max_clip`'s). Returns (B,) float64: for
    each row, the number of kept tokens in the global mini-batch it is trained in, under verl's layout
    (`engine_workers.train_mini_batch` with `shuffle=False`): the B rows are split into `dp_size`
    contiguous chunks (one per DP rank), each chunk into contiguous mini-batches of
    `mini_batch_rows // dp_size` rows, and mini-batch j of every rank makes global mini-batch j.
    Passed to `agg_loss` as `batch_num_tokens`, it makes the token-mean over the kept tokens of the whole
    mini-batch, whatever the micro-batch split (verl's own `batch_num_tokens` counts every token).
    """
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


# --------------------------------------------------------------------------------------------------
# the mixed on/off-policy token loss
# --------------------------------------------------------------------------------------------------


class _TokenObjective(torch.autograd.Function):
    """Identity on a precomputed (B, L) per-token objective whose derivative w.r.t. log_prob was computed
    in the forward pass. Backward is one multiply, and that derivative is the only tensor kept for it:
    this is what keeps the mixed loss as cheap as plain PPO-clip (tests compare it with autograd)."""

    @staticmethod
    def forward(ctx, log_prob: torch.Tensor, value: torch.Tensor, d_value_d_logp: torch.Tensor):
        ctx.save_for_backward(d_value_d_logp)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (d_value_d_logp,) = ctx.saved_tensors
        return grad_out * d_value_d_logp, None, None


def _dot(values: torch.Tensor, mask_f: torch.Tensor) -> torch.Tensor:
    """Sum of `values` over a float 0/1 mask of the same shape, in one pass (values finite)."""
    return torch.dot(values.reshape(-1), mask_f.to(values.dtype).reshape(-1))


class ReshapeParams(NamedTuple):
    """The knobs of one side's reshape (mix.loss.{off,on}_policy_reshape_{gamma,weight,pow_exp})."""

    gamma: float
    weight: float
    pow_exp: float


OffPolicyReshape = Callable[[torch.Tensor, torch.Tensor, ReshapeParams], tuple]
OnPolicyReshape = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ReshapeParams], tuple]

OFF_POLICY_RESHAPES: Registry[OffPolicyReshape] = Registry("off-policy reshape", "mix.loss.off_policy_reshape")
"""Off-policy shaping f(p) of prefix (demonstration) tokens; the token loss is -A * f.
Signature: ``fn(log_prob, prob, params: ReshapeParams) -> (f, df_dlogp)`` on 1-D tensors of the prefix
tokens (prob = exp(log_prob)); df_dlogp is the derivative of f w.r.t. log_prob (a tensor or a number),
or None to let autograd compute it (the function is then called a second time with grad enabled).
Register with ``@register_off_policy_reshape("name")``; pick with ``mix.loss.off_policy_reshape=name``."""
register_off_policy_reshape = OFF_POLICY_RESHAPES.register

ON_POLICY_RESHAPES: Registry[OnPolicyReshape] = Registry("on-policy reshape", "mix.loss.on_policy_reshape")
"""On-policy 'ratio' r that replaces exp(l - l_old) in PPO-clip on on-policy tokens.
Signature: ``fn(log_ratio, log_prob, old_log_prob, params: ReshapeParams) -> (r, dr_dlogp)`` on (B, L)
tensors; log_ratio = l - l_old clamped to +-20 as verl does. dr_dlogp: the derivative w.r.t. log_prob
(a tensor or a number), or None for autograd (called again with grad enabled; the clamp is then
differentiated too). Option ``through_log_ratio`` (default True): r depends on log_prob through
log_ratio, so a closed-form derivative is zeroed where the clamp is active; False when r is computed
from log_prob / old_log_prob directly (p_div_p)."""
register_on_policy_reshape = ON_POLICY_RESHAPES.register


def _resolve_reshape(arg: str, mode: str, gamma: float) -> tuple[str, float]:
    if mode in P_DIV_P_ALIASES:
        return "p_div_p", P_DIV_P_ALIASES[mode]
    registry = OFF_POLICY_RESHAPES if arg.startswith("off") else ON_POLICY_RESHAPES
    if mode not in registry:
        raise ValueError(
            f"{arg}={mode!r} is not allowed; allowed values: {', '.join([*registry.names(), *P_DIV_P_ALIASES])}"
        )
    return mode, gamma


# ---- built-in on-policy reshapes (d = log_ratio) --------------------------------------------------
@register_on_policy_reshape("no_reshape")
def _on_no_reshape(log_ratio, lp, old, params):  # e^d
    r = torch.exp(log_ratio)
    return r, r


@register_on_policy_reshape("logp")
def _on_logp(log_ratio, lp, old, params):  # d itself (not exponentiated)
    return log_ratio, 1.0


@register_on_policy_reshape("p_logp")
def _on_p_logp(log_ratio, lp, old, params):  # e^d + w*d
    e = torch.exp(log_ratio)
    return e + params.weight * log_ratio, e + params.weight


@register_on_policy_reshape("square_root")
def _on_square_root(log_ratio, lp, old, params):  # (e^d)^(1/2)
    r = torch.exp(0.5 * log_ratio)
    return r, 0.5 * r


@register_on_policy_reshape("pow")
def _on_pow(log_ratio, lp, old, params):  # (e^d)^k
    r = torch.exp(params.pow_exp * log_ratio)
    return r, params.pow_exp * r


@register_on_policy_reshape("p_div_p", through_log_ratio=False)
def _on_p_div_p(log_ratio, lp, old, params):  # [p/(p+gamma)] / [p_old/(p_old+gamma)]; dr/dl = r * gamma/(p+gamma)
    p, p_old = torch.exp(lp), torch.exp(old)
    denom = p + params.gamma
    r = p / denom * ((p_old + params.gamma) / p_old)
    return r, r * (params.gamma / denom)


# ---- built-in off-policy reshapes ----------------------------------------------------------------
@register_off_policy_reshape("no_reshape")
def _off_no_reshape(lp, p, params):  # p
    return p, p


@register_off_policy_reshape("logp")
def _off_logp(lp, p, params):  # w*l
    return params.weight * lp, params.weight


@register_off_policy_reshape("p_logp")
def _off_p_logp(lp, p, params):  # w*l + p
    return params.weight * lp + p, p + params.weight


@register_off_policy_reshape("square_root")
def _off_square_root(lp, p, params):  # sqrt(p)
    f = torch.exp(0.5 * lp)
    return f, 0.5 * f


@register_off_policy_reshape("pow")
def _off_pow(lp, p, params):  # p^k
    f = torch.exp(params.pow_exp * lp)
    return f, params.pow_exp * f


@register_off_policy_reshape("p_div_p")
def _off_p_div_p(lp, p, params):  # f = p/(p+gamma); df/dl = gamma*p/(p+gamma)^2 = f * (1 - f)
    f = p / (p + params.gamma)
    return f, torch.addcmul(f, f, f, value=-1.0)


def _on_policy_ratio(mode, log_ratio, lp, old, params, in_clamp):
    """On-policy 'ratio' r and dr/dl from the registered reshape (autograd when it gives no derivative).
    in_clamp: None, or (B, L) bool, False where log_ratio was clamped (its derivative is 0 there)."""
    fn = ON_POLICY_RESHAPES.get(mode)
    r, dr = fn(log_ratio, lp, old, params)
    if dr is None:
        with torch.enable_grad():
            x = lp.detach().requires_grad_(True)
            r = fn((x - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), x, old, params)[0]
            (dr,) = torch.autograd.grad(r, x, torch.ones_like(r))
        r = r.detach()
    elif in_clamp is not None and ON_POLICY_RESHAPES.options(mode).get("through_log_ratio", True):
        dr = torch.where(in_clamp, dr, 0.0)
    return r, dr


def _off_policy_shape(mode, lp, p, params):
    """Off-policy shaped probability f(p) and df/dl from the registered reshape (autograd when needed)."""
    fn = OFF_POLICY_RESHAPES.get(mode)
    f, df = fn(lp, p, params)
    if df is None:
        with torch.enable_grad():
            x = lp.detach().requires_grad_(True)
            f = fn(x, torch.exp(x), params)[0]
            (df,) = torch.autograd.grad(f, x, torch.ones_like(f))
        f = f.detach()
    return f, df


def _clip_rows(loss_remove_clip: bool | torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """Which rows take the PPO clip: None for none (loss_remove_clip True), else a bool tensor broadcasting
    against ``like`` (B, L): all True for False, ~loss_remove_clip for a (B, 1) per-row choice."""
    if not torch.is_tensor(loss_remove_clip):
        return None if loss_remove_clip else torch.ones((), dtype=torch.bool, device=like.device)
    keep = ~loss_remove_clip.to(device=like.device, dtype=torch.bool).reshape(-1, 1)
    return keep if bool(keep.any()) else None


def compute_token_on_off_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    prefix_mask: torch.Tensor,
    *,
    cliprange: float = 0.2,
    clip_upper_bound: float = 1.0,
    off_policy_reshape: str = "no_reshape",
    off_policy_reshape_gamma: float = 0.1,
    off_policy_reshape_weight: float = 0.1,
    off_policy_reshape_pow_exp: float = 0.5,
    on_policy_reshape: str = "no_reshape",
    on_policy_reshape_weight: float = 0.1,
    on_policy_reshape_pow_exp: float = 0.5,
    off_max_clip: float | None = None,
    off_min_clip: float | None = None,
    all_max_clip: float | None = None,
    loss_remove_clip: bool | torch.Tensor = False,
    loss_agg_mode: str = "token-mean",
    target_probs: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    on_policy_reshape_gamma: float | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    behaviour_log_prob: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """LUFFY's mixed token loss (the original's mix_core_alg.py): PPO on on-policy tokens, -A * f(p) on prefix tokens.

    Per valid token: loss = -A * f(p) on prefix tokens, and on the others the PPO-clip loss
    max(-A r, -A clip(r, 1 - eps, U)) with U = max(clip_upper_bound, 1 + eps); then `agg_loss`.

    Args:
        old_log_prob, log_prob, advantages, response_mask, prefix_mask: (B, L), finite (verl pads
            with 0). Gradients flow to `log_prob` only. prefix_mask marks the off-policy tokens.
        cliprange: eps of the clip interval.
        clip_upper_bound: LUFFY's knob to widen the upper clip bound (it can only widen it).
        off_policy_reshape: f for prefix tokens, from p = exp(log_prob) (NOT divided by any old or
            behaviour probability): no_reshape p | logp w*l | p_logp w*l + p | square_root sqrt(p) |
            pow p^k | p_div_p p/(p+gamma) (aliases p_div_p_0.1, p_div_p_0.3, p_div_p_0.5 set gamma).
        off_policy_reshape_gamma: gamma > 0 of the off-policy p_div_p (an alias name sets it instead).
        off_policy_reshape_weight, off_policy_reshape_pow_exp: w and k of the off-policy options.
        on_policy_reshape: r for on-policy tokens, d = l - l_old clamped to +-20 (as verl does):
            no_reshape e^d | logp d | p_logp e^d + w*d | square_root e^(d/2) | pow e^(k d) |
            p_div_p [p/(p+gamma)] / [p_old/(p_old+gamma)].
        on_policy_reshape_weight, on_policy_reshape_pow_exp: w and k of the on-policy options.
        off_max_clip, off_min_clip: optional clamps of f (None = off).
        all_max_clip: optional c in (0, 1]: tokens with p > c leave the loss (after the metrics).
        loss_remove_clip: no PPO clipping on on-policy tokens (loss = -A r); a bool, or a (B, 1) bool tensor
            choosing per row (e.g. ExGRPO's clipped warm-up, set per step by its rollout policy).
        loss_agg_mode: one of LOSS_AGG_MODES (see `agg_loss`).
        target_probs: (B, L) optional behaviour probabilities: then f = p / (target_probs + 1e-6), and
            off_policy_reshape must be "no_reshape".
        clip_ratio_c: optional dual-clip constant c > 1 (verl's clip_ratio_c): with clipping on, the
            on-policy loss of a token with A < 0 is capped at -A*c. None (LUFFY) = off.
        rollout_is_weights: (B, L) optional verl rollout-correction weights; they multiply the on-policy
            token losses only (prefix tokens were not sampled by the rollout policy).
        on_policy_reshape_gamma: gamma > 0 of the on-policy p_div_p; None = off_policy_reshape_gamma (an
            alias name sets it instead).
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: verl's global batch info,
            passed to `agg_loss` unchanged (micro-batch invariant normalisation).
        behaviour_log_prob: (B, L) optional log-probs l_b of the policy that produced the prefix tokens
            (mix_src/off_policy_behaviour.py): the off-policy shaping then takes the importance weight
            w = exp(l - l_b) where it takes p = exp(l) without it (f = w/(w+gamma) for p_div_p, as ExGRPO's
            mix_core_alg.py with recorded old log-probs). None = LUFFY (the expert's probability taken as 1).

    Returns:
        dict of scalar tensors: pg_loss (with grad), and detached metrics off_pg_loss, on_pg_loss,
        on_pg_clipfrac, on_pg_clipfrac_lower (dual clip), ppo_kl, off_policy_prob, on_policy_prob,
        off_ratio_mean, off_ratio_max_clip_frac, off_ratio_min_clip_frac. A metric over no tokens is 0.
        Metrics use the masks before all_max_clip; clip fractions count on-policy tokens; ppo_kl is
        mean(l_old - l) over all valid tokens; on_policy_prob = mean p_old over on-policy tokens.
    """
    # ---- arguments -------------------------------------------------------------------------------
    _check_same_shape(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        prefix_mask=prefix_mask, target_probs=target_probs, rollout_is_weights=rollout_is_weights,
        behaviour_log_prob=behaviour_log_prob,
    )  # fmt: skip
    if target_probs is not None and behaviour_log_prob is not None:
        raise ValueError("target_probs and behaviour_log_prob both give the off-policy behaviour; pass one")
    off_mode, off_gamma = _resolve_reshape("off_policy_reshape", off_policy_reshape, off_policy_reshape_gamma)
    on_gamma_arg = off_policy_reshape_gamma if on_policy_reshape_gamma is None else on_policy_reshape_gamma
    on_mode, on_gamma = _resolve_reshape("on_policy_reshape", on_policy_reshape, on_gamma_arg)
    _check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if not off_gamma > 0:
        raise ValueError(f"off_policy_reshape_gamma must be > 0, got {off_policy_reshape_gamma}")
    if not on_gamma > 0:
        raise ValueError(f"on_policy_reshape_gamma must be > 0, got {on_gamma_arg}")
    if not 0 <= cliprange < 1:
        raise ValueError(f"cliprange must be in [0, 1), got {cliprange}")
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c must be > 1 or None, got {clip_ratio_c}")
    if all_max_clip is not None and not 0 < all_max_clip <= 1:
        raise ValueError(f"all_max_clip must be in (0, 1] or None, got {all_max_clip}")
    if off_max_clip is not None and off_min_clip is not None and off_min_clip > off_max_clip:
        raise ValueError(f"off_min_clip ({off_min_clip}) must be <= off_max_clip ({off_max_clip})")
    if target_probs is not None and off_mode != "no_reshape":
        raise ValueError(
            f"target_probs replaces the off-policy shaping; off_policy_reshape must be 'no_reshape', "
            f"got {off_policy_reshape!r}"
        )
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")

    # Below, everything is written as the objective J = -loss (PPO's min(A r, A clip(r)) form): per
    # token its value and its derivative dJ/dl, both computed without autograd (_TokenObjective).
    with torch.no_grad():
        valid = _bool_mask(response_mask)
        off = _bool_mask(prefix_mask) & valid
        on = valid ^ off  # off is a subset of valid
        n_valid, n_off = _count(valid), _count(off)
        n_on = n_valid - n_off
        has_off, has_on = bool(n_off > 0), bool(n_on > 0)  # one host sync; an empty side is skipped
        lp = log_prob.detach()
        zero = lp.new_zeros(())

        log_ratio = lp - old_log_prob  # d = l - l_old
        in_clamp = None  # d outside +-20 is clamped (as verl does), which also blocks its gradient
        if log_ratio.numel() > 0:
            d_min, d_max = torch.aminmax(log_ratio)
            if d_min < -LOG_RATIO_CLAMP or d_max > LOG_RATIO_CLAMP:
                in_clamp = log_ratio.abs() <= LOG_RATIO_CLAMP
                log_ratio.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl_sum = zero

        # ---- on-policy tokens: J = min(A r, A clip(r)), dJ/dl = A dr where the unclipped branch wins
        clipfrac = clipfrac_lower = on_pg_loss = on_prob = zero
        if not has_on:
            obj, dobj = torch.zeros_like(lp), torch.zeros_like(lp)
        else:
            on_params = ReshapeParams(on_gamma, on_policy_reshape_weight, on_policy_reshape_pow_exp)
            r, dr = _on_policy_ratio(on_mode, log_ratio, lp, old_log_prob, on_params, in_clamp)
            obj = advantages * r
            dobj = obj if dr is r else advantages * dr
            clip_rows = _clip_rows(loss_remove_clip, lp)  # None: no row is clipped
            if clip_rows is not None:
                obj_clipped = advantages * r.clamp(1.0 - cliprange, max(clip_upper_bound, 1.0 + cliprange))
                is_clipped = (obj_clipped < obj) & clip_rows
                obj = torch.where(is_clipped, obj_clipped, obj)
                dobj = dobj.masked_fill_(is_clipped, 0.0)  # dobj is never the new obj: in place is safe
                clipfrac = _count(is_clipped & on) / n_on
                del obj_clipped
                if clip_ratio_c is not None:  # dual clip: J = max(J, A c) where A < 0
                    obj_floor = advantages * clip_ratio_c
                    is_capped = (advantages < 0) & (obj < obj_floor) & clip_rows
                    obj = torch.where(is_capped, obj_floor, obj)
                    dobj.masked_fill_(is_capped, 0.0)
                    clipfrac_lower = _count(is_capped & on) / n_on
            del r, dr
            if rollout_is_weights is not None:
                obj = obj * rollout_is_weights
                dobj = dobj * rollout_is_weights
            on_f = on.to(obj.dtype)
            on_pg_loss = -_dot(obj, on_f) / n_on
            on_prob = _dot(torch.exp(old_log_prob), on_f) / n_on
            kl_sum = _dot(log_ratio, on_f)
            del on_f

        # ---- prefix tokens: J = A f(p), computed on the prefix tokens only (gathered, 1-D) ------------
        off_pg_loss = off_prob = off_ratio_mean = max_clip_frac = min_clip_frac = zero
        if has_off:
            idx = off.reshape(-1).nonzero().squeeze(-1)  # flat positions of the prefix tokens
            lp_o, adv_o = lp.reshape(-1)[idx], advantages.reshape(-1)[idx]
            p_o = torch.exp(lp_o)
            off_prob = p_o.sum() / n_off
            if behaviour_log_prob is not None:  # x = l - l_b: dx/dl = 1, so f and df/dl keep their formulas
                lp_o = lp_o - behaviour_log_prob.reshape(-1)[idx].to(lp_o.dtype)
                p_o = torch.exp(lp_o)
            kl_sum = kl_sum + log_ratio.reshape(-1)[idx].sum()
            if target_probs is not None:
                f = p_o / (target_probs.reshape(-1)[idx] + 1e-6)
                df = f
            else:
                off_params = ReshapeParams(off_gamma, off_policy_reshape_weight, off_policy_reshape_pow_exp)
                f, df = _off_policy_shape(off_mode, lp_o, p_o, off_params)
            if off_max_clip is not None:
                over = f > off_max_clip
                max_clip_frac = _count(over) / n_off
                f, df = torch.where(over, off_max_clip, f), torch.where(over, 0.0, df)
            if off_min_clip is not None:
                under = f < off_min_clip
                min_clip_frac = _count(under) / n_off
                f, df = torch.where(under, off_min_clip, f), torch.where(under, 0.0, df)
            off_ratio_mean = f.sum() / n_off
            obj_off = adv_o * f
            off_pg_loss = -obj_off.sum() / n_off
            if dobj is obj:  # they differ on prefix tokens
                dobj = obj.clone()
            obj.view(-1)[idx] = obj_off
            dobj.view(-1)[idx] = adv_o * df

        ppo_kl = -kl_sum / _nonzero(n_valid)
        loss_mask = valid if all_max_clip is None else valid & (lp <= math.log(all_max_clip))

    # -J aggregated gives exactly the numbers agg_loss gives for the loss matrix -J (every mode is linear)
    pg_loss = -agg_loss(
        _TokenObjective.apply(log_prob, obj, dobj), loss_mask, loss_agg_mode,
        dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )  # fmt: skip
    return {
        "pg_loss": pg_loss,
        "off_pg_loss": off_pg_loss,
        "on_pg_loss": on_pg_loss,
        "on_pg_clipfrac": clipfrac,
        "on_pg_clipfrac_lower": clipfrac_lower,
        "ppo_kl": ppo_kl,
        "off_policy_prob": off_prob,
        "on_policy_prob": on_prob,
        "off_ratio_mean": off_ratio_mean,
        "off_ratio_max_clip_frac": max_clip_frac,
        "off_ratio_min_clip_frac": min_clip_frac,
    }


def compute_sft_pure_loss(log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood: sum(-l * m) / sum(m); 0 when the mask is empty.

    log_prob, mask: (B, L). Returns a scalar tensor (with grad through log_prob)."""
    _check_same_shape(log_prob=log_prob, mask=mask)
    return masked_mean(-log_prob, _bool_mask(mask))


# --------------------------------------------------------------------------------------------------
# entropy coefficient (the original's mix_actor.py, use_adaptive_temperature)
# --------------------------------------------------------------------------------------------------


class AdaptiveEntropyCoef:
    """Learned entropy-bonus coefficient alpha (LUFFY's use_adaptive_temperature).

    log(alpha) starts at log(init_coef) and is trained by AdamW on alpha_loss = (H - H*) * alpha, so one
    step moves it by about -lr * sign(H - H*): alpha falls while the entropy H is above the target H*
    and rises while it is below. max_coef (optional) caps alpha by projecting log(alpha) after each step.

    Usage: `coef = ac.coef` (a float, constant during a mini-batch), then `ac.update(mean_entropy)` once
    per optimiser step with the token-mean entropy of that step's tokens.
    """

    def __init__(
        self,
        init_coef: float,
        target_entropy: float,
        lr: float = 1e-2,
        max_coef: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 1e-2,
    ):
        if not init_coef > 0:
            raise ValueError(f"init_coef (the initial entropy coefficient) must be > 0, got {init_coef}")
        if max_coef is not None and not max_coef > 0:
            raise ValueError(f"max_coef must be > 0 or None, got {max_coef}")
        if not lr > 0:
            raise ValueError(f"lr (alpha_lr) must be > 0, got {lr}")
        self.target_entropy = float(target_entropy)
        self.max_coef = max_coef
        start = init_coef if max_coef is None else min(init_coef, max_coef)
        self.log_alpha = torch.tensor(math.log(start), dtype=torch.float64, requires_grad=True)
        self.optimizer = torch.optim.AdamW([self.log_alpha], lr=lr, betas=betas, weight_decay=weight_decay)

    @property
    def coef(self) -> float:
        """Current alpha = exp(log_alpha)."""
        return float(self.log_alpha.detach().exp())

    def state(self) -> dict[str, float]:
        """Everything a resumed run needs, as plain floats: log_alpha and AdamW's step and moments."""
        adam = self.optimizer.state.get(self.log_alpha, {})
        return {"log_alpha": float(self.log_alpha.detach()), "step": float(adam.get("step", 0.0)),
                "exp_avg": float(adam.get("exp_avg", 0.0)), "exp_avg_sq": float(adam.get("exp_avg_sq", 0.0))}

    def load_state(self, state: dict[str, float]) -> None:
        """Continue from a `state()` (log_alpha and the AdamW moments; the options stay this object's)."""
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
        """One AdamW step on alpha_loss = (entropy - target) * alpha. Returns alpha_loss, the new
        entropy_coeff and log_alpha."""
        alpha_loss = (float(entropy) - self.target_entropy) * self.log_alpha.exp()
        self.optimizer.zero_grad()
        alpha_loss.backward()
        self.optimizer.step()
        if self.max_coef is not None:
            with torch.no_grad():
                self.log_alpha.clamp_(max=math.log(self.max_coef))
        return {"alpha_loss": float(alpha_loss.detach()), "entropy_coeff": self.coef,
                "log_alpha": float(self.log_alpha.detach())}
