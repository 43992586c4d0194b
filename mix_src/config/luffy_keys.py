"""The original LUFFY's command-line keys, mapped to ours, so its launch scripts run unchanged.

LUFFY (https://github.com/ElliottYan/LUFFY, arXiv 2504.14945) put its options under verl's sections, where verl
0.9.1's typed configs reject unknown keys, so ours live in ``mix:`` (mix_src/config/mix_config.py). The entry point
runs :func:`translate_overrides` on ``sys.argv`` before Hydra sees it: each LUFFY key is renamed, converted,
dropped with the reason (one printed line each) or refused (mix_src/README.md, "Launch scripts of the original LUFFY").
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from mix_src.config.mix_config import MixConfigError

A, R, D, T = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "data.", "trainer."

# LUFFY's key -> ours (the value is kept)
RENAMED = {
    **{R + k: "mix." + k for k in ("n_prefix", "prefix_strategy", "min_prefix_ratio", "max_prefix_ratio", "prefix_steps",
                                   "prefix_linear_max_ratio", "prefix_fix_ratios", "prefix_share_across_samples",
                                   "prefix_reward_weight_alpha", "prefix_reward_weight_beta")},
    **{A + k: "mix.loss." + k for k in ("clip_upper_bound", "off_policy_reshape", "off_policy_reshape_weight",
                                        "off_policy_reshape_pow_exp", "on_policy_reshape", "on_policy_reshape_weight",
                                        "on_policy_reshape_pow_exp", "all_max_clip", "loss_remove_clip",
                                        "use_sft_multitask_loss", "sft_loss_coef", "alpha_lr")},
    **{D + k: "mix.data." + k for k in ("max_target_length", "sample_target_ratio")},
    R + "max_prefix_len": "mix.data.max_target_length",
    # dead in the original (its yaml only; the dataset's tgt_input_ids_lst is never read, luffy/verl/verl/mix_src/
    # rl_dataset_with_target.py:159-170); ours: prefixed rows draw demonstrations from target_lst
    A + "use_target_lst": "mix.data.use_target_lst",
    R + "val_temperature": R + "val_kwargs.temperature",
    R + "n_val": R + "val_kwargs.n",
    A + "off_policy_max_clip": "mix.loss.off_max_clip",
    A + "off_policy_min_clip": "mix.loss.off_min_clip",
    A + "use_adaptive_temperature": "mix.loss.use_adaptive_entropy",
    A + "use_adaptive_temperature_fixed": "mix.loss.adaptive_entropy_fixed",
    A + "adaptive_temperature_clip": "mix.loss.entropy_coeff_max",
    A + "adaptive_temperature_target_entropy": "mix.loss.target_entropy",
    "algorithm.grpo_use_std": "algorithm.norm_adv_by_std_in_grpo",
    T + "max_optim_to_keep": T + "max_actor_ckpt_to_keep",  # verl keeps optimizer state in the actor checkpoint
    # the scripts add these with "+", which Hydra refuses for keys that verl 0.9.1 already has
    "+" + T + "val_before_train": T + "val_before_train",
    "+" + T + "val_only": T + "val_only",
}

ANY, DEAD = None, "dead in the original"  # ANY: every value has no effect
NO_EFFECT: dict[str, tuple[Optional[tuple[str, ...]], str]] = {
    # key: (values accepted without effect (None = any), why); any other value is refused
    **dict.fromkeys((A + "use_off_policy_clip", A + "use_sft_reward", A + "debug",
                     R + "prefix_reward_strategy", "algorithm.surprisal_base", D + "filter_targets",
                     D + "add_tgt_acc_upper_bound", T + "add_full_target_when_none", T + "skip_by_step"), (ANY, DEAD)),
    **dict.fromkeys((A + "off_policy_normalize", A + "off_policy_cliprange"), (ANY, "the original's token loss never reads it")),
    **dict.fromkeys((A + "sft_prefix_reward_weight", D + "add_tgt_with_acc"), (ANY, "only read with use_sft_prefix_reward")),
    **dict.fromkeys((D + "accuracy_lower_bound", D + "accuracy_upper_bound"), (ANY, "only read with filter_accuracy")),
    **dict.fromkeys((A + "use_sft_prefix_reward", D + "disable_truncation_advantage", T + "debug"),
                    (("false",), "not implemented in mix_src")),
    A + "use_off_policy_loss": (ANY, "the mixed on/off-policy loss is always on (PPO-clip where there is no prefix)"),
    A + "off_policy_loss_impl": (("token",), "the token-level off-policy loss is the only one"),
    A + "use_off_policy_probs": (("false",), "the target-probability path needs behaviour probabilities the data does not carry"),
    A + "use_ppo_kl_loss": (("false",), "use verl's actor_rollout_ref.actor.use_kl_loss / kl_loss_coef"),
    A + "ppo_kl_loss_coef": (ANY, "only read with use_ppo_kl_loss"),
    A + "fsdp_config.grad_offload": (("false",), "verl 0.9.1 has no such key; gradients follow fsdp_config.param_offload"),
    "actor_rollout_ref.ref.use_ref": (ANY, "verl builds the reference policy only for actor.use_kl_loss or algorithm.use_kl_in_reward"),
    R + "prefix_linear_max_var": (ANY, "dead in the original (it read a misspelt key)"),
    D + "reward_impl_version": (ANY, "the reward is reward.custom_reward_function (math-verify after </think> by default)"),
    D + "filter_accuracy": (("false",), "use algorithm.filter_groups.enable (DAPO-style filtering)"),
    T + "skip_valid_mask": (ANY, "the original's valid mask was never applied; use algorithm.filter_groups.enable"),
    T + "acc_rebatch": (("false",), "use algorithm.filter_groups.enable with mix.filter_groups.carry_over"),
}


CONVERTED: dict[str, Callable[[str], Optional[tuple[str, str]]]] = {
    # key: value -> (new key, new value), or None when the value is our default (dropped, printed)
    A + "loss_remove_token_mean": lambda v: ("mix.loss.loss_agg_mode", "luffy-token-sum-norm") if _bool(v) else None,
    T + "resume_from_path": lambda v: (T + "resume_from_path",
                                       "null" if v.strip().lower() in ("false", "none", "null", "") else v),
}

LUFFY_KEYS = sorted({*RENAMED, *NO_EFFECT, *CONVERTED})
VERL_TOO = frozenset({T + "resume_from_path"})  # LUFFY keys that verl 0.9.1 has too, with the same meaning


def _bool(value: str) -> bool:
    return value.strip().strip("'\"").lower() in ("true", "1", "yes")


def _split(override: str) -> tuple[str, str, Optional[str]]:
    """'++a.b=c' -> ('++', 'a.b', 'c'); 'a.b' (no value) -> ('', 'a.b', None)."""
    plus = len(override) - len(override.lstrip("+"))
    key, sep, value = override[plus:].partition("=")
    return override[:plus], key, value if sep else None


def translate_overrides(overrides: Sequence[str], log: Callable[[str], None] = print) -> list[str]:
    """Rewrite LUFFY's keys in ``overrides`` (Hydra ``key=value``) to ours; the others pass through, in order."""
    out, seen = [], {}  # seen: the LUFFY keys given -> their values
    for item in overrides:
        plus, key, value = _split(item)
        lookup = plus + key if plus + key in RENAMED else key
        if value is None or (lookup not in RENAMED and key not in NO_EFFECT and key not in CONVERTED):
            out.append(item)
            continue
        seen[key] = value
        if lookup in RENAMED:
            log(f"[mix_src] LUFFY key {plus}{key} -> {RENAMED[lookup]}")
            out.append(f"{RENAMED[lookup]}={value}")
        elif key in CONVERTED:
            converted = CONVERTED[key](value)
            if converted is None:
                log(f"[mix_src] LUFFY key {key}={value} dropped: it is mix_src's default")
            else:
                log(f"[mix_src] LUFFY key {key}={value} -> {converted[0]}={converted[1]}")
                out.append(f"{converted[0]}={converted[1]}")
        else:
            accepted, why = NO_EFFECT[key]
            if accepted is not None and value.strip().strip("'\"").lower() not in accepted:
                raise MixConfigError(f"LUFFY key {key}={value} is not supported: {why}; remove it or set it to {accepted[0]}")
            log(f"[mix_src] LUFFY key {key}={value} dropped: {why}")
    off_loss = seen.get(A + "use_off_policy_loss")
    if off_loss is not None and not _bool(off_loss) and not _bool(seen.get(A + "use_sft_multitask_loss", "false")):
        n_prefix = _values(out).get("mix.n_prefix", "0")  # LUFFY's rollout.n_prefix is renamed to it above
        if n_prefix.strip() not in ("0",):
            raise MixConfigError(f"LUFFY key {A}use_off_policy_loss=False with n_prefix={n_prefix}: the original then "
                                 "trained prefix tokens with plain PPO, which mix_src does not do; use "
                                 f"{A}use_sft_multitask_loss=True (SFT on prefix tokens) or keep "
                                 "use_off_policy_loss=True (the shaped off-policy loss)")
    # LUFFY's entropy form only for a LUFFY command line: trainer.resume_from_path is verl's key too (a verl run that
    # resumes would otherwise change its entropy aggregation, and its resume check refuse it)
    luffy_only = {k for k in seen if k not in VERL_TOO}
    out = _official_loss_scale(_fit_target_cap(out, log), log)
    out = _official_entropy_agg(out, log) if luffy_only else out
    return _official_sft_agg(out, log) if A + "use_sft_multitask_loss" in seen else out  # LUFFY's key, not ours


def _values(out: list[str]) -> dict[str, str]:
    """{key: stripped value} of the ``key=value`` overrides in ``out``."""
    return {key: value.strip() for _, key, value in map(_split, out) if value is not None}


def _fit_target_cap(out: list[str], log: Callable[[str], None]) -> list[str]:
    """LUFFY's ``max_prefix_len`` (= its dataset's max_target_length) at or above ``data.max_response_length``
    (train.sh: 8192 and 8192) let a whole target fill the response and cut its EOS (the rollout appends EOS after
    the target, then cuts the response at max_response_length). mix_src refuses such a cap; the original's
    intent, "no cap below the response", is our default (``max_response_length - 1``), so it becomes null."""
    values = _values(out)
    cap, response = values.get("mix.data.max_target_length", ""), values.get(D + "max_response_length", "")
    if not (cap.isdigit() and response.isdigit()) or int(cap) < int(response):
        return out
    log(f"[mix_src] LUFFY cap mix.data.max_target_length={cap} >= data.max_response_length={response} -> null "
        f"(data.max_response_length - 1 = {int(response) - 1}: a whole target keeps its EOS)")
    return ["mix.data.max_target_length=null" if _split(o)[1] == "mix.data.max_target_length" else o for o in out]


def _official_loss_scale(out: list[str], log: Callable[[str], None]) -> list[str]:
    """LUFFY's ``loss_remove_token_mean=True`` divided each GPU's token sum by the response width W and FSDP averaged
    the G GPUs' gradients (luffy/verl/verl/mix_src/mix_core_alg.py:233-234, mix_actor.py:243-244): sum / (G x W).
    Ours divides the global token sum by ``actor.loss_scale_factor``, so G x W reproduces it (unless set already)."""
    values = _values(out)
    if values.get("mix.loss.loss_agg_mode") != "luffy-token-sum-norm" or A + "loss_scale_factor" in values:
        return out
    gpus, nodes, width = (values.get(T + "n_gpus_per_node"), values.get(T + "nnodes", "1"),
                          values.get(D + "max_response_length"))  # fmt: skip
    if not all(v is not None and v.isdigit() for v in (gpus, nodes, width)):
        return out
    scale = int(gpus) * int(nodes) * int(width)
    log(f"[mix_src] LUFFY loss scale: loss_remove_token_mean divided each of {int(gpus) * int(nodes)} GPUs' token sum by "
        f"{width}, averaged over GPUs -> {A}loss_scale_factor={scale}")
    return [*out, f"{A}loss_scale_factor={scale}"]


def _official_sft_agg(out: list[str], log: Callable[[str], None]) -> list[str]:
    """LUFFY's ``use_sft_multitask_loss`` took the NLL's token mean per micro-batch (mix_actor.py:112-142,
    mix_core_alg.py:7-10), summed over micro-batches and averaged over GPUs: ``mix.loss.sft_loss_agg`` =
    micro_batch_token_mean (unless set already; mix_src's default aggregates it like the policy loss). Only for
    LUFFY's own key (``actor_rollout_ref.actor.use_sft_multitask_loss``): ``mix.loss.use_sft_multitask_loss`` on a
    command line is mix_src's key with mix_src's default weighting."""
    values = _values(out)
    if values.get("mix.loss.use_sft_multitask_loss", "").lower() != "true" or "mix.loss.sft_loss_agg" in values:
        return out
    log("[mix_src] LUFFY SFT term: a token mean per micro-batch -> mix.loss.sft_loss_agg=micro_batch_token_mean")
    return [*out, "mix.loss.sft_loss_agg=micro_batch_token_mean"]


def _official_entropy_agg(out: list[str], log: Callable[[str], None]) -> list[str]:
    """LUFFY's entropy bonus was ``entropy_coeff`` x each micro-batch's token-mean entropy (mix_actor.py:202, :226,
    / gradient_accumulation :243): with LUFFY's keys and an ``actor.entropy_coeff`` on the command line,
    ``mix.loss.entropy_agg`` = micro_batch_token_mean (unless set already; mix_src's default aggregates it like the
    policy loss)."""
    values = _values(out)
    if A + "entropy_coeff" not in values or "mix.loss.entropy_agg" in values:
        return out
    log("[mix_src] LUFFY entropy bonus: a token mean per micro-batch -> mix.loss.entropy_agg=micro_batch_token_mean")
    return [*out, "mix.loss.entropy_agg=micro_batch_token_mean"]
