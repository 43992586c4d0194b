"""LUFFY's loss as a registry of terms, and the composer of its mixed token loss (pure torch).

Each term is one entry of :data:`LOSS_TERMS` stating its batch fields (``inputs``), config keys (``reads``), trainer
bases, what it ``writes`` and its config checks (``check_loss``, run when ``LossConfig`` is built): mix_src/README.md
"The loss as a registry of terms". Token terms write a per-token objective J and dJ/dl into one (B, L) matrix;
:func:`token_loss` (the original's ``compute_token_on_off_policy_loss``, luffy/verl/verl/mix_src/mix_core_alg.py:69-240,
arXiv 2504.14945 section 3) aggregates -J once, so on- and off-policy tokens share one sum, as in the original. The
worker loss adds the scalar terms in registration order. Departures: core_alg.py's docstring.

Notation (shapes): B rows, L response width; l = log_prob, l_old = old_log_prob, d = l - l_old, p = exp(l), A the
advantages; valid = response_mask, off = prefix_mask & valid (demonstration tokens), on = valid & ~off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from mix_src.algo.token_maths import (
    LOG_RATIO_CLAMP, LOSS_AGG_MODES, OFF_POLICY_RESHAPES, ON_POLICY_RESHAPES, P_DIV_P_ALIASES, ReshapeParams,
    _bool_mask, _check_same_shape, _count, _nonzero, agg_loss, masked_mean, off_policy_shape,
    on_policy_ratio,
)  # fmt: skip
from mix_src.algo.off_policy_behaviour import OFF_POLICY_BEHAVIOURS
from mix_src.extend import Registry

__all__ = ["LOSS_TERMS", "TOKEN_METRICS", "TermInputs", "TokenBatch", "TokenLossConfig", "check_loss_terms",
           "register_loss_term", "token_loss"]  # fmt: skip

TOKEN_METRICS = ("off_pg_loss", "on_pg_loss", "on_pg_clipfrac", "on_pg_clipfrac_lower", "ppo_kl", "off_policy_prob",
                 "on_policy_prob", "off_ratio_mean", "off_ratio_max_clip_frac", "off_ratio_min_clip_frac")  # fmt: skip

# every term is part of every loss (a term switched off adds 0): check_selected_entries checks each one's bases
LOSS_TERMS: Registry[Callable] = Registry("loss term", "mix.loss", selected=lambda config: LOSS_TERMS.names())


def register_loss_term(name: str, *, stage: str, inputs: tuple[str, ...], writes: str, check_loss=None, **entry):
    """Register one term (module docstring): ``stage`` "token" (``fn(batch, cfg, sets, acc)`` adds its tokens' J,
    dJ/dl and metrics to ``acc``) or "scalar" (``fn(t: TermInputs)`` -> a term of the worker loss, or None)."""
    return LOSS_TERMS.register(name, stage=stage, inputs=tuple(inputs), writes=writes, check_loss=check_loss, **entry)


def check_loss_terms(loss_config: Any, prefix: str = "mix.loss") -> None:
    """Every registered term's config checks on the ``mix.loss`` section (once, when the section is built)."""
    for name in LOSS_TERMS.names():
        check = LOSS_TERMS.options(name).get("check_loss")
        if check is not None:
            check(loss_config, prefix)


@dataclass
class TokenLossConfig:
    """The options of :func:`token_loss` (the mix.loss keys of their name, mix_src/README.md "Loss options", with
    verl's actor clip settings), checked when built. cliprange: eps of the clip interval [1 - eps, U], U =
    max(clip_upper_bound, 1 + eps); on_policy_reshape_gamma None: the off-policy one; None clips/clip_ratio_c: off."""

    cliprange: float = 0.2
    clip_upper_bound: float = 1.0
    off_policy_reshape: str = "no_reshape"
    off_policy_reshape_gamma: float = 0.1
    off_policy_reshape_weight: float = 0.1
    off_policy_reshape_pow_exp: float = 0.5
    on_policy_reshape: str = "no_reshape"
    on_policy_reshape_weight: float = 0.1
    on_policy_reshape_pow_exp: float = 0.5
    on_policy_reshape_gamma: Optional[float] = None
    off_max_clip: Optional[float] = None
    off_min_clip: Optional[float] = None
    all_max_clip: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    clip_ratio_c: Optional[float] = None
    off_params: ReshapeParams = field(init=False)
    on_params: ReshapeParams = field(init=False)

    def __post_init__(self):
        if self.on_policy_reshape_gamma is None:
            self.on_policy_reshape_gamma = self.off_policy_reshape_gamma
        for side in ("off", "on"):  # the original's names p_div_p_<gamma>: the gamma goes to its own key
            gamma = P_DIV_P_ALIASES.get(getattr(self, f"{side}_policy_reshape"))
            if gamma is not None:
                setattr(self, f"{side}_policy_reshape", "p_div_p")
                setattr(self, f"{side}_policy_reshape_gamma", gamma)
        _check_off_shaping(self, "mix.loss")  # the token terms' checks of mix.loss's keys of these names
        _check_on_policy(self, "mix.loss")
        if not 0 <= self.cliprange < 1:
            raise ValueError(f"cliprange must be in [0, 1), got {self.cliprange}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 or None, got {self.clip_ratio_c}")
        self.off_params = ReshapeParams(self.off_policy_reshape_gamma, self.off_policy_reshape_weight,
                                        self.off_policy_reshape_pow_exp)  # fmt: skip
        self.on_params = ReshapeParams(self.on_policy_reshape_gamma, self.on_policy_reshape_weight,
                                       self.on_policy_reshape_pow_exp)  # fmt: skip


@dataclass
class TokenBatch:
    """One micro-batch's inputs of :func:`token_loss`: (B, L) tensors, finite (verl pads with 0), gradients flowing
    to log_prob only; prefix_mask marks the off-policy (demonstration) tokens."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    prefix_mask: torch.Tensor
    loss_remove_clip: bool | torch.Tensor = False  # no PPO clip on on-policy tokens; or (B, 1) bool per row (ExGRPO)
    target_probs: Optional[torch.Tensor] = None  # f = p / (target_probs + 1e-6) (off_policy_reshape no_reshape only)
    rollout_is_weights: Optional[torch.Tensor] = None  # verl's rollout correction, on on-policy token losses only
    # log-probs l_b of the policy that produced the prefix tokens: the shaping takes w = exp(l - l_b) where it takes
    # p (mix_src/algo/off_policy_behaviour.py); None = LUFFY (expert probability 1)
    behaviour_log_prob: Optional[torch.Tensor] = None
    dp_size: int = 1  # dp_size .. loss_scale_factor: verl's global batch numbers, for agg_loss
    batch_num_tokens: int | torch.Tensor | None = None
    global_batch_size: int | torch.Tensor | None = None
    loss_scale_factor: Optional[float] = None

    def check(self, cfg: TokenLossConfig) -> None:
        _check_same_shape(
            old_log_prob=self.old_log_prob, log_prob=self.log_prob, advantages=self.advantages,
            response_mask=self.response_mask, prefix_mask=self.prefix_mask, target_probs=self.target_probs,
            rollout_is_weights=self.rollout_is_weights, behaviour_log_prob=self.behaviour_log_prob,
        )  # fmt: skip
        if self.target_probs is not None and self.behaviour_log_prob is not None:
            raise ValueError("target_probs and behaviour_log_prob both give the off-policy behaviour; pass one")
        if self.target_probs is not None and cfg.off_policy_reshape != "no_reshape":
            raise ValueError(f"target_probs replaces the off-policy shaping; off_policy_reshape must be 'no_reshape', "
                             f"got {cfg.off_policy_reshape!r}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")


@dataclass
class TokenSets:
    """The token sets and the clamped log-ratio (B, L), computed once for every token term (no grad)."""

    valid: torch.Tensor
    off: torch.Tensor
    on: torch.Tensor
    n_valid: torch.Tensor
    n_off: torch.Tensor
    n_on: torch.Tensor
    lp: torch.Tensor  # log_prob, detached
    log_ratio: torch.Tensor  # d = l - l_old, clamped to +-LOG_RATIO_CLAMP
    in_clamp: Optional[torch.Tensor]  # None, or False where d was clamped (its derivative is 0 there)

    @classmethod
    def of(cls, batch: TokenBatch) -> "TokenSets":
        valid = _bool_mask(batch.response_mask)
        off = _bool_mask(batch.prefix_mask) & valid
        n_valid, n_off = _count(valid), _count(off)
        lp = batch.log_prob.detach()
        log_ratio = lp - batch.old_log_prob
        in_clamp = None  # d outside +-20 is clamped (as verl does), which also blocks its gradient
        if log_ratio.numel() > 0:
            d_min, d_max = torch.aminmax(log_ratio)
            if d_min < -LOG_RATIO_CLAMP or d_max > LOG_RATIO_CLAMP:
                in_clamp = log_ratio.abs() <= LOG_RATIO_CLAMP
                log_ratio.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return cls(valid, off, valid ^ off, n_valid, n_off, n_valid - n_off, lp, log_ratio, in_clamp)


@dataclass
class TokenAccumulator:
    """What the token terms accumulate: J and dJ/dl (B, L), sum of d over their tokens, and their metrics."""

    obj: torch.Tensor
    dobj: torch.Tensor
    kl_sum: torch.Tensor
    metrics: dict[str, torch.Tensor]


class _TokenObjective(torch.autograd.Function):
    """Identity on a precomputed (B, L) objective whose derivative w.r.t. log_prob is given: backward is one multiply
    and keeps one tensor, which keeps the mixed loss as cheap as plain PPO-clip (tests compare it with autograd)."""

    @staticmethod
    def forward(ctx, log_prob: torch.Tensor, value: torch.Tensor, d_value_d_logp: torch.Tensor):
        ctx.save_for_backward(d_value_d_logp)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (d_value_d_logp,) = ctx.saved_tensors
        return grad_out * d_value_d_logp, None, None


def token_loss(batch: TokenBatch, cfg: TokenLossConfig) -> dict[str, torch.Tensor]:
    """LUFFY's mixed token loss: every registered token term, then one ``agg_loss`` of -J over the valid tokens
    (minus all_max_clip's confident tokens). Returns pg_loss (with grad) and the detached TOKEN_METRICS (each term's
    ``writes``; ppo_kl = mean(l_old - l) over valid tokens): 0 over no tokens, on the masks before all_max_clip."""
    batch.check(cfg)
    # J = -loss in PPO's min(A r, A clip(r)) form: per token its value and dJ/dl, without autograd (_TokenObjective)
    with torch.no_grad():
        sets = TokenSets.of(batch)
        zero = sets.lp.new_zeros(())
        acc = TokenAccumulator(torch.zeros_like(sets.lp), torch.zeros_like(sets.lp), zero,
                               dict.fromkeys(TOKEN_METRICS, zero))
        for name in LOSS_TERMS.names():
            if LOSS_TERMS.options(name).get("stage") == "token":
                LOSS_TERMS.get(name)(batch, cfg, sets, acc)
        acc.metrics["ppo_kl"] = -acc.kl_sum / _nonzero(sets.n_valid)
        loss_mask = sets.valid
        if cfg.all_max_clip is not None:
            loss_mask = sets.valid & (sets.lp <= math.log(cfg.all_max_clip))
    # -J aggregated gives exactly the numbers agg_loss gives for the loss matrix -J (every mode is linear)
    objective = _TokenObjective.apply(batch.log_prob, acc.obj, acc.dobj)
    pg_loss = -agg_loss(objective, loss_mask, cfg.loss_agg_mode, batch.dp_size, batch.batch_num_tokens,
                        batch.global_batch_size, batch.loss_scale_factor)  # fmt: skip
    return {"pg_loss": pg_loss, **acc.metrics}


# ---- the token terms --------------------------------------------------------------------------------------------


def _dot(values: torch.Tensor, mask_f: torch.Tensor) -> torch.Tensor:
    """Sum of `values` over a float 0/1 mask of the same shape, in one pass (values finite)."""
    return torch.dot(values.reshape(-1), mask_f.to(values.dtype).reshape(-1))


def _check_reshape(loss: Any, p: str, side: str, registry) -> None:
    """mix.loss.<side>_policy_reshape is registered, and its gamma and pow_exp are > 0."""
    mode = getattr(loss, f"{side}_policy_reshape")
    if mode not in registry:
        raise ValueError(f"{registry.unknown(mode)}; the original's aliases: {list(P_DIV_P_ALIASES)}")
    for key in (f"{side}_policy_reshape_gamma", f"{side}_policy_reshape_pow_exp"):
        if not getattr(loss, key) > 0:
            raise ValueError(f"{p}.{key}={getattr(loss, key)!r} must be > 0")


def _check_on_policy(loss: Any, p: str) -> None:
    _check_reshape(loss, p, "on", ON_POLICY_RESHAPES)
    if loss.all_max_clip is not None and not 0 < loss.all_max_clip <= 1:
        raise ValueError(f"{p}.all_max_clip={loss.all_max_clip!r} is out of range [0.0, 1.0]")
    if loss.loss_agg_mode is not None and loss.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"{p}.loss_agg_mode={loss.loss_agg_mode!r} is not one of {[None, *LOSS_AGG_MODES]}")
    if loss.clip_upper_bound < 0:
        raise ValueError(f"{p}.clip_upper_bound={loss.clip_upper_bound!r} is out of range [0.0, inf]")


@register_loss_term(
    "ppo_clip", stage="token", inputs=("old_log_probs", "advantages", "response_mask", "rollout_is_weights"),
    writes="J and dJ/dl of the on-policy tokens; on_pg_loss, on_pg_clipfrac(_lower), on_policy_prob; their d in ppo_kl",
    reads=("mix.loss.on_policy_reshape*", "mix.loss.loss_remove_clip", "mix.loss.clip_upper_bound",
           "actor_rollout_ref.actor.clip_ratio*"), check_loss=_check_on_policy,
)  # fmt: skip
def ppo_clip_term(batch: TokenBatch, cfg: TokenLossConfig, sets: TokenSets, acc: TokenAccumulator) -> None:
    """On-policy tokens: J = min(A r, A clip(r, 1 - eps, U)), dJ/dl = A dr/dl where the unclipped branch wins; with
    clip_ratio_c, J = max(J, A c) where A < 0 (verl's dual clip). Writes J over all (B, L) (prefix tokens are
    overwritten by the off-policy term)."""
    if not bool(sets.n_on > 0):
        return
    adv, m = batch.advantages, acc.metrics
    r, dr = on_policy_ratio(cfg.on_policy_reshape, sets.log_ratio, sets.lp, batch.old_log_prob, cfg.on_params,
                             sets.in_clamp)  # fmt: skip
    obj = adv * r
    dobj = obj if dr is r else adv * dr
    remove = batch.loss_remove_clip  # clip_rows: the rows that take the PPO clip, broadcasting to (B, L); None: none
    if torch.is_tensor(remove):
        clip_rows = ~remove.to(device=sets.lp.device, dtype=torch.bool).reshape(-1, 1)
        clip_rows = clip_rows if bool(clip_rows.any()) else None
    else:
        clip_rows = None if remove else torch.ones((), dtype=torch.bool, device=sets.lp.device)
    if clip_rows is not None:
        obj_clipped = adv * r.clamp(1.0 - cfg.cliprange, max(cfg.clip_upper_bound, 1.0 + cfg.cliprange))
        is_clipped = (obj_clipped < obj) & clip_rows
        obj = torch.where(is_clipped, obj_clipped, obj)
        dobj = dobj.masked_fill_(is_clipped, 0.0)  # dobj is never the new obj: in place is safe
        m["on_pg_clipfrac"] = _count(is_clipped & sets.on) / sets.n_on
        del obj_clipped
        if cfg.clip_ratio_c is not None:  # dual clip: J = max(J, A c) where A < 0
            obj_floor = adv * cfg.clip_ratio_c
            is_capped = (adv < 0) & (obj < obj_floor) & clip_rows
            obj = torch.where(is_capped, obj_floor, obj)
            dobj.masked_fill_(is_capped, 0.0)
            m["on_pg_clipfrac_lower"] = _count(is_capped & sets.on) / sets.n_on
    del r, dr
    if batch.rollout_is_weights is not None:
        obj = obj * batch.rollout_is_weights
        dobj = dobj * batch.rollout_is_weights
    on_f = sets.on.to(obj.dtype)
    m["on_pg_loss"] = -_dot(obj, on_f) / sets.n_on
    m["on_policy_prob"] = _dot(torch.exp(batch.old_log_prob), on_f) / sets.n_on
    acc.obj, acc.dobj, acc.kl_sum = obj, dobj, _dot(sets.log_ratio, on_f)


def _check_off_shaping(loss: Any, p: str) -> None:
    _check_reshape(loss, p, "off", OFF_POLICY_RESHAPES)
    if loss.off_max_clip is not None and loss.off_min_clip is not None and loss.off_min_clip > loss.off_max_clip:
        raise ValueError(f"{p}.off_min_clip={loss.off_min_clip} > {p}.off_max_clip={loss.off_max_clip}")


def _check_off_policy(loss: Any, p: str) -> None:
    _check_off_shaping(loss, p)
    if loss.off_policy_behaviour is not None and loss.off_policy_behaviour not in OFF_POLICY_BEHAVIOURS:
        raise ValueError(OFF_POLICY_BEHAVIOURS.unknown(loss.off_policy_behaviour))
    if loss.off_policy_behaviour is not None and loss.use_sft_multitask_loss:
        raise ValueError(f"{p}.off_policy_behaviour={loss.off_policy_behaviour!r} weighs the off-policy loss, which "
                         f"{p}.use_sft_multitask_loss replaces by SFT; pick one")


@register_loss_term(
    "shaped_off_policy", stage="token", inputs=("advantages", "prefix_mask", "behaviour_log_prob", "target_probs"),
    writes="J = A f(p) and dJ/dl of the prefix tokens; off_pg_loss, off_policy_prob, off_ratio_*; their d in ppo_kl",
    reads=("mix.loss.off_policy_reshape*", "mix.loss.off_max_clip", "mix.loss.off_min_clip",
           "mix.loss.off_policy_behaviour"), check_loss=_check_off_policy,
)  # fmt: skip
def shaped_off_policy_term(batch: TokenBatch, cfg: TokenLossConfig, sets: TokenSets, acc: TokenAccumulator) -> None:
    """Prefix tokens: J = A f(p) (LUFFY's policy shaping, f = p/(p+gamma) in its recipe), computed on the prefix
    tokens only (gathered, 1-D); f clamped to [off_min_clip, off_max_clip] where set (derivative 0 there)."""
    if not bool(sets.n_off > 0):
        return
    m, n_off = acc.metrics, sets.n_off
    idx = sets.off.reshape(-1).nonzero().squeeze(-1)  # flat positions of the prefix tokens
    lp_o, adv_o = sets.lp.reshape(-1)[idx], batch.advantages.reshape(-1)[idx]
    p_o = torch.exp(lp_o)
    m["off_policy_prob"] = p_o.sum() / n_off
    if batch.behaviour_log_prob is not None:  # x = l - l_b: dx/dl = 1, so f and df/dl keep their formulas
        lp_o = lp_o - batch.behaviour_log_prob.reshape(-1)[idx].to(lp_o.dtype)
        p_o = torch.exp(lp_o)
    acc.kl_sum = acc.kl_sum + sets.log_ratio.reshape(-1)[idx].sum()
    if batch.target_probs is not None:
        f = p_o / (batch.target_probs.reshape(-1)[idx] + 1e-6)
        df = f
    else:
        f, df = off_policy_shape(cfg.off_policy_reshape, lp_o, p_o, cfg.off_params)
    for side, bound, beyond in (("max", cfg.off_max_clip, torch.gt), ("min", cfg.off_min_clip, torch.lt)):
        if bound is not None:
            clipped = beyond(f, bound)
            m[f"off_ratio_{side}_clip_frac"] = _count(clipped) / n_off
            f, df = torch.where(clipped, bound, f), torch.where(clipped, 0.0, df)
    m["off_ratio_mean"] = f.sum() / n_off
    obj_off = adv_o * f
    m["off_pg_loss"] = -obj_off.sum() / n_off
    if acc.dobj is acc.obj:  # they differ on prefix tokens
        acc.dobj = acc.obj.clone()
    acc.obj.view(-1)[idx] = obj_off
    acc.dobj.view(-1)[idx] = adv_o * df


# ---- the scalar terms of the worker loss (mix_src/worker/loss.py sums them in this order) ------------------------------


@dataclass
class TermInputs:
    """What a scalar term gets, for one micro-batch (built by mix_src/worker/loss.py ``MixPolicyLoss``; shapes (B, L)).

    agg(values, mask): agg_loss with the actor's mode and verl's global batch numbers; policy(): the policy loss;
    entropy, sft_mask, kld: None when the term is off; log(key, value, total): records a metric (total: summed over
    micro-batches like the loss, else averaged)."""

    log_prob: torch.Tensor
    response_mask: torch.Tensor
    agg: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    policy: Callable[[], torch.Tensor]
    entropy: Optional[torch.Tensor]
    entropy_coef: Callable[[], float]
    sft_mask: Optional[torch.Tensor]
    sft_agg: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sft_coef: float
    kld: Optional[Callable[[], torch.Tensor]]
    kl_coef: float
    log: Callable[..., None]
    entropy_agg: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None  # None: agg (mix.loss.entropy_agg)


@register_loss_term("policy", stage="scalar", pg_loss=True, inputs=("old_log_probs", "advantages", "prefix_mask"),
                    writes="the policy loss: the token terms above, aggregated (mix_src/worker/loss.py _policy_loss)",
                    reads=("mix.loss.combine", "actor_rollout_ref.actor.policy_loss.loss_mode"))  # fmt: skip
def policy_term(t: TermInputs) -> torch.Tensor:
    return t.policy()  # its metrics are logged by t.policy


def _check_sft(loss: Any, p: str) -> None:
    if loss.sft_loss_coef < 0:
        raise ValueError(f"{p}.sft_loss_coef={loss.sft_loss_coef!r} is out of range [0.0, inf]")


@register_loss_term("sft", stage="scalar", pg_loss=True, inputs=("prefix_mask", "sft_row", "mix_sft_tokens"),
                    writes="sft_loss_coef * NLL(sft_mask), aggregated by mix.loss.sft_loss_agg; actor/sft_loss, sft_nll",
                    reads=("mix.loss.use_sft_multitask_loss", "mix.loss.row_loss", "mix.loss.sft_loss_coef",
                           "mix.loss.sft_loss_agg"), check_loss=_check_sft)  # fmt: skip
def sft_term(t: TermInputs) -> Optional[torch.Tensor]:
    """The SFT (NLL) term over the SFT tokens: the prefix tokens (use_sft_multitask_loss) or a row loss's rows."""
    if t.sft_mask is None:
        return None
    sft_loss = t.sft_agg(t.log_prob, t.sft_mask)
    t.log("actor/sft_loss", sft_loss, total=True)
    t.log("actor/sft_nll", masked_mean(-t.log_prob.detach(), t.sft_mask), total=False)
    return t.sft_coef * sft_loss


# mix.loss.entropy_agg: None / policy_loss_agg = aggregated like the policy loss (agg); micro_batch_token_mean = each
# micro-batch's token mean / the gradient-accumulation divisor, no DP factor (the official LUFFY, HPT and ExGRPO actors:
# entropy_loss = masked_mean(entropy, response_mask), loss = (pg_loss - entropy_loss * c) / gradient_accumulation,
# luffy/verl/verl/mix_src/mix_actor.py:202, :226, :243)
ENTROPY_AGGS = ("policy_loss_agg", "micro_batch_token_mean")


def micro_batch_token_mean(values: torch.Tensor, mask: torch.Tensor, grad_accum: float) -> torch.Tensor:
    """The micro-batch's token mean of ``values`` over ``mask`` / grad_accum (0 with the graph kept when the mask is
    empty); FSDP's average over ranks then gives sum_{(rank, micro-batch)} mean / (dp * GA). (B, L) -> ()."""
    m = mask.to(values.dtype)
    count = m.sum()
    if not count > 0:
        return (values * 0.0).sum()
    return (values * m).sum() / count / grad_accum


def _check_entropy(loss: Any, p: str) -> None:
    agg = getattr(loss, "entropy_agg", None)
    if agg is not None and agg not in ENTROPY_AGGS:
        raise ValueError(f"{p}.entropy_agg={agg!r} is not an entropy aggregation; use null or policy_loss_agg (like "
                         "the policy loss) or micro_batch_token_mean (each micro-batch's token mean, as the official "
                         "LUFFY actor)")
    if not loss.alpha_lr > 0:
        raise ValueError(f"{p}.alpha_lr={loss.alpha_lr!r} must be > 0")
    if loss.target_entropy < 0:
        raise ValueError(f"{p}.target_entropy={loss.target_entropy!r} is out of range [0.0, inf]")
    if loss.use_adaptive_entropy and loss.adaptive_entropy_fixed:
        raise ValueError(f"{p}.use_adaptive_entropy and {p}.adaptive_entropy_fixed exclude each other; pick one")


@register_loss_term("entropy", stage="scalar", inputs=("entropy", "response_mask"),
                    writes="- c * agg(entropy); actor/entropy_loss (and the adaptive coefficient's metrics)",
                    reads=("actor_rollout_ref.actor.entropy_coeff", "mix.loss.entropy_agg", "mix.loss.use_adaptive_entropy",
                           "mix.loss.adaptive_entropy_fixed", "mix.loss.target_entropy", "mix.loss.alpha_lr",
                           "mix.loss.entropy_coeff_max"), check_loss=_check_entropy)  # fmt: skip
def entropy_term(t: TermInputs) -> Optional[torch.Tensor]:
    """The entropy bonus over every valid token, aggregated like the policy loss or by ``mix.loss.entropy_agg``."""
    if t.entropy is None:
        return None
    entropy_loss = (t.entropy_agg or t.agg)(t.entropy, t.response_mask)
    coef = t.entropy_coef()
    t.log("actor/entropy_loss", entropy_loss, total=True)
    return -(coef * entropy_loss)


@register_loss_term("kl", stage="scalar", inputs=("ref_log_prob", "response_mask"),
                    writes="kl_loss_coef * agg(kl_penalty) over every valid token, prefix tokens included; kl_loss",
                    reads=("actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef",
                           "actor_rollout_ref.actor.kl_loss_type"))  # fmt: skip
def kl_term(t: TermInputs) -> Optional[torch.Tensor]:
    """verl's KL loss against the reference policy (it works together with the off-policy term)."""
    if t.kld is None:
        return None
    kl_loss = t.agg(t.kld(), t.response_mask)
    t.log("kl_loss", kl_loss, total=True)
    t.log("kl_coef", t.kl_coef)
    return kl_loss * t.kl_coef
