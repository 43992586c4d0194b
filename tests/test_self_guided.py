"""Self-sourced traces in a run (issue #55 item 3): the pool's caps (mix_src/algo/self_pool.py), the rollout policy
``self_guided`` (mix_src/trainer/self_guided.py) on scripted generation passes, and the pool's save and exact restore
through the trainers' own ``mix_state.pt`` code (mix_src/trainer/common.py ``_save_mix_state`` / ``_load_mix_state``).
No Ray."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import torch
from verl import DataProto

from mix_src.algo.self_pool import pool_add, pool_entries, pool_size
from mix_src.config.mix_config import mix_config_from_dict
from mix_src.trainer.common import MixTrainerCommon
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES, RolloutContext

N, L = 4, 3


def test_pool_caps_per_prompt_and_in_all_oldest_first():
    pool: dict = {}
    assert pool_add(pool, "a", ["x", "y", "x"], per_prompt=2, total=3) == 2  # a repeat is not added
    assert pool_add(pool, "a", ["z"], 2, 3) == 1 and pool_entries(pool, "a") == ["y", "z"]  # per prompt: x leaves
    pool_add(pool, "b", ["u", "v"], 2, 3)  # 4 entries > 3: the pool's oldest (a's y) leaves
    assert pool_entries(pool, "a") == ["z"] and pool_entries(pool, "b") == ["u", "v"] and pool_size(pool) == 3
    assert pickle.loads(pickle.dumps(pool)) == pool


class _Tok:
    eos_token_id = 9

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def scripted(solved, state, prompt_ids):
    """A context over len(prompt_ids) prompts x N rows whose first pass solves ``solved`` rows (row r answers the
    tokens [r, r, 9]); guided rows always solve. Records every generate call."""
    calls, rows_total = [], len(solved)

    def generate(ratios, rows=None, targets=None):
        idx = np.arange(rows_total) if rows is None else np.asarray(rows)
        calls.append((idx.copy(), np.asarray(ratios, dtype=float).copy(), targets))
        guided = np.asarray(ratios) > 0
        acc = np.where(guided, 1.0, np.asarray(solved, dtype=float)[idx])
        prompts = torch.tensor([[prompt_ids[r // N], 1] for r in idx])
        responses = torch.tensor([[r, r, 9] for r in idx])
        return DataProto.from_dict(tensors={
            "prompts": prompts, "attention_mask": torch.ones(len(idx), 2 + L, dtype=torch.long), "responses": responses,
            "response_mask": torch.ones(len(idx), L, dtype=torch.long), "prefix_mask": torch.zeros(len(idx), L),
            "token_level_scores": torch.zeros(len(idx), L), "row": torch.as_tensor(idx)},
            non_tensors={"acc": acc})  # fmt: skip

    ctx = RolloutContext(batch=DataProto.from_dict(tensors={"row": torch.arange(rows_total)}), n=N, global_step=1,
                         mix=mix_config_from_dict({"n_prefix": 2, "rollout_policy": "self_guided", "min_prefix_ratio": 0.5, "max_prefix_ratio": 0.5,
                                                   "plugin_options": {"self_guided": {"per_prompt": 2}}}),
                         generate=generate, prefix_ratios=lambda: np.zeros(rows_total), rng=np.random.default_rng(0),
                         state=state, tokenizer=_Tok())  # fmt: skip
    return ctx, calls


def test_successes_are_stored_and_guide_a_later_failing_group():
    state: dict = {}
    # step 1: prompt 7 solves rows 1 and 2; prompt 8 fails with nothing stored (no guidance, counted)
    ctx, calls = scripted([0, 1, 1, 0] + [0] * 4, state, [7, 8])
    out = ROLLOUT_POLICIES.get("self_guided")(ctx)
    assert len(calls) == 1 and len(out) == 8
    assert ctx.metrics["rollout_policy/self_pool_added"] == 2 and ctx.metrics["rollout_policy/self_failed_no_trace"] == 1
    assert sorted(pool_entries(state["self_pool"], next(iter(state["self_pool"]["entries"])))) == ["1 1", "2 2"]
    # step 2: prompt 7 fails: rows 0, 1 (n_prefix=2) regenerate from its two stored successes, distinct
    ctx, calls = scripted([0] * 8, state, [7, 8])
    out = ROLLOUT_POLICIES.get("self_guided")(ctx)
    assert len(calls) == 2 and calls[1][0].tolist() == [0, 1] and calls[1][1].tolist() == [0.5, 0.5]
    assert sorted(calls[1][2]) == ["1 1", "2 2"]
    assert ctx.metrics["rollout_policy/self_guided_prompts"] == 1 and ctx.metrics["rollout_policy/self_failed_no_trace"] == 1
    assert out.batch["row"].tolist() == list(range(8))


def test_the_pool_is_saved_in_mix_state_and_restored_exactly(tmp_path):
    state: dict = {}
    ctx, _ = scripted([1, 1, 0, 0] + [0, 0, 0, 1], state, [3, 4])
    ROLLOUT_POLICIES.get("self_guided")(ctx)
    trainer = MixTrainerCommon()
    trainer.config = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path), resume_mode="auto",
                                                             resume_from_path=None))
    trainer.global_steps = 1
    trainer._rollout_state = state
    (tmp_path / "global_step_1").mkdir()
    trainer._save_mix_state()
    resumed = MixTrainerCommon()
    resumed.config, resumed.global_steps = trainer.config, 1
    resumed._load_mix_state()
    assert resumed._policy_state() == state and resumed._policy_state() is not state
