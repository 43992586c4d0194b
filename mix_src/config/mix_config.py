"""The ``mix:`` config section: one typed, validated place for every key mix_src adds to verl's config.

verl's dataclasses reject unknown keys under ``actor_rollout_ref.*`` and ``algorithm.*``, so ours live in ``mix:``,
named as LUFFY named them; where verl has a key we use verl's. :func:`validate_mix_config` runs on the driver before
Ray starts and names the full key, the value and the allowed range of what it refuses. No verl at import time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, get_args, get_origin, get_type_hints

# The original LUFFY baked gamma into the option name (p_div_p_0.1 ...): accepted as p_div_p + the gamma key.
from mix_src.algo.core_alg import P_DIV_P_ALIASES as RESHAPE_ALIASES
from mix_src.algo.filter_groups import GROUP_FILTERS
from mix_src.algo.loss_combine import LOSS_COMBINES
from mix_src.algo.loss_terms import check_loss_terms
from mix_src.algo.flops import COUNTS as FLOPS_COUNTS
from mix_src.algo.prefix import PREFIX_STRATEGIES
from mix_src.algo.prefix_select import PREFIX_TOKEN_SELECTS
from mix_src.extend import _REGISTRIES, load_plugins
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES
from mix_src.trainer import self_guided  # noqa: F401  (registers the rollout policy self_guided)
from mix_src.algo.row_loss import ROW_LOSSES, SFT_AGGS


class MixConfigError(ValueError):
    """A bad value in the ``mix:`` section (or a rule that ties it to verl's keys)."""


@dataclass
class DataConfig:
    """Off-policy targets (expert solutions) read by :class:`mix_src.trainer.dataset.RLHFDatasetWithTarget`."""

    target_key: str = "target"  # parquet column with the target: [{role: assistant, content}] or a string
    sample_target_ratio: float = 1.0  # probability that a row keeps its target (drawn once per row, seeded)
    max_target_length: Optional[int] = None  # targets longer than this (tokens) are dropped and counted ...
    # (None: data.max_response_length - 1, so a whole target plus its EOS fits the response; see target_limit)
    truncate_targets: bool = False  # ... or truncated to it when true (also counted)
    use_target_lst: bool = False  # several demonstrations a prompt from target_lst_key (LUFFY's actor.use_target_lst)
    target_lst_key: str = "target_lst"  # column with a list of demonstrations (LUFFY's target_list_key)
    max_num_targets: int = 5  # demonstrations kept a row, target first, then the list in order (LUFFY's cap)

    def target_limit(self, max_response_length: Optional[int]) -> int:
        """Longest target kept, in tokens: ``max_target_length``, or by default ``max_response_length - 1`` (the
        rollout appends EOS to a whole target, and a response has ``max_response_length`` tokens; LUFFY's 8192 with
        8192-token responses cut that EOS off, luffy/verl/verl/mix_src/mix_vllm_rollout.py). No response length
        known (a dataset built outside the trainer): no limit."""
        if self.max_target_length is not None:
            return int(self.max_target_length)
        return int(max_response_length) - 1 if max_response_length else 2**31 - 1


# mix.loss.prefix_tokens: how prefix (demonstration) tokens enter the actor update
PREFIX_TOKENS = {
    "off_policy": "LUFFY: the shaped off-policy term -A*f(p) on prefix tokens, counted with the on-policy tokens",
    "context": "PrefixRL (arXiv 2601.18795): prefix tokens are context, as if part of the prompt; only the "
               "continuation is trained (the update's response_mask excludes them: verl's token count, entropy and "
               "KL terms too)",
}


@dataclass
class LossConfig:
    """``mix.loss``: the actor loss on the worker (:mod:`mix_src.worker.loss`; formulas in core_alg and the README).
    Clip range, dual clip, entropy_coeff and the KL settings come from verl's actor config. Checked when built."""

    off_policy_reshape: str = "p_div_p"  # f(p) on prefix tokens (LUFFY's recipe: p/(p+0.1))
    off_policy_reshape_gamma: float = 0.1  # gamma of p/(p+gamma), > 0
    off_policy_reshape_weight: float = 0.1  # w of logp / p_logp
    off_policy_reshape_pow_exp: float = 0.5  # k of pow
    on_policy_reshape: str = "no_reshape"  # r on on-policy tokens
    on_policy_reshape_weight: float = 0.1
    on_policy_reshape_pow_exp: float = 0.5
    on_policy_reshape_gamma: float = 0.1  # gamma of the on-policy p_div_p, > 0
    off_max_clip: Optional[float] = None  # f <- min(f, off_max_clip)
    off_min_clip: Optional[float] = None  # f <- max(f, off_min_clip)
    all_max_clip: Optional[float] = None  # drop tokens with p > all_max_clip from the loss, in (0, 1]
    loss_remove_clip: bool = False  # no PPO clip on on-policy tokens (LUFFY's recipe: True)
    clip_upper_bound: float = 1.0  # widens the upper clip bound to max(this, 1 + clip_ratio_high)
    loss_agg_mode: Optional[str] = None  # None: actor.loss_agg_mode; "luffy-token-sum-norm" only here
    use_sft_multitask_loss: bool = False  # PPO on on-policy rows + sft_loss_coef * NLL of prefix tokens
    combine: Optional[str] = None  # a registered loss combination (mix_src/algo/loss_combine.py); None: LUFFY's loss
    combine_args: dict = field(default_factory=dict)  # older spelling of mix.plugin_options.<combine> (registry.py)
    sft_loss_coef: float = 1.0
    row_loss: Optional[str] = None  # a per-row SFT / policy-loss choice (mix_src/algo/row_loss.py); None = off
    sft_loss_agg: Optional[str] = None  # the SFT term's aggregation (mix_src/algo/row_loss.py SFT_AGGS); None: the
    # row loss's global_token_mean, use_sft_multitask_loss's policy_loss_agg
    off_policy_behaviour: Optional[str] = None  # recorded behaviour log-probs of prefix tokens (mix_src/algo/off_policy_behaviour.py); None = LUFFY
    entropy_agg: Optional[str] = None  # the entropy bonus's aggregation (loss_terms.ENTROPY_AGGS); None: like the policy loss
    use_adaptive_entropy: bool = False  # learn the entropy coefficient (starts at actor.entropy_coeff)
    adaptive_entropy_fixed: bool = False  # c = entropy_coeff * target_entropy / H (no learning)
    target_entropy: float = 1.0  # H*, token-mean entropy target of both adaptive variants
    alpha_lr: float = 1e-2  # AdamW learning rate of log(c)
    entropy_coeff_max: Optional[float] = None  # cap of the learned coefficient
    prefix_token_select: Optional[str] = None  # which prefix tokens keep their advantage: a name in mix_src.algo.prefix_select
    prefix_token_select_ratio: Optional[float] = None  # older spelling of mix.plugin_options.<select>.ratio; None: unset
    prefix_tokens: str = "off_policy"  # off_policy: LUFFY's shaped term on prefix tokens; context: PrefixRL, out of
    # the loss (removed from the update's response_mask: no term, no token count, no entropy, no KL; see PREFIX_TOKENS)

    def _resolve_sft_loss_agg(self, p: str) -> None:
        """sft_loss_agg aggregates the SFT term of row_loss or use_sft_multitask_loss; None picks each one's default
        (the row loss: global_token_mean; the multitask term: policy_loss_agg, aggregated like the policy loss)."""
        if self.row_loss is None and not self.use_sft_multitask_loss:
            if self.sft_loss_agg is not None:
                raise MixConfigError(f"{p}.sft_loss_agg={self.sft_loss_agg!r} aggregates the SFT term of {p}.row_loss or "
                                     f"{p}.use_sft_multitask_loss, and neither is on; set one or leave sft_loss_agg null")
            return
        if self.sft_loss_agg is None:
            self.sft_loss_agg = "global_token_mean" if self.row_loss is not None else "policy_loss_agg"
        _registered(SFT_AGGS, self.sft_loss_agg)
        if self.use_sft_multitask_loss and self.sft_loss_agg == "global_token_mean":
            raise MixConfigError(f"{p}.sft_loss_agg=global_token_mean counts the SFT tokens of {p}.row_loss's rows; with "
                                 f"{p}.use_sft_multitask_loss use policy_loss_agg (the default) or micro_batch_token_mean")

    def __post_init__(self):
        p = "mix.loss"
        if self.prefix_token_select is not None:
            _registered(PREFIX_TOKEN_SELECTS, self.prefix_token_select)
        for key in ("off_policy_reshape", "on_policy_reshape"):
            value = getattr(self, key)
            if value in RESHAPE_ALIASES:  # the original's names: keep the number in its own key
                setattr(self, key, "p_div_p")
                setattr(self, key + "_gamma", RESHAPE_ALIASES[value])
        for key in ("off_max_clip", "off_min_clip", "all_max_clip", "entropy_coeff_max"):
            value = getattr(self, key)
            if value is not None and value == -1:  # the original's "off"
                setattr(self, key, None)
            elif value is not None and not value > 0:
                raise MixConfigError(f"{p}.{key}={value!r} must be > 0, or null/-1 to switch it off")
        try:  # each loss term's own checks (mix_src/algo/loss_terms.py)
            check_loss_terms(self, p)
        except ValueError as e:
            raise e if isinstance(e, MixConfigError) else MixConfigError(str(e)) from e
        if self.row_loss is not None:
            _registered(ROW_LOSSES, self.row_loss)
            if self.use_sft_multitask_loss:
                raise MixConfigError(f"{p}.row_loss={self.row_loss!r} and {p}.use_sft_multitask_loss both choose the "
                                     "SFT rows; pick one")
            if self.all_max_clip is not None:
                raise MixConfigError(f"{p}.row_loss={self.row_loss!r} with {p}.all_max_clip={self.all_max_clip} is not "
                                     "supported (its kept-token mean would count the SFT rows); set it to null")
        self._resolve_sft_loss_agg(p)
        if self.prefix_token_select is not None and self.use_sft_multitask_loss:
            raise MixConfigError(f"{p}.prefix_token_select={self.prefix_token_select!r} with {p}.use_sft_multitask_loss: "
                                 "prefix rows take the SFT term there, so the selected advantages would be ignored; pick one")
        if self.prefix_token_select is not None and PREFIX_TOKEN_SELECTS.options(self.prefix_token_select).get(
                "prefix_tokens_on_policy", False):  # fmt: skip
            self._refuse_changed(lambda k: k.startswith("off_") and k not in (
                "off_policy_reshape_gamma", "off_policy_reshape_weight", "off_policy_reshape_pow_exp"),
                f"{p}.prefix_token_select={self.prefix_token_select!r} makes prefix tokens on-policy tokens of the loss")
        if self.combine is not None and self.prefix_token_select is not None:
            raise MixConfigError(f"{p}.combine={self.combine!r} makes the expert rows' loss itself, so "
                                 f"{p}.prefix_token_select={self.prefix_token_select!r} would be ignored; pick one")
        if self.combine is not None and self.row_loss is not None:
            raise MixConfigError(f"{p}.combine={self.combine!r} and {p}.row_loss={self.row_loss!r} each decide how rows "
                                 "enter the loss; pick one")
        if self.combine is not None:
            _registered(LOSS_COMBINES, self.combine)
            self._refuse_changed(lambda k: k.startswith("off_") or k in ("all_max_clip", "use_sft_multitask_loss"),
                                 f"{p}.combine={self.combine!r} makes the policy loss of the on-policy and expert rows")
        elif self.combine_args:
            raise MixConfigError(f"{p}.combine_args is set but {p}.combine is not; set both or neither")
        if self.use_sft_multitask_loss:
            self._refuse_changed(lambda k: k.startswith("off_"), f"{p}.use_sft_multitask_loss replaces the off-policy "
                                 "loss", "remove them or turn use_sft_multitask_loss off")

        if self.prefix_tokens not in PREFIX_TOKENS:
            raise MixConfigError(f"{p}.prefix_tokens={self.prefix_tokens!r}: use one of {list(PREFIX_TOKENS)}")
        if self.prefix_tokens == "context":
            why = (f"{p}.prefix_tokens=context (PrefixRL) takes the prefix tokens out of the loss (their settings have "
                   "nothing to act on; all_max_clip's and the row losses' token counts are taken before)")
            self._refuse_changed(lambda k: k.startswith("off_") or k in (
                "all_max_clip", "use_sft_multitask_loss", "row_loss", "combine", "prefix_token_select",
                "off_policy_behaviour") and k not in ("off_policy_reshape_gamma", "off_policy_reshape_weight",
                                                     "off_policy_reshape_pow_exp"), why)

    def _refuse_changed(self, chosen: Callable[[str], bool], why: str, remedy: str = "leave them at their defaults"):
        """Refuse the ``chosen`` fields set away from their defaults, which ``why`` says the loss would ignore."""
        ignored = sorted(f.name for f in dataclasses.fields(self) if chosen(f.name) and getattr(self, f.name) != f.default)
        if ignored:
            raise MixConfigError(f"{why}, so {ignored} would be ignored; {remedy}")

    @classmethod
    def from_dict(cls, values: Any) -> "LossConfig":
        """Build from a mapping (None: the defaults); unknown keys are an error."""
        return _build(cls, dict(values or {}), "mix.loss")


@dataclass
class FilterGroupsConfig:
    """Extras on top of verl's ``algorithm.filter_groups.{enable, metric, max_num_gen_batches}``."""

    rule: str = "nonzero_std"  # which groups to keep: a name registered in mix_src.algo.filter_groups (DAPO's std > 0)
    carry_over: bool = False  # keep surplus kept groups for the next step instead of discarding them
    on_policy_only: bool = False  # compute a group's metric std over its on-policy rows only


@dataclass
class PlannerConfig:
    """The memory check before Ray (mix_src/planner/README.md)."""

    check: bool = True  # refuse what cannot fit (fp32 params + grads + AdamW > GPU), print the estimate otherwise
    gpu: Optional[str] = None  # plan for this GPU (mix_src.planner.estimate.GPUS) instead of the driver's; also on CPU


@dataclass
class MixConfig:
    """Everything under ``mix:``. Prefix keys follow LUFFY's ``actor_rollout_ref.rollout.*`` names."""

    n_prefix: int = 0  # rows per group (of rollout.n) that start from a target prefix; -1 = all, 0 = none
    prefix_strategy: str = "random"  # how each prefixed row's ratio is drawn: a name registered in mix_src.algo.prefix
    prefix_share_across_samples: bool = False  # one ratio per prompt instead of one per row
    min_prefix_ratio: float = 1.0  # random: ratio ~ U(min, max); 1.0 = the whole target + EOS
    max_prefix_ratio: float = 1.0
    prefix_steps: int = 1000  # linear schedules: steps over which the ratio window moves
    prefix_linear_max_ratio: float = 0.8  # linear schedules: starting ratio
    prefix_fix_ratios: Optional[list] = None  # fixed: the ratios, one per prefixed row of a group
    prefix_reward_weight_alpha: float = 1.0  # A <- A * alpha on target tokens ...
    prefix_reward_weight_beta: float = 1.0  # ... and A * beta on the other tokens
    seed: Optional[int] = None  # seed of the prefix-ratio generator (None = data.seed or 0)
    rollout_policy: str = "prefix_guided"  # how the generate stage makes a batch: a name in mix_src.trainer.rollout_policy
    plugins: list = field(default_factory=list)  # modules / .py files that register extensions (mix_src/extend.py)
    plugin_options: dict = field(default_factory=dict)  # {entry name: {setting: value}}: the one channel (registry.py)
    flops_budget: Optional[float] = None  # stop training at the first step whose cumulative FLOPs reach this (mix_src/algo/flops.py)
    flops_count: str = "full"  # which count the budget uses: "6n" (6N rule) or "full" (+ attention, LM head)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def check(self, p: str = "mix") -> None:
        """The checks of every section but ``loss`` (checked when built: :class:`LossConfig`)."""
        from mix_src.planner.estimate import GPUS

        _in_range(f"{p}.n_prefix", self.n_prefix, -1, None)
        _registered(PREFIX_STRATEGIES, self.prefix_strategy)
        _registered(ROLLOUT_POLICIES, self.rollout_policy)
        _in_range(f"{p}.min_prefix_ratio", self.min_prefix_ratio, 0.0, 1.0)
        _in_range(f"{p}.max_prefix_ratio", self.max_prefix_ratio, 0.0, 1.0)
        if self.min_prefix_ratio > self.max_prefix_ratio:
            raise MixConfigError(f"{p}.min_prefix_ratio={self.min_prefix_ratio} > "
                                 f"{p}.max_prefix_ratio={self.max_prefix_ratio}")
        _in_range(f"{p}.prefix_steps", self.prefix_steps, 1, None)
        _in_range(f"{p}.prefix_linear_max_ratio", self.prefix_linear_max_ratio, 0.0, 1.0)
        if self.prefix_fix_ratios is not None:
            self.prefix_fix_ratios = [float(r) for r in self.prefix_fix_ratios]
            for i, r in enumerate(self.prefix_fix_ratios):
                _in_range(f"{p}.prefix_fix_ratios[{i}]", r, 0.0, 1.0)
        _in_range(f"{p}.prefix_reward_weight_alpha", self.prefix_reward_weight_alpha, 0.0, None)
        _in_range(f"{p}.prefix_reward_weight_beta", self.prefix_reward_weight_beta, 0.0, None)
        for name, settings in self.plugin_options.items():
            if not isinstance(settings, dict):
                raise MixConfigError(f"{p}.plugin_options.{name}={settings!r} must be a mapping {{key: value}} (the "
                                     f"settings of the entry {name!r})")
            if not any(name in registry for registry in _REGISTRIES):  # resolve_settings checks the values
                raise MixConfigError(f"{p}.plugin_options.{name}: no registered entry is called {name!r} (load its "
                                     f"plugin with {p}.plugins)")
        _in_range(f"{p}.flops_budget", self.flops_budget, 1.0, None)
        if self.flops_count not in FLOPS_COUNTS:
            raise MixConfigError(f"{p}.flops_count={self.flops_count!r}: use one of {list(FLOPS_COUNTS)}")
        _in_range(f"{p}.data.sample_target_ratio", self.data.sample_target_ratio, 0.0, 1.0)
        _in_range(f"{p}.data.max_target_length", self.data.max_target_length, 1, None)
        if not self.data.target_key:
            raise MixConfigError(f"{p}.data.target_key must be a non-empty column name")
        _in_range(f"{p}.data.max_num_targets", self.data.max_num_targets, 1, None)
        if self.data.use_target_lst and not self.data.target_lst_key:
            raise MixConfigError(f"{p}.data.target_lst_key must be a non-empty column name")
        _registered(GROUP_FILTERS, self.filter_groups.rule)
        if self.planner.gpu is not None and self.planner.gpu not in GPUS:
            raise MixConfigError(f"{p}.planner.gpu={self.planner.gpu!r}: use one of {sorted(GPUS)} or null (the "
                                 "driver's GPU)")


# --------------------------------------------------------------------------------------------------------
# building from a (Omega)dict, with errors that name the key


def _registered(registry: Any, name: str) -> None:
    """Refuse a name ``registry`` does not hold, with its own message (the names it holds)."""
    if name not in registry:
        raise MixConfigError(registry.unknown(name))


def _in_range(key: str, value: Any, lo: Optional[float], hi: Optional[float]) -> None:
    """Refuse ``value`` outside [lo, hi] (a None bound: unbounded; a None value: unset, not checked)."""
    if value is not None and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise MixConfigError(f"{key}={value!r} is out of range {bounds}")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the type hint ``hint`` (a scalar of :data:`_SCALARS`, ``Optional[X]`` or a section's
    dataclass); return it converted (int -> float where allowed)."""
    if get_origin(hint) is not None and type(None) in get_args(hint):  # Optional[X]
        inner = next(a for a in get_args(hint) if a is not type(None))
        return None if value is None else _coerce(key, value, inner)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    accepted, what, convert = _SCALARS[hint]
    if not isinstance(value, accepted) or (isinstance(value, bool) and hint in (int, float)):
        raise MixConfigError(f"{key}={value!r} must be {what}")
    return convert(value)


# type hint -> (accepted Python types, what the error says it must be, conversion); a bool is no int or float here
_SCALARS: dict[Any, tuple[Any, str, Callable[[Any], Any]]] = {
    bool: (bool, "true or false", lambda v: v),
    int: (int, "an integer", lambda v: v),
    float: ((int, float), "a number", float),
    str: (str, "a string", lambda v: v),
    dict: (dict, "a mapping", lambda m: {str(k): v for k, v in m.items()}),
    list: ((list, tuple), "a list", list),
}


def _build(cls: type, values: Any, prefix: str):
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise MixConfigError(f"{prefix} must be a mapping of keys to values, got {values!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise MixConfigError(f"unknown key(s) {[f'{prefix}.{k}' for k in unknown]}; valid keys of {prefix}: {names}")
    kwargs = {name: _coerce(f"{prefix}.{name}", values[name], hints[name]) for name in names if name in values}
    return cls(**kwargs)


def mix_config_from_dict(values: Optional[dict], prefix: str = "mix") -> MixConfig:
    """Build and check a :class:`MixConfig` from a plain dict (e.g. ``OmegaConf.to_container(cfg.mix)``).
    The plugins in ``plugins`` are imported first, so the names they register are valid."""
    plugins = (values or {}).get("plugins") or []
    if not isinstance(plugins, (list, tuple)):
        raise MixConfigError(f"{prefix}.plugins={plugins!r} must be a list of module names or .py paths")
    load_plugins(plugins)
    cfg = _build(MixConfig, values, prefix)
    cfg.check(prefix)
    return cfg


def _resolve_target_limit(config: Any, mix: MixConfig) -> None:
    """Refuse a ``mix.data.max_target_length`` whose target + EOS cannot fit ``data.max_response_length``; write
    the resolved limit (default ``max_response_length - 1``) into both ``mix`` and ``config.mix.data``, so the
    datasets Ray builds read the number checked here."""
    from omegaconf import OmegaConf, open_dict

    response = config.get("data", {}).get("max_response_length")
    if response is None:
        return
    cap, response = mix.data.max_target_length, int(response)
    if cap is not None and cap > response - 1:  # a whole target plus its EOS must fit the response
        raise MixConfigError(f"mix.data.max_target_length={cap} cannot fit data.max_response_length={response}: a "
                             f"whole target plus its EOS needs max_target_length <= {response - 1}, or longer targets "
                             f"are cut and score 0; set it <= {response - 1}, or null to follow "
                             "data.max_response_length - 1")
    mix.data.max_target_length = mix.data.target_limit(response)
    if config.get("mix") is not None:
        with open_dict(config):
            OmegaConf.update(config, "mix.data.max_target_length", mix.data.max_target_length, force_add=True)


def uses_critic(config: Any) -> bool:
    """verl's rule (``need_critic``, verl/trainer/ppo/utils.py 96-107; without its warning, and with no
    ``critic`` section read as unset): ``critic.enable`` if set, else whether the estimator is verl's GAE."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    enable = (config.get("critic") or {}).get("enable")
    return bool(enable) if enable is not None else str(config.algorithm.get("adv_estimator")) == AdvantageEstimator.GAE


def validate_mix_config(config: Any) -> MixConfig:
    """Validate ``config.mix`` and its ties to verl's keys (``config``: the whole config); return the MixConfig."""
    from omegaconf import OmegaConf  # here, not at the top: this module stays free of verl and import-light
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    from mix_src.trainer.adv_estimators import ADV_ESTIMATORS

    mix_values = OmegaConf.to_container(config.get("mix"), resolve=True) if config.get("mix") is not None else {}
    mix = mix_config_from_dict(mix_values)
    _resolve_target_limit(config, mix)

    n = int(config.actor_rollout_ref.rollout.n)
    if mix.n_prefix > n:
        raise MixConfigError(f"mix.n_prefix={mix.n_prefix} > actor_rollout_ref.rollout.n={n}; use 0..{n} or -1 (all)")
    actor = config.actor_rollout_ref.actor
    if mix.loss.use_adaptive_entropy and not (actor.get("calculate_entropy", False) or actor.entropy_coeff != 0):
        raise MixConfigError("mix.loss.use_adaptive_entropy=true needs the entropy on the worker: set "
                             "actor_rollout_ref.actor.entropy_coeff (its initial value) to a value > 0")
    agg_mode = mix.loss.loss_agg_mode or actor.get("loss_agg_mode", "token-mean")
    counted = [f"mix.loss.{k}={getattr(mix.loss, k)!r}" for k in ("row_loss", "combine") if getattr(mix.loss, k)]
    counted += ["mix.loss.all_max_clip with token-mean"] if mix.loss.all_max_clip and agg_mode == "token-mean" else []
    if counted and actor.get("shuffle", False):  # the tokens counted on the driver are each mini-batch's
        raise MixConfigError(f"{counted[0]} counts the tokens of each mini-batch before the update, which needs "
                             "verl's unshuffled mini-batches: set actor_rollout_ref.actor.shuffle=false")
    fg = config.algorithm.get("filter_groups") or {}
    if mix.filter_groups != FilterGroupsConfig() and not fg.get("enable", False):  # any mix.filter_groups key set
        raise MixConfigError("mix.filter_groups.* is set but algorithm.filter_groups.enable=false; set "
                             "algorithm.filter_groups.enable=true")
    if mix.flops_budget is not None and uses_critic(config):
        raise MixConfigError("mix.flops_budget counts the actor's compute only (mix_src/algo/flops.py); a critic "
                             "(algorithm.adv_estimator=gae or critic.enable=true) would go uncounted: unset "
                             "mix.flops_budget or use a critic-free estimator")
    estimator = str(config.algorithm.adv_estimator)  # a prefix-aware one (mix_src.trainer.adv_estimators) or verl's
    if estimator not in ADV_ESTIMATORS and estimator not in ADV_ESTIMATOR_REGISTRY:
        verl_names = sorted(n for n in ADV_ESTIMATOR_REGISTRY if n not in ADV_ESTIMATORS)
        raise MixConfigError(f"{ADV_ESTIMATORS.unknown(estimator)}; or one of verl's: {verl_names}")
    gen_bs = config.data.get("gen_batch_size", None)
    if gen_bs is not None and gen_bs != config.data.train_batch_size and not fg.get("enable", False):
        raise MixConfigError(f"data.gen_batch_size={gen_bs} differs from data.train_batch_size="
                             f"{config.data.train_batch_size} but algorithm.filter_groups.enable=false; a generation "
                             "batch is the training batch then: unset it or enable filter groups")
    return mix
