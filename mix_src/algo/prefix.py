"""Prefix-ratio schedules (a registry of strategies) and prefix assembly (pure numpy).

Rows are ordered `i*n + j` (prompt i, sample j), as after verl's `repeat(interleave=True)`. A row's ratio rho
says how much of the prompt's target starts its response: `prefix = (target + [EOS])[: floor(rho * len)]`
(rho = 0: a plain on-policy sample; rho = 1: the whole demonstration). n_prefix: -1 every sample gets a ratio; 0
none (all ratios 0, in both modes; the original's shared mode gave every sample one); k samples 0..k-1 of every
prompt (the original's convention), samples k..n-1 get 0.

Built-in strategies (a plugin adds more with @register_prefix_strategy; S = prefix_steps, M = prefix_linear_max_ratio,
s = global_step - 1, window k = the first k in 0..9 with s in [k*S/10, (k+1)*S/10]; steps past S stay in window 9):
random U(min_prefix_ratio, max_prefix_ratio); linear M * (1 - min(s / S, 1)) (deterministic; in both modes, the
original only in shared mode); linear_max U(0, (10 - k) * M / 10); reverse_linear U(0, (k + 1) * M / 10); fixed the
list prefix_fix_ratios (default: N = prefixed samples per prompt evenly spaced values from min to max; N = 1 gives
[min_prefix_ratio], where the original divides by zero).

Modes: per-sample (share_across_samples=False) draws one ratio per prefixed row, `fixed` giving sample j the j-th
value (a single value: every prefixed sample); shared (True) one ratio per prompt for all its prefixed rows, `fixed`
giving prompt i the value (i mod N) of the list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from mix_src.extend import Registry

__all__ = ["PREFIX_STRATEGIES", "PrefixDraw", "build_prefix", "compute_prefix_ratios", "register_prefix_strategy",
           "step_window"]

NUM_WINDOWS = 10


@dataclass(frozen=True)
class PrefixDraw:
    """What a prefix strategy sees for one generation batch (the arguments of compute_prefix_ratios): shape is the
    array to return ((num_prompts, 1) shared, else (num_prompts, num_prefixed)); draw from rng only (seeded runs)."""

    shape: tuple
    num_prompts: int
    num_prefixed: int
    share_across_samples: bool
    min_prefix_ratio: float
    max_prefix_ratio: float
    prefix_steps: int
    prefix_linear_max_ratio: float
    prefix_fix_ratios: Optional[Sequence[float]]
    global_step: int
    rng: np.random.Generator


PrefixStrategy = Callable[[PrefixDraw], np.ndarray]
PREFIX_STRATEGIES: Registry[PrefixStrategy] = Registry("prefix strategy", "mix.prefix_strategy")
"""``fn(draw: PrefixDraw) -> np.ndarray``: ratios in [0, 1] of shape ``draw.shape`` (or broadcastable to it)."""
register_prefix_strategy = PREFIX_STRATEGIES.register


def step_window(global_step: int, prefix_steps: int) -> int:
    """Index k in 0..9 of the step window holding s = global_step - 1 (ends inclusive, first match wins)."""
    s = global_step - 1
    k = -(-NUM_WINDOWS * s // prefix_steps) - 1  # ceil(10 s / S) - 1, exact in integers
    return min(max(k, 0), NUM_WINDOWS - 1)


@register_prefix_strategy("random")
def _random(d: PrefixDraw) -> np.ndarray:
    return d.rng.uniform(d.min_prefix_ratio, d.max_prefix_ratio, size=d.shape)


@register_prefix_strategy("linear")
def _linear(d: PrefixDraw) -> np.ndarray:
    s = d.global_step - 1
    return np.full(d.shape, d.prefix_linear_max_ratio * (1.0 - min(s / d.prefix_steps, 1.0)))


@register_prefix_strategy("linear_max")
def _linear_max(d: PrefixDraw) -> np.ndarray:
    window = step_window(d.global_step, d.prefix_steps)
    return d.rng.uniform(0.0, (NUM_WINDOWS - window) * d.prefix_linear_max_ratio / NUM_WINDOWS, size=d.shape)


@register_prefix_strategy("reverse_linear")
def _reverse_linear(d: PrefixDraw) -> np.ndarray:
    window = step_window(d.global_step, d.prefix_steps)
    return d.rng.uniform(0.0, (window + 1) * d.prefix_linear_max_ratio / NUM_WINDOWS, size=d.shape)


def _check_fixed(config) -> None:
    """mix.prefix_fix_ratios: given, and 1 ratio or one per prefixed row of a group (unless shared per prompt)."""
    mix, n = config.mix, int(config.actor_rollout_ref.rollout.n)
    ratios, n_prefix = mix.get("prefix_fix_ratios"), int(mix.get("n_prefix", 0))
    if not ratios:
        raise ValueError("mix.prefix_strategy=fixed needs mix.prefix_fix_ratios (a list of ratios)")
    want = n if n_prefix == -1 else n_prefix
    if not mix.get("prefix_share_across_samples", False) and len(ratios) not in (1, want):
        raise ValueError(f"mix.prefix_fix_ratios has {len(ratios)} ratios; give 1 or one per prefixed row "
                         f"({want} = {'rollout.n' if n_prefix == -1 else 'mix.n_prefix'})")


@register_prefix_strategy("fixed", check=_check_fixed, reads=("mix.prefix_fix_ratios", "mix.n_prefix",
                          "mix.prefix_share_across_samples", "actor_rollout_ref.rollout.n"))  # fmt: skip
def _fixed(d: PrefixDraw) -> np.ndarray:
    if d.prefix_fix_ratios is None:  # N = 1 gives [min] (the original divides by zero)
        fixed = np.linspace(d.min_prefix_ratio, d.max_prefix_ratio, d.num_prefixed)
    else:
        fixed = np.asarray(d.prefix_fix_ratios, dtype=np.float64).reshape(-1)  # checked: _check_fixed, mix_config
        if not d.share_across_samples and fixed.size == 1:
            fixed = np.repeat(fixed, d.num_prefixed)
    if d.share_across_samples:  # prompt i gets value (i mod N)
        return fixed[np.arange(d.num_prompts) % fixed.size][:, None]
    return np.broadcast_to(fixed[None, :], d.shape)  # sample j gets value j


def compute_prefix_ratios(num_prompts: int, n: int, *, strategy: str = "random", n_prefix: int = -1,
                          min_prefix_ratio: float = 0.0, max_prefix_ratio: float = 1.0, prefix_steps: int = 300,
                          prefix_linear_max_ratio: float = 0.8, prefix_fix_ratios: Sequence[float] | None = None,
                          share_across_samples: bool = False, global_step: int, rng: np.random.Generator) -> np.ndarray:
    """(num_prompts * n,) float64 ratios in [0, 1], one per row, rows ordered i*n + j (the module docstring gives
    every rule; n = rollout.n, global_step counts from 1, rng is seeded by the trainer from (seed, global_step)).
    The config values are checked once before Ray (mix_src/config/mix_config.py and the strategy's entry check)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if global_step < 1:
        raise ValueError(f"global_step counts from 1 (verl's global_steps), got {global_step}")

    num_prefixed = n if n_prefix == -1 else n_prefix  # prefixed samples per prompt
    ratios = np.zeros((num_prompts, n), dtype=np.float64)
    if num_prefixed == 0 or num_prompts == 0:
        return ratios.reshape(-1)

    shape = (num_prompts, 1) if share_across_samples else (num_prompts, num_prefixed)
    draw = PrefixDraw(
        shape=shape, num_prompts=num_prompts, num_prefixed=num_prefixed, share_across_samples=share_across_samples,
        min_prefix_ratio=min_prefix_ratio, max_prefix_ratio=max_prefix_ratio, prefix_steps=prefix_steps,
        prefix_linear_max_ratio=prefix_linear_max_ratio, prefix_fix_ratios=prefix_fix_ratios,
        global_step=global_step, rng=rng,
    )  # fmt: skip
    drawn = np.asarray(PREFIX_STRATEGIES.get(strategy)(draw), dtype=np.float64)
    if drawn.size and (np.isnan(drawn).any() or drawn.min() < 0.0 or drawn.max() > 1.0):
        raise ValueError(f"prefix strategy {strategy!r} returned ratios outside [0, 1]")
    ratios[:, :num_prefixed] = drawn  # a shared (num_prompts, 1) draw broadcasts over the samples
    return ratios.reshape(-1)


def build_prefix(target_ids: Sequence[int], ratio: float, eos_id: int) -> list[int]:
    """Prefix token ids of one row: (target_ids (T,) + [EOS] unless it ends with EOS or is empty)[: floor(ratio * len)],
    ratio in [0, 1]."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    ids = [int(t) for t in target_ids]
    if ids and ids[-1] != eos_id:
        ids.append(int(eos_id))
    return ids[: int(np.floor(ratio * len(ids)))]
