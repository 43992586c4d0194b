"""CHORD as a mix_src plugin: a scheduled mix of expert SFT and on-policy GRPO, with phi = p(1-p) token weights.

CHORD (Zhang et al., "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised Fine-Tuning and
Reinforcement Learning via Dynamic Weighting", arXiv 2508.11408); official code: Trinity-RFT's ``mix_chord``
algorithm (modelscope/Trinity-RFT, trinity/algorithm/policy_loss_fn/chord_policy_loss.py,
``MIXCHORDPolicyLossFn``, ``SFTPhiLossFn``, ``mu_schedule_function``, ``phi_function``). The policy loss is

    L = (1 - mu(step)) * L_GRPO(on-policy rows) + mu(step) * L_SFT(expert rows)
    L_SFT = agg_t[ -w_t * log p_t ],   w_t = sg[p_t (1 - p_t)]  (CHORD-phi)   or  w_t = 1  (CHORD-mu)
    mu(s) = s / warmup * peak                                         for s < warmup
          = valley + (peak - valley) * (1 + cos(pi * (s - warmup) / decay)) / 2   for s < warmup + decay
          = valley                                                    after

with sg = stop-gradient (the official code detaches phi) and L_GRPO the PPO-clip loss of the on-policy rows,
each term normalised over its own rows' tokens (token-mean) in the mini-batch.

In mix_src the expert rows are ``mix.n_prefix`` rows per prompt at prefix ratio 1.0 (the whole target + EOS,
never sent to the server); ``algorithm.adv_estimator=grpo_split`` takes the group baseline from the on-policy
rows only, and the loss combination below leaves the expert rows out of the RL term, so they act as SFT samples
outside the GRPO groups. Load with ``mix.plugins=[recipes/chord/chord.py] mix.loss.combine=chord``; settings in
``mix.plugin_options.chord`` or its older spelling ``mix.loss.combine_args`` (keys: CHORD_SETTINGS). Metrics: actor/chord_mu, actor/chord_sft_loss (token mean of
-w log p over the expert tokens), actor/chord_phi_mean; the RL term is the worker loss's actor/on_pg_loss.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from mix_src.algo.loss_combine import CombineInputs, register_loss_combine
from mix_src.extend import flag, integer, number

# Trinity-RFT's MIXCHORDPolicyLossFn.default_args() / __init__ defaults (CHORD-phi with a constant mu = 0.1)
CHORD_SETTINGS = dict(mu_warmup_steps=integer(0, 0), mu_decay_steps=integer(0, 0), mu_peak=number(0.1, 0.0, 1.0),
                      mu_valley=number(0.1, 0.0, 1.0), enable_phi_function=flag(True))  # checked by mix_src/extend.py


def mu_schedule(global_step: float, warmup_steps: int, decay_steps: int, peak: float, valley: float) -> float:
    """CHORD's global SFT weight mu at ``global_step``: linear warm-up 0 -> peak over ``warmup_steps``, cosine
    decay peak -> valley over ``decay_steps``, then ``valley``."""
    if global_step < warmup_steps:
        return global_step / warmup_steps * peak
    if global_step >= warmup_steps + decay_steps:
        return valley
    cosine = 0.5 * (1.0 + math.cos(math.pi * (global_step - warmup_steps) / decay_steps))
    return valley + (peak - valley) * cosine


def phi(prob: torch.Tensor) -> torch.Tensor:
    """phi(p) = p (1 - p), any shape: small where the model is already sure (p ~ 1) or finds the token
    implausible (p ~ 0)."""
    return prob * (1.0 - prob)


def sft_token_loss(log_prob: torch.Tensor, use_phi: bool) -> torch.Tensor:
    """(B, L) -> (B, L): the per-token SFT loss -w * log p with w = sg[phi(p)] (use_phi) or 1."""
    if not use_phi:
        return -log_prob
    return -log_prob * phi(log_prob.detach().exp())


def _check(config: Any) -> None:
    """mix.loss.combine=chord: the expert rows must be whole targets outside the GRPO baseline."""
    mix, actor = config.mix, config.actor_rollout_ref.actor
    if int(mix.get("n_prefix", 0)) == 0:
        raise ValueError("mix.n_prefix=0: CHORD needs expert rows (mix.n_prefix >= 1 rows per prompt at ratio 1.0)")
    if float(mix.get("min_prefix_ratio", 1.0)) != 1.0 or float(mix.get("max_prefix_ratio", 1.0)) != 1.0 \
            or mix.get("prefix_strategy", "random") != "random":
        raise ValueError("CHORD's expert rows are whole targets: set mix.prefix_strategy=random and "
                         "mix.min_prefix_ratio=mix.max_prefix_ratio=1.0")
    if config.algorithm.adv_estimator != "grpo_split":
        raise ValueError(f"algorithm.adv_estimator={config.algorithm.adv_estimator!r}: CHORD's GRPO groups hold only "
                         "on-policy rows; use grpo_split (baseline over the on-policy rows)")
    if mix.loss.get("loss_remove_clip", False):
        raise ValueError("mix.loss.loss_remove_clip=true: CHORD's RL term is PPO-clip (Trinity-RFT's PPOPolicyLossFn)")
    mode = mix.loss.get("loss_agg_mode") or actor.get("loss_agg_mode", "token-mean")
    if mode not in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"loss_agg_mode={mode!r}: CHORD aggregates by token-mean (or seq-mean-token-mean, the "
                         "official use_token_level_loss_in_sft=false); set mix.loss.loss_agg_mode")


@register_loss_combine(
    "chord",
    check=_check,
    settings=CHORD_SETTINGS,
    reads=("mix.plugin_options.chord", "mix.loss.combine_args", "mix.n_prefix", "mix.min_prefix_ratio",
           "mix.max_prefix_ratio", "mix.prefix_strategy", "mix.loss.loss_remove_clip", "mix.loss.loss_agg_mode",
           "actor_rollout_ref.actor.loss_agg_mode", "algorithm.adv_estimator"),
)
def chord(inputs: CombineInputs, a: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    """(1 - mu) * RL loss of the on-policy rows + mu * (phi-weighted) SFT loss of the expert tokens; ``a``: the
    settings (CHORD_SETTINGS, defaults filled in)."""
    mu = mu_schedule(inputs.global_step, a["mu_warmup_steps"], a["mu_decay_steps"], a["mu_peak"], a["mu_valley"])
    sft = inputs.agg_expert(sft_token_loss(inputs.log_prob, a["enable_phi_function"]))
    loss = (1.0 - mu) * inputs.rl_loss + mu * sft
    expert = inputs.expert_mask
    n_expert = expert.sum().clamp(min=1)
    with torch.no_grad():  # per micro-batch token means over its expert tokens (averaged over micro-batches)
        sft_mean = (sft_token_loss(inputs.log_prob, a["enable_phi_function"]) * expert).sum() / n_expert
        phi_mean = (phi(inputs.log_prob.exp()) * expert).sum() / n_expert
    return loss, {"chord_mu": mu, "chord_sft_loss": sft_mean.item(), "chord_phi_mean": phi_mean.item()}
