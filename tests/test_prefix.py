"""Tests of mix_src/algo/prefix.py: every strategy in both modes, hand-computed windows, a loop reference of
the original's per-sample algorithm, edge cases and bad arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mix_src.algo import prefix as prefix_mod
from mix_src.algo.prefix import PREFIX_STRATEGIES, build_prefix, compute_prefix_ratios, step_window


def ratios(num_prompts=50, n=4, seed=0, global_step=1, **kwargs):
    return compute_prefix_ratios(num_prompts, n, global_step=global_step, rng=np.random.default_rng(seed), **kwargs)


def test_pure_module_does_not_import_verl():
    source = open(prefix_mod.__file__).read()
    assert "import verl" not in source and "from verl" not in source and "import torch" not in source


def loop_window(s, S):
    """The original's window search (mix_vllm_rollout.py): first k with k*S/10 <= s <= (k+1)*S/10, else the last."""
    for k in range(10):
        if k * S / 10 <= s <= (k + 1) * S / 10:
            return k
    return 9


@pytest.mark.parametrize("S", [1, 7, 10, 300, 1000])
def test_step_window_matches_loop_and_stays_in_last_window(S):
    for global_step in range(1, 3 * S + 3):
        assert step_window(global_step, S) == loop_window(global_step - 1, S), (global_step, S)
    assert step_window(10**9, S) == 9


def test_step_window_hand_computed():
    # S = 300: s = 0..30 -> window 0 (both ends inclusive, first match wins), s = 31 -> 1, s >= 271 -> 9
    assert [step_window(s + 1, 300) for s in (0, 30, 31, 60, 61, 270, 271, 300, 5000)] == [0, 0, 1, 1, 2, 8, 9, 9, 9]


@pytest.mark.parametrize("share", [False, True])
def test_random_reproducible_and_in_range(share):
    a = ratios(n_prefix=2, min_prefix_ratio=0.3, max_prefix_ratio=0.7, share_across_samples=share)
    b = ratios(n_prefix=2, min_prefix_ratio=0.3, max_prefix_ratio=0.7, share_across_samples=share)
    assert np.array_equal(a, b) and a.shape == (200,) and a.dtype == np.float64
    grid = a.reshape(50, 4)
    assert ((grid[:, :2] >= 0.3) & (grid[:, :2] <= 0.7)).all()
    assert (grid[:, 2:] == 0).all()  # samples n_prefix.. are on-policy
    if share:
        assert (grid[:, 0] == grid[:, 1]).all() and len(set(grid[:, 0])) > 40  # one draw per prompt
    else:
        assert (grid[:, 0] != grid[:, 1]).all()
    # the draws are exactly the generator's uniform draws in row-major order
    expected = np.random.default_rng(0).uniform(0.3, 0.7, size=(50, 1 if share else 2))
    assert np.allclose(grid[:, :2], np.broadcast_to(expected, (50, 2)))


def test_main_recipe_ratios():
    # n = 8, n_prefix = 1, random with min = max = 1.0: [1, 0, 0, 0, 0, 0, 0, 0] per prompt
    r = ratios(num_prompts=3, n=8, n_prefix=1, min_prefix_ratio=1.0, max_prefix_ratio=1.0)
    assert r.tolist() == ([1.0] + [0.0] * 7) * 3
    assert r.mean() == 0.125


@pytest.mark.parametrize("share", [False, True])
def test_linear_is_deterministic_in_both_modes(share):
    # M = 0.8, S = 300; s = global_step - 1: ratio = 0.8 * (1 - min(s/300, 1))
    for global_step, expected in [(1, 0.8), (151, 0.4), (301, 0.0), (1000, 0.0)]:
        r = ratios(strategy="linear", n_prefix=-1, prefix_steps=300, prefix_linear_max_ratio=0.8,
                   share_across_samples=share, global_step=global_step)  # fmt: skip
        assert np.allclose(r, expected), (global_step, share)


@pytest.mark.parametrize("strategy, bound", [("linear_max", lambda k: (10 - k) * 0.8 / 10),
                                             ("reverse_linear", lambda k: (k + 1) * 0.8 / 10)])  # fmt: skip
@pytest.mark.parametrize("share", [False, True])
def test_window_strategies_bounds(strategy, bound, share):
    for global_step in (1, 31, 32, 151, 300, 301, 2000):
        k = step_window(global_step, 300)
        r = ratios(num_prompts=400, strategy=strategy, n_prefix=-1, prefix_steps=300, prefix_linear_max_ratio=0.8,
                   share_across_samples=share, global_step=global_step)  # fmt: skip
        assert r.min() >= 0 and r.max() <= bound(k) + 1e-12
        assert r.max() > 0.95 * bound(k)  # uniform over [0, bound]: 400+ draws come close to the bound
    assert bound(step_window(2000, 300)) == bound(9)  # past prefix_steps: the last window, on purpose


def test_fixed_per_sample_and_shared():
    r = ratios(num_prompts=2, n=4, strategy="fixed", n_prefix=-1, min_prefix_ratio=0.2, max_prefix_ratio=0.8)
    assert np.allclose(r, [0.2, 0.4, 0.6, 0.8] * 2)
    r = ratios(num_prompts=2, n=4, strategy="fixed", n_prefix=2, min_prefix_ratio=0.2, max_prefix_ratio=0.8)
    assert np.allclose(r, [0.2, 0.8, 0.0, 0.0] * 2)
    # one prefixed sample: the original divides by zero; here it is min_prefix_ratio
    r = ratios(num_prompts=2, n=4, strategy="fixed", n_prefix=1, min_prefix_ratio=0.5, max_prefix_ratio=1.0)
    assert np.allclose(r, [0.5, 0, 0, 0] * 2)
    r = ratios(num_prompts=1, n=1, strategy="fixed", n_prefix=-1, min_prefix_ratio=1.0, max_prefix_ratio=1.0)
    assert r.tolist() == [1.0]
    r = ratios(num_prompts=2, n=3, strategy="fixed", n_prefix=-1, prefix_fix_ratios=[0.1, 0.5, 1.0])
    assert np.allclose(r, [0.1, 0.5, 1.0] * 2)
    r = ratios(num_prompts=2, n=3, strategy="fixed", n_prefix=2, prefix_fix_ratios=[0.4])  # one for all
    assert np.allclose(r, [0.4, 0.4, 0.0] * 2)
    # shared: prompt i gets value i mod N for all its prefixed samples
    r = ratios(num_prompts=3, n=2, strategy="fixed", n_prefix=-1, share_across_samples=True,
               prefix_fix_ratios=[0.25, 0.75])  # fmt: skip
    assert np.allclose(r, [0.25, 0.25, 0.75, 0.75, 0.25, 0.25])


BUILTIN_STRATEGIES = [n for n in PREFIX_STRATEGIES if PREFIX_STRATEGIES.get(n).__module__ == "mix_src.algo.prefix"]


@pytest.mark.parametrize("strategy", BUILTIN_STRATEGIES)
@pytest.mark.parametrize("share", [False, True])
def test_every_strategy_every_mode_shape_and_n_prefix(strategy, share):
    for n, n_prefix in [(1, -1), (1, 1), (1, 0), (4, -1), (4, 0), (4, 3), (4, 4)]:
        r = ratios(num_prompts=5, n=n, strategy=strategy, n_prefix=n_prefix, share_across_samples=share,
                   min_prefix_ratio=0.2, max_prefix_ratio=0.9, global_step=40)  # fmt: skip
        grid = r.reshape(5, n)
        assert r.shape == (5 * n,) and np.isfinite(r).all() and ((r >= 0) & (r <= 1)).all()
        prefixed = n if n_prefix == -1 else n_prefix
        assert (grid[:, prefixed:] == 0).all()
        if prefixed and strategy in ("random", "fixed", "linear"):
            assert (grid[:, :prefixed] > 0).all()  # these strategies give a non-zero ratio here
        if share and prefixed:
            assert (grid[:, :prefixed] == grid[:, :1]).all()
    assert ratios(num_prompts=0, n=4, strategy=strategy, share_across_samples=share).shape == (0,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_step=0), "global_step"),
    ],
)
def test_bad_arguments(kwargs, match):
    """The step's own arguments; the config values are checked once before Ray (tests/test_mix_config.py)."""
    kwargs = {"global_step": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        compute_prefix_ratios(3, 4, rng=np.random.default_rng(0), **kwargs)
    with pytest.raises(ValueError, match="n must be >= 1"):
        compute_prefix_ratios(3, 0, global_step=1, rng=np.random.default_rng(0))
    # an unknown strategy: refused before Ray by the config (tests/test_mix_config.py), here by the registry itself
    with pytest.raises(KeyError, match=r"strategy='linear_variance'.*registered: random, linear, linear_max, reverse_linear"):
        compute_prefix_ratios(3, 4, strategy="linear_variance", global_step=1, rng=np.random.default_rng(0))


def test_build_prefix():
    target, eos = [11, 12, 13, 14, 15], 2
    assert build_prefix(target, 1.0, eos) == [11, 12, 13, 14, 15, 2]  # whole target + EOS
    assert build_prefix(target, 0.0, eos) == []
    assert build_prefix(target, 0.5, eos) == [11, 12, 13]  # floor(0.5 * 6) = 3
    assert build_prefix(target, 0.99, eos) == [11, 12, 13, 14, 15]  # floor(5.94) = 5: EOS not reached
    assert build_prefix(np.array(target), 1 / 6, eos) == [11]
    assert build_prefix([11, 2], 1.0, eos) == [11, 2]  # already ends with EOS: not doubled
    assert build_prefix([], 1.0, eos) == []  # an empty target stays empty
    for ratio in np.linspace(0, 1, 23):  # loop reference: floor(ratio * len(target + [EOS]))
        assert len(build_prefix(target, ratio, eos)) == math.floor(ratio * 6)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\]"):
        build_prefix(target, 1.1, eos)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\]"):
        build_prefix(target, -0.1, eos)
