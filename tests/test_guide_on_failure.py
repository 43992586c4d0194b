"""The guidance-on-failure method, built only as a plugin (recipes/guide_on_failure/guide_on_failure.py):
its rollout policy on scripted generation passes (no Ray). Its 2 real training steps through the entry point,
the plugin loaded from its file (Ray, CPU), share a run with tests/test_plugins.py's plugin
(``test_plugins_train_two_steps_with_guide_on_failure``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from verl import DataProto

from mix_src.config.mix_config import mix_config_from_dict
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES, RolloutContext

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
