"""Pure torch pieces of LUFFY's loss (arXiv 2504.14945 section 3; the original's mix_core_alg.py): masked sums,
verl 0.9.1's `agg_loss` (verl/trainer/ppo/core_algos.py, plus LUFFY's token sum / L), and the registries of the on-
and off-policy reshapes (options of the ``ppo_clip`` and ``shaped_off_policy`` loss terms). Shapes: B rows, L
response width; masks (B, L), non-zero = valid.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from mix_src.extend import Registry

__all__ = ["LOG_RATIO_CLAMP", "LOSS_AGG_MODES", "OFF_POLICY_RESHAPES", "ON_POLICY_RESHAPES", "P_DIV_P_ALIASES",
           "ReshapeParams", "agg_loss", "masked_mean", "masked_sum", "off_policy_shape", "on_policy_ratio",
           "register_off_policy_reshape", "register_on_policy_reshape"]  # fmt: skip

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                  "luffy-token-sum-norm")
P_DIV_P_ALIASES = {"p_div_p_0.1": 0.1, "p_div_p_0.3": 0.3, "p_div_p_0.5": 0.5}  # the original's names (gamma in them)
LOG_RATIO_CLAMP = 20.0  # |l - l_old| is clamped before exp, as verl's vanilla PPO loss does


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """(any shape) bool/int/float mask -> bool mask of the same shape (non-zero = valid)."""
    return mask if mask.dtype == torch.bool else mask.bool()


def _check_same_shape(**tensors: torch.Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"expected tensors of one shape (B, L), got {shapes}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum over `axis` (all when None) of `values` where `mask` is non-zero, exactly as verl's `masked_sum` (NaN
    outside the mask is ignored; a non-binary numeric mask also weights the values)."""
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
    """Mean of `values` over the non-zero entries of `mask` (same shape), a scalar tensor; 0 (not NaN) if none."""
    return masked_sum(values, mask) / _nonzero(_count(mask))


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: int | torch.Tensor | None = None, global_batch_size: int | torch.Tensor | None = None,
             loss_scale_factor: float | None = None) -> torch.Tensor:
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
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not allowed; allowed values: {', '.join(LOSS_AGG_MODES)}")
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("batch_num_tokens (global) is required for token-mean when dp_size > 1")
            batch_num_tokens = _nonzero(_count(loss_mask))
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    horizon = loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1]
    if loss_agg_mode == "luffy-token-sum-norm":
        return masked_sum(loss_mat, loss_mask) / horizon * dp_size
    seq_tokens = loss_mask.sum(dim=-1)
    seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)  # seq-mean-token-sum(-norm); divided for token-mean
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (seq_tokens + 1e-8)
    seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"global_batch_size is required for {loss_agg_mode} when dp_size > 1")
        global_batch_size = _nonzero(seq_mask.sum())
    loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    return loss / horizon if loss_agg_mode == "seq-mean-token-sum-norm" else loss


# ---- the reshapes of the mixed token loss (its terms and composer: mix_src/algo/loss_terms.py)

class ReshapeParams(NamedTuple):
    """The knobs of one side's reshape (mix.loss.{off,on}_policy_reshape_{gamma,weight,pow_exp})."""

    gamma: float
    weight: float
    pow_exp: float


OffPolicyReshape = Callable[[torch.Tensor, torch.Tensor, ReshapeParams], tuple]
OnPolicyReshape = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ReshapeParams], tuple]

OFF_POLICY_RESHAPES: Registry[OffPolicyReshape] = Registry("off-policy reshape", "mix.loss.off_policy_reshape")
"""Off-policy shaping f(p) of prefix tokens (token loss -A * f): ``fn(log_prob, prob, params) -> (f, df_dlogp)``
on 1-D tensors of the prefix tokens; df_dlogp a tensor or a number, or None for autograd (fn is then called again
with grad enabled)."""
register_off_policy_reshape = OFF_POLICY_RESHAPES.register

ON_POLICY_RESHAPES: Registry[OnPolicyReshape] = Registry("on-policy reshape", "mix.loss.on_policy_reshape")
"""On-policy 'ratio' r in place of exp(l - l_old) in PPO-clip: ``fn(log_ratio, log_prob, old_log_prob, params) ->
(r, dr_dlogp)`` on (B, L) tensors (log_ratio clamped to +-20 as verl does); dr_dlogp as above (autograd then
differentiates the clamp too). Option ``through_log_ratio`` (default True): a closed-form derivative is zeroed
where the clamp is active; False when r is computed from log_prob / old_log_prob directly (p_div_p)."""
register_on_policy_reshape = ON_POLICY_RESHAPES.register


# ---- the built-in reshapes (formulas: mix_src/README.md "Loss options"); d = log_ratio, w = weight, k = pow_exp
def _exp_pow(x: torch.Tensor, k: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^x)^k and its derivative k (e^x)^k (for k = 1 the same tensor, e^x)."""
    if k == 1.0:
        r = torch.exp(x)
        return r, r
    r = torch.exp(k * x)
    return r, k * r


def _p_logp(p: torch.Tensor, x: torch.Tensor, w: float) -> tuple[torch.Tensor, torch.Tensor]:
    return p + w * x, p + w  # p + w*x and its derivative


def _on_p_div_p(log_ratio, lp, old, params):  # [p/(p+gamma)] / [p_old/(p_old+gamma)]; dr/dl = r * gamma/(p+gamma)
    p, p_old = torch.exp(lp), torch.exp(old)
    denom = p + params.gamma
    r = p / denom * ((p_old + params.gamma) / p_old)
    return r, r * (params.gamma / denom)


def _off_p_div_p(lp, p, params):  # f = p/(p+gamma); df/dl = gamma*p/(p+gamma)^2 = f * (1 - f)
    f = p / (p + params.gamma)
    return f, torch.addcmul(f, f, f, value=-1.0)


for _name, _on, _off in (  # name, on-policy fn(d, l, l_old, params), off-policy fn(l, p, params)
    ("no_reshape", lambda d, lp, old, q: _exp_pow(d), lambda lp, p, q: (p, p)),
    ("logp", lambda d, lp, old, q: (d, 1.0), lambda lp, p, q: (q.weight * lp, q.weight)),
    ("p_logp", lambda d, lp, old, q: _p_logp(torch.exp(d), d, q.weight), lambda lp, p, q: _p_logp(p, lp, q.weight)),
    ("square_root", lambda d, lp, old, q: _exp_pow(d, 0.5), lambda lp, p, q: _exp_pow(lp, 0.5)),
    ("pow", lambda d, lp, old, q: _exp_pow(d, q.pow_exp), lambda lp, p, q: _exp_pow(lp, q.pow_exp)),
    ("p_div_p", _on_p_div_p, _off_p_div_p),
):  # fmt: skip
    register_on_policy_reshape(_name, through_log_ratio=_name != "p_div_p")(_on)
    register_off_policy_reshape(_name)(_off)


def _by_autograd(value_of, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value_of(x), its derivative) at x = lp, by autograd: for a reshape that gives no closed-form derivative."""
    with torch.enable_grad():
        x = lp.detach().requires_grad_(True)
        value = value_of(x)
        (derivative,) = torch.autograd.grad(value, x, torch.ones_like(value))
    return value.detach(), derivative


def on_policy_ratio(mode, log_ratio, lp, old, params, in_clamp):
    """On-policy 'ratio' r and dr/dl from the registered reshape (autograd when it gives no derivative).
    in_clamp: None, or (B, L) bool, False where log_ratio was clamped (its derivative is 0 there)."""
    fn = ON_POLICY_RESHAPES.get(mode)
    r, dr = fn(log_ratio, lp, old, params)
    if dr is None:
        r, dr = _by_autograd(lambda x: fn((x - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), x, old, params)[0], lp)
    elif in_clamp is not None and ON_POLICY_RESHAPES.options(mode).get("through_log_ratio", True):
        dr = torch.where(in_clamp, dr, 0.0)
    return r, dr


def off_policy_shape(mode, lp, p, params):
    """Off-policy shaped probability f(p) and df/dl from the registered reshape (autograd when needed)."""
    fn = OFF_POLICY_RESHAPES.get(mode)
    f, df = fn(lp, p, params)
    return _by_autograd(lambda x: fn(x, torch.exp(x), params)[0], lp) if df is None else (f, df)
