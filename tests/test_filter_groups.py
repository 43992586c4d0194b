"""Tests of mix_src/algo/filter_groups.py: hand-computed cases, a loop reference, on-policy-only decisions,
accumulation / carry-over planning, bad arguments."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from mix_src.algo import filter_groups as fg_mod
from mix_src.algo.filter_groups import filter_groups, plan_train_batch


def test_pure_module_does_not_import_verl():
    source = open(fg_mod.__file__).read()
    assert "import verl" not in source and "from verl" not in source


def test_hand_computed():
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d"], dtype=object)
    values = [1, 1, 1, 0, 1, 1, 0.1, 0.1]
    res = filter_groups(index, values)
    # a: all 1 -> filtered; b: 0/1 -> kept (std 0.5); c: one sample -> kept; d: equal floats -> filtered
    assert res.keep_rows.tolist() == [False, False, False, True, True, True, False, False]
    assert res.kept_groups.tolist() == ["b", "c"]
    assert (res.num_groups, res.num_kept, res.num_filtered) == (4, 2, 2)
    assert res.filter_rate == 0.5
    assert res.mean_std == pytest.approx((0 + 0.5 + 0 + 0) / 4)


def test_exact_equality_not_tolerance():
    res = filter_groups(["a", "a", "b", "b"], [0.3, 0.3 + 1e-15, 0.1 + 0.2, 0.1 + 0.2])
    assert res.keep_rows.tolist() == [True, True, False, False]  # a differs by 1 ulp: kept
    assert filter_groups(["a", "a"], [True, False]).num_kept == 1  # bool metric (acc)


def loop_filter(index, values, row_mask=None):
    members = defaultdict(list)
    for i, g in enumerate(index):
        members[g].append(i)
    keep = np.zeros(len(index), dtype=bool)
    stds = []
    for g, rows in members.items():
        deciding = [i for i in rows if row_mask is None or row_mask[i]] or rows
        vals = [values[i] for i in deciding]
        stds.append(np.std(vals) if len(set(vals)) > 1 else 0.0)
        if len(set(vals)) > 1 or len(deciding) == 1:
            keep[rows] = True
    return keep, float(np.mean(stds)) if stds else 0.0


@pytest.mark.parametrize("use_mask", [False, True])
def test_matches_loop(use_mask):
    rng = np.random.default_rng(0)
    index = rng.integers(0, 40, size=300).astype(str)  # unordered, uneven groups, some of size 1
    values = rng.choice([0.0, 1.0], size=300, p=[0.3, 0.7])
    row_mask = rng.random(300) < 0.6 if use_mask else None
    res = filter_groups(index, values, row_mask)
    keep, mean_std = loop_filter(index, values, row_mask)
    assert np.array_equal(res.keep_rows, keep)
    assert res.mean_std == pytest.approx(mean_std)
    assert res.num_kept == len(set(index[keep])) and 0 < res.num_kept < res.num_groups
    first_seen = list(dict.fromkeys(index[keep]))
    assert res.kept_groups.tolist() == first_seen  # kept groups in order of first appearance


def test_on_policy_only():
    index = ["a", "a", "a", "b", "b", "c", "c", "c", "d", "d"]
    acc = [1, 0, 0, 0, 1, 1, 0, 0, 1, 1]
    on = [False, True, True, False, True, False, False, False, False, False]
    res = filter_groups(index, acc, row_mask=on)
    # a: on-policy rows 0, 0 -> filtered (the off-policy 1 does not count); b: a single on-policy row ->
    # kept; c: no on-policy row -> falls back to all rows 1, 0, 0 -> kept; d: no on-policy row, all rows
    # equal -> filtered
    assert res.keep_rows.tolist() == [False] * 3 + [True] * 5 + [False] * 2
    assert filter_groups(index, acc).keep_rows.tolist() == [True] * 8 + [False] * 2  # without the mask


def test_empty_and_bad_arguments():
    res = filter_groups([], [])
    assert (res.num_groups, res.num_kept, res.filter_rate, res.mean_std) == (0, 0, 0.0, 0.0)
    assert res.keep_rows.shape == (0,)
    with pytest.raises(ValueError, match="values has 1 entries but index has 2"):
        filter_groups(["a", "a"], [1])
    with pytest.raises(ValueError, match="NaN"):
        filter_groups(["a", "a"], [1.0, float("nan")])
    with pytest.raises(ValueError, match="numeric or bool"):
        filter_groups(["a", "a"], ["x", "y"])
    with pytest.raises(ValueError, match="row_mask has 1 entries"):
        filter_groups(["a", "a"], [1, 0], row_mask=[True])


def test_plan_train_batch_accumulates_then_trains_and_carries():
    # pending rows in arrival order: group 7 (carried), then 3 and 9 from one batch, then 5 and 3 again
    pending = np.array([7, 7, 3, 9, 3, 9, 5, 5])
    not_yet = plan_train_batch(pending[:2], target_groups=2, carry_over=True)
    assert not not_yet.ready and not_yet.num_groups == 1 and not_yet.train_rows.size == 0

    plan = plan_train_batch(pending, target_groups=2, carry_over=True)
    assert plan.ready and plan.num_groups == 4
    assert plan.train_rows.tolist() == [0, 1, 2, 4]  # groups 7 and 3, the first two to arrive
    assert plan.carry_rows.tolist() == [3, 5, 6, 7]  # groups 9 and 5 wait for the next step
    assert plan.num_dropped_groups == 0

    dropped = plan_train_batch(pending, target_groups=2, carry_over=False)
    assert dropped.train_rows.tolist() == [0, 1, 2, 4] and dropped.carry_rows.size == 0
    assert dropped.num_dropped_groups == 2

    exact = plan_train_batch(pending, target_groups=4, carry_over=True)
    assert exact.ready and exact.train_rows.tolist() == list(range(8)) and exact.carry_rows.size == 0

    assert not plan_train_batch([], 1, True).ready
    with pytest.raises(ValueError, match="target_groups must be >= 1"):
        plan_train_batch(pending, 0, True)


def test_plan_train_batch_covers_every_row_once():
    rng = np.random.default_rng(3)
    pending = rng.integers(0, 30, size=200)
    plan = plan_train_batch(pending, target_groups=12, carry_over=True)
    rows = np.concatenate([plan.train_rows, plan.carry_rows])
    assert sorted(rows.tolist()) == list(range(200))
    assert len(set(pending[plan.train_rows])) == 12
    assert set(pending[plan.train_rows]).isdisjoint(set(pending[plan.carry_rows]))
