"""The on-policy term of LUFFY's mixed loss under any policy loss verl registers (``actor.policy_loss.loss_mode``).

verl 0.9.1 registers its policy losses with ``register_policy_loss`` (``verl/trainer/ppo/core_algos.py``:
vanilla ~1285, dppo_tv ~1379, dppo_kl ~1460, gspo ~1545, sapo ~1622, gpg ~1707, clip_cov ~1743, kl_cov ~1848,
geo_mean ~1928, dro ~2014, cispo ~2047, bypass_mode ~2413). Under the MIX loss (mix_src/worker/loss.py) the on-policy
tokens get verl's own ``get_policy_loss_fn(loss_mode)`` (the on-policy mask as its ``response_mask``), the prefix
tokens LUFFY's -A f(p) by ``loss_terms.token_loss`` with the on-policy tokens' advantage set to 0 (LUFFY, arXiv
2504.14945 section 3; official mix_core_alg.py ``compute_token_on_off_policy_loss``). ``vanilla`` (``luffy_kernel``):
the LUFFY kernel computes both sides. Every other mode: :func:`on_policy_term`.

How the two terms add up to one agg_loss over all tokens (same global N, S, W, D), per mode, what prefix tokens get
and the mode x knob table (:func:`knob_refusals`): recipes/guided_gspo/README.md. verl's sources behind it:
luffy-token-sum-norm is unknown to verl's agg_loss (core_algos.py ~1140-1206); SAPO always uses seq-mean-token-mean
(~1689); GMPO takes ``torch.mean`` over the micro-batch's rows (~2000), rescaled here by B_micro * D / S; GSPO's
sequence ratio (~1583-1589) and GMPO's geometric mean (~1983-1987) run over a row's generated tokens only; clip_cov
and kl_cov pick tokens from per-micro-batch statistics (~1812-1819, ~1905-1907), so they are not micro-batch exact.
A plugin's ``@register_policy_loss`` loss gets :data:`PLUGIN_DEFAULT` unless it calls :func:`register_on_policy_mode`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

__all__ = ["ON_POLICY_MODES", "PLUGIN_DEFAULT", "OnPolicyMode", "RequiredKey", "knob_refusals", "mode_entry",
           "on_policy_config", "on_policy_term", "register_on_policy_mode", "required_refusals"]  # fmt: skip

ACTOR_AGG, ROW_MEAN = "actor", "row-mean"  # aggregation: the actor's loss_agg_mode / torch.mean over rows


@dataclass(frozen=True)
class RequiredKey:
    """A key of ``actor_rollout_ref.actor`` a mode needs set, whose verl default does not run it."""

    key: str  # under actor_rollout_ref.actor
    ok: Callable[[Any], bool]
    what: str  # what to set it to, and why


def _positive(value: Any) -> bool:
    try:
        return value is not None and float(value) > 0
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class OnPolicyMode:
    """What the MIX loss needs to know about one registered verl policy loss (one row of the knob table)."""

    name: str
    aggregation: str = ACTOR_AGG  # ACTOR_AGG (the mode it is given), a fixed verl mode (SAPO) or ROW_MEAN (GMPO)
    sequence_level: bool = False  # it couples a row's tokens (a sequence ratio / geometric mean)
    micro_batch_exact: bool = True  # its gradient does not depend on the micro-batch split (given global N / S)
    ratio_clip: bool = True  # it clips a ratio as its method (loss_remove_clip cannot remove it)
    clip_high_is_ratio_bound: bool = False  # it bounds the ratio above by 1 + clip_ratio_high
    luffy_kernel: bool = False  # the LUFFY kernel computes the on-policy term (vanilla)
    refused: str = ""  # why it cannot be the on-policy term ("" = usable)
    required: tuple[RequiredKey, ...] = ()  # keys verl's defaults leave unusable for this mode


ON_POLICY_MODES: dict[str, OnPolicyMode] = {entry.name: entry for entry in (
    OnPolicyMode("vanilla", luffy_kernel=True, clip_high_is_ratio_bound=True),
    OnPolicyMode("gspo", sequence_level=True, clip_high_is_ratio_bound=True),
    OnPolicyMode("geo_mean", aggregation=ROW_MEAN, sequence_level=True),
    OnPolicyMode("sapo", aggregation="seq-mean-token-mean", ratio_clip=False),
    OnPolicyMode("cispo", clip_high_is_ratio_bound=True),
    OnPolicyMode("gpg", ratio_clip=False),
    OnPolicyMode("dro", ratio_clip=False, required=(RequiredKey(
        "policy_loss.dro_beta", _positive, "a positive float, DRO's quadratic log-ratio penalty beta (verl's default "
        "is null, and its DRO loss raises on it: verl/trainer/ppo/core_algos.py compute_policy_loss_dro ~2028-2030)"),)),
    OnPolicyMode("dppo_tv"),
    OnPolicyMode("dppo_kl"),
    OnPolicyMode("clip_cov", micro_batch_exact=False, clip_high_is_ratio_bound=True),
    OnPolicyMode("kl_cov", micro_batch_exact=False, ratio_clip=False),
    OnPolicyMode("bypass_mode", refused=(
        "verl selects it itself for algorithm.rollout_correction.bypass_mode=true: apply_bypass_mode "
        "(verl/trainer/ppo/rollout_corr_helper.py ~1109-1144) overwrites old_log_probs with rollout_log_probs for "
        "every token (prefix tokens have none: the agent loop writes 0) and the MIX trainers always recompute old "
        "log-probs; use decoupled rollout correction (rollout_is / rollout_rs), which keeps prefix tokens out")),
)}  # fmt: skip


def register_on_policy_mode(entry: OnPolicyMode) -> OnPolicyMode:
    """Declare (or replace) the properties of the verl policy loss ``entry.name``."""
    ON_POLICY_MODES[entry.name] = entry
    return entry


PLUGIN_DEFAULT = OnPolicyMode("<plugin>", micro_batch_exact=False)  # token-level, the actor's aggregation


def mode_entry(loss_mode: str) -> OnPolicyMode:
    """The entry of ``loss_mode`` (PLUGIN_DEFAULT for a plugin's); ValueError for a name verl does not know."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if loss_mode in ON_POLICY_MODES:
        return ON_POLICY_MODES[loss_mode]
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"actor.policy_loss.loss_mode={loss_mode!r} is not a registered verl policy loss; "
                         f"registered: {sorted(POLICY_LOSS_REGISTRY)} (a plugin registers more: mix.plugins)")
    return replace(PLUGIN_DEFAULT, name=loss_mode)


def required_refusals(loss_mode: str, actor: Any) -> list[str]:
    """The keys ``loss_mode``'s entry declares required that ``actor`` (actor_rollout_ref.actor) leaves unusable."""
    out = []
    for req in mode_entry(loss_mode).required:
        node = actor
        for part in req.key.split("."):
            node = None if node is None else node.get(part, None)
        if not req.ok(node):
            out.append(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} needs "
                       f"actor_rollout_ref.actor.{req.key} (now {node!r}): set it to {req.what}")
    return out


def _clip_high(actor: Any) -> float:
    high = actor.get("clip_ratio_high", None)
    return float(actor.get("clip_ratio", 0.2) if high is None else high)


def knob_refusals(loss_mode: str, mix_loss: Any, actor: Any) -> list[str]:
    """The reasons ``loss_mode`` cannot run with the ``mix.loss`` knobs ``mix_loss`` and ``actor``
    (actor_rollout_ref.actor), each naming the key and what to do; empty: it can."""
    entry = mode_entry(loss_mode)
    key = f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r}"
    if entry.refused:
        return [f"{key}: {entry.refused}"]
    if entry.luffy_kernel:
        return []
    reasons = []
    if mix_loss.loss_remove_clip and entry.ratio_clip:
        reasons.append(f"{key} clips its ratio as its method (verl core_algos.py, the {loss_mode} loss); "
                       "mix.loss.loss_remove_clip=true cannot remove it: set mix.loss.loss_remove_clip=false")
    if mix_loss.on_policy_reshape != "no_reshape":
        reasons.append(f"mix.loss.on_policy_reshape={mix_loss.on_policy_reshape!r} reshapes the PPO ratio of the "
                       f"LUFFY kernel; under {key} verl's function computes its own ratio: set it to 'no_reshape'")
    if mix_loss.clip_upper_bound > 1.0 + _clip_high(actor) and not entry.clip_high_is_ratio_bound:
        reasons.append(f"mix.loss.clip_upper_bound={mix_loss.clip_upper_bound} widens an upper ratio bound that "
                       f"{key} does not have as 1 + clip_ratio_high: set it to 1.0")
    if mix_loss.all_max_clip is not None and (entry.sequence_level or entry.aggregation != ACTOR_AGG):
        reasons.append(f"mix.loss.all_max_clip={mix_loss.all_max_clip} drops single tokens from the loss; under "
                       f"{key} that changes a row's {'sequence ratio' if entry.sequence_level else 'own aggregation'}"
                       ": set mix.loss.all_max_clip=null")
    for flag in ("use_sft_multitask_loss", "combine"):
        if getattr(mix_loss, flag, None):
            reasons.append(f"mix.loss.{flag} puts PPO-clip (the LUFFY kernel) on the on-policy rows; it runs with "
                           f"loss_mode='vanilla' only, not {key}")
    return reasons


def on_policy_config(config: Any, mix_loss: Any) -> Any:
    """The ActorConfig verl's function gets: ``config``, or a copy with clip_ratio_high = clip_upper_bound - 1 where
    the mode's upper ratio bound is 1 + clip_ratio_high and mix.loss.clip_upper_bound widens it."""
    entry = mode_entry(config.policy_loss.get("loss_mode", "vanilla"))
    bound = float(mix_loss.clip_upper_bound)
    if entry.clip_high_is_ratio_bound and not entry.luffy_kernel and bound > 1.0 + _clip_high(config):
        return replace(config, clip_ratio_high=bound - 1.0, global_batch_info={})
    return config


def on_policy_term(config: Any, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                   on_mask: torch.Tensor, valid_mask: torch.Tensor, loss_agg_mode: str, info: dict,
                   rollout_is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's registered loss ``config.policy_loss.loss_mode`` on the on-policy tokens, aggregated so that it adds
    to the LUFFY off-term over ``valid_mask`` (module docstring). Returns (loss scalar with grad, verl's metrics).

    config: verl's ActorConfig (on_policy_config's copy; its ``global_batch_info`` is set here); old_log_prob,
    log_prob, advantages, rollout_is_weights (or None): (B, L); on_mask: (B, L) bool, the on-policy tokens that enter
    the loss (all_max_clip's drops applied); valid_mask: (B, L) bool, every token the off-term aggregates over;
    info: dp_size, batch_num_tokens (N), global_batch_size (S), loss_scale_factor (W) of the mini-batch.
    """
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    entry = mode_entry(loss_mode)
    dp, width = int(info["dp_size"]), valid_mask.shape[-1]
    n_tokens, rows = info["batch_num_tokens"], info["global_batch_size"]
    if n_tokens is None:  # LUFFY's token mean runs over every valid token, prefix tokens included
        n_tokens = int(valid_mask.sum()) or 1
    if rows is None:
        rows = valid_mask.shape[0] if entry.aggregation == ROW_MEAN else int(valid_mask.any(-1).sum()) or 1
    scale = info["loss_scale_factor"] if info["loss_scale_factor"] is not None else width
    mode = loss_agg_mode if entry.aggregation == ACTOR_AGG else entry.aggregation
    post = 1.0  # the factor applied to verl's result
    if mode == "luffy-token-sum-norm":
        mode, post = "token-sum", 1.0 / scale
    elif mode == ROW_MEAN:
        post = valid_mask.shape[0] * dp / rows
    weights = rollout_is_weights
    if mode == "seq-mean-token-mean":  # divide a mixed row by all its valid tokens, as the off-term does
        n_on, n_valid = on_mask.sum(-1, keepdim=True), valid_mask.sum(-1, keepdim=True)
        row_weight = torch.where(n_on == n_valid, 1.0, n_on / n_valid.clamp(min=1)).to(log_prob.dtype)
        row_weight = row_weight.expand_as(log_prob)
        weights = row_weight if weights is None else weights * row_weight
    config.global_batch_info.update(dp_size=dp, batch_num_tokens=n_tokens, global_batch_size=rows,
                                    loss_scale_factor=info["loss_scale_factor"])  # fmt: skip
    loss, metrics = get_policy_loss_fn(loss_mode)(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=on_mask,
        loss_agg_mode=mode, config=config, rollout_is_weights=weights,
    )  # fmt: skip
    return (loss if post == 1.0 else loss * post), metrics
