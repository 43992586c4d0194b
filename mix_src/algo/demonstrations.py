"""Several demonstrations per prompt (``mix.data.use_target_lst``): which one each row of a group starts from.

A prompt with ``m`` demonstrations (``target`` first, then ``target_lst``: mix_src/config/data_check.py
``demonstrations``) and ``n`` rows, ``k`` of them prefixed (``k = n`` for ``n_prefix = -1``, else ``min(n_prefix,
n)``): one seeded permutation ``π`` of the ``m`` demonstrations per prompt, and row ``j`` takes ``π[j mod m]``. So the
prefixed rows draw distinct demonstrations whenever ``m >= k``; only when ``m < k`` do ``k - m`` of them repeat one
(a cycle through ``π``, each demonstration used ``⌊k/m⌋`` or ``⌈k/m⌉`` times; counted). Rows past ``k`` (on-policy
rows, which a rollout policy may still guide later) continue the cycle. With one prefix per group
(``mix.prefix_share_across_samples``) every row takes ``π[0]``: one demonstration per prompt. LUFFY's dataset loaded the list but never drew
from it (luffy/verl/verl/mix_src/rl_dataset_with_target.py:159-170; its ``use_target_lst`` is read nowhere), so
this rule is ours. Pure numpy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["draw_demonstration_indices", "draw_row_targets"]


def draw_demonstration_indices(set_sizes: Sequence[int], n: int, n_prefix: int, rng: np.random.Generator,
                               shared: bool = False) -> tuple[np.ndarray, int]:
    """(num_prompts * n,) int64: the demonstration index of each row ``i*n + j`` into prompt i's list (-1 where the
    prompt has none), and the number of prefixed rows that repeat a demonstration of their group (``sum max(0, k - m)``
    over prompts with ``m >= 1``). ``set_sizes``: (num_prompts,) ``m``; ``rng``: the draw's seeded generator (one
    permutation per prompt with ``m >= 2``, in prompt order). ``shared`` (``mix.prefix_share_across_samples``: one
    prefix for the whole group, PrefixRL's prefixed problem): every row takes ``π[0]``, and none counts as repeated."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    k = n if n_prefix == -1 else min(max(int(n_prefix), 0), n)
    out = np.full((len(set_sizes), n), -1, dtype=np.int64)
    repeated = 0
    for i, m in enumerate(int(s) for s in set_sizes):
        if m < 1:
            continue
        order = rng.permutation(m) if m > 1 else np.zeros(1, dtype=np.int64)
        out[i] = order[0] if shared else order[np.arange(n) % m]
        repeated += 0 if shared else max(0, k - m)
    return out.reshape(-1), repeated


def draw_row_targets(target_sets: Sequence[Sequence[str]], n: int, n_prefix: int, rng: np.random.Generator,
                     shared: bool = False) -> tuple[np.ndarray, int]:
    """(num_prompts * n,) object array: each row's demonstration (``""`` where the prompt has none), rows ``i*n + j``,
    and the count of repeated prefixed rows (:func:`draw_demonstration_indices`). ``target_sets``: (num_prompts,)
    lists of strings (a numpy array of lists as verl's collate gives is fine)."""
    sets = [list(s) if s is not None else [] for s in target_sets]
    idx, repeated = draw_demonstration_indices([len(s) for s in sets], n, n_prefix, rng, shared)
    rows = np.empty(len(idx), dtype=object)
    for r, d in enumerate(idx):
        rows[r] = sets[r // n][d] if d >= 0 else ""
    return rows, repeated
