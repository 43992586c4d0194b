"""Rollout policies (``mix.rollout_policy=name``): how the generate stage turns one batch of prompts into ``n``
scored rows each: ``prefix_guided`` (LUFFY) in one pass, or several passes choosing rows from each (e.g.
recipes/guide_on_failure). Signature (one for all)::

    @register_rollout_policy("name")
    def fn(ctx: RolloutContext) -> DataProto     # len(ctx.batch) rows, in the order i*n + j

The returned rows must be scored rows as ``ctx.generate`` returns them (one per input row, same order);
:func:`replace_rows` merges a second pass into a first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from mix_src.extend import Registry

__all__ = ["ROLLOUT_POLICIES", "RolloutContext", "register_rollout_policy", "replace_rows", "solved"]


@dataclass
class RolloutContext:
    """What a rollout policy gets for one generation batch.

    batch: the prompts repeated n times (a read-only DataProto of B = num_prompts * n rows, row i*n + j = sample j
        of prompt i; ``non_tensor_batch["uid"]``: the prompt's group id; on V1 only the ``uid`` and ``target`` columns).
    n: samples per prompt (rollout.n). global_step: the trainer's step (from 1). mix: the MixConfig.
    generate(ratios, rows=None, targets=None, prompts=None) -> DataProto: generate the rows ``rows`` (int
        array; None = all B) with one prefix ratio each (ratios: float array of len(rows), 0 = on-policy) and
        score them; the result has the rows' tensors, ``prefix_mask`` (rows, response_len), ``response_mask``,
        ``token_level_scores`` and the reward's extra keys (e.g. ``acc``). ``targets`` (strings, one per
        row) replace the rows' off-policy targets for this pass (e.g. a replayed sample of the model's
        own). ``prompts`` (a DataProto from ``records``, possibly of an earlier step; then ``rows`` must be
        None) generates for those prompt rows instead of this batch's (new rollout seeds).
    records(rows) -> DataProto: self-contained copies of the rows ``rows`` (prompt, reward keys, target),
        to keep (e.g. in ``state``) and pass to ``generate(prompts=...)`` later.
    state: the policy's own dict, kept across steps and saved with the checkpoint (``mix_state.pt``); picklable.
    tokenizer: the trainer's tokenizer (e.g. to turn recorded token ids back into a target string).
    prefix_ratios() -> (B,) float array: the configured strategy's ratios for this batch (seeded from
        (seed, global_step, gen batch); 0 for rows without a target).
    rng: a generator seeded like the ratios, for the policy's own draws.
    entropy(rows) -> (rows, response_len) float tensor: per-token entropy of rows that ``generate`` returned,
        under the current actor (verl's old-log-prob pass with ``calculate_entropy``); None where the trainer
        base offers none (V1).
    metrics: the policy's per-step metrics ({name: float}), logged with the step's metrics on both bases (a step of
        several generation batches logs each name's mean over them).
    """

    batch: Any
    n: int
    global_step: int
    mix: Any
    generate: Callable[..., Any]
    prefix_ratios: Callable[[], np.ndarray]
    rng: np.random.Generator
    records: Optional[Callable[..., Any]] = None
    state: dict = field(default_factory=dict)
    tokenizer: Any = None
    entropy: Optional[Callable[..., Any]] = None
    metrics: dict = field(default_factory=dict)


RolloutPolicy = Callable[[RolloutContext], Any]
ROLLOUT_POLICIES: Registry[RolloutPolicy] = Registry("rollout policy", "mix.rollout_policy")


#: ``@register_rollout_policy("name", **entry)`` (:meth:`mix_src.extend.Registry.register`): runs on both bases (on V1
#: pass by pass, unless the entry says ``v1_stream=True``, see :func:`streams_on_v1`).
register_rollout_policy = ROLLOUT_POLICIES.register


def streams_on_v1(policy: str) -> bool:
    """Whether the V1 trainer streams ``policy`` through verl's agent loop (its entry says ``v1_stream=True``: one
    pass, ratios drawn per session) rather than running it pass by pass (:mod:`mix_src.trainer.rollout_policy_v1`)."""
    return bool(ROLLOUT_POLICIES.options(policy).get("v1_stream", False))


@register_rollout_policy("prefix_guided", v1_stream=True)
def prefix_guided(ctx: RolloutContext):
    """LUFFY: one pass, each row with its ratio from mix.prefix_strategy (ratio 0 = on-policy row)."""
    return ctx.generate(ctx.prefix_ratios())


def replace_rows(first, rows: np.ndarray, second):
    """``first`` (B rows) with rows ``rows`` replaced, in order, by the rows of ``second``. A per-row field only one
    pass has is None on the other pass's rows, as verl's agent loop fills it within one batch."""
    from verl import DataProto

    rows = np.asarray(rows, dtype=np.int64)
    if len(rows) != len(second):
        raise ValueError(f"replace_rows: {len(rows)} row indices for {len(second)} new rows")
    if len(rows) == 0:
        return first
    a_keys, b_keys = set(first.batch.keys()), set(second.batch.keys())
    if a_keys != b_keys:
        raise ValueError(f"replace_rows: the passes have different tensors: {sorted(a_keys ^ b_keys)}")
    parts = []
    for part, other in ((first, second), (second, first)):
        missing = other.non_tensor_batch.keys() - part.non_tensor_batch.keys()
        non_tensor = {**part.non_tensor_batch, **{key: np.full(len(part), None, dtype=object) for key in missing}}
        parts.append(DataProto(batch=part.batch, non_tensor_batch=non_tensor, meta_info=part.meta_info))
    order = np.arange(len(first))
    order[rows] = len(first) + np.arange(len(rows))
    return DataProto.concat(parts)[order]


def solved(batch) -> np.ndarray:
    """(rows,) bool: :func:`mix_src.trainer.stages.solved_rows` of a scored DataProto."""
    from mix_src.trainer.stages import solved_rows  # lazily: stages imports torch and verl's estimators

    return solved_rows(batch.non_tensor_batch.get("acc"), lambda: batch.batch["token_level_scores"].sum(-1).numpy())


def group_all_failed(batch, n: int, rows_solved: Optional[np.ndarray] = None) -> np.ndarray:
    """(num_prompts,) bool: prompts none of whose n rows (i*n .. i*n + n-1) solved the task (``rows_solved``: a
    plugin's own (bsz,) bool, else :func:`solved`)."""
    return ~(solved(batch) if rows_solved is None else rows_solved).reshape(-1, n).any(axis=1)
