"""Steps without off-policy rows, and micro-batches with only off-policy rows, train (issue #41 item 6) on both
trainer bases: ``mix.data.sample_target_ratio=0`` (documented "on-policy only"; it raised IndexError in
mix_src/dataset.py before) on both bases, and a file whose targets are null for half the prompts with
one-row micro-batches and one-prompt mini-batches on the V1 base (LUFFY issue #24 saw NaN in such batches).
Real verl trainer, workers, Ray and agent loop on the tiny assets (tests/e2e.py); about a minute each."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from e2e import MIX_CPU, run_verl, tiny_overrides

pytestmark = pytest.mark.ray

LUFFY = ["mix.n_prefix=1", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0", "algorithm.adv_estimator=grpo_split"]
ONE_ROW_MICRO = [f"actor_rollout_ref.{k}=1" for k in ("actor.ppo_micro_batch_size_per_gpu",
                                                       "rollout.log_prob_micro_batch_size_per_gpu",
                                                       "ref.log_prob_micro_batch_size_per_gpu")]


def _finite(m: dict) -> None:
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/on_policy_prob"):
        assert key in m and math.isfinite(m[key]), (key, m.get(key))


@pytest.mark.parametrize("base", [[], ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]], ids=["legacy", "v1"])
def test_sample_target_ratio_zero_trains_on_policy_only(tiny_assets, tmp_path, base):
    overrides = MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=4, batch_size=4, response_length=24) + base
    result = run_verl("mix_src.main_mix_ppo", overrides + LUFFY + ONE_ROW_MICRO + ["mix.data.sample_target_ratio=0.0"],
                      tmp_path, timeout=420)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert m["batch/off_policy_rows"] == 0 and m["batch/off_solved"] == 0.0 and m["batch/avg_prefix_ratio"] == 0
        _finite(m)
    assert "0 with a target" in result.log_path.read_text()


def test_half_null_targets_one_row_micro_batches_v1(tiny_assets, tmp_path):
    df = pd.read_parquet(tiny_assets["train"])
    df["target"] = [t if i % 2 == 0 else None for i, t in enumerate(df["target"])]
    train = tmp_path / "half_null.parquet"
    df.to_parquet(train)
    overrides = MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=2, batch_size=4, response_length=24)
    overrides += LUFFY + ONE_ROW_MICRO + [f"data.train_files={train}", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                          "trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]
    result = run_verl("mix_src.main_mix_ppo", overrides, tmp_path, timeout=420)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert 0 <= m["batch/off_policy_rows"] <= 4
        # off_solved: the expert rows are graded correct; 0.0 when a step drew only null-target prompts
        assert m["batch/off_solved"] == (1.0 if m["batch/off_policy_rows"] else 0.0)
        _finite(m)
    assert sum(m["batch/off_policy_rows"] for m in result.metrics) > 0
