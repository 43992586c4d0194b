"""DAPO-style filter groups, pure numpy: which groups to keep (a registry of rules), and the bookkeeping
of accumulating kept groups over generation batches (with optional carry-over of the surplus).

A group is all rows of one prompt (same `uid`). A rule (``mix.filter_groups.rule``) decides from the per-group
statistics of the metric; equality is exact (a float tolerance would keep or drop groups depending on rounding).
With `row_mask` (``mix.filter_groups.on_policy_only``) only the masked rows decide; a group with none of them
falls back to all its rows, as grpo_split does. The trainer keeps ``filter_groups(uids, acc).keep_rows`` of each
generation batch after the carried rows, until :func:`plan_train_batch` says ready (mix_src/trainer/legacy_collect.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mix_src.extend import Registry

__all__ = ["GROUP_FILTERS", "GroupFilterResult", "GroupStats", "TrainBatchPlan", "filter_groups", "plan_train_batch",
           "register_group_filter"]


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics of the deciding rows' metric, each (G,) in order of first appearance:
    count (rows), mean, std (population, ddof=0; exactly 0 when all values are equal), min, max."""

    count: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray


GroupFilter = Callable[[GroupStats], np.ndarray]  # fn(stats) -> (G,) bool, True = keep the group
GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter", "mix.filter_groups.rule")
register_group_filter = GROUP_FILTERS.register


@register_group_filter("nonzero_std")
def _nonzero_std(stats: GroupStats) -> np.ndarray:
    """DAPO: keep groups whose values differ (exactly), and single-row groups."""
    return (stats.max != stats.min) | (stats.count == 1)


def _group_ids(index: Any) -> tuple[np.ndarray, np.ndarray]:
    """index: (B,) group ids -> (unique ids in order of first appearance (G,), (B,) position of each
    row's group in that order)."""
    ids = np.asarray(index).reshape(-1)
    uniques, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # groups in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return uniques[order], rank[inverse.reshape(-1)]


@dataclass(frozen=True)
class GroupFilterResult:
    """What filter_groups decided."""

    keep_rows: np.ndarray  # (B,) bool
    kept_groups: np.ndarray  # ids of the kept groups, in order of first appearance
    num_groups: int
    num_kept: int
    num_filtered: int
    filter_rate: float  # num_filtered / num_groups (0 without groups)
    mean_std: float  # mean over all groups of the deciding rows' population std (ddof=0, as DAPO)


def filter_groups(index: Any, values: Any, row_mask: Any = None, rule: str = "nonzero_std") -> GroupFilterResult:
    """Decide which groups to keep (vectorised): index (B,) group ids (verl's uid), values (B,) metric per row
    (bool, int or float), row_mask optional (B,) bool (the deciding rows), rule a GROUP_FILTERS name."""
    ids = np.asarray(index).reshape(-1)
    vals = np.asarray(values).reshape(-1)
    if vals.size != ids.size:
        raise ValueError(f"values has {vals.size} entries but index has {ids.size}")
    if ids.size and not (np.issubdtype(vals.dtype, np.number) or vals.dtype == np.bool_):
        raise ValueError(f"values must be numeric or bool, got dtype {vals.dtype}")
    vals = vals.astype(np.float64)
    if np.isnan(vals).any():
        raise ValueError("values contain NaN; a group's spread is undefined")
    groups, gid = _group_ids(ids)
    num_groups = groups.size

    deciding = np.ones(ids.size, dtype=bool)
    if row_mask is not None:
        mask = np.asarray(row_mask, dtype=bool).reshape(-1)
        if mask.size != ids.size:
            raise ValueError(f"row_mask has {mask.size} entries but index has {ids.size}")
        has_masked = np.bincount(gid, weights=mask, minlength=num_groups) > 0
        deciding = mask | ~has_masked[gid]

    count = np.bincount(gid, weights=deciding, minlength=num_groups)
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, gid[deciding], vals[deciding])
    np.minimum.at(gmin, gid[deciding], vals[deciding])
    mean = np.bincount(gid, weights=np.where(deciding, vals, 0.0), minlength=num_groups) / np.maximum(count, 1)
    sq_dev = np.where(deciding, (vals - mean[gid]) ** 2, 0.0)
    std = np.sqrt(np.bincount(gid, weights=sq_dev, minlength=num_groups) / np.maximum(count, 1))
    std[gmax == gmin] = 0.0  # exactly equal values: exactly 0 (no rounding residue)

    keep_group = np.asarray(GROUP_FILTERS.get(rule)(GroupStats(count, mean, std, gmin, gmax)), dtype=bool)
    if keep_group.shape != (num_groups,):
        raise ValueError(f"group filter {rule!r} returned shape {keep_group.shape}, expected ({num_groups},)")
    num_kept = int(keep_group.sum())
    return GroupFilterResult(keep_group[gid], groups[keep_group], int(num_groups), num_kept, int(num_groups - num_kept),
                             float((num_groups - num_kept) / num_groups) if num_groups else 0.0,
                             float(std.mean()) if num_groups else 0.0)  # fmt: skip


@dataclass(frozen=True)
class TrainBatchPlan:
    """What plan_train_batch decided."""

    ready: bool  # enough groups to train
    train_rows: np.ndarray  # ascending indices of the pending rows to train on now
    carry_rows: np.ndarray  # ... to keep for the next step
    num_groups: int  # groups pending
    num_dropped_groups: int  # surplus groups discarded (carry_over=False)


def plan_train_batch(index: Any, target_groups: int, carry_over: bool) -> TrainBatchPlan:
    """What to train on now, from the pending kept rows' group ids index (P,) (carried rows first, then each
    generation batch's kept rows): not ready while fewer than target_groups (data.train_batch_size) groups are
    pending; else the rows of the first target_groups groups, and the rest carried (carry_over) or dropped (DAPO)."""
    if target_groups < 1:
        raise ValueError(f"target_groups must be >= 1, got {target_groups}")
    ids = np.asarray(index).reshape(-1)
    empty = np.zeros(0, dtype=np.int64)
    groups, gid = _group_ids(ids)
    if groups.size < target_groups:  # no rows pending included
        return TrainBatchPlan(False, empty, empty, int(groups.size), 0)
    train = gid < target_groups
    rows = np.arange(ids.size)
    surplus = int(groups.size - target_groups)
    return TrainBatchPlan(True, rows[train], rows[~train] if carry_over else empty, int(groups.size),
                          0 if carry_over else surplus)
