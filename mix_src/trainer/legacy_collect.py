"""Stages 1-3 of the legacy loop (mix_src/README.md "The algorithm and its knobs"): generate with prefixes through
the rollout policy, extract the reward, filter groups and accumulate until ``data.train_batch_size`` prompt groups
are collected. The V1 base collects in verl's replay buffer instead (mix_src/trainer/v1_replay.py).
"""

from __future__ import annotations

import uuid
from typing import Iterator, Optional

import numpy as np

from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_response_mask
from verl.trainer.ppo.reward import extract_reward
from verl.utils.debug import marked_timer

from mix_src.algo.filter_groups import filter_groups, plan_train_batch
from mix_src.algo.flops import lengths_from_masks
from mix_src.trainer.dataset import TARGET_FIELD, TARGET_LST_FIELD
from mix_src.trainer.rollout_policy import solved as rows_solved
from mix_src.trainer.stages import (FilterGroupsExhausted, filter_metric_values, luffy_metrics, pass_arguments,
                                    prefix_mask_tensor)  # fmt: skip

__all__ = ["LegacyCollect", "merge_rollout_timing"]


class LegacyCollect:
    """Stages 1-3 of :class:`mix_src.trainer.legacy.MIXRayPPOTrainer` (needs its ``config``, ``mix``, ``n``,
    ``filter_cfg``, ``_carry``, ``global_steps``, rollout wake/sleep, ``_actor_entropy`` and verl's helpers)."""

    def _collect_batch(self, batches: Iterator[dict], metrics: dict, timing: dict) -> Optional[DataProto]:
        target_groups = int(self.config.data.train_batch_size)
        filtering = bool(self.filter_cfg.enable)
        max_gen = int(self.filter_cfg.get("max_num_gen_batches", 0) or 0)
        pool: list[DataProto] = []
        n_groups = 0
        if self._carry is not None:
            pool.append(self._carry)
            n_groups = _num_groups(self._carry)
            metrics["train/num_carried_prompts"] = n_groups
            self._carry = None
        stats = {"groups": 0, "kept": 0, "std_sum": 0.0}
        gen_timings: list[tuple[dict, int]] = []
        num_gen = 0
        while (not filtering and num_gen == 0) or (filtering and n_groups < target_groups):
            if filtering and max_gen > 0 and num_gen >= max_gen:
                dropped = f"{stats['groups'] - stats['kept']} of {stats['groups']} groups dropped"
                raise FilterGroupsExhausted.after(f"{num_gen} generation batches", max_gen, n_groups, target_groups,
                                                  self.filter_cfg.metric, dropped)
            batch_dict = next(batches, None)
            if batch_dict is None:
                if pool:
                    print(f"[mix_src] the training data ran out with {n_groups} of {target_groups} prompt groups "
                          f"collected for step {self.global_steps}; those {n_groups} groups are dropped and training ends.")
                return None
            gen_timing: dict[str, float] = {}
            with marked_timer("gen", timing):
                gen = self._generate(batch_dict, gen_index=num_gen, timing=gen_timing)  # stage 1
            gen_timings.append((gen_timing, len(gen)))
            num_gen += 1
            gen = self._extract_reward(gen)  # stage 2
            if filtering:  # stage 3
                result = self._filter_groups(gen)
                stats["groups"] += result.num_groups
                stats["kept"] += result.num_kept
                stats["std_sum"] += result.mean_std * result.num_groups
                gen = gen[np.flatnonzero(result.keep_rows)] if result.num_filtered else gen
            if len(gen):
                pool.append(gen)
                n_groups += _num_groups(gen)

        for key, value in merge_rollout_timing(gen_timings).items():
            timing[key] = timing.get(key, 0.0) + value
        batch = DataProto.concat(pool)
        if filtering:
            plan = plan_train_batch(batch.non_tensor_batch["uid"], target_groups, self.mix.filter_groups.carry_over)
            if len(plan.carry_rows):
                self._carry = batch[plan.carry_rows]
            batch = batch[plan.train_rows] if len(plan.train_rows) < len(batch) else batch
            metrics["train/num_gen_batches"] = num_gen
            metrics["train/filter_rate"] = 1.0 - stats["kept"] / max(stats["groups"], 1)
            metrics["train/num_kept_prompts"] = _num_groups(batch)
            metrics["train/group_metric_std_mean"] = stats["std_sum"] / max(stats["groups"], 1)
            metrics["train/num_surplus_carried"] = plan.num_groups - target_groups - plan.num_dropped_groups
            metrics["train/num_surplus_dropped"] = plan.num_dropped_groups
        self._add_rollout_metrics(batch, metrics)
        return batch

    def _generate(self, batch_dict: dict, gen_index: int, timing: dict) -> DataProto:
        """Stage 1: one generation batch of ``len(batch_dict) * n`` rows, rows ``i*n + j`` of prompt i, produced by
        the rollout policy ``mix.rollout_policy``."""
        batch = DataProto.from_single_dict(batch_dict)
        batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        target_sets = batch.non_tensor_batch.pop(TARGET_LST_FIELD, None) if self.mix.data.use_target_lst else None
        gen_batch = self._get_gen_batch(batch)
        gen_batch.meta_info["global_steps"] = self.global_steps
        gen_batch = gen_batch.repeat(repeat_times=self.n, interleave=True)
        if target_sets is not None:
            gen_batch.non_tensor_batch[TARGET_FIELD] = self._draw_targets(target_sets, gen_index)
        gen_batch.non_tensor_batch["rollout_seed"] = self._row_seeds(len(batch), gen_index)
        batch = batch.repeat(repeat_times=self.n, interleave=True)
        passes: list[tuple[dict, int]] = []  # (timing, rows) of each pass the rollout policy makes

        def records(rows: np.ndarray) -> DataProto:
            idx = np.asarray(rows, dtype=np.int64)
            b, g = batch[idx], gen_batch[idx]  # copies (DataProto slicing copies); g has no tensors
            return DataProto(batch=b.batch, non_tensor_batch={**g.non_tensor_batch, **b.non_tensor_batch},
                             meta_info={**g.meta_info, **b.meta_info})

        def generate(ratios: np.ndarray, rows: Optional[np.ndarray] = None, targets=None, prompts=None) -> DataProto:
            if prompts is not None:  # prompt rows kept from an earlier batch (records)
                src = prompts[np.arange(len(prompts))]
                sub = self._get_gen_batch(src)  # pops the generation keys off the copy `src`
                sub.meta_info = dict(gen_batch.meta_info)
            else:
                idx = np.arange(len(batch)) if rows is None else np.asarray(rows, dtype=np.int64)
                sub = gen_batch if rows is None else gen_batch[idx]
                src = None
            seeds = sub.non_tensor_batch["rollout_seed"]
            ratios, targets, seeds = pass_arguments(ratios, targets, seeds, self.global_steps, len(passes),
                                                    rows is not None, src is not None)
            sub = DataProto(batch=sub.batch, non_tensor_batch=dict(sub.non_tensor_batch), meta_info=dict(sub.meta_info))
            sub.non_tensor_batch["prefix_ratio"], sub.non_tensor_batch["rollout_seed"] = ratios, seeds
            if targets is not None:
                sub.non_tensor_batch[TARGET_FIELD] = np.asarray(targets, dtype=object)
            if not self._rollout_awake:  # a colocated reward model put it to sleep after the last batch
                self._wake_rollout()
            out = self.async_rollout_manager.generate_sequences(sub)
            passes.append((out.meta_info.pop("timing", {}), len(sub)))
            part = (batch[idx] if src is None else src).union(out)
            if "response_mask" not in part.batch.keys():
                part.batch["response_mask"] = compute_response_mask(part)
            part.batch["prefix_mask"] = prefix_mask_tensor(part.non_tensor_batch.pop("prefix_token_mask"),
                                                           part.batch["response_mask"])  # fmt: skip
            if "attention_mask" in part.batch.keys() and "responses" in part.batch.keys():  # generation FLOPs
                self.add_rollout_flops(*lengths_from_masks(part.batch["attention_mask"], part.batch["responses"],
                                                           part.batch["prefix_mask"]))  # fmt: skip
            return self._extract_reward(part)

        def prefix_ratios() -> np.ndarray:
            return self._row_ratios(len(batch) // self.n, gen_index, gen_batch.non_tensor_batch.get(TARGET_FIELD))

        out = self._run_rollout_policy(batch, gen_index, generate=generate, prefix_ratios=prefix_ratios,
                                       records=records, entropy=self._actor_entropy)  # fmt: skip
        timing.update(merge_rollout_timing(passes))  # min/max/mean keep their meaning over several passes
        return out

    def _extract_reward(self, batch: DataProto) -> DataProto:
        """Stage 2: the agent loop's reward (``rm_scores``) into place; a reward model colocated with the rollout runs
        after the replicas sleep (as verl's fit does)."""
        if self.use_rm and "rm_scores" not in batch.batch.keys():
            self._sleep_rollout()
            batch = batch.union(self._compute_reward_colocate(batch))
        batch.batch["token_level_scores"], extra = extract_reward(batch)
        batch.non_tensor_batch.update({key: np.asarray(values) for key, values in extra.items()})
        return batch

    def _filter_groups(self, batch: DataProto):
        """Stage 3: which prompt groups to keep (metric std > 0, or a single sample); see mix_src.algo.filter_groups."""
        on_policy = ~batch.batch["prefix_mask"].any(-1).numpy() if self.mix.filter_groups.on_policy_only else None
        return filter_groups(batch.non_tensor_batch["uid"], self._filter_metric(batch), row_mask=on_policy,
                             rule=self.mix.filter_groups.rule)  # fmt: skip

    def _filter_metric(self, batch: DataProto) -> np.ndarray:
        """(rows,) the group-filter metric's values, as on V1 (:func:`mix_src.trainer.stages.filter_metric_values`)."""
        return filter_metric_values(self.filter_cfg.metric, lambda: batch.batch["token_level_scores"].sum(-1).numpy(),
                                    batch.non_tensor_batch.get, batch.meta_info.get("reward_extra_keys", []))  # fmt: skip

    def _add_rollout_metrics(self, batch: DataProto, metrics: dict) -> None:
        """LUFFY's solve metrics over the rows the step trains on (after filtering), as on V1 (stages.luffy_metrics)."""
        rows = batch.non_tensor_batch
        metrics.update(self._target_draw_metrics())
        metrics.update(luffy_metrics(rows_solved(batch), batch.batch["prefix_mask"], batch.batch["response_mask"],
                                     rows["uid"], rows["prefix_ratio"], rows.get("prefix_truncated"), rows.get("ungradable")))


def merge_rollout_timing(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """One step's rollout timing from its generation batches' ``(timing, rows)`` (filter groups make several).

    verl's agent loop reports per-batch ``agent_loop/*/{min,max,mean}`` and ``agent_loop/slowest/*``
    (``agent_loop.py`` ``_performance_metrics``): ``/min`` -> min, ``/max`` -> max, ``/mean`` -> row-weighted
    mean, ``slowest/*`` -> the batch whose slowest sample was slowest; other entries (wall times) add up.
    """
    merged: dict[str, float] = {}
    weight: dict[str, int] = {}
    slowest = max(parts, key=lambda p: p[0].get("agent_loop/slowest/generate_sequences", float("-inf")), default=None)
    for timing, rows in parts:
        for key, value in timing.items():
            if key.startswith("agent_loop/slowest/"):
                continue
            if key not in merged:
                merged[key], weight[key] = value, rows
            elif key.endswith("/min"):
                merged[key] = min(merged[key], value)
            elif key.endswith("/max"):
                merged[key] = max(merged[key], value)
            elif key.endswith("/mean"):
                total = weight[key] + rows
                merged[key] = (merged[key] * weight[key] + value * rows) / max(total, 1)
                weight[key] = total
            else:
                merged[key] += value
    if slowest is not None:
        merged.update({k: v for k, v in slowest[0].items() if k.startswith("agent_loop/slowest/")})
    return merged


def _num_groups(batch: DataProto) -> int:
    return len(set(batch.non_tensor_batch["uid"].tolist()))
