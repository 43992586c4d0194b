"""mix_src's rules in verl's V1 replay buffer (``verl/trainer/ppo/v1/replay_buffer.py``), listed in
:meth:`V1ReplayBufferRules._mix_replay_buffer`, and the V1 base's TransferQueue row readers. The legacy base filters
and carries groups in its own loop (``LegacyCollect._collect_batch``) with the same stage functions.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Callable, Optional

import numpy as np
import transfer_queue as tq
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from mix_src.compat import checked
from mix_src.algo.filter_groups import filter_groups
from mix_src.trainer.rollout_policy import streams_on_v1
from mix_src.trainer.stages import SUMMED_REWARD_METRICS, FilterGroupsExhausted, filter_metric_values, prefix_mask_tensor

__all__ = ["V1ReplayBufferRules", "extra_fields", "make_dapo_filtered_keys", "tag_lengths", "tq_prefix_mask"]


class V1ReplayBufferRules:
    """The V1 trainer's side of the replay-buffer rules (needs ``config``, ``mix``, ``global_steps``, ``replay_buffer``,
    the step's fetch counters and :class:`mix_src.trainer.common.MixTrainerCommon`'s FLOPs meter)."""

    @property
    def _steps_in_sync(self) -> bool:
        """verl's ``PPOTrainerSync``: each step dispatches its own generation batches (budget and carried groups)."""
        return isinstance(self, PPOTrainerSync)

    def _install_generation_count(self, buffer) -> None:
        """With a streamed rollout policy, count each new ``train`` trajectory's generation once, at the buffer's
        metadata sync."""
        self._counts_generation = False
        verl_sync = getattr(buffer, "_sync_metadata_from_transfer_queue", None)
        if verl_sync is None or not streams_on_v1(self.mix.rollout_policy):
            return  # a policy with several passes: V1PolicyRunner counts its passes
        self._counted_rows = set()

        def _sync_metadata_from_transfer_queue(buf):  # buf: the buffer; self: the trainer
            verl_sync()
            rows = buf.partitions.get("train", {})
            self._counted_rows &= rows.keys()  # cleared rows are gone for good
            new = [k for k, tag in rows.items() if k not in self._counted_rows and "response_len" in tag]
            if new:  # their generation FLOPs: response minus prefix tokens, as the legacy base counts a pass
                prefix, _ = tq_prefix_mask(new, "train")
                p, r = tag_lengths([rows[k] for k in new])
                self.add_rollout_flops(p, r, r - prefix.long().sum(-1).numpy())
                self._counted_rows.update(new)

        checked("v1.replay_buffer.sync_metadata")
        buffer._sync_metadata_from_transfer_queue = types.MethodType(_sync_metadata_from_transfer_queue, buffer)
        self._counts_generation = True

    def _carries_in_tq(self) -> bool:
        """sync mode with mix.filter_groups.carry_over: carried groups are kept in TransferQueue between steps."""
        return self._steps_in_sync and bool(self.mix.filter_groups.carry_over) and getattr(
            self.replay_buffer, "filter_groups_metric", None) is not None  # fmt: skip

    def _restore_carried_groups(self, path: str) -> None:
        """Load the checkpoint's TransferQueue state, keeping only whole carried groups (the trained batch's rows,
        whose prompt keys verl's sample removed, go)."""
        tq.load_checkpoint(path)
        tags = (tq.kv_list("train") or {}).get("train", {})
        prompts = {k for k, t in tags.items() if t.get("is_prompt", False)}
        orphans = [k for k, t in tags.items() if not t.get("is_prompt", False) and k.split("_")[0] not in prompts]
        if orphans:
            tq.kv_clear(keys=orphans, partition_id="train")
        print(f"[mix_src] restored {len(prompts)} carried prompt groups from {path}")

    def _mix_replay_buffer(self, buffer):
        """verl's replay buffer with mix_src's filter-group settings, on this instance only (a custom sampler,
        ``trainer.v1.sampler.custom_sampler``, owns its filtering and is left alone):

        * its DAPO classification (``_dapo_filtered_keys``, ``verl/trainer/ppo/v1/replay_buffer.py`` 261-315) is
          :func:`make_dapo_filtered_keys`;
        * sync mode, ``algorithm.filter_groups.max_num_gen_batches``: once the step's generation batches are spent
          and nothing is in flight, the buffer's wait (``_wait_for_next_poll``) raises ``FilterGroupsExhausted``;
        * sync mode, ``mix.filter_groups.carry_over``: the surplus groups verl's ``sample`` discards (``_clear_groups``,
          replay_buffer.py 502-507) stay in TransferQueue, taken first by the next step's ``sample``;
        * a streamed rollout policy: every trajectory the metadata sync (``_sync_metadata_from_transfer_queue``,
          replay_buffer.py 201-235) sees first has its generation FLOPs counted."""
        self._install_generation_count(buffer)
        if getattr(buffer, "filter_groups_metric", None) is None or not hasattr(buffer, "_dapo_filtered_keys"):
            return buffer
        checked("v1.replay_buffer.dapo_filter")
        buffer._dapo_filtered_keys = types.MethodType(
            make_dapo_filtered_keys(self.mix.filter_groups.rule, self.mix.filter_groups.on_policy_only), buffer
        )
        if not self._steps_in_sync:
            return buffer
        verl_wait, verl_select, verl_clear = buffer._wait_for_next_poll, buffer._select_prompt_uids, buffer._clear_groups

        def _wait_for_next_poll(buf, partition_id, last_debug_time):  # buf: the buffer; self: the trainer
            if (partition_id == "train" and self._gen_budget_spent == self.global_steps
                    and not buf.pending_keys[partition_id] and not buf.running_keys[partition_id]):  # fmt: skip
                fg, gen_bs = self.config.algorithm.filter_groups, self._gen_batch_prompts()
                raise FilterGroupsExhausted.after(
                    f"{self._step_prompts() // gen_bs} generation batches of {gen_bs} prompts",
                    fg.max_num_gen_batches, len(buf.finished_keys[partition_id]), self.config.data.train_batch_size,
                    fg.metric, f"mix.filter_groups.rule={self.mix.filter_groups.rule!r}")
            return verl_wait(partition_id, last_debug_time)

        def _select_prompt_uids(buf, partition_id, sampleable_keys, batch_size):
            selected, partition_snapshot, steps = verl_select(partition_id, sampleable_keys, batch_size)
            buf._mix_surplus = set(sampleable_keys) - set(selected) if partition_id == "train" else None
            if partition_id == "train" and self.mix.filter_groups.carry_over:
                self._carry_metrics["train/num_carried_prompts"] = sum(
                    int(steps.get(u, self.global_steps) < self.global_steps) for u in selected)
            return selected, partition_snapshot, steps

        def _clear_groups(buf, partition_id, uids):
            surplus = getattr(buf, "_mix_surplus", None)
            if self.mix.filter_groups.carry_over and surplus and set(uids) == surplus:
                buf._mix_surplus = None
                self._carry_metrics["train/num_surplus_carried"] = len(surplus)
                return None  # carried: they stay finished in TransferQueue for the next step
            return verl_clear(partition_id, uids)

        checked("v1.replay_buffer.sync_steps")
        buffer._wait_for_next_poll = types.MethodType(_wait_for_next_poll, buffer)
        buffer._select_prompt_uids = types.MethodType(_select_prompt_uids, buffer)
        buffer._clear_groups = types.MethodType(_clear_groups, buffer)
        return buffer

    # ---- filter groups, sync mode: the generation budget of a step (algorithm.filter_groups.max_num_gen_batches) ---
    def _gen_batch_prompts(self) -> int:
        data = self.config.data
        return int(data.get("gen_batch_size", None) or data.train_batch_size)

    def _gen_budget(self) -> Optional[int]:
        """Prompts one step may dispatch (max_num_gen_batches x gen batch size), or None for no limit."""
        fg = self.config.algorithm.get("filter_groups") or {}
        max_gen = int(fg.get("max_num_gen_batches", 0) or 0)
        if not self._steps_in_sync or not fg.get("enable", False) or max_gen <= 0:
            return None
        return max_gen * self._gen_batch_prompts()

    def _step_prompts(self) -> int:
        """Prompts fetched for generation in the current global step."""
        return self._fetch_prompts if self._fetch_step == self.global_steps else 0


def make_dapo_filtered_keys(rule: str, on_policy_only: bool) -> Callable:
    """A ``ReplayBuffer._dapo_filtered_keys(partition_id) -> (evicted uids, Counter of their metric values)`` (verl
    0.9.1 contract) deciding by :func:`mix_src.algo.filter_groups.filter_groups` (``rule``; ``on_policy_only``: rows
    without a prefix token decide), each finished group once (verl's cache), on the metric as the legacy base reads
    it (:func:`mix_src.trainer.stages.filter_metric_values`)."""
    def _dapo_filtered_keys(self, partition_id: str):
        if partition_id == "val" or self.filter_groups_metric is None:
            return set(), Counter()
        finished = self.finished_keys[partition_id]
        cache = self._dapo_classification_cache[partition_id]
        for uid in cache.keys() - finished:
            del cache[uid]
        new = finished - cache.keys()
        keys = [k for k in self.partitions[partition_id] if k.split("_")[0] in new]
        if not keys:
            return {u for u, v in cache.items() if v is not None}, Counter(v for v in cache.values() if v is not None)
        fields = ["extra_fields"] + (["rm_scores"] if self.filter_groups_metric in SUMMED_REWARD_METRICS else [])
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)
        extra = extra_fields(data["extra_fields"])
        infos = [e.get("reward_extra_info", {}) for e in extra]
        values = filter_metric_values(
            self.filter_groups_metric, lambda: [float(v.sum().item()) for v in data["rm_scores"]],
            lambda name: [float(i[name]) for i in infos] if all(name in i for i in infos) else None,
            sorted(set().union(*infos)),
        ).tolist()  # fmt: skip
        uids = [k.split("_")[0] for k in keys]
        row_mask = [not bool(np.any(e.get("prefix_token_mask", []))) for e in extra] if on_policy_only else None
        result = filter_groups(np.array(uids, dtype=object), np.array(values), row_mask=row_mask, rule=rule)
        kept = set(result.kept_groups.tolist())
        first_value = dict(zip(reversed(uids), reversed(values)))  # each group's first row's value
        for uid in new:
            cache[uid] = None if uid in kept or uid not in first_value else first_value[uid]
        evicted = {u: v for u, v in cache.items() if v is not None}
        return set(evicted), Counter(evicted.values())

    return _dapo_filtered_keys


def extra_fields(stack) -> list[dict]:
    """The per-row ``extra_fields`` dicts out of a TransferQueue non-tensor field."""
    return [getattr(e, "data", e) if isinstance(getattr(e, "data", e), dict) else {} for e in list(stack)]


def tag_lengths(tags: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(rows,) int64 prompt and response lengths from the rows' TransferQueue tags."""
    return tuple(np.array([int(t[k]) for t in tags], dtype=np.int64) for k in ("prompt_len", "response_len"))


def tq_prefix_mask(keys: list[str], partition_id: str):
    """(rows, L) bool prefix mask of the TransferQueue rows ``keys`` (each row's ``prefix_token_mask``), and their
    nested ``response_mask``."""
    data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["response_mask", "extra_fields"])
    extra = extra_fields(data.pop("extra_fields"))
    nested = data["response_mask"]
    return prefix_mask_tensor([e.get("prefix_token_mask") for e in extra], data.to_padded_tensor()["response_mask"]), nested
