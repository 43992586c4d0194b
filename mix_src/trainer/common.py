"""What both trainer bases do the same way: prefix seeding, the rollout policy's call, the FLOPs meter (``flops/*``,
``mix.flops_budget``), the checkpointed ``mix_state.pt`` and the MIX worker loss. Every attribute of the mixin
:class:`MixTrainerCommon` has a class default, so the stage tests' trainers built without ``__init__`` work."""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import torch
from verl.utils.config import omega_conf_to_dataclass

from mix_src.algo.flops import COUNTS, ModelShape, add_step_flops, rollout_flops, shape_unreadable
from mix_src.worker.loss import MixPolicyLoss, add_combine_inputs, add_kept_token_counts, install_loss, pop_entropy_state
from mix_src.algo.demonstrations import draw_row_targets
from mix_src.algo.seeding import request_seeds
from mix_src.config.run_identity import write_run_file
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES, RolloutContext
from mix_src.trainer.stages import MIX_STATE_FILE, draw_prefix_ratios

__all__ = ["MixTrainerCommon"]


class MixTrainerCommon:
    """Needs ``config``, ``mix``, ``n``, ``prefix_seed``, ``global_steps``, ``actor_rollout_wg`` (and verl's
    ``_get_dp_size``), ``use_reference_policy``."""

    _flops_shape: Any = None  # the actor's ModelShape, read from its config.json on first use (or the read error)
    _flops: Optional[dict] = None  # the run's training FLOPs so far per count (saved: a resumed budget counts them)
    _rollout_flops: Optional[dict] = None  # generation FLOPs since the last step's count
    _entropy_state: Optional[dict] = None  # the learned entropy coefficient's state (mix.loss.use_adaptive_entropy)
    _rollout_state: Optional[dict] = None  # the rollout policy's own state (RolloutContext.state)
    _policy_step_metrics: Optional[list] = None  # the RolloutContext.metrics of this step's generation batches
    _target_draws: Optional[dict] = None  # mix.data.use_target_lst: the draws' counts since the last step's metrics

    # ---- prefix seeding: keyed by (seed, global_step, gen_index), so a resumed run draws what an uninterrupted one drew
    def _row_ratios(self, num_prompts: int, gen_index: int, targets) -> np.ndarray:
        """(num_prompts * n,) prefix ratios (:func:`mix_src.trainer.stages.draw_prefix_ratios`)."""
        return draw_prefix_ratios(self.mix, num_prompts, self.n, seed=self.prefix_seed, global_step=self.global_steps,
                                  gen_index=gen_index, targets=targets)  # fmt: skip

    def _draw_targets(self, target_sets, gen_index: int) -> np.ndarray:
        """(num_prompts * n,) object array: each row's demonstration from its prompt's ``target_lst``
        (:func:`mix_src.algo.demonstrations.draw_row_targets`, seeded from ``(seed, global_step, gen_index, 2)``: a
        resumed run draws what an uninterrupted one drew); the counts go to :meth:`_target_draw_metrics`."""
        rng = np.random.default_rng([self.prefix_seed, self.global_steps, gen_index, 2])
        rows, repeated = draw_row_targets(target_sets, self.n, self.mix.n_prefix, rng,
                                          shared=self.mix.prefix_share_across_samples)
        draws = self._target_draws if self._target_draws is not None else {}
        draws["repeated"] = draws.get("repeated", 0) + repeated
        draws["prompts"] = draws.get("prompts", 0) + len(target_sets)
        draws["demonstrations"] = draws.get("demonstrations", 0) + sum(len(s) for s in target_sets if s is not None)
        self._target_draws = draws
        return rows

    def _target_draw_metrics(self) -> dict:
        """``batch/target_lst_repeated_rows`` (prefixed rows that repeat a demonstration of their group: the prompt has
        fewer than the prefixed rows) and ``batch/target_lst_mean_size`` (demonstrations per prompt), over every
        generation batch since the last call (filter groups: several); {} without ``mix.data.use_target_lst``."""
        draws, self._target_draws = self._target_draws, None
        if not draws:
            return {}
        return {"batch/target_lst_repeated_rows": int(draws["repeated"]),
                "batch/target_lst_mean_size": draws["demonstrations"] / max(draws["prompts"], 1)}

    def _row_seeds(self, num_prompts: int, gen_index: int) -> np.ndarray:
        """(num_prompts * n,) sampling seeds from ``(rollout.seed, global_step, gen_index, prompt, sample)``: a sample's
        tokens never depend on its arrival order at the server (mix_src/algo/seeding.py)."""
        seed = int(self.config.actor_rollout_ref.rollout.get("seed") or 0)
        return request_seeds(seed, self.global_steps, gen_index, num_prompts, self.n)

    def _run_rollout_policy(self, batch: Any, gen_index: int, **context) -> Any:
        """``mix.rollout_policy`` on one generation batch (B = num_prompts * n rows, i*n + j) with the base's
        ``context`` (RolloutContext's generate, prefix_ratios, records, entropy); returns its B rows."""
        ctx = RolloutContext(batch=batch, n=self.n, global_step=self.global_steps, mix=self.mix,
                             rng=np.random.default_rng([self.prefix_seed, self.global_steps, gen_index, 1]),
                             state=self._policy_state(), tokenizer=getattr(self, "tokenizer", None), **context)
        out = ROLLOUT_POLICIES.get(self.mix.rollout_policy)(ctx)
        if len(out) != len(batch):
            raise ValueError(f"rollout policy {self.mix.rollout_policy!r} returned {len(out)} rows for {len(batch)}")
        if ctx.metrics:
            self._policy_step_metrics = [*(self._policy_step_metrics or []), dict(ctx.metrics)]
        return out

    def _pop_policy_metrics(self) -> dict:
        """The rollout policy's metrics of this step (RolloutContext.metrics; each name's mean over the step's
        generation batches that reported it), then cleared."""
        parts, self._policy_step_metrics = self._policy_step_metrics or [], None
        names = dict.fromkeys(k for part in parts for k in part)
        return {k: float(np.mean([float(p[k]) for p in parts if k in p])) for k in names}

    # ---- FLOPs (mix_src/algo/flops.py) ----------------------------------------------------------------------------
    def _model_shape(self) -> ModelShape:
        """The actor's shape, read once from its ``config.json`` (a read failure is kept and raised on every use)."""
        if self._flops_shape is None:
            from transformers import AutoConfig

            model_cfg = self.config.actor_rollout_ref.model
            try:
                cfg = AutoConfig.from_pretrained(model_cfg.path,
                                                 trust_remote_code=model_cfg.get("trust_remote_code", False))
                self._flops_shape = ModelShape.from_hf_config(cfg.to_dict())
            except Exception as e:  # noqa: BLE001 - kept, and raised to the caller on every use
                self._flops_shape = e
        if isinstance(self._flops_shape, Exception):
            raise self._flops_shape
        return self._flops_shape

    def _flops_totals(self) -> dict:
        """The run's FLOPs so far per count."""
        if self._flops is None:
            self._flops = {c: 0.0 for c in COUNTS}
        return self._flops

    def add_rollout_flops(self, prompt_lens, response_lens, generated_lens) -> None:
        """Generation FLOPs of rows a rollout pass generated, counted at the next step's :meth:`_count_step_flops`."""
        try:
            shape = self._model_shape()
        except Exception:  # noqa: BLE001 - reported (fatal with a budget) at the step's count
            return
        pending, lens = self._rollout_flops or {}, (prompt_lens, response_lens, generated_lens)
        self._rollout_flops = {c: pending.get(c, 0.0) + rollout_flops(shape, *lens, c) for c in COUNTS}

    def _pending_rollout_flops(self) -> dict:
        """The generation FLOPs added since the last count (then reset)."""
        pending = self._rollout_flops or {}
        self._rollout_flops = {c: 0.0 for c in COUNTS}
        return {c: float(pending.get(c, 0.0)) for c in COUNTS}

    def _flops_off(self, metrics: dict) -> bool:
        """No FLOPs this run: no ``mix.flops_budget`` and the model's shape unreadable (logged once in ``metrics``)."""
        return self.mix.flops_budget is None and shape_unreadable(self._model_shape, metrics)

    def _count_step_flops(self, prompt_lens, response_lens, rollout: dict, metrics: dict) -> bool:
        """The step's ``flops/*`` (old/ref log-probs and ``ppo_epochs`` updates over the trained rows' lengths, plus
        ``rollout``) into ``metrics`` and the totals; True when ``mix.flops_budget`` is reached with this step."""
        totals = self._flops_totals()
        add_step_flops(self._model_shape(), prompt_lens, response_lens, rollout, totals, metrics,
                       ppo_epochs=int(self.config.actor_rollout_ref.actor.get("ppo_epochs", 1)),
                       ref_policy=self.use_reference_policy)  # fmt: skip
        budget = self.mix.flops_budget
        return budget is not None and totals[self.mix.flops_count] >= budget

    def _budget_message(self) -> str:
        return (f"[mix_src] mix.flops_budget={self.mix.flops_budget:.4g} reached at step {self.global_steps} "
                f"({self.mix.flops_count} count: {self._flops_totals()[self.mix.flops_count]:.4g} FLOPs): training ends")

    # ---- the worker loss and its learned entropy coefficient -------------------------------------------------
    def _install_mix_loss(self) -> None:
        """The MIX worker loss (mix_src/worker/loss.py) on every actor worker, continuing a restored entropy state."""
        actor_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        install_loss(self.actor_rollout_wg, MixPolicyLoss(actor_cfg, self.mix.loss, entropy_state=self._entropy_state))

    def _add_loss_inputs(self, batch: Any) -> None:
        """The per-row inputs the worker loss reads (mix_src/worker/loss.py: kept-token counts for
        ``mix.loss.all_max_clip`` / ``row_loss``, ``mix.loss.combine``'s population counts), added to the DataProto
        ``batch`` before the actor update (verl's ``_get_dp_size``: the actor's data-parallel size)."""
        dp_size = lambda: self._get_dp_size(self.actor_rollout_wg, "actor")  # noqa: E731
        add_kept_token_counts(batch, self.config, self.mix.loss, dp_size)
        add_combine_inputs(batch, self.config, self.mix.loss, dp_size, self.global_steps)

    def _keep_entropy_state(self, update_metrics: dict) -> None:
        """Take the coefficient's state out of the workers' update metrics (before verl averages them)."""
        state = pop_entropy_state(update_metrics)
        if state is not None:
            self._entropy_state = state

    # ---- mix_state.pt --------------------------------------------------------------------------------------
    def _policy_state(self) -> dict:
        """The rollout policy's own state (RolloutContext.state), one dict for the run, saved in mix_state.pt."""
        if self._rollout_state is None:
            self._rollout_state = {}
        return self._rollout_state

    def _step_folder(self) -> str:
        """This step's checkpoint folder (verl's ``global_step_<n>`` under ``trainer.default_local_dir``)."""
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")

    def _resumed_folder(self) -> str:
        """The folder verl's ``_load_checkpoint`` resumed from (``resume_from_path`` or the step's), absolute."""
        trainer = self.config.trainer
        folder = trainer.resume_from_path if trainer.resume_mode == "resume_path" else self._step_folder()
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

    def _save_run_file(self) -> None:
        """``mix_run.json`` in this step's folder: the run's identity and config, which the next run's pre-Ray check
        compares before it resumes this checkpoint (mix_src/config/run_identity.py)."""
        write_run_file(self._step_folder(), self.config)

    def _save_mix_state(self, **own) -> None:
        """``mix_state.pt`` in this step's folder: the shared state plus the base's ``own`` keys."""
        state = {"entropy_coef": self._entropy_state, "rollout_policy": self._policy_state(),
                 "flops": dict(self._flops or {}), **own}  # fmt: skip
        torch.save(state, os.path.join(self._step_folder(), MIX_STATE_FILE))

    def _load_mix_state(self) -> Optional[dict]:
        """Restore the shared state from the resumed folder's ``mix_state.pt`` and return the whole dict (None when
        there is none)."""
        path = os.path.join(self._resumed_folder(), MIX_STATE_FILE)
        if not os.path.exists(path):
            return None
        state = torch.load(path, weights_only=False)
        self._entropy_state = state.get("entropy_coef")
        if state.get("flops"):
            self._flops = {**{c: 0.0 for c in COUNTS}, **state["flops"]}
        self._policy_state().clear()  # the policy's RolloutContext.state: the same dict object, refilled
        self._policy_state().update(state.get("rollout_policy") or {})
        return state
