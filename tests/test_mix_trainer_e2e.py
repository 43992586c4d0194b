"""MIX trainer end to end on CPU: real verl trainer, workers, Ray and agent loop on the tiny assets.

The runs the tests only read metrics from train in the legacy batch (tests/e2e.py ``batch_run``: one process and
one Ray cluster for several tests' runs, tests/conftest.py ``legacy_batch``); the failure paths are each
``python -m mix_src.main_mix_ppo +backend=cpu ...`` in its own process tree and Ray cluster (tests/e2e.py). About a
minute each, mostly start-up.
"""

from __future__ import annotations

import math

import pytest

from e2e import (MIX_CPU, PARTIAL_PREFIX_CKPT, batch_result, batch_run, partial_prefix_overrides,
                 partial_prefix_saved, run_verl, tiny_overrides)  # fmt: skip

pytestmark = pytest.mark.ray

MIX = "mix_src.main_mix_ppo"
HERE = "test_mix_trainer_e2e.py::"


def mix_overrides(tiny_assets, *extra, steps=2, n=4, batch_size=4) -> list[str]:
    sizes = tiny_overrides(tiny_assets, steps=steps, n=n, batch_size=batch_size, response_length=24)
    return MIX_CPU + sizes + list(extra)


def mix_run(tiny_assets, tmp_path, *extra, steps=2, name="run", check=True, timeout=420):
    return run_verl(MIX, mix_overrides(tiny_assets, *extra, steps=steps), tmp_path, timeout=timeout, name=name,
                    check=check)  # fmt: skip


def full_target(assets, batch_dir) -> list[str]:
    return mix_overrides(assets, "mix.n_prefix=1", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0",
                         "algorithm.adv_estimator=grpo_split", "mix.loss.loss_remove_clip=true")  # fmt: skip


def partial_prefix_resumed(assets, batch_dir) -> list[str]:
    """Resumed from step 1 of the batch's ``partial_prefix`` run (which trains before it, in the same batch)."""
    step1 = batch_dir / PARTIAL_PREFIX_CKPT / "global_step_1"
    return partial_prefix_overrides(assets, f"trainer.default_local_dir={batch_dir / 'partial_prefix_resumed_ckpt'}",
                                    "trainer.save_freq=-1", "trainer.resume_mode=resume_path",
                                    f"trainer.resume_from_path={step1}")  # fmt: skip


def filter_groups(assets, batch_dir) -> list[str]:
    return mix_overrides(assets, "mix.n_prefix=1", "mix.data.sample_target_ratio=0.5",
                         "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                         "algorithm.filter_groups.max_num_gen_batches=10",
                         "mix.filter_groups.carry_over=true")  # fmt: skip


FULL_TARGET = batch_run("legacy", "full_target", full_target, [HERE + "test_luffy_full_target_grpo_split"])
PARTIAL = batch_run("legacy", "partial_prefix", partial_prefix_saved,
                    [HERE + "test_partial_prefixes_and_resume_draw_the_same_ratios"])  # fmt: skip
RESUMED = batch_run("legacy", "partial_prefix_resumed", partial_prefix_resumed,
                    [HERE + "test_partial_prefixes_and_resume_draw_the_same_ratios"])  # fmt: skip
FILTER_GROUPS = batch_run("legacy", "filter_groups", filter_groups,
                          [HERE + "test_filter_groups_accumulate_generation_batches"])  # fmt: skip


def test_luffy_full_target_grpo_split(legacy_batch):
    """LUFFY's main setting: 1 of n=4 rows is the whole target + EOS; grpo_split; shaped off-policy loss."""
    result = batch_result(legacy_batch, FULL_TARGET)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert m["batch/avg_prefix_ratio"] == pytest.approx(0.25)
        assert m["batch/off_policy_rows"] == 4  # one per prompt
        assert m["batch/off_solved"] == 1.0  # the expert solutions are graded correct
        for key in ("actor/off_policy_prob", "actor/on_policy_prob", "actor/pg_loss", "actor/grad_norm"):
            assert key in m and math.isfinite(m[key]), key
        assert 0.0 < m["actor/off_policy_prob"] < 1.0 and 0.0 < m["actor/on_policy_prob"] < 1.0
        assert m["actor/grad_norm"] > 0  # the update moved the parameters
        assert m["training/rollout_probs_diff_mean"] < 0.05  # on-policy tokens only


def test_partial_prefixes_and_resume_draw_the_same_ratios(legacy_batch):
    """Random ratios in [0.3, 0.7] for 2 of 4 rows; a run resumed from step 1 draws what an uninterrupted one drew
    and continues its learned entropy coefficient (checkpointed with the trainer's state).

    The uninterrupted run, which saves every step, is the legacy batch's ``partial_prefix``
    (``e2e.PARTIAL_PREFIX_LUFFY``, read by tests/test_bases_equivalence.py too); the resumed run, next in the batch,
    starts from its step-1 checkpoint."""
    full = batch_result(legacy_batch, PARTIAL)
    ratios = full.series("batch/avg_prefix_ratio")
    assert len(ratios) == 2 and ratios[0] != ratios[1]
    assert all(0.3 * 2 / 4 <= r <= 0.7 * 2 / 4 for r in ratios)  # 2 of 4 rows prefixed, U(0.3, 0.7) each
    for m in full.metrics:
        assert 0 < m["batch/prefix_token_frac"] < 1 and "actor/off_pg_loss" in m

    resumed = batch_result(legacy_batch, RESUMED)
    assert [m["step"] for m in resumed.metrics] == [2]  # resumed at step 2
    assert resumed.series("batch/avg_prefix_ratio") == ratios[1:]
    coefs = full.series("actor/entropy_coeff")  # the coefficient each step's loss used
    assert coefs[0] == pytest.approx(0.01) and coefs[1] != pytest.approx(0.01)
    assert resumed.series("actor/entropy_coeff") == pytest.approx(coefs[1:], rel=1e-9)
    assert not any("mix_entropy_state" in k for m in full.metrics for k in m)  # state is not logged


def test_filter_groups_accumulate_generation_batches(legacy_batch):
    """Half the prompts have no target -> their groups all score 0 and are dropped; the trainer keeps
    generating until 4 groups are kept, trains on exactly 4, and carries the surplus."""
    result = batch_result(legacy_batch, FILTER_GROUPS)
    gen_batches = result.series("train/num_gen_batches")
    assert len(gen_batches) == 2 and max(gen_batches) >= 2
    assert result.series("train/num_kept_prompts") == [4, 4]
    assert all(0 < r < 1 for r in result.series("train/filter_rate"))
    step1, step2 = result.metrics
    assert step2["train/num_carried_prompts"] == step1["train/num_surplus_carried"] > 0
    for m in result.metrics:  # kept groups: mostly those with an (always solved) expert row
        assert m["batch/off_solved"] == 1.0 and 0 < m["batch/avg_prefix_ratio"] <= 0.25


def test_filter_groups_error_says_what_to_change(tiny_assets, tmp_path):
    """No prefixes and a random model: every group scores 0, nothing is kept, the run stops with advice."""
    result = mix_run(
        tiny_assets, tmp_path,
        "mix.n_prefix=0", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=2",
        steps=1, check=False,
    )  # fmt: skip
    log = result.log_path.read_text()
    assert result.returncode != 0
    assert "after 2 generation batches (algorithm.filter_groups.max_num_gen_batches=2)" in log
    assert "Raise algorithm.filter_groups.max_num_gen_batches" in log


def test_bad_mix_key_fails_before_ray(tiny_assets, tmp_path):
    result = mix_run(tiny_assets, tmp_path, "+mix.n_prefixx=1", check=False, timeout=120)
    log = result.log_path.read_text()
    assert result.returncode != 0 and "unknown key(s) ['mix.n_prefixx']" in log
    assert "ray init kwargs" not in log and "Started a local Ray instance" not in log
