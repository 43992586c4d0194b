"""LUFFY on verl's V1 trainer (``trainer.use_v1=true``): ``MixPPOTrainerSync``, ``MixPPOTrainerColocateAsync``,
``MixPPOTrainerSeparateAsync``, registered with verl's ``register_trainer`` as ``mix_<trainer.v1.trainer_mode>``.

Each is :class:`MixV1Mixin` in front of verl's trainer for that mode (``verl/trainer/ppo/v1/trainer_sync.py``,
``trainer_colocate_async.py``, ``trainer_separate_async.py``): verl keeps the loop, the replay buffer, the weight
sync and the checkpoints; the mixin fills LUFFY into verl's overridable steps (``verl/trainer/ppo/v1/trainer_base.py``),
each method's docstring says which. The maths and everything the legacy base does too live in :mod:`mix_src.stages`,
:mod:`mix_src.trainer.common` (FLOPs, ``mix_state.pt``, the worker loss) and :mod:`mix_src.core_alg`.

Which policy the log-probs come from (``trainer_base.py`` ``_compute_old_log_prob``): ``old_log_probs`` are
recomputed by the actor at the start of each step in every mode, for expert and on-policy rows alike (V1's
"decoupled" mode; ``algorithm.rollout_correction.bypass_mode`` is refused with prefixes). In the async modes an
on-policy row may come from older weights: its PPO ratio is taken against the current policy and verl's decoupled
rollout correction covers its on-policy tokens. An expert row never goes stale: its loss ``-A * f(p)`` uses only
the current policy's probability. Rollout correction never reweights prefix tokens (weight 1).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import OmegaConf, open_dict
from tensordict import TensorDict

from verl import DataProto
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.debug import marked_timer
from verl.workers.utils.padding import response_to_nested

from mix_src import adv_estimators  # noqa: F401  (registers grpo_split with verl)
from mix_src.dataset import TARGET_FIELD
from mix_src.compat import checked, swapped
from mix_src.mix_config import MixConfig, validate_mix_config
from mix_src.seeding import request_seeds
from mix_src.stages import FilterGroupsExhausted
from mix_src.stages import (SUMMED_REWARD_METRICS, draw_prefix_ratios, filter_metric_values, length_clip_metrics,
                            luffy_advantage_stage, on_policy_rollout_correction, on_policy_rollout_metrics,
                            prefix_mask_tensor, prefix_step_metrics, solve_metrics, solved_rows,
                            start_data_epoch)  # fmt: skip
from mix_src.trainer.common import MixTrainerCommon

__all__ = [
    "MixTaskRunnerV1",
    "MixV1Mixin",
    "MixPPOTrainerSync",
    "MixPPOTrainerColocateAsync",
    "MixPPOTrainerSeparateAsync",
    "mix_trainer_name",
]


def mix_trainer_name(trainer_mode: str) -> str:
    """Registry name of the LUFFY trainer for ``trainer.v1.trainer_mode``."""
    return f"mix_{trainer_mode}"


class MixV1Mixin(MixTrainerCommon):
    """LUFFY's stages in verl's V1 trainer hooks; put it before verl's mode trainer (see the module docstring)."""

    mix: MixConfig

    def __init__(self, config, **kwargs):
        self.mix = validate_mix_config(config)
        seed = self.mix.seed if self.mix.seed is not None else config.data.get("seed", None)
        self.prefix_seed = 0 if seed is None else int(seed)
        self.n = int(config.actor_rollout_ref.rollout.n)
        self._fetch_step, self._fetch_index = None, 0  # prompt fetches within one global step (ratio seeds)
        self._policy_metrics: dict = {}  # a multi-pass rollout policy's pass counts since the last step's metrics
        self._batch_fetch_index = 0  # the fetch index of the last prompt batch (its ratios' and seeds' key)
        self._fetch_prompts = 0  # prompts fetched in step _fetch_step (max_num_gen_batches)
        self._gen_budget_spent = -1  # the global step whose generation budget ran out
        self._carry_metrics: dict = {}  # carry_over counts of the step (train/num_*carried*)
        super().__init__(config, **kwargs)

    @property
    def _steps_in_sync(self) -> bool:
        """verl's synchronous trainer (``PPOTrainerSync``, with its sync ``ReplayBuffer``): each step dispatches its
        own generation batches, which the step's generation budget and the carried groups hook into."""
        return isinstance(self, PPOTrainerSync)

    # ---- set-up ------------------------------------------------------------------------------------
    def _init_dataloader(self):
        """verl's dataloaders; the training set is built with the ``mix:`` settings (targets), validation without.

        verl builds both sets from ``config.data`` (``trainer_base.py`` ``_init_dataloader`` 708-724, through the
        module's ``create_rl_dataset``); for this one call its training-set builder gets ``data.mix``.
        """
        build = trainer_base.create_rl_dataset
        train_data_cfg = OmegaConf.create(OmegaConf.to_container(self.config.data, resolve=True))
        with open_dict(train_data_cfg):
            train_data_cfg.mix = OmegaConf.create(OmegaConf.to_container(self.config.mix, resolve=True))

        def create_rl_dataset(data_paths, data_config, tokenizer, processor, is_train=True, max_samples=-1):
            return build(data_paths, train_data_cfg if is_train else data_config, tokenizer, processor,
                         is_train=is_train, max_samples=max_samples)  # fmt: skip

        with swapped(trainer_base, "create_rl_dataset", create_rl_dataset, patch="v1.create_rl_dataset"):
            super()._init_dataloader()

    def on_init_end(self):
        """Install the MIX worker loss (after verl's ``_setup``, which restored a checkpoint: a learned entropy
        coefficient continues from its saved state)."""
        self._install_mix_loss()
        super().on_init_end()

    # ---- the learned entropy coefficient (mix.loss.use_adaptive_entropy): checkpointed with V1's checkpoints ---
    def _update_actor(self, batch, metrics: dict):
        """verl's stage; the coefficient's state, which the workers' loss returns in the update metrics
        (``mix_entropy_state/*``, :func:`mix_src.loss.pop_entropy_state`), is taken out before verl averages the
        metrics (``trainer_base`` ``reduce_metrics``, swapped for this call) and kept for the checkpoint."""
        verl_reduce = trainer_base.reduce_metrics

        def reduce(output):
            self._keep_entropy_state(output)
            return verl_reduce(output)

        batch = self._add_update_inputs(batch)
        with swapped(trainer_base, "reduce_metrics", reduce, patch="v1.reduce_metrics"):
            return super()._update_actor(batch, metrics)

    def _add_update_inputs(self, batch):
        """The per-row inputs the worker loss reads next to verl's fields, computed on the driver as the legacy base
        computes them before its update (``MIXRayPPOTrainer._update``), from the rows' TransferQueue fields, and
        written back to TransferQueue as fields of the same rows:

        * ``mix.loss.all_max_clip`` with token-mean: ``mix_kept_tokens`` (:func:`mix_src.loss.add_kept_token_counts`);
        * ``mix.loss.row_loss``: ``mix_sft_tokens``, the SFT tokens of each row's global mini-batch, from the
          ``sft_row`` field the rollout policy's rows carry (:func:`mix_src.loss.add_sft_token_counts`);
        * ``mix.loss.combine``: the per-population token/row counts and the global step
          (:func:`mix_src.loss.add_combine_inputs`, ``mix_src.loss.COMBINE_FIELDS``).

        The rows' order is the order verl's ``update_actor`` splits into mini-batches (``batch.keys``;
        ``actor.shuffle`` is refused with these). Returns the batch's meta with the new fields (the worker loads
        only the fields its meta names)."""
        from mix_src.loss import COMBINE_FIELDS, KEPT_TOKENS, add_combine_inputs, add_kept_token_counts
        from mix_src.row_loss import SFT_ROW, SFT_TOKENS

        loss = self.mix.loss
        if loss.all_max_clip is None and loss.row_loss is None and loss.combine is None:
            return batch
        fields = ["old_log_probs", "response_mask", "prefix_mask"] + ([SFT_ROW] if loss.row_loss is not None else [])
        try:
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        except Exception as e:  # noqa: BLE001 - re-raised, naming what the rows lack
            if loss.row_loss is None:
                raise
            raise KeyError(f"mix.loss.row_loss={loss.row_loss!r} needs the per-row field '{SFT_ROW}' in the rows; it is "
                           "set by a rollout policy that marks SFT rows (e.g. recipes/hpt: mix.rollout_policy=hpt) "
                           f"(TransferQueue: {e})") from e
        proto = DataProto(batch=data.to_padded_tensor())
        dp_size = lambda: _actor_dp_size(self.actor_rollout_wg)  # noqa: E731
        add_kept_token_counts(proto, self.config, loss, dp_size)  # with row_loss: the SFT-token counts too
        add_combine_inputs(proto, self.config, loss, dp_size, self.global_steps)
        new = [k for k in (KEPT_TOKENS, SFT_TOKENS, *COMBINE_FIELDS) if k in proto.batch.keys()]
        if new:
            out = TensorDict({k: proto.batch[k] for k in new}, batch_size=len(batch))
            batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)  # the meta names them
        return batch

    # ---- mix.flops_budget: the step's FLOPs (mix_src/trainer/common.py), counted as the legacy base counts them ---
    def step(self, metrics: dict, timing_raw: dict):
        """verl's step (sample, log-probs, advantages, update); then the step's FLOPs (:meth:`_count_flops`)."""
        batch = super().step(metrics, timing_raw)
        self._count_flops(batch, metrics)
        return batch

    def _install_generation_count(self, buffer) -> None:
        """With a streamed rollout policy, wrap the replay buffer's metadata sync so that each new ``train``
        trajectory's generation is counted once (see :meth:`_build_replay_buffer`)."""
        from mix_src.rollout_policy import streams_on_v1

        self._counts_generation = False
        verl_sync = getattr(buffer, "_sync_metadata_from_transfer_queue", None)
        if verl_sync is None or not streams_on_v1(self.mix.rollout_policy):
            return  # a policy with several passes: V1PolicyRunner counts its passes
        import types

        trainer = self
        trainer._counted_rows = set()

        def _sync_metadata_from_transfer_queue(buf):
            verl_sync()
            rows = buf.partitions.get("train", {})
            trainer._counted_rows &= rows.keys()  # cleared rows are gone for good
            new = [k for k, tag in rows.items() if k not in trainer._counted_rows and "response_len" in tag]
            if new:
                trainer._count_generated_rows(new, [rows[k] for k in new])
                trainer._counted_rows.update(new)

        checked("v1.replay_buffer.sync_metadata")
        buffer._sync_metadata_from_transfer_queue = types.MethodType(_sync_metadata_from_transfer_queue, buffer)
        self._counts_generation = True

    def _count_generated_rows(self, keys: list[str], tags: list[dict]) -> None:
        """Generation FLOPs of newly generated ``train`` trajectories: ``F(P + R)`` for each that generated a token
        (R minus its prefix tokens), as the legacy base counts every row of a rollout pass."""
        try:
            self._model_shape()
        except Exception:  # noqa: BLE001 - reported by _count_flops (and fatal there with a budget)
            return
        data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["response_mask", "extra_fields"])
        extra = _extra_fields(data.pop("extra_fields"))
        prefix = prefix_mask_tensor([e.get("prefix_token_mask") for e in extra], data.to_padded_tensor()["response_mask"])
        p = np.array([int(t["prompt_len"]) for t in tags], dtype=np.int64)
        r = np.array([int(t["response_len"]) for t in tags], dtype=np.int64)
        self.add_rollout_flops(p, r, r - prefix.long().sum(-1).numpy())

    def _count_flops(self, batch, metrics: dict) -> None:
        """``flops/*`` of the step, as the legacy ``MIXRayPPOTrainer._count_flops`` counts them (mix_src/flops.py):
        old (and reference) log-probs and ``ppo_epochs`` training passes over the rows the step trained on (verl's
        padding rows excluded), plus the generation of every row generated since the last count, trained or not
        (a streamed policy: :meth:`_count_generated_rows` from the replay buffer's metadata sync; a policy with
        several passes: :class:`mix_src.rollout_policy_v1.V1PolicyRunner`, per pass). Lengths are the rows'
        TransferQueue tags (``prompt_len``, ``response_len``: verl's agent loop writes them unpadded), a row's
        generated tokens its response minus its prefix. Sets ``_budget_step`` when ``mix.flops_budget`` is reached
        with this step."""
        from mix_src.flops import COUNTS, rollout_flops
        from mix_src.rollout_policy import streams_on_v1

        if self._flops_off(metrics):
            return
        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        tags = [batch.tags[i] for i in keep]
        p = np.array([int(t["prompt_len"]) for t in tags], dtype=np.int64)
        r = np.array([int(t["response_len"]) for t in tags], dtype=np.int64)
        rollout = self._pending_rollout_flops()
        if streams_on_v1(self.mix.rollout_policy) and not getattr(self, "_counts_generation", False):
            # a custom sampler without verl's metadata sync: generation counted over the trained rows
            data = tq.kv_batch_get(keys=[batch.keys[i] for i in keep], partition_id=batch.partition_id,
                                   select_fields=["prefix_mask"])  # fmt: skip
            g = r - data.to_padded_tensor()["prefix_mask"].long().sum(-1).numpy()
            for c in COUNTS:
                rollout[c] += rollout_flops(self._model_shape(), p, r, g, c)
        if self._count_step_flops(p, r, rollout, metrics):
            self._budget_step = self.global_steps

    def on_step_end(self):
        """verl's (weight sync). When ``mix.flops_budget`` was reached in this step, the step is the run's last, as on
        the legacy base: verl's ``fit`` (``trainer_base.py`` 467-523) fixed its ``is_last_step`` before the step ran,
        so the step's checkpoint (``trainer.save_freq`` > 0) is saved here unless verl's loop just saved it, the
        validation (``trainer.test_freq`` > 0) runs here after the weight sync unless verl's loop will run it, its
        metrics join the step's (:meth:`_consume_sync_metrics`), and ``total_training_steps`` becomes this step, so
        verl's loop ends after logging it."""
        step, cfg = self.global_steps, self.config.trainer
        last = getattr(self, "_budget_step", None) == step and step < self.total_training_steps
        if last and cfg.save_freq > 0 and step % cfg.save_freq != 0:
            with marked_timer("save_checkpoint", self.timing_raw, color="green"):
                self._save_checkpoint()
        super().on_step_end()
        if not last:
            return
        print(self._budget_message())
        if cfg.test_freq > 0 and step % cfg.test_freq != 0:
            with marked_timer("testing", self.timing_raw, color="green"):
                self.on_validate_begin()
                self._budget_val_metrics = self._validate()
                self.on_validate_end()
        self.total_training_steps = step

    def _consume_sync_metrics(self) -> dict:
        """verl's weight-sync metrics, plus the validation run at a step that reached ``mix.flops_budget``."""
        metrics = dict(super()._consume_sync_metrics())
        metrics.update(getattr(self, "_budget_val_metrics", None) or {})
        self._budget_val_metrics = None
        return metrics

    def _save_checkpoint(self):
        super()._save_checkpoint()
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        if self._carries_in_tq():  # the carried groups live in TransferQueue: saved as verl saves it in async modes
            tq.save_checkpoint(os.path.join(folder, "transfer_queue"), metadata={"global_steps": self.global_steps})
        if self._entropy_state is not None or self._policy_state() or self._flops:
            # the trajectories whose generation is counted: those TransferQueue's checkpoint restores are not again
            self._save_mix_state(flops_counted_rows=sorted(getattr(self, "_counted_rows", None) or ()))

    def _carries_in_tq(self) -> bool:
        """sync mode with mix.filter_groups.carry_over: carried groups are kept in TransferQueue between steps."""
        return self._steps_in_sync and bool(self.mix.filter_groups.carry_over) and getattr(
            self.replay_buffer, "filter_groups_metric", None) is not None  # fmt: skip

    def _restore_carried_groups(self, path: str) -> None:
        """Load the checkpoint's TransferQueue state and keep only whole carried groups (their prompt key and rows);
        the rows of the batch the step trained on, whose prompt keys verl's sample had already removed, go."""
        tq.load_checkpoint(path)
        tags = (tq.kv_list("train") or {}).get("train", {})
        prompts = {k for k, t in tags.items() if t.get("is_prompt", False)}
        orphans = [k for k, t in tags.items() if not t.get("is_prompt", False) and k.split("_")[0] not in prompts]
        if orphans:
            tq.kv_clear(keys=orphans, partition_id="train")
        print(f"[mix_src] restored {len(prompts)} carried prompt groups from {path}")

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps <= 0:
            return
        folder = self._resumed_folder()
        if self._carries_in_tq() and os.path.exists(os.path.join(folder, "transfer_queue")):
            self._restore_carried_groups(os.path.join(folder, "transfer_queue"))
        state = self._load_mix_state()
        if state is not None and getattr(self, "_counted_rows", None) is not None:
            self._counted_rows = set(state.get("flops_counted_rows") or ())

    def _resolve_filter_groups_metric(self):
        """verl's (trainer_base.py 187-213), with an unset ``algorithm.filter_groups.metric`` meaning ``reward`` as on
        the legacy base (:func:`mix_src.stages.filter_metric_values`) where verl raises once Ray has started."""
        fg = self.config.algorithm.get("filter_groups", None)
        if fg is not None and fg.get("enable", False) and not fg.get("metric", None):
            with open_dict(fg):
                fg.metric = "reward"
        return super()._resolve_filter_groups_metric()

    def _build_replay_buffer(self):
        """verl's replay buffer with mix_src's filter-group settings, on this instance only (a custom sampler,
        ``trainer.v1.sampler.custom_sampler``, owns its filtering and is left alone):

        * its DAPO classification (``ReplayBuffer._dapo_filtered_keys``, ``verl/trainer/ppo/v1/replay_buffer.py``
          261-315: evict a finished group whose metric has std 0) is :func:`mix_src.filter_groups.filter_groups` with
          ``mix.filter_groups.rule`` and, with ``on_policy_only``, only the group's on-policy rows deciding;
        * sync mode, ``algorithm.filter_groups.max_num_gen_batches`` (:meth:`_add_prompts_to_generate`, the buffer's
          ``refill_fn``): a step dispatches at most that many generation batches of ``data.gen_batch_size``
          (default ``data.train_batch_size``) prompts; once they are spent and nothing is in flight, the buffer's
          wait (``_wait_for_next_poll``, reached only while too few groups are sampleable) raises
          :class:`~mix_src.mix_trainer.FilterGroupsExhausted`, as the legacy loop does;
        * sync mode, ``mix.filter_groups.carry_over``: the surplus groups verl's ``sample`` discards once it has
          selected the batch (``self._clear_groups(partition_id, surplus_uids)``, replay_buffer.py 502-507) stay
          in TransferQueue as finished groups; the next step's ``sample`` takes them first (oldest prompt step
          first, ``_select_prompt_uids``), as the legacy loop puts carried groups first. They are saved with the
          checkpoint (verl's ``tq.save_checkpoint``, which verl itself calls in the async modes only);
        * a streamed rollout policy: every trajectory the buffer's metadata sync (``_sync_metadata_from_transfer_queue``,
          replay_buffer.py 201-235) sees for the first time has its generation FLOPs counted
          (:meth:`_count_generated_rows`), whether it is later trained, evicted by the group filter or discarded."""
        import types

        buffer = super()._build_replay_buffer()
        self._install_generation_count(buffer)
        if getattr(buffer, "filter_groups_metric", None) is None or not hasattr(buffer, "_dapo_filtered_keys"):
            return buffer
        checked("v1.replay_buffer.dapo_filter")
        buffer._dapo_filtered_keys = types.MethodType(
            make_dapo_filtered_keys(self.mix.filter_groups.rule, self.mix.filter_groups.on_policy_only), buffer
        )
        if not self._steps_in_sync:
            return buffer
        trainer = self
        verl_wait, verl_select, verl_clear = buffer._wait_for_next_poll, buffer._select_prompt_uids, buffer._clear_groups

        def _wait_for_next_poll(buf, partition_id, last_debug_time):
            if (partition_id == "train" and trainer._gen_budget_spent == trainer.global_steps
                    and not buf.pending_keys[partition_id] and not buf.running_keys[partition_id]):  # fmt: skip
                raise FilterGroupsExhausted(trainer._exhausted_message(len(buf.finished_keys[partition_id])))
            return verl_wait(partition_id, last_debug_time)

        def _select_prompt_uids(buf, partition_id, sampleable_keys, batch_size):
            selected, partition_snapshot, steps = verl_select(partition_id, sampleable_keys, batch_size)
            buf._mix_surplus = set(sampleable_keys) - set(selected) if partition_id == "train" else None
            if partition_id == "train" and trainer.mix.filter_groups.carry_over:
                trainer._carry_metrics["train/num_carried_prompts"] = sum(
                    int(steps.get(u, trainer.global_steps) < trainer.global_steps) for u in selected)
            return selected, partition_snapshot, steps

        def _clear_groups(buf, partition_id, uids):
            surplus = getattr(buf, "_mix_surplus", None)
            if trainer.mix.filter_groups.carry_over and surplus and set(uids) == surplus:
                buf._mix_surplus = None
                trainer._carry_metrics["train/num_surplus_carried"] = len(surplus)
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

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's refill (the replay buffer's ``refill_fn``) in whole generation batches of ``data.gen_batch_size``
        prompts, within the step's generation budget: what exceeds it is not dispatched, and the budget is marked
        spent (the buffer's wait then raises, see :meth:`_build_replay_buffer`)."""
        if getattr(self.replay_buffer, "filter_groups_metric", None) is not None:
            # verl's sync buffer refills in single prompts (its gen_batch_size is 1 with filter groups) while
            # _next_train_batch fetches whole data.gen_batch_size batches only (ValueError otherwise): round up
            gen_bs = self._gen_batch_prompts()
            num_prompts = -(-num_prompts // gen_bs) * gen_bs
        budget = self._gen_budget()
        if budget is not None:
            left = budget - self._step_prompts()
            if num_prompts > left:
                self._gen_budget_spent = self.global_steps
                num_prompts = left
            if num_prompts <= 0:
                return 0
        return super()._add_prompts_to_generate(num_prompts)

    def _step_prompts(self) -> int:
        """Prompts fetched for generation in the current global step."""
        return self._fetch_prompts if self._fetch_step == self.global_steps else 0

    def _exhausted_message(self, kept: int) -> str:
        fg, prompts, gen_bs = self.config.algorithm.filter_groups, self._step_prompts(), self._gen_batch_prompts()
        return (
            f"filter groups: after {prompts // gen_bs} generation batches of {gen_bs} prompts (algorithm.filter_groups."
            f"max_num_gen_batches={fg.max_num_gen_batches}) only {kept} of data.train_batch_size="
            f"{self.config.data.train_batch_size} prompt groups had a non-zero std of '{fg.metric}' (mix.filter_groups."
            f"rule={self.mix.filter_groups.rule!r}). Raise algorithm.filter_groups.max_num_gen_batches (0 = no limit), "
            "lower data.train_batch_size, or use prompts of a difficulty where some but not all samples succeed."
        )

    # ---- the data: each pass over it starts with mix_src's epoch stage ---------------------------------------
    def _fetch_one_gen_batch(self):
        """verl's (``trainer_base.py`` ``_fetch_one_gen_batch``: a new iterator once the last is exhausted), with
        :func:`mix_src.stages.start_data_epoch` (prompts a rollout policy retired leave the data) before each new one."""
        it = self.train_dataloader_it
        if it is None or it._num_yielded >= len(it):  # torch's _BaseDataLoaderIter: batches yielded / per pass
            start_data_epoch(self.train_dataloader, self.train_dataset, self._policy_state())
            self.train_dataloader_it = iter(self.train_dataloader)
        return super()._fetch_one_gen_batch()

    # ---- generate: per-row prefix ratios ------------------------------------------------------------
    def _next_train_batch(self, num_prompts: Optional[int] = None):
        batch = super()._next_train_batch(num_prompts)
        if self._fetch_step != self.global_steps:
            self._fetch_step, self._fetch_index, self._fetch_prompts = self.global_steps, 0, 0
        self._fetch_prompts += len(batch)
        targets = batch.get(TARGET_FIELD, None) if TARGET_FIELD in batch.keys() else None  # the dataset's normalised target
        targets = None if targets is None else [t for t in targets.tolist() for _ in range(self.n)]
        ratios = draw_prefix_ratios(
            self.mix, len(batch), self.n, seed=self.prefix_seed, global_step=self.global_steps,
            gen_index=self._fetch_index, targets=targets,
        )  # fmt: skip
        rollout_seed = int(self.config.actor_rollout_ref.rollout.get("seed") or 0)
        seeds = request_seeds(rollout_seed, self.global_steps, self._fetch_index, len(batch), self.n)
        self._batch_fetch_index = self._fetch_index
        self._fetch_index += 1
        tu.assign_non_tensor_stack(batch, "prefix_ratios", ratios.reshape(len(batch), self.n).tolist())
        tu.assign_non_tensor_stack(batch, "rollout_seeds", seeds.reshape(len(batch), self.n).tolist())
        return batch

    # ---- generate: a rollout policy with several passes (mix.rollout_policy other than a streamed one) -------
    def _submit_batch_to_rollout(self, batch):
        """verl's stage (the prompts registered in TransferQueue, ``trainer_base.py`` ``_submit_batch_to_rollout``);
        a rollout policy that V1 does not stream (:func:`mix_src.rollout_policy.streams_on_v1`) generates the
        groups pass by pass through :class:`mix_src.rollout_policy_v1.V1PolicyRunner`, which stands in for the
        agent-loop manager for this call and drives verl's own."""
        from mix_src.rollout_policy import streams_on_v1
        from mix_src.rollout_policy_v1 import V1PolicyRunner

        if streams_on_v1(self.mix.rollout_policy):
            return super()._submit_batch_to_rollout(batch)
        manager = self.agent_loop_manager
        self.agent_loop_manager = V1PolicyRunner(self, manager, self._batch_fetch_index, self._policy_metrics)
        try:
            return super()._submit_batch_to_rollout(batch)
        finally:
            self.agent_loop_manager = manager

    # ---- values: the reference's adapter switch must not reach the critic ----------------------------
    def _compute_values(self, batch, metrics: dict):
        """verl 0.9.1's V1 ``_compute_ref_log_prob`` puts ``no_lora_adapter=True`` into ``batch.extra_info`` for a
        LoRA actor's reference (``verl/trainer/ppo/v1/trainer_base.py`` 1703-1705) and leaves it there;
        ``_compute_values`` (1724-1730) sends the same extra_info to the critic, whose ``infer_batch`` then calls
        ``disable_adapter()`` on a model without adapters (``verl/workers/engine_workers.py`` 403, 425):
        AttributeError with LoRA + a critic + a reference policy. The flag belongs to the reference call only."""
        batch.extra_info.pop("no_lora_adapter", None)
        return super()._compute_values(batch, metrics)

    # ---- advantages: prefix_mask, grpo_split, alpha/beta --------------------------------------------
    def _prefix_mask(self, batch) -> tuple[torch.Tensor, Any]:
        """(bsz, L) bool prefix mask of ``batch``'s rows (from each row's ``prefix_token_mask``), and the rows'
        nested response mask."""
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask", "extra_fields"])
        extra = _extra_fields(data.pop("extra_fields"))
        nested = data["response_mask"]
        return prefix_mask_tensor([e.get("prefix_token_mask") for e in extra], data.to_padded_tensor()["response_mask"]), nested

    # ---- old log-probs: the rollout-vs-actor metrics over on-policy tokens ---------------------------
    def _compute_old_log_prob(self, batch, metrics: dict):
        """verl's stage; its ``training/rollout_*`` metrics (over the whole response mask, where prefix tokens
        carry rollout log-prob 0) are replaced by the same metrics over the on-policy tokens, as on the legacy base
        (:func:`mix_src.stages.on_policy_rollout_metrics`)."""
        before = set(metrics)
        batch = super()._compute_old_log_prob(batch, metrics)
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            return batch
        for key in [k for k in metrics if k not in before and k.startswith("training/rollout_")]:
            del metrics[key]
        fields = ["old_log_probs", "rollout_log_probs", "response_mask", "responses"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        prefix_mask, _ = self._prefix_mask(batch)
        metrics.update(on_policy_rollout_metrics(DataProto(batch=data.to_padded_tensor()), prefix_mask))
        return batch

    # ---- advantages: LUFFY's, in verl's stage ----------------------------------------------------------
    def _compute_advantage(self, batch, metrics: dict):
        """verl's stage (KL-in-reward, rollout correction, advantages, the TransferQueue write) with two of its
        calls replaced for this call (``trainer_base`` module names, verl 0.9.1 ``_compute_advantage`` 1743-1802):

        * ``compute_advantage_for_multi_trajectories`` -> :func:`mix_src.stages.luffy_advantages`: a prefix-aware
          estimator (``grpo_split``) runs once, with the rows' prefix mask; verl's estimator only for other names;
        * ``compute_rollout_correction_and_add_to_batch`` -> the same over on-policy tokens
          (:func:`mix_src.stages.on_policy_rollout_correction`), as on the legacy base.

        Then the rows' ``prefix_mask`` is written to TransferQueue (nested like ``response_mask``) for the loss."""
        prefix_mask, nested_response_mask = self._prefix_mask(batch)
        algo, mix = self.config.algorithm, self.mix
        verl_advantage = trainer_base.compute_advantage_for_multi_trajectories
        verl_correction = trainer_base.compute_rollout_correction_and_add_to_batch

        advantages = luffy_advantage_stage(verl_advantage, prefix_mask, algo, mix)

        def correction(data, rc):
            return on_policy_rollout_correction(data, prefix_mask, rc, verl_correction)

        with (swapped(trainer_base, "compute_advantage_for_multi_trajectories", advantages, patch="v1.advantage"),
              swapped(trainer_base, "compute_rollout_correction_and_add_to_batch", correction,
                      patch="v1.rollout_correction")):
            batch = super()._compute_advantage(batch, metrics)
        out = {"prefix_mask": response_to_nested(prefix_mask.to(nested_response_mask.dtype), nested_response_mask)}
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(out, batch_size=len(batch)))

    # ---- metrics -------------------------------------------------------------------------------------
    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        metrics.update(self._luffy_metrics(batch))
        metrics.update(self._policy_metrics)  # rollout_policy/passes, rollout_policy/rows_generated
        self._policy_metrics.clear()
        if self._gen_budget() is not None or self.mix.filter_groups.carry_over:
            metrics["train/num_gen_batches"] = self._step_prompts() / self._gen_batch_prompts()
        if self._carries_in_tq():  # verl counts the surplus it would have cleared as discarded; here it was carried
            metrics.pop("training/filter_groups/discarded_surplus_samples", None)
        metrics.update(self._carry_metrics)
        self._carry_metrics.clear()

    def _luffy_metrics(self, batch) -> dict[str, Any]:
        """LUFFY's metrics over the step's trained rows (verl's padding rows excluded)."""
        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        keys = [batch.keys[i] for i in keep]
        fields = ["uid", "response_mask", "prefix_mask", "rm_scores", "extra_fields", "prompts", "responses"]
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields)
        extra = _extra_fields(data.pop("extra_fields"))
        uids = data.pop("uid").tolist()
        rollout = self.config.actor_rollout_ref.rollout  # verl's clip ratios measure the step's longest row (stages)
        out = length_clip_metrics(data.pop("prompts").offsets().diff(), data.pop("responses").offsets().diff(),
                                  rollout.prompt_length, rollout.response_length)  # fmt: skip
        padded = data.to_padded_tensor()
        prefix_mask = padded["prefix_mask"].bool()
        acc = [e.get("reward_extra_info", {}).get("acc") for e in extra]
        solved = solved_rows(acc, lambda: padded["rm_scores"].sum(-1).numpy())
        out.update(solve_metrics(solved, prefix_mask.any(-1).numpy(), uids))
        out.update(prefix_step_metrics([e.get("prefix_ratio", 0.0) for e in extra], prefix_mask, padded["response_mask"]))
        out["batch/prefix_truncated"] = int(sum(bool(e.get("prefix_truncated", False)) for e in extra))
        # rows the reward could not grade (scored wrong), as the legacy trainer counts them
        out["reward/ungradable"] = int(sum(bool(e.get("reward_extra_info", {}).get("ungradable")) for e in extra))
        return out


def make_dapo_filtered_keys(rule: str, on_policy_only: bool) -> Callable:
    """A ``ReplayBuffer._dapo_filtered_keys(partition_id) -> (evicted uids, Counter)`` (verl 0.9.1 contract: the
    finished groups to evict and a ``{shared metric value: group count}`` breakdown of them) whose decision is
    :func:`mix_src.filter_groups.filter_groups` (``rule``; ``on_policy_only``: rows without a prefix token decide).
    Each finished group is classified once (verl's cache), from its rows' values of the metric as the legacy base
    reads it (:func:`mix_src.stages.filter_metric_values`: ``reward``/``seq_reward`` the summed ``rm_scores``,
    another name ``reward_extra_info[metric]``), and ``prefix_token_mask``."""
    from collections import Counter

    from mix_src.filter_groups import filter_groups

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
        summed = self.filter_groups_metric in SUMMED_REWARD_METRICS
        fields = ["extra_fields", "rm_scores"] if summed else ["extra_fields"]
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)
        extra = _extra_fields(data["extra_fields"])
        infos = [e.get("reward_extra_info", {}) for e in extra]

        def extra_values(name):
            return [float(i[name]) for i in infos] if all(name in i for i in infos) else None

        values = filter_metric_values(
            self.filter_groups_metric, lambda: [float(v.sum().item()) for v in data["rm_scores"]], extra_values,
            sorted(set().union(*infos)) if infos else [],
        ).tolist()  # fmt: skip
        uids = [k.split("_")[0] for k in keys]
        row_mask = None
        if on_policy_only:
            row_mask = [not bool(np.any(e.get("prefix_token_mask", []))) for e in extra]
        result = filter_groups(np.array(uids, dtype=object), np.array(values), row_mask=row_mask, rule=rule)
        kept = set(result.kept_groups.tolist())
        first_value = {}
        for uid, value in zip(uids, values):
            first_value.setdefault(uid, value)
        for uid in new:
            cache[uid] = None if uid in kept or uid not in first_value else first_value[uid]
        evicted = {u: v for u, v in cache.items() if v is not None}
        return set(evicted), Counter(evicted.values())

    return _dapo_filtered_keys


def _actor_dp_size(worker_group) -> int:
    """The actor's data-parallel size, as verl's ``RayPPOTrainer._get_dp_size`` reads it (ray_trainer.py 1162)."""
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    return max(worker_group._dispatch_info["actor"]) + 1


def _extra_fields(stack) -> list[dict]:
    """The per-row ``extra_fields`` dicts out of a TransferQueue non-tensor field."""
    return [getattr(e, "data", e) if isinstance(getattr(e, "data", e), dict) else {} for e in list(stack)]


@register_trainer(mix_trainer_name("sync"))
class MixPPOTrainerSync(MixV1Mixin, PPOTrainerSync):
    """LUFFY on verl's synchronous V1 trainer (rollout and training colocated, no partial rollout)."""


@register_trainer(mix_trainer_name("colocate_async"))
class MixPPOTrainerColocateAsync(MixV1Mixin, PPOTrainerColocateAsync):
    """LUFFY on verl's colocated asynchronous V1 trainer (partial rollout, warm-up batches)."""


class _DropFlush(logging.LoggerAdapter):
    """A logger that accepts (and drops) print's ``flush=`` keyword."""

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


@register_trainer(mix_trainer_name("separate_async"))
class MixPPOTrainerSeparateAsync(MixV1Mixin, PPOTrainerSeparateAsync):
    """LUFFY on verl's separate asynchronous V1 trainer (standalone rollout pool)."""

    def _setup(self):
        """verl's. With ``actor_rollout_ref.hybrid_engine=false`` (rollout served by the standalone pool only) verl
        0.9.1 logs ``logger.info(..., flush=True)`` (``verl/trainer/ppo/v1/trainer_separate_async.py`` 181-186), which
        the stdlib logger refuses with a TypeError on any device; during this call the module's logger drops
        ``flush``."""
        from verl.trainer.ppo.v1 import trainer_separate_async

        drop_flush = _DropFlush(trainer_separate_async.logger, {})
        with swapped(trainer_separate_async, "logger", drop_flush, patch="v1.separate_async.logger"):
            super()._setup()


class MixTaskRunnerV1(TaskRunnerV1.__ray_actor_class__):
    """verl's ``TaskRunnerV1`` (``verl/trainer/main_ppo.py`` 102-161) with the LUFFY trainer of the configured mode.

    ``TaskRunnerV1`` is a Ray actor class; this subclasses the class under it and keeps verl's
    ``init_agent_loop_manager``. ``run`` is verl's with one change: the trainer class.
    """

    def run(self, config):
        from pprint import pprint

        from verl.trainer.ppo.v1 import get_trainer_cls
        from verl.utils.logging_utils import configure_verl_logging

        configure_verl_logging()
        trainer_cls = get_trainer_cls(mix_trainer_name(config.trainer.v1.trainer_mode))
        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config)
            self.trainer.init()
            self.init_agent_loop_manager()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()
