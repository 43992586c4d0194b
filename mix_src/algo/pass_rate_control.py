"""Pass-rate control of the prefix length: per prompt, the recent pass rate -> the next prefix ratio (pure python).

Rollout pass-rate control (Zhu et al., "Rollout Pass-Rate Control: Steering Binary-Reward RL Toward Its Most
Informative Regime", arXiv 2605.05112, Sec. 1 and the abstract): a group's binary-reward signal is strongest near a
50 % pass rate, and prefixes replayed into a skewed group steer it there: a successful prefix gives a mostly-failing
group a head start, a failing prefix handicaps a mostly-passing one; an adaptive controller sets the prefix length.

The paper's exact update rule could not be read here (the stored copies of the paper and of its authors' blog give
only their opening sections; no official code was found), so the rule below is ours, a plain integral controller on
the prefix ratio, with every parameter a setting (:class:`ControlSettings`). For prompt x and side s:

    rate   <- smoothing * rate + (1 - smoothing) * p          (p: the group's pass rate at the ratio just used;
                                                              the first visit takes p as it is)
    ratio  <- clip(ratio + sign(s) * gain * (target - rate), min_ratio, max_ratio)

sign(head_start) = +1 (a longer successful prefix raises the pass rate), sign(handicap) = -1 (a longer failing
prefix lowers it). A prompt's first ratio on a side is ``init_ratio``, or with ``pooled`` (ours, off by default) the
mean current ratio of the prompts already seen on that side (``init_ratio`` while none is): in a run that draws each
prompt about once (a large prompt set, under two epochs) the per-prompt rule never reaches a second visit, and every
head start would use ``init_ratio`` (measured: scripts/experiments/README.md, issue #56's grid); pooled, the prompts
seen so far steer the ones not yet seen. With a pass-rate curve p(ratio) whose slope
stays below 2 / gain the loop settles at p = target (tests/test_pass_rate_control.py drives simulated prompts from
below and from above into [band_low, band_high]). Which side a group is steered to: :func:`side_for` (below the
band: head start; above it: handicap; inside: none).

The state is a plain dict ``{"head_start": {key: entry}, "handicap": {key: entry}, "pooled": {side: [sum, count]}}``
with ``entry = {"ratio": float, "rate": float, "visits": int}`` (keys: strings) and per side the running sum and count
of the entries' current ratios: picklable, saved and restored exactly (a state saved without ``pooled`` rebuilds it
from its entries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["HANDICAP", "HEAD_START", "SIDES", "ControlSettings", "current_ratio", "new_state", "observe", "side_for"]

HEAD_START = "head_start"  # a prefix of a successful trajectory (a stored demonstration): raises the pass rate
HANDICAP = "handicap"  # a prefix of one of the model's own failures: lowers it
SIDES = (HEAD_START, HANDICAP)
_SIGN = {HEAD_START: 1.0, HANDICAP: -1.0}


@dataclass(frozen=True)
class ControlSettings:
    """The controller's parameters (checked when built).

    target: the pass rate the controller steers to (the paper: 0.5). band_low, band_high: a group is steered when its
    unaided pass rate is outside [band_low, band_high] (the issue's informative band 0.25-0.75). gain: ratio change
    per unit of pass-rate error. init_ratio: a prompt's first ratio on a side. min_ratio, max_ratio: the ratio's range.
    smoothing: weight of the previous recent pass rate (0 = the latest group's rate alone). pooled: an unseen prompt's
    first ratio is the mean current ratio of the prompts seen on its side (False: ``init_ratio``)."""

    target: float = 0.5
    band_low: float = 0.25
    band_high: float = 0.75
    gain: float = 0.5
    init_ratio: float = 0.5
    min_ratio: float = 0.0
    max_ratio: float = 1.0
    smoothing: float = 0.0
    pooled: bool = False

    def __post_init__(self):
        if not 0.0 <= self.band_low <= self.target <= self.band_high <= 1.0:
            raise ValueError(f"pass-rate control: need 0 <= band_low <= target <= band_high <= 1 (got band_low="
                             f"{self.band_low}, target={self.target}, band_high={self.band_high})")
        if not self.gain > 0:
            raise ValueError(f"pass-rate control: gain={self.gain!r} must be > 0")
        if not 0.0 <= self.min_ratio <= self.init_ratio <= self.max_ratio <= 1.0:
            raise ValueError(f"pass-rate control: need 0 <= min_ratio <= init_ratio <= max_ratio <= 1 (got "
                             f"{self.min_ratio}, {self.init_ratio}, {self.max_ratio})")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"pass-rate control: smoothing={self.smoothing!r} must be in [0, 1)")


def new_state() -> dict:
    """An empty controller state."""
    return {**{side: {} for side in SIDES}, "pooled": {side: [0.0, 0] for side in SIDES}}


def _pool(state: dict, side: str) -> list:
    """[sum, count] of the current ratios of the prompts seen on ``side`` (rebuilt for a state saved without it)."""
    pooled = state.setdefault("pooled", {})
    if side not in pooled:
        pooled[side] = [float(sum(e["ratio"] for e in state[side].values())), len(state[side])]
    return pooled[side]


def side_for(pass_rate: float, s: ControlSettings) -> Optional[str]:
    """The side a group of unaided pass rate ``pass_rate`` is steered to: HEAD_START below the band, HANDICAP above
    it, None inside it (ends included)."""
    if pass_rate < s.band_low:
        return HEAD_START
    if pass_rate > s.band_high:
        return HANDICAP
    return None


def current_ratio(state: dict, key: str, side: str, s: ControlSettings) -> float:
    """The prefix ratio prompt ``key`` gets next on ``side`` (before its first visit: ``init_ratio``, or with ``pooled``
    the mean ratio of the prompts seen on ``side`` when there is one)."""
    entry = state[side].get(key)
    if entry is not None:
        return float(entry["ratio"])
    total, count = _pool(state, side)
    return min(max(total / count, s.min_ratio), s.max_ratio) if s.pooled and count else s.init_ratio


def observe(state: dict, key: str, side: str, pass_rate: float, s: ControlSettings,
            ratio: Optional[float] = None) -> float:
    """One controller step: prompt ``key``'s group reached ``pass_rate`` with the ratio :func:`current_ratio` gave on
    ``side`` (``ratio``: that ratio, read before the batch's other groups were observed; a pooled start moves with
    every observation); updates ``state`` (the module docstring's rule) and returns the next ratio."""
    if not 0.0 <= pass_rate <= 1.0:
        raise ValueError(f"pass-rate control: a pass rate is in [0, 1], got {pass_rate!r}")
    pool, entry = _pool(state, side), state[side].get(key)
    if entry is None:  # the ratio it was given
        entry = {"ratio": current_ratio(state, key, side, s) if ratio is None else float(ratio),
                 "rate": float(pass_rate), "visits": 0}
        state[side][key] = entry
        pool[0], pool[1] = pool[0] + entry["ratio"], pool[1] + 1
    else:
        entry["rate"] = s.smoothing * entry["rate"] + (1.0 - s.smoothing) * float(pass_rate)
    step = _SIGN[side] * s.gain * (s.target - entry["rate"])
    old, entry["ratio"] = entry["ratio"], min(max(entry["ratio"] + step, s.min_ratio), s.max_ratio)
    pool[0] += entry["ratio"] - old
    entry["visits"] += 1
    return entry["ratio"]
