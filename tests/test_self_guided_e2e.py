"""The rollout policy ``self_guided`` (issue #55 item 3) trains 2 steps on both trainer bases, as opt-in runs of the
legacy and V1 batches (``make test-extra``: over the issue's test-time budget). The reward is 1 when the response's
length is a multiple of 4 (the random tiny model earns it about a quarter of the time) and the file has 4 prompts,
one batch: step 1 stores successes, and a group of step 2 that fails is guided from its own stored ones. The pool's rules, the policy on scripted passes and its exact restore
from ``mix_state.pt``: tests/test_self_guided.py (no Ray)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from e2e import MIX_CPU, batch_result, batch_run, tiny_overrides

QUARTER_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    score = float(len(solution_str) % 4 == 0)
    return {"score": score, "acc": score}
"""

pytestmark = [pytest.mark.ray, pytest.mark.extra]  # opt-in: #55's new tests keep to their 3-minute budget in CI

SELF = ["mix.rollout_policy=self_guided", "mix.n_prefix=2", "mix.min_prefix_ratio=0.5", "mix.max_prefix_ratio=0.5",
        "algorithm.adv_estimator=grpo", "+mix.plugin_options.self_guided.per_prompt=2"]  # fmt: skip


def _run(assets: dict, batch_dir: Path, *extra: str) -> list[str]:
    reward = batch_dir / "quarter_reward_self.py"
    reward.write_text(QUARTER_REWARD)
    data = batch_dir / "four_prompts.parquet"  # one batch is the whole file: step 2 sees step 1's prompts again
    pd.read_parquet(assets["train"]).head(4).to_parquet(data)
    sizes = tiny_overrides(assets, steps=2, n=4, batch_size=4, response_length=24,
                           reward=[f"reward.custom_reward_function.path={reward}",
                                   "reward.custom_reward_function.name=compute_score"])  # fmt: skip
    return [*MIX_CPU, *sizes, *SELF, f"data.train_files={data}", "data.shuffle=false", "trainer.total_epochs=2", *extra]


HERE = "test_self_guided_e2e.py::"
LEGACY = batch_run("legacy", "self_guided", lambda a, d: _run(a, d), [HERE + "test_self_guided_trains_two_steps_legacy"])
V1_RUN = batch_run("v1", "self_guided_v1", lambda a, d: _run(a, d, "trainer.use_v1=true", "trainer.v1.trainer_mode=sync"),
                   [HERE + "test_self_guided_trains_two_steps_v1"])


def _check(run) -> None:
    metrics = run.metrics
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["rollout_policy/self_pool_size"] > 0  # the reward's successes were stored
    for m in metrics:
        assert math.isfinite(m["actor/pg_loss"])
        # a guided prompt regenerates n_prefix=2 rows from its stored successes
        assert m["batch/off_policy_rows"] == 2 * m["rollout_policy/self_guided_prompts"]


def test_self_guided_trains_two_steps_legacy(legacy_batch):
    _check(batch_result(legacy_batch, LEGACY))


def test_self_guided_trains_two_steps_v1(v1_batch):
    _check(batch_result(v1_batch, V1_RUN))
