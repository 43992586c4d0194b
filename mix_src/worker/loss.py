"""The actor's loss on the worker: LUFFY's mixed on/off-policy loss in verl 0.9.1's engine workers.

verl's registered policy losses never see `prefix_mask` (its `ppo_loss` passes a fixed set of fields), so the
trainer replaces the whole worker loss after `init_workers()` (:func:`install_loss`).
`MixPolicyLoss.__call__(model_output, data, dp_group=None) -> (loss, metrics)` has the signature of verl's
`workers/utils/losses.py::ppo_loss` and mirrors it: log-probs and entropy back to padded (bsz, response_len), then
the scalar terms of mix_src/algo/loss_terms.py's LOSS_TERMS summed in their order, each aggregated by `agg_loss`
with the engine's global batch numbers (dp_size, batch_num_tokens, global_batch_size), so a mini-batch's gradient
does not depend on its micro-batch split. With an all-zero prefix_mask it equals verl's ppo_loss.

Each `mix.loss` option, its formula and the module that holds its maths: mix_src/README.md "Loss options". Beyond
that table: adaptive_entropy_fixed is the one variant that depends on the micro-batch split (as the original); with
all_max_clip and token-mean the kept tokens are counted from old_log_probs (loss_inputs.add_kept_token_counts); a
rollout policy may put REMOVE_CLIP (bsz,) 0/1 into the batch in place of mix.loss.loss_remove_clip (recipes/exgrpo).
Metrics: verl's names (actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower, actor/entropy_loss,
kl_loss, kl_coef) plus LUFFY's (loss_terms.TOKEN_METRICS as actor/<name>) and those of the features above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Optional

import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import kl_penalty
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from mix_src.algo.core_alg import AdaptiveEntropyCoef, agg_loss, masked_mean
from mix_src.worker.loss_inputs import (  # noqa: F401 (re-exported: the trainers' and plugins' import path)
    COMBINE_FIELDS, ENTROPY_STATE, EXPERT_ROWS, EXPERT_TOKENS, GLOBAL_STEP, KEPT_TOKENS, ON_ROWS, ON_TOKENS, REMOVE_CLIP,
    add_combine_inputs, add_kept_token_counts, add_sft_token_counts, pop_entropy_state, uses_kept_token_counts,
)  # fmt: skip
from mix_src.algo.loss_terms import (LOSS_TERMS, TOKEN_METRICS, TermInputs, TokenBatch, TokenLossConfig,
                                     micro_batch_token_mean, token_loss)  # fmt: skip
from mix_src.algo.loss_combine import LOSS_COMBINES, CombineInputs
from mix_src.worker.onpolicy_losses import mode_entry, on_policy_config, on_policy_term
from mix_src.config.mix_config import LossConfig as MixLossConfig  # the `mix.loss` section, checked when built
from mix_src.algo.prefix_select import PREFIX_TOKEN_SELECTS, PrefixTokenView, select_prefix_tokens
from mix_src.algo.off_policy_behaviour import BEHAVIOUR_LOG_PROB, OFF_POLICY_BEHAVIOURS
from mix_src.algo.row_loss import ROW_LOSSES, SFT_AGGS, SFT_ROW, SFT_TOKENS, SftScale, row_marks

__all__ = ["COMBINE_FIELDS", "ENTROPY_STATE", "KEPT_TOKENS", "MixLossConfig", "MixPolicyLoss", "REMOVE_CLIP",
           "add_combine_inputs", "add_kept_token_counts", "add_sft_token_counts", "pop_entropy_state"]

_VERL_NAMES = {"on_pg_clipfrac": "pg_clipfrac", "on_pg_clipfrac_lower": "pg_clipfrac_lower"}  # the kernel's -> verl's
_METRIC_NAMES = {k: f"actor/{_VERL_NAMES.get(k, k)}" for k in TOKEN_METRICS}  # logged: verl's name, else LUFFY's

_ON_KEYS = ("on_policy_reshape", "on_policy_reshape_gamma", "on_policy_reshape_weight", "on_policy_reshape_pow_exp")
_OFF_KEYS = ("off_policy_reshape", "off_policy_reshape_gamma", "off_policy_reshape_weight", "off_policy_reshape_pow_exp",
             "off_max_clip", "off_min_clip", "all_max_clip")  # mix.loss keys of TokenLossConfig, by side


def _row_values(data: TensorDict, keys, feature: str, helper: str) -> dict[str, float]:
    """The per-row values ``keys`` of a micro-batch, one number each (equal on every row of the micro-batch)."""
    values = {}
    for key in keys:
        if key not in data.keys():
            raise KeyError(f"{feature} needs '{key}' in the batch; the MIX trainer adds it before update_actor "
                           f"(mix_src.worker.loss.{helper})")
        value = data[key]
        if value.numel() and value.min() != value.max():
            raise ValueError(f"'{key}' differs within one micro-batch: its rows come from different mini-batches "
                             f"than {helper} assumed (actor.shuffle must be false)")
        values[key] = float(value.reshape(-1)[0]) if value.numel() else 0.0
    return values


def _grad_accum(data: TensorDict, info: dict) -> float:
    """The official actors' gradient-accumulation divisor (ppo_mini_batch_size // ppo_micro_batch_size per GPU): the
    rank's rows / micro-batch rows with static micro-batches, 1 with dynamic ones (as in every official script)."""
    micro_rows = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None)
    if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True) and micro_rows and info["global_batch_size"]:
        return max(float(info["global_batch_size"]) / info["dp_size"] / float(micro_rows), 1.0)
    return 1.0


def install_loss(worker_group: Any, loss: "MixPolicyLoss") -> None:
    """``worker_group.set_loss_fn(loss)`` once the workers are up (both bases); each actor worker checks its CPU-backend
    patches on arrival (``__setstate__``), this process its own (no-ops off the CPU backend)."""
    from mix_src.cpu import check_hooks_fired

    worker_group.set_loss_fn(loss)
    check_hooks_fired("trainer")


@dataclass
class _LossContext:
    """One micro-batch as the terms see it: padded fields (bsz, response_len), verl's global numbers, the metrics."""

    data: TensorDict
    batch: TensorDict
    log_prob: torch.Tensor
    response_mask: torch.Tensor
    prefix_mask: torch.Tensor
    advantages: torch.Tensor
    info: dict
    total_agg: Any
    metrics: dict
    rl_mask: Optional[torch.Tensor] = None


class MixPolicyLoss:
    """Worker loss for `actor_rollout_wg.set_loss_fn` (see the module docstring).

    config: verl's ActorConfig; loss_config: the `mix.loss` section (MixLossConfig, a mapping, or None); entropy_state:
    the learned entropy coefficient's `AdaptiveEntropyCoef.state()` to resume from, which goes back to the driver
    in each update's metrics (`mix_entropy_state/*`, see `pop_entropy_state`) and is saved with the checkpoint.
    """

    def __init__(self, config: Any, loss_config: Any = None, entropy_state: dict | None = None):
        self.config = config
        self.mix = loss_config if isinstance(loss_config, MixLossConfig) else MixLossConfig.from_dict(loss_config)
        loss_mode = config.policy_loss.get("loss_mode", "vanilla") if config.get("policy_loss") else "vanilla"
        # None: the LUFFY kernel's PPO-clip (vanilla); else the ActorConfig verl's own loss gets on on-policy tokens
        # (the mode x mix.loss knob table is checked once, before Ray: onpolicy_losses.knob_refusals, verl_parity.py)
        self.on_policy_config = None if mode_entry(loss_mode).luffy_kernel else on_policy_config(config, self.mix)
        self.cliprange = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
        clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
        if clip_high < self.cliprange:
            raise ValueError(f"actor.clip_ratio_high ({clip_high}) < clip_ratio_low ({self.cliprange}) is not "
                             "supported: the upper clip bound is max(mix.loss.clip_upper_bound, 1 + clip_ratio_high, "
                             "1 + clip_ratio_low)")
        self.clip_upper_bound = max(self.mix.clip_upper_bound, 1.0 + clip_high)
        self.clip_ratio_c = config.get("clip_ratio_c", 3.0)
        self.loss_agg_mode = self.mix.loss_agg_mode or config.loss_agg_mode
        if (self.mix.use_adaptive_entropy or self.mix.adaptive_entropy_fixed) and not config.entropy_coeff > 0:
            raise ValueError(f"the adaptive entropy coefficient starts from / scales actor.entropy_coeff, which "
                             f"must be > 0 (got {config.entropy_coeff})")
        self.kept_token_counts = uses_kept_token_counts(self.mix, self.loss_agg_mode)
        # the kernel's options, built (and checked) once: PPO-clip alone, and with the prefix tokens' term
        ppo = dict(cliprange=self.cliprange, clip_upper_bound=self.clip_upper_bound, clip_ratio_c=self.clip_ratio_c,
                   loss_agg_mode=self.loss_agg_mode, **{k: getattr(self.mix, k) for k in _ON_KEYS})  # fmt: skip
        self.ppo_clip_config = TokenLossConfig(**ppo)
        self.token_config = TokenLossConfig(**ppo, **{k: getattr(self.mix, k) for k in _OFF_KEYS})
        self._entropy_coef: AdaptiveEntropyCoef | None = None  # built on the worker, at the first call
        self._entropy_state = dict(entropy_state) if entropy_state else None
        self._pending_entropy = [0.0, 0.0]  # [sum of token entropies, tokens] of the current mini-batch

    def __setstate__(self, state: dict) -> None:
        """Unpickled on each actor worker by ``set_loss_fn``: check that worker's CPU-backend patches applied."""
        self.__dict__.update(state)
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # a worker, not a test
            from mix_src.cpu import check_hooks_fired

            check_hooks_fired("worker")

    # ---- the loss --------------------------------------------------------------------------------

    def __call__(self, model_output: Mapping[str, Any], data: TensorDict, dp_group=None):
        """The loss of one micro-batch (module docstring); actor/pg_loss is the sum of the terms marked pg_loss."""
        ctx, terms = self._context(model_output, data, dp_group)
        loss = pg_loss = None
        for name in LOSS_TERMS.names():
            options = LOSS_TERMS.options(name)
            term = LOSS_TERMS.get(name)(terms) if options.get("stage") == "scalar" else None
            if term is not None:
                loss = term if loss is None else loss + term
            if options.get("pg_loss"):
                pg_loss = loss
        ctx.metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=ctx.total_agg)
        return loss, ctx.metrics

    def _context(self, model_output: Mapping[str, Any], data: TensorDict, dp_group) -> tuple[_LossContext, TermInputs]:
        """The micro-batch padded to (bsz, response_len), verl's global numbers and masks; the terms' inputs."""
        config, mix = self.config, self.mix
        log_prob = no_padding_2_padding(model_output["log_probs"], data)  # (bsz, response_len)
        entropy = model_output.get("entropy", None)
        if entropy is not None:
            entropy = no_padding_2_padding(entropy, data)
        elif mix.use_adaptive_entropy or mix.adaptive_entropy_fixed:
            raise ValueError("adaptive entropy needs the entropy in model_output (calculate_entropy)")

        info = dict(dp_size=data["dp_size"], batch_num_tokens=data["batch_num_tokens"],
                    global_batch_size=data["global_batch_size"], loss_scale_factor=config.loss_scale_factor)  # fmt: skip
        global_norm = info["dp_size"] > 1 or any(v is not None for k, v in info.items() if k != "dp_size")
        total_agg = AggregationType.SUM if global_norm else AggregationType.MEAN  # as verl's ppo_loss

        if "prefix_mask" not in data.keys():
            raise KeyError("the batch has no 'prefix_mask' (bsz, response_len); the MIX trainer must add it (all zeros "
                           "for on-policy rows) before update_actor")
        fields = ["response_mask", "old_log_probs", "advantages", "prefix_mask"]
        fields += [k for k in ("rollout_is_weights", "ref_log_prob", BEHAVIOUR_LOG_PROB) if k in data.keys()]
        batch = data.select(*fields).to_padded_tensor()
        response_mask = batch["response_mask"].to(bool)
        if mix.row_loss is not None:  # SFT_COPY rows carry no token (mix_src/algo/row_loss.py)
            live, sft_row = row_marks(data[SFT_ROW].to(response_mask.device))
            response_mask = response_mask & live[:, None]
        if batch["prefix_mask"].shape != response_mask.shape:
            raise ValueError(f"prefix_mask has shape {tuple(batch['prefix_mask'].shape)}; it must match response_mask "
                             f"{tuple(response_mask.shape)} (bsz, response_len)")
        ctx = _LossContext(data, batch, log_prob, response_mask, batch["prefix_mask"].to(bool) & response_mask,
                           batch["advantages"], info, total_agg, {})  # fmt: skip
        if mix.prefix_token_select is not None:  # which prefix tokens keep their advantage (mix_src.algo.prefix_select)
            view = PrefixTokenView(
                entropy=None if entropy is None else entropy.detach(), log_prob=log_prob.detach(),
                old_log_prob=batch["old_log_probs"], advantages=ctx.advantages, response_mask=response_mask,
                prefix_mask=ctx.prefix_mask, ratio=PREFIX_TOKEN_SELECTS.settings(mix.prefix_token_select, {} if
                mix.prefix_token_select_ratio is None else {"ratio": mix.prefix_token_select_ratio})["ratio"],
            )  # fmt: skip
            ctx.advantages, kept, prefix_on_policy = select_prefix_tokens(mix.prefix_token_select, view)
            ctx.metrics["actor/prefix_kept_frac"] = Metric(value=float(masked_mean(kept.float(), ctx.prefix_mask)),
                                                           aggregation=AggregationType.MEAN)  # fmt: skip
            if prefix_on_policy:  # the entry's option: prefix tokens get the on-policy PPO-clip loss
                ctx.prefix_mask = torch.zeros_like(ctx.prefix_mask)
        ctx.rl_mask, sft_mask = response_mask, None
        if mix.row_loss is not None:  # the rows' own choice ('sft_row' (bsz,): checked by add_sft_token_counts)
            ctx.rl_mask, sft_mask = ROW_LOSSES.get(mix.row_loss)(response_mask, ctx.prefix_mask, sft_row)
        elif mix.use_sft_multitask_loss:  # the prefix tokens take the SFT term, the on-policy rows PPO-clip
            sft_mask = ctx.prefix_mask

        def agg(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return agg_loss(values, mask, self.loss_agg_mode, **info)

        def log(key: str, value: Any, total: bool | None = None) -> None:
            ctx.metrics[key] = value if total is None else Metric(
                value=value, aggregation=total_agg if total else AggregationType.MEAN)

        def kld() -> torch.Tensor:
            if "ref_log_prob" not in batch.keys():
                raise KeyError("actor.use_kl_loss is on but the batch has no 'ref_log_prob'")
            return kl_penalty(logprob=log_prob, ref_logprob=batch["ref_log_prob"], kl_penalty=config.kl_loss_type)

        return ctx, TermInputs(
            log_prob=log_prob, response_mask=response_mask, agg=agg, policy=lambda: self._policy_loss(ctx),
            entropy=entropy, sft_mask=sft_mask,
            entropy_coef=lambda: self._entropy_coefficient(entropy, response_mask, info, dp_group, ctx.metrics),
            sft_agg=lambda lp, mask: SFT_AGGS.get(mix.sft_loss_agg)(lp, mask, self._sft_scale(data, info, agg)),
            sft_coef=mix.sft_loss_coef, kld=kld if config.use_kl_loss else None, kl_coef=config.kl_loss_coef, log=log,
            entropy_agg=(lambda v, m: micro_batch_token_mean(v, m, _grad_accum(data, info)))
            if mix.entropy_agg == "micro_batch_token_mean" else None,
        )  # fmt: skip

    def _policy_loss(self, ctx: "_LossContext") -> torch.Tensor:
        """The policy loss: a loss combination, PPO-clip on the on-policy rows (use_sft_multitask_loss), or the LUFFY
        kernel over rl_mask (+ verl's loss_mode on the on-policy tokens); logs TOKEN_METRICS."""
        mix, batch, prefix_mask = self.mix, ctx.batch, ctx.prefix_mask
        policy_info = ctx.info
        if self.kept_token_counts:
            feature = "mix.loss.all_max_clip with token-mean"
            kept = _row_values(ctx.data, (KEPT_TOKENS,), feature, "add_kept_token_counts")[KEPT_TOKENS]
            policy_info = dict(ctx.info, batch_num_tokens=max(kept, 1.0))  # 0 kept tokens: a numerator of 0 too
        remove_clip = self.mix.loss_remove_clip  # or the rows' own choice (bsz, 1) where a rollout policy set it
        if REMOVE_CLIP in ctx.data.keys():
            remove_clip = ctx.data[REMOVE_CLIP].to(ctx.response_mask.device).reshape(-1, 1).bool()
        token_batch = partial(TokenBatch, batch["old_log_probs"], ctx.log_prob,
                              loss_remove_clip=remove_clip,
                              rollout_is_weights=batch.get("rollout_is_weights", None), **policy_info)  # fmt: skip
        if mix.combine is not None:  # a registered loss combination (mix_src.algo.loss_combine)
            pg_loss, out = self._combined_policy_loss(ctx, token_batch)
        elif mix.use_sft_multitask_loss:
            off_rows = prefix_mask.any(dim=-1, keepdim=True)  # rows with a prefix are off-policy rows
            out = token_loss(token_batch(ctx.advantages, ctx.response_mask & ~off_rows, torch.zeros_like(prefix_mask)),
                             self.ppo_clip_config)  # fmt: skip
            out["off_policy_prob"] = masked_mean(ctx.log_prob.detach().exp(), prefix_mask)
            pg_loss = out["pg_loss"]
        else:
            rl_mask = ctx.rl_mask
            behaviour = None  # the prefix tokens' recorded behaviour log-probs (mix_src/algo/off_policy_behaviour.py)
            if mix.off_policy_behaviour is not None:
                behaviour = OFF_POLICY_BEHAVIOURS.get(mix.off_policy_behaviour)(prefix_mask & rl_mask, batch)
            kernel_advantages = ctx.advantages  # a verl loss on the on-policy tokens: the kernel gives them A = 0
            if self.on_policy_config is not None:
                kernel_advantages = torch.where(prefix_mask & rl_mask, ctx.advantages, 0.0)
            out = token_loss(token_batch(kernel_advantages, rl_mask, prefix_mask & rl_mask, behaviour_log_prob=behaviour),
                             self.token_config)  # fmt: skip
            pg_loss = out["pg_loss"]
            if self.on_policy_config is not None:
                pg_loss = pg_loss + self._verl_on_policy_term(ctx, policy_info, out)
        values = torch.stack([out[k].float() for k in TOKEN_METRICS]).tolist()  # one host sync
        ctx.metrics.update(Metric.from_dict(dict(zip(_METRIC_NAMES.values(), values)),
                                            aggregation=AggregationType.MEAN))  # fmt: skip
        return pg_loss

    def _verl_on_policy_term(self, ctx: "_LossContext", policy_info: dict, out: dict) -> torch.Tensor:
        """verl's ``policy_loss.loss_mode`` on the on-policy tokens of ``rl_mask`` (mix_src/worker/onpolicy_losses.py);
        its metrics replace the kernel's on-policy ones in ``out`` (on_pg_loss: the on-term's share of pg_loss)."""
        valid = ctx.rl_mask
        if self.mix.all_max_clip is not None:  # tokens with p > c leave the loss, as in the kernel
            valid = ctx.rl_mask & (ctx.log_prob.detach() <= math.log(self.mix.all_max_clip))
        loss, verl_metrics = on_policy_term(
            self.on_policy_config, ctx.batch["old_log_probs"], ctx.log_prob, ctx.advantages, valid & ~ctx.prefix_mask,
            valid, self.loss_agg_mode, policy_info, ctx.batch.get("rollout_is_weights", None),
        )  # fmt: skip
        for key in ("on_pg_clipfrac", "on_pg_clipfrac_lower", "ppo_kl"):
            out[key] = torch.as_tensor(float(verl_metrics.get(_METRIC_NAMES[key], 0.0)))
        out["on_pg_loss"] = loss.detach()
        return loss

    def _sft_scale(self, data: TensorDict, info: dict, policy_agg: Callable) -> SftScale:
        """The numbers of ``mix.loss.sft_loss_agg`` (mix_src/algo/row_loss.py SftScale)."""
        sft_tokens = None  # the SFT tokens of this micro-batch's global mini-batch (add_sft_token_counts)
        if SFT_TOKENS in data.keys():
            sft_tokens = _row_values(data, (SFT_TOKENS,), "mix.loss.row_loss", "add_sft_token_counts")[SFT_TOKENS]
        return SftScale(sft_tokens, int(info["dp_size"]), _grad_accum(data, info), policy_agg)

    def _combined_policy_loss(self, ctx: "_LossContext", token_batch: Callable[..., TokenBatch]):
        """``mix.loss.combine``: PPO-clip on the on-policy rows, combined with the expert tokens by the entry."""
        mix, log_prob, prefix_mask = self.mix, ctx.log_prob, ctx.prefix_mask
        counts = _row_values(ctx.data, COMBINE_FIELDS, "mix.loss.combine", "add_combine_inputs")
        on_mask = ctx.response_mask & ~prefix_mask.any(dim=-1, keepdim=True)  # rows with a prefix are expert rows
        on_info, expert_info = (  # each population's own global mini-batch size (>= 1: 0/0 -> 0)
            dict(ctx.info, batch_num_tokens=max(counts[tokens], 1.0), global_batch_size=max(counts[rows], 1.0))
            for tokens, rows in ((ON_TOKENS, ON_ROWS), (EXPERT_TOKENS, EXPERT_ROWS)))
        out = token_loss(token_batch(ctx.batch["advantages"], on_mask, torch.zeros_like(prefix_mask), **on_info),
                         self.ppo_clip_config)  # fmt: skip
        out["off_policy_prob"] = masked_mean(log_prob.detach().exp(), prefix_mask)
        inputs = CombineInputs(
            log_prob=log_prob, on_mask=on_mask, expert_mask=prefix_mask, rl_loss=out["pg_loss"],
            agg_on=lambda m: agg_loss(m, on_mask, self.loss_agg_mode, **on_info),
            agg_expert=lambda m: agg_loss(m, prefix_mask, self.loss_agg_mode, **expert_info),
            global_step=int(counts[GLOBAL_STEP]),
        )  # fmt: skip
        loss, extra = LOSS_COMBINES.get(mix.combine)(inputs, LOSS_COMBINES.settings(mix.combine, mix.combine_args))
        ctx.metrics.update(Metric.from_dict({f"actor/{k}": float(v) for k, v in extra.items()},
                                            aggregation=AggregationType.MEAN))  # fmt: skip
        return loss, out

    # ---- entropy coefficient -------------------------------------------------------------------------

    def _entropy_coefficient(self, entropy, response_mask, info, dp_group, metrics) -> float:
        """The coefficient of this micro-batch's entropy bonus (and the adaptive bookkeeping)."""
        mix, base = self.mix, self.config.entropy_coeff
        if mix.adaptive_entropy_fixed:
            mean_entropy = masked_mean(entropy.detach(), response_mask).item()
            coef = base * mix.target_entropy / mean_entropy if mean_entropy > 0 else base
            metrics["actor/entropy_coeff"] = coef
            return coef
        if not mix.use_adaptive_entropy:
            return base
        if self._entropy_coef is None:
            self._entropy_coef = AdaptiveEntropyCoef(base, mix.target_entropy, lr=mix.alpha_lr,
                                                     max_coef=mix.entropy_coeff_max)  # fmt: skip
            if self._entropy_state is not None:
                self._entropy_coef.load_state(self._entropy_state)
        coef = self._entropy_coef.coef  # constant during a mini-batch: the split does not matter
        metrics["actor/entropy_coeff"] = coef

        # the mini-batch's token-mean entropy over micro-batches and DP ranks; step once all its tokens are seen
        local = torch.stack([(entropy.detach() * response_mask).sum(), response_mask.sum()]).double()
        if info["dp_size"] > 1 and dp_group is not None and torch.distributed.is_initialized():
            torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.SUM, group=dp_group)
        self._pending_entropy = [total + float(part) for total, part in zip(self._pending_entropy, local)]
        total = info["batch_num_tokens"]
        if total is None or self._pending_entropy[1] >= total:
            tokens = self._pending_entropy[1]
            mean_entropy = self._pending_entropy[0] / tokens if tokens else self._entropy_coef.target_entropy
            update = self._entropy_coef.update(mean_entropy)
            metrics.update({f"actor/{k}": update[k] for k in ("alpha_loss", "log_alpha")})
            metrics.update({ENTROPY_STATE + k: v for k, v in self._entropy_coef.state().items()})
            self._pending_entropy = [0.0, 0.0]
        return coef
