"""Steps without off-policy rows, and mini-/micro-batches with no off-policy row or only off-policy rows, train
(issue #41 item 6) on both trainer bases, as runs of the legacy and V1 batches (tests/conftest.py ``legacy_batch``,
``v1_batch``: one process and one Ray cluster for several test files' runs, tests/mix_modes_run.py):

* ``legacy``: ``mix.data.sample_target_ratio=0`` (documented "on-policy only"; it raised IndexError in
  mix_src/trainer/dataset.py before), one-row micro-batches, 1 step: every row on-policy (every step is alike);
* ``v1``: a train file read in order (``data.shuffle=false``) whose first batch has no target at all (every target
  null: the on-policy-only step) and whose second has targets for half its prompts, one-prompt mini-batches and
  one-row micro-batches: mini-batches with no off-policy row and with one, micro-batches with only off-policy rows
  (LUFFY issue #24 saw NaN in such batches).

``sample_target_ratio=0`` and an all-null target column reach the trainers as the same rows: the dataset class, one
for both bases (``data.custom_cls``), turns both into empty targets (tests/test_data_check.py
``test_no_target_left_loads_on_policy_only``); so a whole run of each on each base would train the same batches as
the steps here. Real verl trainer, workers, Ray and agent loop on the tiny assets (tests/e2e.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from e2e import MIX_CPU, batch_result, batch_run, tiny_overrides

pytestmark = pytest.mark.ray

LUFFY = ["mix.n_prefix=1", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0", "algorithm.adv_estimator=grpo_split"]
ONE_ROW_MICRO = [f"actor_rollout_ref.{k}=1" for k in ("actor.ppo_micro_batch_size_per_gpu",
                                                       "rollout.log_prob_micro_batch_size_per_gpu",
                                                       "ref.log_prob_micro_batch_size_per_gpu")]
V1 = ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]


def _blocked_file(assets: dict, path: Path) -> Path:
    """The tiny train file with no target in rows 0-3 (the first batch) and a target in every other row after."""
    df = pd.read_parquet(assets["train"])
    df["target"] = [t if i >= 4 and i % 2 == 0 else None for i, t in enumerate(df["target"])]
    df.to_parquet(path)
    return path


def _finite(m: dict) -> None:
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/on_policy_prob"):
        assert key in m and math.isfinite(m[key]), (key, m.get(key))


def _base(assets: dict) -> list[str]:
    return MIX_CPU + tiny_overrides(assets, steps=2, n=2, batch_size=4, response_length=24) + LUFFY + ONE_ROW_MICRO


def legacy_run(assets: dict, _) -> list[str]:
    return [*_base(assets), "mix.data.sample_target_ratio=0.0", "trainer.total_training_steps=1"]  # every step alike


def v1_run(assets: dict, batch_dir: Path) -> list[str]:
    return [*_base(assets), *V1, f"data.train_files={_blocked_file(assets, batch_dir / 'blocked.parquet')}",
            "data.shuffle=false", "actor_rollout_ref.actor.ppo_mini_batch_size=1"]  # fmt: skip


HERE = "test_no_target_e2e.py::"
LEGACY = batch_run("legacy", "no_target", legacy_run, [HERE + "test_sample_target_ratio_zero_trains_on_policy_only"])
V1_RUN = batch_run("v1", "no_target_v1", v1_run,
                   [HERE + "test_null_targets_and_one_prompt_mini_batches_one_row_micro_batches_v1"])


def test_sample_target_ratio_zero_trains_on_policy_only(legacy_batch):
    run = batch_result(legacy_batch, LEGACY)
    metrics = run.metrics
    assert [m["step"] for m in metrics] == [1]
    for m in metrics:
        assert m["batch/off_policy_rows"] == 0 and m["batch/off_solved"] == 0.0 and m["batch/avg_prefix_ratio"] == 0
        _finite(m)
    assert re.search(r"\[mix_src\.trainer\.dataset\] .*: 32 rows; 0 with a target; 0 empty/non-string targets .* 32 targets "
                     r"not sampled \(mix\.data\.sample_target_ratio=0\.0\)", run.log_path.read_text(errors="replace"))


def test_null_targets_and_one_prompt_mini_batches_one_row_micro_batches_v1(v1_batch):
    run = batch_result(v1_batch, V1_RUN)
    metrics = run.metrics
    assert [m["step"] for m in metrics] == [1, 2]
    # step 1: the first batch has no target (on-policy only); step 2: 2 of its 4 prompts have one, 1 expert row each
    assert [m["batch/off_policy_rows"] for m in metrics] == [0, 2]
    # off_solved: the expert rows (whole targets) are graded correct; 0.0 when a step has none
    assert [m["batch/off_solved"] for m in metrics] == [0.0, 1.0]
    assert metrics[0]["batch/avg_prefix_ratio"] == 0 and metrics[1]["batch/avg_prefix_ratio"] == pytest.approx(2 / 8)
    for m in metrics:
        _finite(m)
    assert "actor/off_pg_loss" in metrics[1] and math.isfinite(metrics[1]["actor/off_pg_loss"])
    assert re.search(r"\[mix_src\.trainer\.dataset\] .*blocked\.parquet.*: 32 rows; 14 with a target; 18 empty/non-string",
                     run.log_path.read_text(errors="replace"))
