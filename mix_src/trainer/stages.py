"""LUFFY's per-step pieces, called by both trainer bases (:mod:`mix_src.trainer.legacy`, :mod:`mix_src.trainer.v1`),
independent of how the trainer stores its batch. ``mix``: the validated ``MixConfig``, typed ``Any`` (the config
schema imports the rollout policies, which import this module)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from mix_src.trainer.adv_estimators import ADV_ESTIMATORS
from mix_src.algo import core_alg, seeding
from mix_src.algo.core_alg import apply_prefix_advantage_weights
from mix_src.algo.prefix import compute_prefix_ratios

__all__ = ["MIX_STATE_FILE", "FilterGroupsExhausted", "DATA_DROP", "DATA_EPOCH", "SUMMED_REWARD_METRICS",
           "draw_prefix_ratios", "filter_metric_values", "length_clip_metrics", "luffy_advantage_stage",
           "luffy_advantages", "luffy_metrics", "pass_arguments", "prefix_context_mask", "on_policy_rollout_metrics",
           "on_policy_rollout_correction", "prefix_mask_tensor", "prompt_data_key", "solved_rows", "start_data_epoch"]


MIX_STATE_FILE = "mix_state.pt"  # the MIX loop's own state, saved beside verl's checkpoint of each step


class FilterGroupsExhausted(RuntimeError):
    """Filter groups could not fill a training batch within ``algorithm.filter_groups.max_num_gen_batches``."""

    @classmethod
    def after(cls, batches: str, max_gen: Any, kept: int, target: Any, metric: Any, detail: str):
        """Both bases' error: after ``batches`` only ``kept`` of ``target`` prompt groups were kept."""
        return cls(f"filter groups: after {batches} (algorithm.filter_groups.max_num_gen_batches={max_gen}) only "
                   f"{kept} of data.train_batch_size={target} prompt groups had a non-zero std of '{metric}' "
                   f"({detail}). Raise algorithm.filter_groups.max_num_gen_batches (0 = no limit), lower "
                   "data.train_batch_size, or use prompts of a difficulty where some but not all samples succeed.")


def draw_prefix_ratios(mix: Any, num_prompts: int, n: int, *, seed: int, global_step: int, gen_index: int,
                       targets: Optional[Sequence]) -> np.ndarray:
    """One prefix ratio per row, float64 (num_prompts * n,), rows ``i*n + j`` (prompt i, sample j), drawn from
    ``np.random.default_rng([seed, global_step, gen_index])`` (a resumed run draws what an uninterrupted one drew).
    ``targets``: one per row (or None); rows without a non-empty string target get 0."""
    ratios = compute_prefix_ratios(
        num_prompts, n, strategy=mix.prefix_strategy, n_prefix=mix.n_prefix, min_prefix_ratio=mix.min_prefix_ratio,
        max_prefix_ratio=mix.max_prefix_ratio, prefix_steps=mix.prefix_steps,
        prefix_linear_max_ratio=mix.prefix_linear_max_ratio, prefix_fix_ratios=mix.prefix_fix_ratios,
        share_across_samples=mix.prefix_share_across_samples, global_step=global_step,
        rng=np.random.default_rng([seed, global_step, gen_index]),
    )  # fmt: skip
    if targets is None:
        return np.zeros(num_prompts * n, dtype=np.float64)
    has_target = np.array([isinstance(t, str) and len(t) > 0 for t in targets], dtype=bool)
    return np.where(has_target, ratios, 0.0)


def pass_arguments(ratios: Sequence[float], targets: Optional[Sequence], seeds: Sequence[int], global_step: int,
                   num_passes: int, rows_given: bool = False, prompts_given: bool = False) -> tuple[np.ndarray, ...]:
    """A rollout policy's ``generate(ratios, rows=None, targets=None, prompts=None)`` arguments for rows whose base
    sampling seeds are ``seeds``, checked: ``prompts`` takes no ``rows``, one ratio and (if given) one target per row.
    Returns (rows,) float64 ratios, the targets list and the rows' int64 sampling seeds of pass ``num_passes``
    (:func:`mix_src.algo.seeding.pass_seeds`); prompt rows kept from an earlier step (``prompts=``) take a pass index
    of this step."""
    if prompts_given and rows_given:
        raise ValueError("rollout policy: generate(prompts=...) takes no rows")
    ratios = np.asarray(ratios, dtype=np.float64).reshape(-1)
    if ratios.shape != (len(seeds),):
        raise ValueError(f"rollout policy: {ratios.size} ratios for {len(seeds)} rows")
    targets = None if targets is None else list(targets)
    if targets is not None and len(targets) != len(seeds):
        raise ValueError(f"rollout policy: {len(targets)} targets for {len(seeds)} rows")
    index = (int(global_step) << 16) + num_passes + 1 if prompts_given else num_passes
    return ratios, targets, seeding.pass_seeds(np.asarray(seeds, dtype=np.int64), index)


def prefix_mask_tensor(row_masks: Sequence, response_mask: torch.Tensor) -> torch.Tensor:
    """(bsz, response_len) bool: the rows' ``prefix_token_mask`` arrays (one 0/1 array, or None / empty for an
    on-policy row, per row), right-padded, within the response."""
    out, width = torch.zeros(response_mask.shape, dtype=torch.bool), response_mask.shape[-1]
    for i, m in enumerate(row_masks):
        if m is not None and len(m):
            out[i, : min(len(m), width)] = torch.as_tensor(np.asarray(m[:width], dtype=bool))
    return out & response_mask.bool()


def luffy_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence,
                     prefix_mask: torch.Tensor, algorithm: Any, mix: Any,
                     verl_estimator: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """(bsz, L) advantages and returns: a prefix-aware estimator of :data:`~mix_src.trainer.adv_estimators.ADV_ESTIMATORS`
    with ``prefix_mask`` (bsz, L) bool, any other ``verl_estimator()``; then LUFFY's prefix weights
    ``A <- A * (alpha * g + beta * (1 - g))``. token_level_rewards, response_mask: (bsz, L); uids: (bsz,)."""
    if algorithm.adv_estimator in ADV_ESTIMATORS:
        advantages, returns = ADV_ESTIMATORS.get(algorithm.adv_estimator)(
            token_level_rewards, response_mask, core_alg.group_ids(np.asarray(uids, dtype=object)), prefix_mask, algorithm
        )
    else:
        advantages, returns = verl_estimator()
    alpha, beta = mix.prefix_reward_weight_alpha, mix.prefix_reward_weight_beta
    if alpha != 1.0 or beta != 1.0:
        advantages = apply_prefix_advantage_weights(advantages, prefix_mask, alpha, beta)
    return advantages, returns


def luffy_advantage_stage(verl_advantage: Callable, prefix_mask: torch.Tensor, algorithm: Any, mix: Any) -> Callable:
    """A stand-in for verl's advantage call ``verl_advantage(data, **kwargs) -> data`` (legacy: ``ray_trainer.py``
    ``compute_advantage``; V1: ``trainer_base.compute_advantage_for_multi_trajectories``) writing
    :func:`luffy_advantages` into ``data.batch``; ``prefix_mask``: (bsz, L)."""

    def advantages(data, **kwargs):
        def verl_estimator():
            out = verl_advantage(data, **kwargs)
            return out.batch["advantages"], out.batch["returns"]

        data.batch["advantages"], data.batch["returns"] = luffy_advantages(
            data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"],
            prefix_mask, algorithm, mix, verl_estimator=verl_estimator,
        )  # fmt: skip
        return data

    return advantages


def solved_rows(acc: Optional[Sequence], scores: Callable[[], np.ndarray]) -> np.ndarray:
    """(bsz,) bool: ``acc > 0`` when the reward reported an ``acc`` for every row, else a summed score ``> 0``.
    acc: (bsz,) or None (None entries: rows without one); scores: returns the (bsz,) summed token scores."""
    if acc is not None and all(a is not None for a in acc):
        return np.array([float(a) > 0 for a in acc], dtype=bool)  # NaN counts as unsolved
    return np.asarray(scores()) > 0


def luffy_metrics(solved: np.ndarray, prefix_mask: torch.Tensor, response_mask: torch.Tensor, uids: Sequence,
                  ratios: Sequence[float], truncated: Optional[Sequence] = None,
                  ungradable: Optional[Sequence] = None) -> dict[str, float]:
    """LUFFY's metrics of the rows a step trains on: ``batch/solve_none``, ``solve_all`` (fractions of prompt groups),
    ``solved``, ``on_solved``, ``off_solved`` (of rows), ``batch/avg_prefix_ratio`` (exact sum: row order cannot change
    it), ``off_policy_rows``, ``prefix_token_frac`` (prefix tokens / response tokens), and when the rows report them
    ``batch/prefix_truncated`` and ``reward/ungradable`` (rows the reward could not grade).
    ``solved``: (bsz,) bool; ``prefix_mask``, ``response_mask``: (bsz, L); the others (bsz,)."""
    solved, off = np.asarray(solved, dtype=bool), prefix_mask.any(-1).numpy()
    gid = core_alg.group_ids(np.asarray(uids, dtype=object)).numpy()
    solved_per_group = np.bincount(gid, weights=solved)
    out = {
        "batch/solve_none": float(np.mean(solved_per_group == 0)),
        "batch/solve_all": float(np.mean(solved_per_group == np.bincount(gid))),
        "batch/solved": float(solved.mean()),
        "batch/on_solved": float(solved[~off].mean()) if (~off).any() else 0.0,
        "batch/off_solved": float(solved[off].mean()) if off.any() else 0.0,
        "batch/avg_prefix_ratio": math.fsum(np.asarray(ratios, dtype=np.float64)) / max(len(ratios), 1),
        "batch/off_policy_rows": int(off.sum()),
        "batch/prefix_token_frac": float((prefix_mask.sum() / response_mask.sum().clamp(min=1)).item()),
    }
    if truncated is not None:
        out["batch/prefix_truncated"] = int(sum(bool(t) for t in truncated))
    if ungradable is not None:
        out["reward/ungradable"] = int(np.count_nonzero(np.asarray(ungradable, dtype=bool)))
    return out


# ---- group filtering: which per-row value ``algorithm.filter_groups.metric`` names ---------------------------
#: the names of a row's summed token reward: verl's canonical ``reward`` (V1 ``replay_buffer.py`` 278: the sum of
#: ``rm_scores``) and ``seq_reward``, which verl's DAPO recipe computes as ``token_level_scores.sum(-1)``
#: (``recipe/dapo/dapo_ray_trainer.py``, its ``elif metric_name == "seq_reward"`` branch). V1's built-in buffer
#: would look ``seq_reward`` up in ``reward_extra_info`` and fail after Ray has started.
SUMMED_REWARD_METRICS = ("reward", "seq_reward")


def filter_metric_values(metric: Optional[str], summed_reward: Callable[[], Sequence[float]],
                         extra: Callable[[str], Optional[Sequence]], extra_keys: Sequence[str] = ()) -> np.ndarray:
    """(rows,) float64: each row's value of the group-filter metric ``metric`` (unset: ``reward``).
    ``summed_reward()``: the rows' summed token scores; ``extra(name)``: the rows' values of the reward's extra key
    ``name`` (None when some row lacks it); ``extra_keys``: the reward's extra keys, for the error."""
    name = metric or "reward"
    if name in SUMMED_REWARD_METRICS:
        return np.asarray(summed_reward(), dtype=np.float64)
    values = extra(name)
    if values is None:
        raise KeyError(
            f"algorithm.filter_groups.metric={name!r} is not a value the reward returned for every row; use one of "
            f"{list(SUMMED_REWARD_METRICS)} (the summed token reward) or one of the reward's extra keys: "
            f"{sorted(extra_keys)}"
        )
    return np.asarray(values, dtype=np.float64)


def length_clip_metrics(prompt_length: torch.Tensor, response_length: torch.Tensor, max_prompt_length: int,
                        max_response_length: int) -> dict[str, float]:
    """``prompt_length/clip_ratio``, ``response_length/clip_ratio``, ``response_length_non_aborted/clip_ratio``:
    the fraction of rows cut at the configured limit. ``prompt_length``, ``response_length``: (bsz,) token counts.

    verl's ``compute_data_metrics`` (``metric_utils.py`` 459, 592) compares with the batch tensors' width: the limit
    on the legacy base, the step's longest row on V1. Both bases overwrite verl's three values with these."""

    def clipped(lengths: torch.Tensor, limit: int) -> float:  # NaN over no rows (every row aborted), as verl logs it
        return torch.eq(lengths.float(), limit).float().mean().item()

    non_aborted = response_length[response_length > 0]
    return {"prompt_length/clip_ratio": clipped(prompt_length, max_prompt_length),
            "response_length/clip_ratio": clipped(response_length, max_response_length),
            "response_length_non_aborted/clip_ratio": clipped(non_aborted, max_response_length)}


# ---- rollout vs actor: on-policy tokens only. A prefix (target) token has no rollout log-prob (the agent loop writes
# 0): verl's metrics over the whole response would report a rollout/actor mismatch that does not exist.
def on_policy_rollout_metrics(data: Any, prefix_mask: torch.Tensor) -> dict[str, float]:
    """verl's ``calculate_debug_metrics`` (``training/rollout_probs_diff_*``, ``rollout_actor_probs_pearson_corr``)
    over the on-policy tokens. ``data``: a DataProto with (bsz, L) ``rollout_log_probs``, ``old_log_probs``,
    ``response_mask``, ``responses``; ``prefix_mask``: (bsz, L) bool. {} when no token is on-policy."""
    from verl import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    mask = data.batch["response_mask"]
    on_policy = mask * (~prefix_mask.bool()).to(mask.dtype)
    if on_policy.sum() == 0:
        return {}
    tensors = {k: data.batch[k] for k in ("rollout_log_probs", "old_log_probs", "response_mask", "responses")}
    return calculate_debug_metrics(DataProto.from_dict(tensors={**tensors, "response_mask": on_policy}))


def on_policy_rollout_correction(data: Any, prefix_mask: torch.Tensor, rc: Any, correct: Callable) -> tuple[Any, dict]:
    """``correct(data, rc) -> (data, metrics)`` (verl's ``compute_rollout_correction_and_add_to_batch``, decoupled
    mode) over the on-policy tokens: prefix tokens keep IS weight 1 and are never rejected. ({} metrics and ``data``
    unchanged when every token is a prefix token.)"""
    full_mask = data.batch["response_mask"]
    prefix = prefix_mask.bool() & full_mask.bool()
    if not (full_mask.bool() & ~prefix).any():
        return data, {}
    data.batch["response_mask"] = full_mask * (~prefix).to(full_mask.dtype)
    data, metrics = correct(data, rc)
    data.batch["response_mask"] = torch.where(prefix, full_mask, data.batch["response_mask"])
    if "rollout_is_weights" in data.batch.keys():
        weights = data.batch["rollout_is_weights"]
        data.batch["rollout_is_weights"] = torch.where(prefix, torch.ones_like(weights), weights)
    return data, metrics


# ---- the data of each epoch: prompts a rollout policy retired ---------------------------------------------------

DATA_DROP = "mix_data_drop"  # RolloutContext.state key a rollout policy may fill: {"keys": set of prompt_data_key
#                              (the prompts to leave out of the data from the next epoch on), "min_left": int}
DATA_EPOCH = "mix_data_epoch"  # the state key start_data_epoch writes: the keys left out of the current epoch


def prompt_data_key(messages: Sequence) -> str:
    """A prompt's identity in the data: a hash of its chat messages' (role, content), the same for a dataset row's
    prompt column and for a batch row's ``raw_prompt`` (verl's RLHFDataset passes the messages through)."""
    norm = [[str(m["role"]), str(m["content"])] for m in messages]
    return hashlib.sha1(json.dumps(norm, ensure_ascii=False).encode("utf-8")).hexdigest()


def start_data_epoch(dataloader: Any, dataset: Any, state: dict) -> Optional[int]:
    """Before each pass over the training data: the prompts a rollout policy listed in ``state[DATA_DROP]`` leave the
    dataset for this epoch.

    ExGRPO's official ``fit`` (LUFFY repo 01f4ae0, ``ExGRPO/exgrpo/verl/verl/mix_src/mix_trainer_experience.py:245-250``
    with ``experience/rl_dataset_with_experience.py:40-45`` ``set_skip_uid_set``): if more than ``min_left`` prompts
    are left, the epoch's data is the full data minus every retired prompt, else the previous epoch's choice stays.
    The choice is saved in ``state[DATA_EPOCH]``; a run resumed mid-epoch (torchdata's ``next_iter_state`` is set)
    applies it again, so the restored sampler walks the same rows. Returns the rows left (None: no-op)."""
    drop = state.get(DATA_DROP)
    fresh = getattr(dataloader, "next_iter_state", None) is None
    if fresh and drop is not None and len(dataset) > int(drop["min_left"]):
        state[DATA_EPOCH] = sorted(drop["keys"])
    if DATA_EPOCH not in state:
        return None
    leave_out = getattr(dataset, "leave_out", None)
    if leave_out is None:
        raise TypeError(f"the rollout policy retires prompts from the data ({DATA_DROP!r} in its state), which the "
                        f"dataset {type(dataset).__name__} cannot do: use mix_src.trainer.dataset.RLHFDatasetWithTarget "
                        "(data.custom_cls, set by mix_src's configs)")
    return leave_out(set(state[DATA_EPOCH]))


def prefix_context_mask(response_mask: torch.Tensor, prefix_mask: torch.Tensor) -> torch.Tensor:
    """``mix.loss.prefix_tokens=context`` (PrefixRL, arXiv 2601.18795: condition on the prefix, train the continuation):
    the update's (bsz, L) ``response_mask`` without the prefix tokens, same dtype. verl's engine counts a mini-batch's
    tokens from it (``loss_mask``, verl/workers/utils/padding.py ``left_right_2_no_padding``; fsdp
    ``transformer_impl.py`` ``batch_num_tokens``) and the worker loss takes its policy, entropy and KL terms over it,
    so a prefix token is in none of them, as a prompt token is not."""
    return response_mask * (~prefix_mask.bool()).to(response_mask.dtype)
