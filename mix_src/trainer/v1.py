"""LUFFY on verl's V1 trainer (``trainer.use_v1=true``): ``MixPPOTrainerSync``, ``MixPPOTrainerColocateAsync``,
``MixPPOTrainerSeparateAsync``, registered with verl's ``register_trainer`` as ``mix_<trainer.v1.trainer_mode>``.

Each is :class:`MixV1Mixin` in front of verl's trainer for that mode (``verl/trainer/ppo/v1/trainer_sync.py``,
``trainer_colocate_async.py``, ``trainer_separate_async.py``): verl keeps the loop, the replay buffer, the weight
sync and the checkpoints; the mixin fills LUFFY into verl's overridable steps (``verl/trainer/ppo/v1/trainer_base.py``).
Which policy the old log-probs come from in each mode: mix_src/README.md "Two trainer bases".
"""

from __future__ import annotations

import logging
import os
from pprint import pprint
from typing import Any, Optional

import transfer_queue as tq
from omegaconf import OmegaConf, open_dict
from tensordict import TensorDict

from verl import DataProto
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base, trainer_separate_async
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.debug import marked_timer
from verl.utils.logging_utils import configure_verl_logging
from verl.workers.utils.padding import response_to_nested

from mix_src.algo.row_loss import SFT_ROW, SFT_TOKENS
from mix_src.trainer import adv_estimators  # noqa: F401  (registers grpo_split with verl)
from mix_src.trainer.dataset import TARGET_FIELD, TARGET_LST_FIELD
from mix_src.compat import swapped
from mix_src.config.mix_config import MixConfig, validate_mix_config
from mix_src.trainer.rollout_policy import streams_on_v1
from mix_src.trainer.rollout_policy_v1 import PREFIX_TARGETS, V1PolicyRunner
from mix_src.trainer.stages import prefix_context_mask
from mix_src.trainer.stages import (length_clip_metrics, luffy_advantage_stage, luffy_metrics, on_policy_rollout_correction,
                            on_policy_rollout_metrics, solved_rows, start_data_epoch)  # fmt: skip
from mix_src.trainer.common import MixTrainerCommon
from mix_src.trainer.v1_replay import V1ReplayBufferRules, make_dapo_filtered_keys  # noqa: F401  (re-exported)
from mix_src.trainer.v1_replay import extra_fields as _extra_fields, tag_lengths, tq_prefix_mask
from mix_src.worker.loss import COMBINE_FIELDS, KEPT_TOKENS

__all__ = ["MixTaskRunnerV1", "MixV1Mixin", "MixPPOTrainerSync", "MixPPOTrainerColocateAsync",
           "MixPPOTrainerSeparateAsync"]


class MixV1Mixin(V1ReplayBufferRules, MixTrainerCommon):
    """LUFFY's stages in verl's V1 trainer hooks; put it before verl's mode trainer (see the module docstring)."""

    mix: MixConfig
    _get_dp_size = RayPPOTrainer._get_dp_size  # a worker group's data-parallel size (verl's ray_trainer.py 1162)

    def __init__(self, config, **kwargs):
        self.mix = validate_mix_config(config)
        seed = self.mix.seed if self.mix.seed is not None else config.data.get("seed", None)
        self.prefix_seed = 0 if seed is None else int(seed)
        self.n = int(config.actor_rollout_ref.rollout.n)
        self._fetch_step, self._fetch_index, self._fetch_prompts = None, 0, 0  # fetch index (ratio seeds), prompts
        self._policy_metrics: dict = {}  # a multi-pass rollout policy's pass counts since the last step's metrics
        self._gen_budget_spent = -1  # the global step whose generation budget ran out
        self._carry_metrics: dict = {}  # carry_over counts of the step (train/num_*carried*)
        super().__init__(config, **kwargs)

    # ---- set-up ------------------------------------------------------------------------------------
    def _init_dataloader(self):
        """verl's dataloaders (``trainer_base.py`` ``_init_dataloader`` 708-724, through the module's
        ``create_rl_dataset``); for this one call the training set's builder also gets ``data.mix`` (targets)."""
        build, data = trainer_base.create_rl_dataset, OmegaConf.to_container(self.config.data, resolve=True)
        train_data_cfg = OmegaConf.create({**data, "mix": OmegaConf.to_container(self.config.mix, resolve=True)})

        def create_rl_dataset(data_paths, data_config, tokenizer, processor, is_train=True, max_samples=-1):
            return build(data_paths, train_data_cfg if is_train else data_config, tokenizer, processor,
                         is_train=is_train, max_samples=max_samples)  # fmt: skip

        with swapped(trainer_base, "create_rl_dataset", create_rl_dataset, patch="v1.create_rl_dataset"):
            super()._init_dataloader()

    def on_init_end(self):
        """The MIX worker loss, after verl's ``_setup`` restored a checkpoint (a learned entropy coefficient goes on)."""
        self._install_mix_loss()
        super().on_init_end()

    # ---- the learned entropy coefficient (mix.loss.use_adaptive_entropy): checkpointed with V1's checkpoints ---
    def _update_actor(self, batch, metrics: dict):
        """verl's stage; the coefficient's state (:func:`mix_src.worker.loss.pop_entropy_state`) is kept for the
        checkpoint before verl averages the metrics (``trainer_base`` ``reduce_metrics``, swapped for this call)."""
        verl_reduce = trainer_base.reduce_metrics

        def reduce(output):
            self._keep_entropy_state(output)
            return verl_reduce(output)

        batch = self._add_update_inputs(batch)
        restore = self._prefix_as_context(batch)
        try:
            with swapped(trainer_base, "reduce_metrics", reduce, patch="v1.reduce_metrics"):
                return super()._update_actor(batch, metrics)
        finally:
            if restore is not None:
                tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=restore)

    def _prefix_as_context(self, batch) -> Optional[TensorDict]:
        """``mix.loss.prefix_tokens=context`` (PrefixRL): the rows' ``response_mask`` and ``loss_mask`` (verl's engine
        counts tokens from the latter, ``agent_loop_tq.py`` 199) in TransferQueue without the prefix tokens for the
        update (:func:`~mix_src.trainer.stages.prefix_context_mask`); returns the originals to put back after it (the
        step's metrics read them), or None."""
        if self.mix.loss.prefix_tokens != "context":
            return None
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["response_mask", "loss_mask", "prefix_mask"])
        nested, padded = data["response_mask"], data.select("response_mask", "prefix_mask").to_padded_tensor()
        masked = response_to_nested(prefix_context_mask(padded["response_mask"], padded["prefix_mask"]), nested)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict({"response_mask": masked, "loss_mask": masked}, batch_size=len(batch)))
        return TensorDict({"response_mask": nested, "loss_mask": data["loss_mask"]}, batch_size=len(batch))

    def _add_update_inputs(self, batch):
        """:meth:`MixTrainerCommon._add_loss_inputs` on the rows' TransferQueue fields in verl's mini-batch order
        (``actor.shuffle`` is refused with these), written back as their fields; returns the meta naming them."""
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
        self._add_loss_inputs(proto)
        new = [k for k in (KEPT_TOKENS, SFT_TOKENS, *COMBINE_FIELDS) if k in proto.batch.keys()]
        if new:
            out = TensorDict({k: proto.batch[k] for k in new}, batch_size=len(batch))
            batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)  # the meta names them
        return batch

    # ---- mix.flops_budget: the step's FLOPs (mix_src/trainer/common.py), counted as the legacy base counts them ---
    def step(self, metrics: dict, timing_raw: dict):
        """verl's step, then ``flops/*`` over its trained rows plus the rows generated since the last count;
        ``_budget_step`` is set when ``mix.flops_budget`` is reached with this step."""
        batch = super().step(metrics, timing_raw)
        if self._flops_off(metrics):
            return batch
        keep = _trained_rows(batch)
        p, r = tag_lengths([batch.tags[i] for i in keep])
        if streams_on_v1(self.mix.rollout_policy) and not getattr(self, "_counts_generation", False):
            # a custom sampler without verl's metadata sync: generation counted over the trained rows
            data = tq.kv_batch_get(keys=[batch.keys[i] for i in keep], partition_id=batch.partition_id,
                                   select_fields=["prefix_mask"])  # fmt: skip
            self.add_rollout_flops(p, r, r - data.to_padded_tensor()["prefix_mask"].long().sum(-1).numpy())
        if self._count_step_flops(p, r, self._pending_rollout_flops(), metrics):
            self._budget_step = self.global_steps
        return batch

    def on_step_end(self):
        """verl's (weight sync). A step that reached ``mix.flops_budget`` is the run's last: verl's ``fit``
        (``trainer_base.py`` 467-523) fixed ``is_last_step`` before the step ran, so its checkpoint and validation
        run here unless verl's loop runs them."""
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
        metrics = {**super()._consume_sync_metrics(), **(getattr(self, "_budget_val_metrics", None) or {})}
        self._budget_val_metrics = None
        return metrics

    def _save_checkpoint(self):
        super()._save_checkpoint()
        self._save_run_file()
        folder = self._step_folder()
        if self._carries_in_tq():  # the carried groups live in TransferQueue: saved as verl saves it in async modes
            tq.save_checkpoint(os.path.join(folder, "transfer_queue"), metadata={"global_steps": self.global_steps})
        if self._entropy_state is not None or self._policy_state() or self._flops:
            # the trajectories whose generation is counted: those TransferQueue's checkpoint restores are not again
            self._save_mix_state(flops_counted_rows=sorted(getattr(self, "_counted_rows", None) or ()))

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps <= 0:
            return
        carried = os.path.join(self._resumed_folder(), "transfer_queue")
        if self._carries_in_tq() and os.path.exists(carried):
            self._restore_carried_groups(carried)
        state = self._load_mix_state()
        if state is not None and getattr(self, "_counted_rows", None) is not None:
            self._counted_rows = set(state.get("flops_counted_rows") or ())

    def _resolve_filter_groups_metric(self):
        """verl's (trainer_base.py 187-213), with an unset ``algorithm.filter_groups.metric`` meaning ``reward`` as on
        the legacy base, where verl raises once Ray has started."""
        fg = self.config.algorithm.get("filter_groups", None)
        if fg is not None and fg.get("enable", False) and not fg.get("metric", None):
            with open_dict(fg):
                fg.metric = "reward"
        return super()._resolve_filter_groups_metric()

    def _build_replay_buffer(self):  # with mix_src's rules (mix_src/trainer/v1_replay.py)
        return self._mix_replay_buffer(super()._build_replay_buffer())

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        """verl's refill (the replay buffer's ``refill_fn``) in whole generation batches of ``data.gen_batch_size``
        prompts, within the step's generation budget (once spent, the buffer's wait raises)."""
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

    # ---- the data: each pass over it starts with mix_src's epoch stage ---------------------------------------
    def _fetch_one_gen_batch(self):
        """verl's, with :func:`mix_src.trainer.stages.start_data_epoch` before each new iterator."""
        it = self.train_dataloader_it
        if it is None or it._num_yielded >= len(it):  # torch's _BaseDataLoaderIter: batches yielded / per pass
            start_data_epoch(self.train_dataloader, self.train_dataset, self._policy_state())
            self.train_dataloader_it = iter(self.train_dataloader)
        return super()._fetch_one_gen_batch()

    # ---- generate: per-row prefix ratios and seeds; a rollout policy with several passes -------------
    def _next_train_batch(self, num_prompts: Optional[int] = None):
        batch = super()._next_train_batch(num_prompts)
        if self._fetch_step != self.global_steps:
            self._fetch_step, self._fetch_index, self._fetch_prompts = self.global_steps, 0, 0
        self._fetch_prompts += len(batch)
        targets = batch.get(TARGET_FIELD, None) if TARGET_FIELD in batch.keys() else None  # the dataset's normalised target
        targets = None if targets is None else [t for t in targets.tolist() for _ in range(self.n)]
        if self.mix.data.use_target_lst and TARGET_LST_FIELD in batch.keys():  # one drawn demonstration per session
            targets = list(self._draw_targets(batch.get(TARGET_LST_FIELD).tolist(), self._fetch_index))
            tu.assign_non_tensor_stack(batch, PREFIX_TARGETS, [targets[i * self.n:(i + 1) * self.n]
                                                               for i in range(len(batch))])
        ratios = self._row_ratios(len(batch), self._fetch_index, targets)
        seeds = self._row_seeds(len(batch), self._fetch_index)
        self._fetch_index += 1
        tu.assign_non_tensor_stack(batch, "prefix_ratios", ratios.reshape(len(batch), self.n).tolist())
        tu.assign_non_tensor_stack(batch, "rollout_seeds", seeds.reshape(len(batch), self.n).tolist())
        return batch

    def _submit_batch_to_rollout(self, batch):
        """verl's stage (right after ``_next_train_batch``: ``trainer_base.py`` 1514-1523); a rollout policy that V1
        does not stream generates pass by pass through :class:`mix_src.trainer.rollout_policy_v1.V1PolicyRunner`, the
        agent-loop manager for this call, keyed by the batch's fetch index."""
        if streams_on_v1(self.mix.rollout_policy):
            return super()._submit_batch_to_rollout(batch)
        manager = self.agent_loop_manager
        self.agent_loop_manager = V1PolicyRunner(self, manager, self._fetch_index - 1, self._policy_metrics)
        try:
            return super()._submit_batch_to_rollout(batch)
        finally:
            self.agent_loop_manager = manager

    def _compute_values(self, batch, metrics: dict):
        """verl 0.9.1's ``_compute_ref_log_prob`` leaves a LoRA reference's ``no_lora_adapter=True`` in
        ``batch.extra_info`` (``trainer_base.py`` 1703-1705); ``_compute_values`` (1724-1730) would send it to the critic,
        whose model has no adapter to disable (``engine_workers.py`` 403, 425: AttributeError). Dropped here."""
        batch.extra_info.pop("no_lora_adapter", None)
        return super()._compute_values(batch, metrics)

    def _compute_old_log_prob(self, batch, metrics: dict):
        """verl's stage, with its ``training/rollout_*`` metrics over the on-policy tokens only
        (:func:`mix_src.trainer.stages.on_policy_rollout_metrics`)."""
        before = set(metrics)
        batch = super()._compute_old_log_prob(batch, metrics)
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            return batch
        for key in [k for k in metrics if k not in before and k.startswith("training/rollout_")]:
            del metrics[key]
        fields = ["old_log_probs", "rollout_log_probs", "response_mask", "responses"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        prefix_mask, _ = tq_prefix_mask(batch.keys, batch.partition_id)
        metrics.update(on_policy_rollout_metrics(DataProto(batch=data.to_padded_tensor()), prefix_mask))
        return batch

    def _compute_advantage(self, batch, metrics: dict):
        """verl's stage (``trainer_base.py`` 1743-1802) with its advantage call and rollout correction swapped for
        :func:`~mix_src.trainer.stages.luffy_advantage_stage` and :func:`~mix_src.trainer.stages.on_policy_rollout_correction`;
        then the rows' ``prefix_mask`` is written to TransferQueue (nested like ``response_mask``) for the loss."""
        prefix_mask, nested_response_mask = tq_prefix_mask(batch.keys, batch.partition_id)
        advantages = luffy_advantage_stage(trainer_base.compute_advantage_for_multi_trajectories, prefix_mask,
                                           self.config.algorithm, self.mix)
        verl_correction = trainer_base.compute_rollout_correction_and_add_to_batch

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
        metrics.update(self._target_draw_metrics())  # over the generation batches fetched since the last step
        metrics.update(self._policy_metrics)  # rollout_policy/passes, rollout_policy/rows_generated
        metrics.update(self._pop_policy_metrics())  # the rollout policy's own (RolloutContext.metrics)
        self._policy_metrics.clear()
        if self._gen_budget() is not None or self.mix.filter_groups.carry_over:
            metrics["train/num_gen_batches"] = self._step_prompts() / self._gen_batch_prompts()
        if self._carries_in_tq():  # verl counts the surplus it would have cleared as discarded; here it was carried
            metrics.pop("training/filter_groups/discarded_surplus_samples", None)
        metrics.update(self._carry_metrics)
        self._carry_metrics.clear()

    def _luffy_metrics(self, batch) -> dict[str, Any]:  # over the step's trained rows
        keys = [batch.keys[i] for i in _trained_rows(batch)]
        fields = ["uid", "response_mask", "prefix_mask", "rm_scores", "extra_fields", "prompts", "responses"]
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields)
        extra = _extra_fields(data.pop("extra_fields"))
        uids = data.pop("uid").tolist()
        rollout = self.config.actor_rollout_ref.rollout  # verl's clip ratios measure the step's longest row (stages)
        out = length_clip_metrics(data.pop("prompts").offsets().diff(), data.pop("responses").offsets().diff(),
                                  rollout.prompt_length, rollout.response_length)  # fmt: skip
        padded, info = data.to_padded_tensor(), [e.get("reward_extra_info", {}) for e in extra]
        solved = solved_rows([i.get("acc") for i in info], lambda: padded["rm_scores"].sum(-1).numpy())
        out.update(luffy_metrics(solved, padded["prefix_mask"].bool(), padded["response_mask"], uids,
                                 [e.get("prefix_ratio", 0.0) for e in extra],
                                 [e.get("prefix_truncated", False) for e in extra], [i.get("ungradable") for i in info]))
        return out


def _trained_rows(batch) -> list[int]:  # verl's padding rows excluded
    return [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]


@register_trainer("mix_sync")  # mix_<trainer.v1.trainer_mode>
class MixPPOTrainerSync(MixV1Mixin, PPOTrainerSync):
    """LUFFY on verl's synchronous V1 trainer (rollout and training colocated, no partial rollout)."""


@register_trainer("mix_colocate_async")  # mix_<trainer.v1.trainer_mode>
class MixPPOTrainerColocateAsync(MixV1Mixin, PPOTrainerColocateAsync):
    """LUFFY on verl's colocated asynchronous V1 trainer (partial rollout, warm-up batches)."""


class _DropFlush(logging.LoggerAdapter):  # a logger that accepts (and drops) print's flush= keyword

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


@register_trainer("mix_separate_async")  # mix_<trainer.v1.trainer_mode>
class MixPPOTrainerSeparateAsync(MixV1Mixin, PPOTrainerSeparateAsync):
    """LUFFY on verl's separate asynchronous V1 trainer (standalone rollout pool)."""

    def _setup(self):
        """verl's, whose ``logger.info(..., flush=True)`` with ``hybrid_engine=false`` (``trainer_separate_async.py``
        181-186) the stdlib logger refuses with a TypeError; during this call the module's logger drops ``flush``."""
        drop_flush = _DropFlush(trainer_separate_async.logger, {})
        with swapped(trainer_separate_async, "logger", drop_flush, patch="v1.separate_async.logger"):
            super()._setup()


class MixTaskRunnerV1(TaskRunnerV1.__ray_actor_class__):
    """verl's ``TaskRunnerV1`` (``verl/trainer/main_ppo.py`` 102-161; a Ray actor class: this subclasses the class
    under it) with one change in ``run``: the LUFFY trainer of the configured mode."""

    def run(self, config):
        configure_verl_logging()
        trainer_cls = get_trainer_cls(f"mix_{config.trainer.v1.trainer_mode}")
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
