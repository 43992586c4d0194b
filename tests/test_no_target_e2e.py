"""Steps without off-policy rows, and mini-/micro-batches with no off-policy row or only off-policy rows, train
(issue #41 item 6) on both trainer bases, in ONE process and ONE Ray cluster (tests/mix_modes_run.py):

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

import json
import math
import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from e2e import MIX_CPU, cpu_env, read_metrics, run_command, tail, tiny_overrides

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


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory) -> dict:
    """Both runs in one process; returns {name: per-step metrics, "log": the process's log}."""
    tmp = tmp_path_factory.mktemp("no_target")
    base = MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=2, batch_size=4, response_length=24) + LUFFY + ONE_ROW_MICRO
    spec = {
        "legacy": [*base, "mix.data.sample_target_ratio=0.0", "trainer.total_training_steps=1"],  # every step alike
        "v1": [*base, *V1, f"data.train_files={_blocked_file(tiny_assets, tmp / 'blocked.parquet')}", "data.shuffle=false",
               "actor_rollout_ref.actor.ppo_mini_batch_size=1"],
    }  # fmt: skip
    (tmp / "runs.json").write_text(json.dumps(spec))
    env = cpu_env({"VERL_FILE_LOGGER_ROOT": str(tmp)})
    env.pop("VERL_FILE_LOGGER_PATH", None)
    log = tmp / "runs.log"
    cmd = [sys.executable, str(Path(__file__).with_name("mix_modes_run.py")), str(tmp / "runs.json")]
    code, wall, _, timed_out, _ = run_command(cmd, env, log, 600, cwd=tmp)
    text = log.read_text(errors="replace")
    print(f"{len(spec)} runs in one process: {wall:.0f} s (exit {code}); {re.findall(r'^MIX_MODES_RUN .*$', text, re.M)}")
    if timed_out or code != 0:
        pytest.fail(f"mix_modes_run exited {code} (timed out: {timed_out}) after {wall:.0f}s; log {log}\n{tail(log, 120)}",
                    pytrace=False)  # fmt: skip
    return {**{name: read_metrics(tmp / "e2e" / f"{name}.jsonl") for name in spec}, "log": text}


def test_sample_target_ratio_zero_trains_on_policy_only(runs):
    metrics = runs["legacy"]
    assert [m["step"] for m in metrics] == [1]
    for m in metrics:
        assert m["batch/off_policy_rows"] == 0 and m["batch/off_solved"] == 0.0 and m["batch/avg_prefix_ratio"] == 0
        _finite(m)
    assert re.search(r"\[mix_src\.trainer\.dataset\] .*: 32 rows; 0 with a target; 0 empty/non-string targets .* 32 targets "
                     r"not sampled \(mix\.data\.sample_target_ratio=0\.0\)", runs["log"])


def test_null_targets_and_one_prompt_mini_batches_one_row_micro_batches_v1(runs):
    metrics = runs["v1"]
    assert [m["step"] for m in metrics] == [1, 2]
    # step 1: the first batch has no target (on-policy only); step 2: 2 of its 4 prompts have one, 1 expert row each
    assert [m["batch/off_policy_rows"] for m in metrics] == [0, 2]
    # off_solved: the expert rows (whole targets) are graded correct; 0.0 when a step has none
    assert [m["batch/off_solved"] for m in metrics] == [0.0, 1.0]
    assert metrics[0]["batch/avg_prefix_ratio"] == 0 and metrics[1]["batch/avg_prefix_ratio"] == pytest.approx(2 / 8)
    for m in metrics:
        _finite(m)
    assert "actor/off_pg_loss" in metrics[1] and math.isfinite(metrics[1]["actor/off_pg_loss"])
    assert re.search(r"\[mix_src\.trainer\.dataset\] .*blocked\.parquet.*: 32 rows; 14 with a target; 18 empty/non-string", runs["log"])
