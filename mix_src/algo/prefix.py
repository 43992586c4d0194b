"""Prefix-ratio schedules (a registry of strategies) and prefix assembly (pure numpy).

Rows are ordered `i*n + j` (prompt i, sample j), as after verl's `repeat(interleave=True)`. A row's ratio
rho says how much of the prompt's off-policy target becomes the start of its response:
`prefix = (target + [EOS])[: floor(rho * len)]`. rho = 0: a plain on-policy sample; rho = 1: the whole
demonstration.

Which rows get a ratio (n_prefix):
    -1  every sample of every prompt;
    0   none (all ratios 0, in both modes; the original's shared mode gave every sample a ratio);
    k   samples 0..k-1 of every prompt (the original's convention); samples k..n-1 get 0.

Built-in strategies (registered below; a plugin adds more with @register_prefix_strategy) (S = prefix_steps, M = prefix_linear_max_ratio, s = global_step - 1, and window
k = the first k in 0..9 with s in [k*S/10, (k+1)*S/10]; steps past S stay in the last window on purpose):
    random          U(min_prefix_ratio, max_prefix_ratio)
    linear          M * (1 - min(s / S, 1))  (deterministic; in both modes, where the original allowed
                    it only in shared mode)
    linear_max      U(0, (10 - k) * M / 10)  (upper bound falls from M to M/10)
    reverse_linear  U(0, (k + 1) * M / 10)   (upper bound rises from M/10 to M)
    fixed           the list prefix_fix_ratios (default: N evenly spaced values from min to max, N = the
                    number of prefixed samples per prompt; N = 1 gives [min_prefix_ratio], where the
                    original divides by zero)

Modes: per-sample (share_across_samples=False) draws one ratio per prefixed row; `fixed` gives sample j
the j-th value (a single value: every prefixed sample). Shared (True) draws one ratio per prompt for all its prefixed rows; `fixed` then gives
prompt i the value (i mod N) of the list.
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
    """What a prefix strategy sees for one generation batch (all arguments of compute_prefix_ratios).

    shape: (num_prompts, 1) in shared mode, else (num_prompts, num_prefixed): the array to return.
    num_prefixed: prefixed samples per prompt (n, or n_prefix). global_step counts from 1; rng is the
    seeded generator of this batch (draw from it only, so seeded runs reproduce)."""

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
"""Prefix strategies. Signature: ``fn(draw: PrefixDraw) -> np.ndarray`` of ratios in [0, 1], of shape
``draw.shape`` (or broadcastable to it). Register with ``@register_prefix_strategy("name")`` and pick it
with ``mix.prefix_strategy=name``; compute_prefix_ratios puts the values on the prefixed rows."""
register_prefix_strategy = PREFIX_STRATEGIES.register


def _check_ratio(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def step_window(global_step: int, prefix_steps: int) -> int:
    """Index k in 0..9 of the step window holding s = global_step - 1 (both window ends inclusive, the
    first match wins); any s past prefix_steps stays in window 9."""
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
    if d.prefix_fix_ratios is None:
        if d.num_prefixed == 1:
            fixed = np.array([d.min_prefix_ratio])
        else:
            fixed = np.linspace(d.min_prefix_ratio, d.max_prefix_ratio, d.num_prefixed)
    else:
        fixed = np.asarray(d.prefix_fix_ratios, dtype=np.float64).reshape(-1)  # checked: _check_fixed, mix_config
        if not d.share_across_samples and fixed.size == 1:
            fixed = np.repeat(fixed, d.num_prefixed)
    if d.share_across_samples:  # prompt i gets value (i mod N)
        return fixed[np.arange(d.num_prompts) % fixed.size][:, None]
    return np.broadcast_to(fixed[None, :], d.shape)  # sample j gets value j


def compute_prefix_ratios(
    num_prompts: int,
    n: int,
    *,
    strategy: str = "random",
    n_prefix: int = -1,
    min_prefix_ratio: float = 0.0,
    max_prefix_ratio: float = 1.0,
    prefix_steps: int = 300,
    prefix_linear_max_ratio: float = 0.8,
    prefix_fix_ratios: Sequence[float] | None = None,
    share_across_samples: bool = False,
    global_step: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """One prefix ratio per row, rows ordered i*n + j (see the module docstring for every rule).

    Args:
        num_prompts: number of prompts in the batch.
        n: samples per prompt (rollout.n).
        strategy: a name registered in PREFIX_STRATEGIES.
        n_prefix: samples per prompt that get a prefix: -1 = all, 0 = none, 1..n = the first n_prefix.
        min_prefix_ratio, max_prefix_ratio: range of `random` and of the default `fixed` list.
        prefix_steps: S, the number of steps over which the linear schedules move.
        prefix_linear_max_ratio: M, the top ratio of linear, linear_max and reverse_linear.
        prefix_fix_ratios: the `fixed` list (per-sample mode: N values, or 1 value for every sample).
        share_across_samples: one ratio per prompt instead of one per row.
        global_step: the trainer's step counter, starting at 1 (verl's `global_steps`).
        rng: the random generator (the trainer seeds it from (seed, global_step)).

    Returns:
        (num_prompts * n,) float64 array of ratios in [0, 1].

    The config values (n_prefix, the ratios, prefix_steps, prefix_fix_ratios) are checked once, before Ray, by
    mix_src/config/mix_config.py and the strategy's entry check; not again at each step.
    """
    if strategy not in PREFIX_STRATEGIES:
        raise ValueError(PREFIX_STRATEGIES.unknown(strategy))
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

    # one draw per prompt (shared) or per prefixed row (per-sample)
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
    """Prefix token ids of one row: EOS is appended to the target (unless it already ends with it, or
    the target is empty), then the first floor(ratio * len) tokens are taken.

    target_ids: (T,) token ids of the off-policy target; ratio in [0, 1]. Returns a list of ints."""
    _check_ratio("ratio", ratio)
    ids = [int(t) for t in target_ids]
    if ids and ids[-1] != eos_id:
        ids.append(int(eos_id))
    return ids[: int(np.floor(ratio * len(ids)))]
