"""A ``target_lst`` file trains 2 steps on both trainer bases with per-row draws (issue #55 item 1), as opt-in runs of
the legacy and V1 batches
(tests/conftest.py ``legacy_batch``, ``v1_batch``: one process and one Ray cluster for several test files' runs).

The tiny train file, read in order (``data.shuffle=false``), with ``target_lst`` = three correct demonstrations of
different lengths on even rows and an empty list on odd rows (those keep their ``target`` alone); ``n=4`` rows a
prompt, ``n_prefix=2`` whole-demonstration rows. Each step's 4 prompts: 2 with 3 demonstrations (2 distinct draws)
and 2 with 1 (one repeated row each): ``batch/target_lst_repeated_rows == 2``, ``batch/target_lst_mean_size == 2``
(``target`` joins its own list first: 3 demonstrations, not 4). Every off-policy row is a whole correct
demonstration, so ``batch/off_solved == 1``. Real verl trainer, workers, Ray and agent loop on the tiny assets."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from e2e import MIX_CPU, batch_result, batch_run, tiny_overrides

# opt-in (make test-extra): #55's 3-minute budget keeps CI to tests/test_prefix_rl_e2e.py's two runs, which train a
# target_lst file on both bases too (one shared draw per prompt); these add the per-row distinct draws
pytestmark = [pytest.mark.ray, pytest.mark.extra]

LUFFY = ["mix.n_prefix=2", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0", "algorithm.adv_estimator=grpo_split",
         "mix.data.use_target_lst=true"]  # fmt: skip


def _lst_file(assets: dict, path: Path) -> Path:
    df = pd.read_parquet(assets["train"])
    lists = []
    for i, target in enumerate(df["target"]):
        text, answer = target[0]["content"], df["reward_model"][i]["ground_truth"]
        lists.append([text, f"<think></think> \\boxed{{{answer}}}", f"<think>{answer}</think> \\boxed{{{answer}}}"] if i % 2 == 0 else [])
    df["target_lst"] = lists
    df.to_parquet(path)
    return path


def _base(assets: dict, batch_dir: Path) -> list[str]:
    return [*MIX_CPU, *tiny_overrides(assets, steps=2, n=4, batch_size=4, response_length=24), *LUFFY,
            f"data.train_files={_lst_file(assets, batch_dir / 'target_lst.parquet')}", "data.shuffle=false"]


def legacy_run(assets: dict, batch_dir: Path) -> list[str]:
    return _base(assets, batch_dir)


def v1_run(assets: dict, batch_dir: Path) -> list[str]:
    return [*_base(assets, batch_dir), "trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]


HERE = "test_target_lst_e2e.py::"
LEGACY = batch_run("legacy", "target_lst", legacy_run, [HERE + "test_target_lst_trains_two_steps_legacy"])
V1_RUN = batch_run("v1", "target_lst_v1", v1_run, [HERE + "test_target_lst_trains_two_steps_v1"])


def _check(run) -> None:
    metrics = run.metrics
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["batch/target_lst_repeated_rows"] == 2 and m["batch/target_lst_mean_size"] == 2.0
        assert m["batch/off_policy_rows"] == 8 and m["batch/off_solved"] == 1.0
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/off_pg_loss"):
            assert key in m and math.isfinite(m[key]), (key, m.get(key))
    log = run.log_path.read_text(errors="replace")
    assert "target_lst: 64 demonstrations in 32 rows (target first when present), left out: 16 null, empty" in log
    assert "target_lst (target_lst, target first, at most mix.data.max_num_targets=5): 64 demonstrations" in log


def test_target_lst_trains_two_steps_legacy(legacy_batch):
    _check(batch_result(legacy_batch, LEGACY))


def test_target_lst_trains_two_steps_v1(v1_batch):
    _check(batch_result(v1_batch, V1_RUN))
