"""The pass-rate controller (mix_src/algo/pass_rate_control.py) closed-loop on simulated prompts, and its state's
save/restore. A simulated prompt's expected pass rate is a logistic function of the prefix ratio r,
p(r) = 1 / (1 + exp(-(r - c) / w)) for a head start (a successful prefix) and 1 - that for a handicap (a failing
prefix); the controller sees the group's pass rate: the expected one, or a seeded Binomial(8, p) / 8 (a group of 8).

Stated numbers (default settings: target 0.5, band [0.25, 0.75], gain 0.5, init_ratio 0.5), both sides, from below
and from above the band:
* noise-free, w = 0.1 (slope <= 2.5 < 2 / gain): the pass rate enters the band by visit 3 (from ratio 0 or 1; visit
  1 from the default init 0.5) and stays there; w = 0.2: by visit 3 too;
* groups of 8, w = 0.2, 50 seeds: in the band by visit 5, and in it on >= 90 % of the next 60 visits.
"""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch

from mix_src.algo.pass_rate_control import (HANDICAP, HEAD_START, ControlSettings, current_ratio, new_state, observe,
                                            side_for)  # fmt: skip

BAND = (0.25, 0.75)


def curve(side: str, c: float, w: float):
    """The simulated prompt's expected pass rate as a function of the prefix ratio on ``side``."""
    up = lambda r: 1.0 / (1.0 + math.exp(-(r - c) / w))  # noqa: E731
    return up if side == HEAD_START else (lambda r: 1.0 - up(r))


def closed_loop(side, c, w, settings, visits, group=None, seed=0, state=None, key="x"):
    """The expected pass rate at each visit of one prompt; the controller observes it (or a group's sample of it)."""
    rng, f, state = np.random.default_rng(seed), curve(side, c, w), new_state() if state is None else state
    rates = []
    for _ in range(visits):
        p = f(current_ratio(state, key, side, settings))
        rates.append(p)
        observe(state, key, side, p if group is None else rng.binomial(group, p) / group, settings)
    return rates


def in_band(p):
    return BAND[0] <= p <= BAND[1]


# (side, curve centre c, init ratio): the unaided start is below the band or above it
CASES = [(HEAD_START, 0.7, 0.0), (HEAD_START, 0.2, 1.0), (HANDICAP, 0.8, 0.0), (HANDICAP, 0.3, 1.0)]


@pytest.mark.parametrize("side,c,init", CASES)
@pytest.mark.parametrize("w", [0.1, 0.2])
def test_drives_the_pass_rate_into_the_band_from_below_and_above(side, c, init, w):
    rates = closed_loop(side, c, w, ControlSettings(init_ratio=init), visits=30)
    assert not in_band(rates[0])  # the start is outside the band (below or above)
    first = next(i for i, p in enumerate(rates) if in_band(p))
    assert first <= 3
    assert all(in_band(p) for p in rates[first:])
    assert abs(rates[-1] - 0.5) < 1e-3  # settles at the target


@pytest.mark.parametrize("side,c,init", CASES)
def test_groups_of_eight_reach_and_hold_the_band(side, c, init):
    s = ControlSettings(init_ratio=init)
    for seed in range(50):
        rates = closed_loop(side, c, 0.2, s, visits=66, group=8, seed=seed)
        first = next(i for i, p in enumerate(rates) if in_band(p))
        assert first <= 5, seed
        assert np.mean([in_band(p) for p in rates[first:first + 60]]) >= 0.9, seed


def test_default_init_ratio_reaches_the_band_on_the_second_visit():
    rates = closed_loop(HEAD_START, 0.7, 0.1, ControlSettings(), visits=10)
    assert not in_band(rates[0]) and all(in_band(p) for p in rates[1:])


def test_update_rule_by_hand():
    s = ControlSettings(gain=0.4, init_ratio=0.5, smoothing=0.5)
    state = new_state()
    assert observe(state, "a", HEAD_START, 0.0, s) == pytest.approx(0.5 + 0.4 * 0.5)  # first visit: rate = p
    assert observe(state, "a", HEAD_START, 1.0, s) == pytest.approx(0.7 + 0.4 * (0.5 - 0.5))  # rate 0.5*0 + 0.5*1
    assert observe(state, "b", HANDICAP, 1.0, s) == pytest.approx(0.5 + 0.4 * 0.5)  # handicap: longer when passing
    assert observe(state, "c", HEAD_START, 1.0, ControlSettings(init_ratio=0.1)) == 0.0  # clipped to min_ratio
    assert state[HEAD_START]["a"] == {"ratio": pytest.approx(0.7), "rate": 0.5, "visits": 2}
    assert current_ratio(state, "new", HANDICAP, s) == 0.5


def test_side_for():
    s = ControlSettings()
    assert [side_for(p, s) for p in (0.0, 0.125, 0.25, 0.5, 0.75, 0.875, 1.0)] == \
        [HEAD_START, HEAD_START, None, None, None, HANDICAP, HANDICAP]


@pytest.mark.parametrize("bad", [dict(target=0.8, band_high=0.75), dict(gain=0.0), dict(init_ratio=1.5),
                                 dict(smoothing=1.0), dict(min_ratio=0.6)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="pass-rate control"):
        ControlSettings(**bad)


def test_state_saved_and_restored_continues_identically():
    s = ControlSettings(smoothing=0.3)
    state = new_state()
    for key, side, c in (("p0", HEAD_START, 0.7), ("p1", HANDICAP, 0.8), ("p2", HEAD_START, 0.2)):
        closed_loop(side, c, 0.2, s, visits=7, group=8, seed=1, state=state, key=key)
    buf = io.BytesIO()
    torch.save({"rollout_policy": {"pass_rate_control": state}}, buf)  # as mix_state.pt holds it
    buf.seek(0)
    restored = torch.load(buf, weights_only=False)["rollout_policy"]["pass_rate_control"]
    assert restored == state and restored is not state
    twin = copy.deepcopy(state)
    for st in (state, restored, twin):
        for key, side, c in (("p0", HEAD_START, 0.7), ("p1", HANDICAP, 0.8), ("p3", HANDICAP, 0.3)):
            trace = closed_loop(side, c, 0.2, s, visits=20, group=8, seed=2, state=st, key=key)
            st.setdefault("trace", []).append(trace)
    assert restored == state == twin  # every ratio, rate and visit count, and every pass rate on the way


def test_pooled_an_unseen_prompt_starts_from_the_seen_prompts_mean_ratio():
    s, pooled = ControlSettings(gain=0.4), ControlSettings(gain=0.4, pooled=True)
    state = new_state()
    assert observe(state, "a", HEAD_START, 0.0, pooled) == pytest.approx(0.7)  # none seen: init 0.5, + 0.4 * 0.5
    assert observe(state, "b", HEAD_START, 1.0, pooled) == pytest.approx(0.5)  # starts at a's 0.7, - 0.4 * 0.5
    assert observe(state, "c", HEAD_START, 0.0, pooled) == pytest.approx(0.8)  # starts at mean(0.7, 0.5) = 0.6
    assert current_ratio(state, "new", HEAD_START, pooled) == pytest.approx((0.7 + 0.5 + 0.8) / 3)
    assert current_ratio(state, "new", HEAD_START, s) == 0.5  # per prompt alone: init_ratio
    assert current_ratio(state, "new", HANDICAP, pooled) == 0.5  # no prompt seen on that side yet
    assert state["pooled"][HEAD_START] == [pytest.approx(2.0), 3]
    # a state saved before the pool existed rebuilds it from its entries
    old = {side: copy.deepcopy(state[side]) for side in (HEAD_START, HANDICAP)}
    assert current_ratio(old, "new", HEAD_START, pooled) == pytest.approx(2.0 / 3)


@pytest.mark.parametrize("pooled", [False, True])
def test_prompts_seen_once_are_steered_only_when_pooled(pooled):
    """The toy grid's regime (issue #56): every step brings 32 prompts never seen before (one draw each, under one
    epoch), all with one pass-rate curve below the band at init_ratio (p(0.5) = 0.12). Per prompt alone, every group
    keeps p(init_ratio); pooled, the groups of step 2 on are in the band. As in the policy, a step's ratios are all
    read before its groups are observed (recipes/pass_rate_control/pass_rate_control.py)."""
    s, f, state = ControlSettings(pooled=pooled), curve(HEAD_START, 0.7, 0.1), new_state()
    means = []
    for step in range(6):
        keys = [f"{step}-{i}" for i in range(32)]
        rates = [f(current_ratio(state, key, HEAD_START, s)) for key in keys]
        ratios = [current_ratio(state, key, HEAD_START, s) for key in keys]
        for key, p, r in zip(keys, rates, ratios):
            observe(state, key, HEAD_START, p, s, ratio=r)
        means.append(float(np.mean(rates)))
    assert not in_band(means[0])
    assert all(in_band(m) for m in means[1:]) if pooled else all(m == means[0] for m in means)
