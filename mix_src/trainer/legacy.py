"""``MIXRayPPOTrainer``: LUFFY's off-policy guided GRPO with DAPO-style filter groups, on verl's RayPPOTrainer.

``_step`` runs the numbered stages of mix_src/README.md "The algorithm and its knobs" (1-3:
:class:`mix_src.trainer.legacy_collect.LegacyCollect`) and honours or refuses every setting verl's own ``fit`` reads
(:mod:`mix_src.config.verl_parity`). Departures from LUFFY's trainer (arXiv 2504.14945, github.com/ElliottYan/LUFFY):
ratios are drawn on the driver, not with Python's global ``random`` on each TP rank; ratio-1.0 rows never reach the
inference server; filter groups are applied (LUFFY computed its ``valid_mask`` and never used it); metric
denominators never divide by zero.
"""

from __future__ import annotations

from pprint import pprint
from typing import Any, Iterator, Optional

import numpy as np
import torch
from omegaconf import OmegaConf, open_dict
from tqdm import tqdm

from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.metric_utils import (compute_data_metrics, compute_throughout_metrics, compute_timing_metrics,
                                           compute_variance_proxy_metrics)  # fmt: skip
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, apply_kl_penalty, compute_advantage, compute_spec_decode_metrics
from verl.trainer.ppo.reward import extract_reward
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.utils.checkpoint.checkpoint_manager import should_save_ckpt_esi
from verl.utils.debug import marked_timer
from verl.utils.metric import reduce_metrics
from verl.utils.skip.skip_manager import SkipManager
from verl.utils.tracking import Tracking

from mix_src.algo.flops import lengths_from_masks
from mix_src.config.mix_config import MixConfig
from mix_src.trainer.common import MixTrainerCommon
from mix_src.trainer.legacy_collect import LegacyCollect, merge_rollout_timing  # noqa: F401  (re-exported)
from mix_src.trainer.stages import MIX_STATE_FILE, FilterGroupsExhausted  # noqa: F401  (re-exported)
from mix_src.trainer.stages import prefix_context_mask
from mix_src.trainer.stages import (length_clip_metrics, luffy_advantage_stage, on_policy_rollout_correction,
                                    on_policy_rollout_metrics, start_data_epoch)  # fmt: skip


class MIXRayPPOTrainer(LegacyCollect, MixTrainerCommon, RayPPOTrainer):
    """RayPPOTrainer with prefix-guided rollouts, the mixed on/off-policy loss and filter groups."""

    _budget_reached = False

    def __init__(self, *args, mix_config: MixConfig, **kwargs):
        self.mix = mix_config
        super().__init__(*args, **kwargs)
        self.n = int(self.config.actor_rollout_ref.rollout.n)
        seed = self.mix.seed if self.mix.seed is not None else self.config.data.get("seed", None)
        self.prefix_seed = 0 if seed is None else int(seed)
        self.filter_cfg = self.config.algorithm.filter_groups
        self._carry: Optional[DataProto] = None  # kept groups left over from the last step (carry_over)
        self._epoch = 0
        self._rollout_awake = False  # whether the rollout replicas hold their weights (see _wake_rollout)
        self.max_steps_duration = 0.0  # longest step so far (seconds), for verl's ESI expiry checkpoint
        self._flops_totals()  # training FLOPs so far, both counts (mix_src/algo/flops.py)

    # ---- worker calls: verl's own, on the tensors plus the per-row fields workers read -------------------------------
    def _compute_old_log_prob(self, batch: DataProto):
        return super()._compute_old_log_prob(worker_view(batch))

    def _compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        return super()._compute_ref_log_prob(worker_view(batch))

    def _compute_values(self, batch: DataProto) -> DataProto:
        return super()._compute_values(worker_view(batch))

    def _update_actor(self, batch: DataProto) -> DataProto:
        view = worker_view(batch)
        if self.mix.loss.prefix_tokens == "context":  # PrefixRL: prefix tokens out of the update (stages.prefix_context_mask)
            view = DataProto(batch=view.batch.clone(recurse=False), non_tensor_batch=view.non_tensor_batch,
                             meta_info=view.meta_info)
            view.batch["response_mask"] = prefix_context_mask(batch.batch["response_mask"], batch.batch["prefix_mask"])
        return super()._update_actor(view)

    def _update_critic(self, batch: DataProto) -> DataProto:
        return super()._update_critic(worker_view(batch))

    # ---- set-up ------------------------------------------------------------------------------------------------------
    def init_workers(self):
        agent_cfg = self.config.actor_rollout_ref.rollout.agent
        if not agent_cfg.get("agent_loop_manager_class"):  # verl's option; one set by the user is kept
            from mix_src.rollout.agent_loop_worker import MANAGER_FQN

            with open_dict(agent_cfg):
                agent_cfg.agent_loop_manager_class = MANAGER_FQN
        super().init_workers()
        self._install_mix_loss()  # pickled once to every actor worker by set_loss_fn

    # ---- the loop ----------------------------------------------------------------------------------------------------
    def fit(self):
        if self._dump_executor._shutdown:
            self._init_dump_executor()
        cfg = self.config.trainer
        tracker = Tracking(project_name=cfg.project_name, experiment_name=cfg.experiment_name, default_backend=cfg.logger,
                           config=OmegaConf.to_container(self.config, resolve=True))
        self.global_steps = 0
        self._load_checkpoint()
        self._wake_rollout()
        SkipManager.init(self.config)

        if cfg.get("val_before_train", True):
            val_metrics = self._validate()
            pprint(f"Initial validation metrics: {val_metrics}")
            tracker.log(data=val_metrics, step=self.global_steps)
            if cfg.get("val_only", False):
                self._shutdown_dump_executor()
                return

        progress_bar = tqdm(total=self.total_training_steps, initial=self.global_steps, desc="Training Progress")
        first_step = self.global_steps + 1
        self.global_steps += 1
        SkipManager.set_step(self.global_steps)
        batches = self._train_batches()
        try:
            while self.global_steps <= self.total_training_steps:
                self._finalize_async_calls(blocking=False)
                metrics = self._step(batches)
                if metrics is None:  # the data ran out (see _collect_batch)
                    self._end_of_data(tracker, first_step)
                    break
                tracker.log(data=metrics, step=self.global_steps)
                progress_bar.update(1)
                if self._budget_reached:
                    print(self._budget_message())
                    break
                self.global_steps += 1
                SkipManager.set_step(self.global_steps)
            self._finalize_async_calls(blocking=True)
        finally:
            progress_bar.close()
            self._shutdown_dump_executor()

    def _finalize_async_calls(self, blocking: bool) -> None:
        """As verl's fit: finish the worker group's asynchronous calls (async checkpoint saves), if it has any."""
        if hasattr(self.actor_rollout_wg, "async_calls_finalize_fn_exec"):
            self.actor_rollout_wg.async_calls_finalize_fn_exec(blocking=blocking)

    def _end_of_data(self, tracker, first_step: int) -> None:
        """The data ran out before ``total_training_steps``: checkpoint and validate the last finished step unless
        its own step already did."""
        self.global_steps -= 1  # the step that could not be filled never ran
        step, cfg = self.global_steps, self.config.trainer
        if step < first_step:
            return
        print(f"[mix_src] the training data ran out after step {step}: final checkpoint and validation")
        if cfg.save_freq > 0 and step % cfg.save_freq != 0 and cfg.critic_warmup <= step:
            self._save_checkpoint()
        if cfg.test_freq > 0 and step % cfg.test_freq != 0:
            if not self._rollout_awake:  # a colocated reward model left it asleep
                self._wake_rollout()
            val_metrics = self._validate()
            pprint(f"Final validation metrics: {val_metrics}")
            tracker.log(data=val_metrics, step=step)

    # ---- rollout replicas: awake to generate, asleep for a colocated reward model or the trainer ---------------------
    def _wake_rollout(self) -> None:
        """Weights to the rollout replicas, which wakes them (as verl's _validate does after a colocated reward model)."""
        self.checkpoint_manager.update_weights(self.global_steps)
        self._rollout_awake = True

    def _sleep_rollout(self) -> None:
        if self._rollout_awake:
            self.checkpoint_manager.sleep_replicas()
            self._rollout_awake = False

    def _actor_entropy(self, rows: DataProto) -> torch.Tensor:
        """RolloutContext.entropy: (rows, response_len) per-token entropy of generated rows under the current
        actor, by verl's old-log-prob pass, padded to a multiple of world size x log-prob micro-batch (verl's
        static micro-batching); the rollout replicas sleep first, as before stage 4."""
        self._sleep_rollout()
        rollout, world = self.config.actor_rollout_ref.rollout, self.actor_rollout_wg.world_size
        sub = DataProto(batch=rows.batch, non_tensor_batch=dict(rows.non_tensor_batch),
                        meta_info={**rows.meta_info, "temperature": rollout.temperature})
        micro = rollout.get("log_prob_micro_batch_size_per_gpu") or (
            (rollout.get("log_prob_micro_batch_size") or world) // world)
        sub, _ = pad_dataproto_to_divisor(sub, world * max(int(micro), 1))  # engine_workers.py:624, utils.py:125
        sub.meta_info["global_token_num"] = torch.sum(sub.batch["attention_mask"], dim=-1).tolist()
        sub.meta_info["images_seqlens"] = []
        out, _ = self._compute_old_log_prob(sub)
        return out.batch["entropys"][: len(rows)]

    def _train_batches(self) -> Iterator[dict]:
        """Batches of ``data.train_batch_size`` prompts across epochs (resumes mid-epoch via the dataloader)."""
        for epoch in range(self._epoch, self.config.trainer.total_epochs):
            self._epoch = epoch
            start_data_epoch(self.train_dataloader, self.train_dataset, self._policy_state())  # retired prompts leave
            yield from self.train_dataloader

    def _step(self, batches: Iterator[dict]) -> Optional[dict[str, Any]]:
        metrics: dict[str, Any] = {}
        timing: dict[str, float] = {}
        is_last_step = self.global_steps >= self.total_training_steps
        self._pending_rollout_flops()  # this step's generation FLOPs count from zero
        with marked_timer("step", timing):
            batch = self._collect_batch(batches, metrics, timing)  # stages 1-3
            if batch is None:
                return None
            if not self._flops_off(metrics):  # flops/*; the step that reaches mix.flops_budget is the last
                p, r, _ = lengths_from_masks(batch.batch["attention_mask"], batch.batch["responses"])
                self._budget_reached = self._count_step_flops(p, r, self._pending_rollout_flops(), metrics)
                is_last_step = self._budget_reached or is_last_step
            self._sleep_rollout()
            batch = self._compute_log_probs(batch, metrics, timing)  # stage 4
            batch = self._compute_advantages(batch, metrics, timing)  # stage 5
            self._update(batch, metrics, timing, is_last_step)  # stage 6
            rollout_data_dir = self.config.trainer.get("rollout_data_dir", None)
            if rollout_data_dir:
                self._dump_rollouts(batch, timing, rollout_data_dir)
        if self.config.trainer.test_freq > 0 and (is_last_step or self.global_steps % self.config.trainer.test_freq == 0):
            with marked_timer("testing", timing):
                metrics.update(self._validate())
        self.max_steps_duration = max(self.max_steps_duration, timing["step"])
        self._add_step_metrics(batch, metrics, timing)  # stage 7
        if hasattr(self.train_dataset, "on_batch_end"):  # verl's experimental dataset hook, as in its fit
            self.train_dataset.on_batch_end(batch=batch)
        return metrics

    def _dump_rollouts(self, batch: DataProto, timing: dict, rollout_data_dir: str) -> None:
        """``trainer.rollout_data_dir``: verl's JSONL dump of the step's rows, plus their prefix ratio and tokens."""
        extra = {**extract_reward(batch)[1],
                 "prefix_ratio": np.asarray(batch.non_tensor_batch["prefix_ratio"], dtype=np.float64),
                 "prefix_tokens": batch.batch["prefix_mask"].sum(-1).numpy()}
        self._log_rollout_data(batch, extra, timing, rollout_data_dir)

    # ---- stage 4: old and reference log-probs ------------------------------------------------------------------------
    def _compute_log_probs(self, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
        if self.config.trainer.balance_batch:
            self._balance_batch(batch, metrics=metrics)
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        batch.meta_info["images_seqlens"] = []
        with marked_timer("old_log_prob", timing):
            old_log_prob, mfu = self._compute_old_log_prob(batch)
            entropys = old_log_prob.batch.pop("entropys")
            actor_cfg = self.config.actor_rollout_ref.actor
            metrics["actor/entropy"] = core_algos.agg_loss(
                loss_mat=entropys, loss_mask=batch.batch["response_mask"], loss_agg_mode=actor_cfg.loss_agg_mode,
                loss_scale_factor=actor_cfg.get("loss_scale_factor", None),
            ).item()
            metrics["perf/mfu/actor_infer"] = mfu
            batch = batch.union(old_log_prob)
        if "rollout_log_probs" in batch.batch.keys():
            metrics.update(on_policy_rollout_metrics(batch, batch.batch["prefix_mask"]))  # over on-policy tokens
        if self.use_reference_policy:
            with marked_timer("ref", timing):
                batch = batch.union(self._compute_ref_log_prob(batch))
        if self.use_critic:  # GAE and other critic-based estimators
            with marked_timer("values", timing):
                batch = batch.union(self._compute_values(batch))
        return self._apply_rollout_correction(batch, metrics)

    def _apply_rollout_correction(self, batch: DataProto, metrics: dict) -> DataProto:
        """``algorithm.rollout_correction`` in verl's decoupled mode over on-policy tokens only
        (:func:`mix_src.trainer.stages.on_policy_rollout_correction`; bypass mode is refused before Ray)."""
        rc = self.config.algorithm.get("rollout_correction", None)
        if rc is None or "rollout_log_probs" not in batch.batch.keys():
            return batch
        batch, rc_metrics = on_policy_rollout_correction(batch, batch.batch["prefix_mask"], rc,
                                                         compute_rollout_correction_and_add_to_batch)  # fmt: skip
        metrics.update(rc_metrics)
        return batch

    # ---- stage 5: advantages -----------------------------------------------------------------------------------------
    def _compute_advantages(self, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
        algo = self.config.algorithm
        with marked_timer("adv", timing):
            if algo.use_kl_in_reward:
                batch, kl_metrics = apply_kl_penalty(batch, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=algo.kl_penalty)
                metrics.update(kl_metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]

            def verl_advantage(data: DataProto) -> DataProto:  # read only for an estimator that is verl's
                return compute_advantage(data, adv_estimator=algo.adv_estimator, gamma=algo.gamma, lam=algo.lam,
                                         num_repeat=self.n, norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True),
                                         config=algo)  # fmt: skip

            return luffy_advantage_stage(verl_advantage, batch.batch["prefix_mask"], algo, self.mix)(batch)

    # ---- stage 6: update, checkpoint, weight sync --------------------------------------------------------------------
    def _update(self, batch: DataProto, metrics: dict, timing: dict, is_last_step: bool) -> None:
        if self.use_critic:
            with marked_timer("update_critic", timing):
                metrics.update(reduce_metrics(self._update_critic(batch).meta_info["metrics"]))
        if self.config.trainer.critic_warmup > self.global_steps:
            self._wake_rollout()
            return
        self._add_loss_inputs(batch)
        with marked_timer("update_actor", timing):
            actor_output = self._update_actor(batch)
        self._keep_entropy_state(actor_output.meta_info["metrics"])  # the learned entropy coefficient
        save_freq = self.config.trainer.save_freq
        esi_expiring = should_save_ckpt_esi(max_steps_duration=self.max_steps_duration,  # verl's ESI expiry rule
                                            redundant_time=self.config.trainer.esi_redundant_time)
        if save_freq > 0 and (is_last_step or self.global_steps % save_freq == 0 or esi_expiring):
            if esi_expiring:
                print("Force saving checkpoint: ESI instance expiration approaching.")
            with marked_timer("save_checkpoint", timing):
                self._save_checkpoint()
        with marked_timer("update_weights", timing):
            self._wake_rollout()
        metrics.update(reduce_metrics(actor_output.meta_info["metrics"]))

    def _save_checkpoint(self):
        """verl's checkpoint plus ``mix_state.pt`` with the epoch, the carried groups and the dataloader position."""
        super()._save_checkpoint()
        self._save_run_file()
        self._save_mix_state(epoch=self._epoch, carry=self._carry, dataloader=self.train_dataloader.state_dict())

    def _load_checkpoint(self):
        """verl's loader, then the epoch and dataloader state from ``mix_state.pt`` as they were: verl's own restore
        (``ray_trainer.py`` ``_load_checkpoint``) assumes one batch per step, which filter groups break."""
        result = super()._load_checkpoint()
        state = self._load_mix_state() if self.global_steps > 0 else None
        if state is not None:
            self._epoch, self._carry = state["epoch"], state["carry"]
            if state.get("dataloader") is not None:
                self.train_dataloader.load_state_dict(state["dataloader"])
            if self._entropy_state is not None:  # the workers' loss continues the learned coefficient
                self._install_mix_loss()
        return result

    # ---- stage 7: metrics --------------------------------------------------------------------------------------------
    def _add_step_metrics(self, batch: DataProto, metrics: dict, timing: dict) -> None:
        metrics["training/global_step"] = self.global_steps
        metrics["training/epoch"] = self._epoch
        metrics.update(self._pop_policy_metrics())  # the rollout policy's own (RolloutContext.metrics)
        metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))
        # the clip ratios against the configured limits, as on V1 (lengths as verl's metric_utils.py 60-92 reads them)
        width, mask, rollout = batch.batch["responses"].shape[-1], batch.batch["attention_mask"], self.config.actor_rollout_ref.rollout
        metrics.update(length_clip_metrics(mask[:, :-width].sum(-1), mask[:, -width:].sum(-1), rollout.prompt_length,
                                           rollout.response_length))  # fmt: skip
        gdpo_keys = self.config.algorithm.get("gdpo_reward_keys", None)
        # verl's per-component GDPO metrics (ray_trainer.py 1774-1782), for the estimator verl registered as GDPO's
        name = self.config.algorithm.adv_estimator
        estimator = core_algos.ADV_ESTIMATOR_REGISTRY.get(getattr(name, "value", name))
        if gdpo_keys and estimator is core_algos.compute_gdpo_outcome_advantage:
            for key in (k for k in gdpo_keys if k in batch.non_tensor_batch):
                values = np.asarray(batch.non_tensor_batch[key], dtype=np.float32)
                for stat, fn in (("mean", np.mean), ("std", np.std), ("max", np.max), ("min", np.min)):
                    metrics[f"gdpo/{key}/{stat}"] = float(fn(values))
        metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing))
        metrics.update(compute_throughout_metrics(batch=batch, timing_raw=timing, n_gpus=self.resource_pool_manager.get_n_gpus()))
        metrics.update(compute_variance_proxy_metrics(batch=batch, gradient_norm=metrics.get("actor/grad_norm", None)))
        spec = (batch.non_tensor_batch.get(f"spec_num_{k}", None) for k in ("draft_tokens", "accepted_tokens", "verify_steps"))
        metrics.update(compute_spec_decode_metrics(*spec))


WORKER_NON_TENSOR_KEYS = ("multi_modal_inputs",)  # the per-row non-tensor fields the actor/ref/critic workers read


def worker_view(batch: DataProto) -> DataProto:
    """``batch`` for a worker call: the same tensors and meta info (shared, not copied), and only the per-row fields in
    :data:`WORKER_NON_TENSOR_KEYS` (verl 0.9.1: verl/workers/engine/fsdp/transformer_impl.py
    ``extract_multi_modal_inputs``); ``DataProto.to_tensordict()`` would ship every other one per row for nothing."""
    keep = {k: v for k, v in batch.non_tensor_batch.items() if k in WORKER_NON_TENSOR_KEYS}
    return DataProto(batch=batch.batch, non_tensor_batch=keep, meta_info=batch.meta_info)
