"""Rollout policy ``self_guided`` (issue #55 item 3): the model's own verified responses guide later steps of prompts
whose groups fail (PrefixRL, arXiv 2601.18795, conditions on prefixes of successful traces, sourced from the model
itself). One policy, so one stage on both trainer bases (mix_src/trainer/rollout_policy.py; V1 runs it pass by pass).

Per generation batch:

1. pass 1: every row on-policy (ratio 0);
2. the solved rows' responses (decoded, EOS dropped) join the pool of their prompt (mix_src/algo/self_pool.py:
   ``per_prompt`` / ``total`` caps), keyed by a hash of the prompt's token ids; the pool lives in
   ``RolloutContext.state`` and so in ``mix_state.pt``, restored exactly on resume (a resumed run's step equals the
   uninterrupted run's on both bases: tests/test_self_guided_resume.py);
3. a prompt whose ``n`` rows all failed and whose pool holds entries: rows ``0 .. k-1`` (``k = mix.n_prefix``, -1 = n)
   are generated again, each from a prefix of a stored success (distinct ones while they last:
   mix_src/algo/demonstrations.py ``draw_row_targets``, seeded from ``ctx.rng``) with the ratio of
   ``mix.prefix_strategy`` (its draw for rows that have a dataset target, else ``max_prefix_ratio``); the new rows
   replace the failed ones. A failing prompt with no stored success gets **no guidance** (counted).

Metrics (``rollout_policy/*``): ``self_pool_size``, ``self_pool_added``, ``self_guided_prompts``,
``self_failed_no_trace``. Settings: ``mix.plugin_options.self_guided.{per_prompt, total}``.
"""

from __future__ import annotations

import hashlib

import numpy as np

from mix_src.algo.demonstrations import draw_row_targets
from mix_src.algo.self_pool import pool_add, pool_entries, pool_size
from mix_src.extend import integer
from mix_src.trainer.rollout_policy import (ROLLOUT_POLICIES, RolloutContext, group_all_failed, register_rollout_policy,
                                            replace_rows, solved)

NAME = "self_guided"
STATE_KEY = "self_pool"
SETTINGS = {"per_prompt": integer(4, 1), "total": integer(100_000, 1)}


def prompt_key(rows, row: int) -> str:
    """A prompt's identity across steps: a hash of its token ids (the generated row's ``prompts``)."""
    ids = rows.batch["prompts"][row]
    mask = rows.batch["attention_mask"][row, : ids.shape[-1]].bool()
    return hashlib.sha1(ids[mask].numpy().astype(np.int64).tobytes()).hexdigest()


def response_text(tokenizer, rows, row: int) -> str:
    """The row's response (its response_mask's tokens, a trailing EOS dropped) as a target string."""
    ids = rows.batch["responses"][row][rows.batch["response_mask"][row].bool()].tolist()
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


@register_rollout_policy(NAME, settings=SETTINGS,
                         reads=tuple(f"mix.plugin_options.{NAME}.{k}" for k in SETTINGS) + ("mix.n_prefix",))
def self_guided(ctx: RolloutContext):
    n, opts = ctx.n, ROLLOUT_POLICIES.settings(NAME, ctx.mix.plugin_options.get(NAME))
    pool = ctx.state.setdefault(STATE_KEY, {})
    first = ctx.generate(np.zeros(len(ctx.batch)))  # pass 1: on-policy
    ok = solved(first)
    keys = [prompt_key(first, g * n) for g in range(len(first) // n)]
    added = 0
    for g, key in enumerate(keys):
        wins = [response_text(ctx.tokenizer, first, g * n + j) for j in range(n) if ok[g * n + j]]
        added += pool_add(pool, key, wins, int(opts["per_prompt"]), int(opts["total"])) if wins else 0
    failed = group_all_failed(first, n, ok)
    guided = [g for g in np.flatnonzero(failed) if pool_entries(pool, keys[g])]
    ctx.metrics.update({"rollout_policy/self_pool_size": pool_size(pool), "rollout_policy/self_pool_added": added,
                        "rollout_policy/self_guided_prompts": len(guided),
                        "rollout_policy/self_failed_no_trace": int(failed.sum()) - len(guided)})
    k = n if ctx.mix.n_prefix == -1 else min(int(ctx.mix.n_prefix), n)
    if not guided or k == 0:
        return first
    targets, _ = draw_row_targets([pool_entries(pool, keys[g]) for g in guided], n, k, ctx.rng)
    schedule = ctx.prefix_ratios().reshape(-1, n)
    rows, row_targets, ratios = [], [], []
    for i, g in enumerate(guided):
        for j in range(k):
            rows.append(g * n + j)
            row_targets.append(targets[i * n + j])
            ratios.append(schedule[g, j] if schedule[g, j] > 0 else float(ctx.mix.max_prefix_ratio))
    second = ctx.generate(np.asarray(ratios), np.asarray(rows), targets=row_targets)
    return replace_rows(first, np.asarray(rows), second)
