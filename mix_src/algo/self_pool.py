"""Self-sourced traces in a run (issue #55 item 3; PrefixRL, arXiv 2601.18795, guides with the model's own
successes): a pool of the model's verified responses per prompt, at most ``per_prompt`` entries a prompt and
``total`` in all. Plain Python (dicts and lists of strings), so it pickles into ``mix_state.pt`` with the rollout
policy's state and a resumed run restores it exactly.

Rules: a new success of a prompt joins its list unless the same text is there already; past ``per_prompt`` the
prompt's oldest entry leaves; past ``total`` the oldest entry of the whole pool leaves (a global insertion counter
orders them).
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["pool_add", "pool_entries", "pool_size"]


def pool_add(pool: dict, key: str, texts: Iterable[str], per_prompt: int, total: int) -> int:
    """Add prompt ``key``'s verified ``texts`` to ``pool`` (``{"entries": {key: [[seq, text], ...]}, "seq": int}``,
    created empty when missing); returns how many were new."""
    entries, added = pool.setdefault("entries", {}), 0
    pool.setdefault("seq", 0)
    mine = entries.setdefault(key, [])
    for text in texts:
        if not text or any(t == text for _, t in mine):
            continue
        mine.append([pool["seq"], text])
        pool["seq"] += 1
        added += 1
        if len(mine) > per_prompt:
            mine.pop(0)
    while pool_size(pool) > total:  # the oldest entry of the pool leaves
        oldest = min((e[0][0], k) for k, e in entries.items() if e)[1]
        entries[oldest].pop(0)
    for k in [k for k, e in entries.items() if not e]:
        del entries[k]
    return added


def pool_entries(pool: dict, key: str) -> list[str]:
    """Prompt ``key``'s stored texts, oldest first (empty when none)."""
    return [t for _, t in pool.get("entries", {}).get(key, [])]


def pool_size(pool: dict) -> int:
    return sum(len(e) for e in pool.get("entries", {}).values())
