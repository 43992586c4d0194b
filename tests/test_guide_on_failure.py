"""The guidance-on-failure method, built only as a plugin (recipes/guide_on_failure/guide_on_failure.py):
its rollout policy on scripted generation passes (no Ray), and 2 real training steps through the
entry point with the plugin loaded from its file (Ray, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from verl import DataProto

from e2e import MIX_CPU, run_verl, tiny_overrides
from mix_src.mix_config import mix_config_from_dict
from mix_src.rollout_policy import ROLLOUT_POLICIES, RolloutContext

PLUGIN = Path(__file__).resolve().parents[1] / "recipes" / "guide_on_failure" / "guide_on_failure.py"
N = 4


def scripted_context(solved_first_pass, *, n_prefix=1, has_target=None):
    """A context whose first pass solves the given rows; guided rows always solve. Records every call."""
    calls = []
    rows_total = len(solved_first_pass)

    def generate(ratios, rows=None):
        idx = np.arange(rows_total) if rows is None else np.asarray(rows)
        calls.append((idx.copy(), np.asarray(ratios, dtype=float).copy()))
        guided = np.asarray(ratios) > 0
        acc = np.where(guided, 1.0, np.asarray(solved_first_pass, dtype=float)[idx])
        prefix = torch.zeros(len(idx), 3, dtype=torch.bool)
        prefix[torch.as_tensor(guided), :2] = True
        non_tensors = {"acc": acc, "prefix_ratio": np.asarray(ratios, dtype=float)}
        if not guided.all():  # like the inference server's extra fields: absent when no row was generated
            non_tensors["server_field"] = np.array(["x"] * len(idx), dtype=object)
        return DataProto.from_dict(tensors={"prefix_mask": prefix, "row": torch.as_tensor(idx)}, non_tensors=non_tensors)

    targets = np.ones(rows_total, dtype=bool) if has_target is None else np.asarray(has_target)
    ctx = RolloutContext(
        batch=DataProto.from_dict(tensors={"row": torch.arange(rows_total)}), n=N, global_step=1,
        mix=mix_config_from_dict({"n_prefix": n_prefix, "plugins": [str(PLUGIN)]}), generate=generate,
        prefix_ratios=lambda: np.where(targets & (np.arange(rows_total) % N < max(n_prefix, 0)), 1.0, 0.0)
        if n_prefix != -1 else np.where(targets, 1.0, 0.0),
        rng=np.random.default_rng(0),
    )  # fmt: skip
    return ctx, calls


def test_only_all_fail_groups_get_guided_rows():
    # prompt 0: 1 of 4 solved; prompt 1: none (guided); prompt 2: none but no target (left on-policy)
    solved = [0, 1, 0, 0] + [0, 0, 0, 0] + [0, 0, 0, 0]
    ctx, calls = scripted_context(solved, n_prefix=2, has_target=[True] * 8 + [False] * 4)
    out = ROLLOUT_POLICIES.get("guide_on_failure")(ctx)
    assert len(calls) == 2
    assert calls[0][1].tolist() == [0.0] * 12  # pass 1: on-policy
    assert calls[1][0].tolist() == [4, 5]  # pass 2: the first k=2 samples of prompt 1 only
    assert out.batch["row"].tolist() == list(range(12))  # row order kept
    assert out.batch["prefix_mask"].any(-1).tolist() == [False] * 4 + [True, True, False, False] + [False] * 4
    assert out.non_tensor_batch["acc"].tolist() == solved[:4] + [1, 1, 0, 0] + [0] * 4
    assert out.non_tensor_batch["server_field"].tolist() == ["x"] * 4 + [None, None, "x", "x"] + ["x"] * 4


def test_no_second_pass_when_every_group_has_a_success():
    ctx, calls = scripted_context([1, 0, 0, 0] + [0, 0, 0, 1], n_prefix=-1)
    out = ROLLOUT_POLICIES.get("guide_on_failure")(ctx)
    assert len(calls) == 1 and not out.batch["prefix_mask"].any()


@pytest.mark.ray
def test_guide_on_failure_plugin_trains_two_steps(tiny_assets, tmp_path):
    """The random tiny model fails every prompt, so every group gets k=1 guided row (the whole target)."""
    overrides = MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=N, batch_size=4, response_length=24) + [
        f"mix.plugins=[{PLUGIN}]", "mix.rollout_policy=guide_on_failure", "mix.n_prefix=1",
        "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0", "mix.loss.loss_remove_clip=true",
    ]  # fmt: skip
    result = run_verl("mix_src.main_mix_ppo", overrides, tmp_path, timeout=420)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        if m["batch/on_solved"] == 0:  # all on-policy samples failed: one guided row per prompt
            assert m["batch/off_policy_rows"] == 4 and m["batch/avg_prefix_ratio"] == pytest.approx(0.25)
        assert m["batch/off_solved"] in (0.0, 1.0) and m["actor/grad_norm"] >= 0
    assert any(m["batch/off_policy_rows"] > 0 and m["actor/grad_norm"] > 0 for m in result.metrics)
