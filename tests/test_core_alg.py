"""Tests of mix_src/algo/core_alg.py: hand-computed numbers, naive loop references written here, verl parity
(verl is imported by the tests only; the module under test never imports it)."""

from __future__ import annotations

import itertools
import math
import uuid
from collections import defaultdict

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mix_src.algo import core_alg
from mix_src.algo.core_alg import (
    LOSS_AGG_MODES,
    AdaptiveEntropyCoef,
    agg_loss,
    apply_prefix_advantage_weights,
    compute_grpo_outcome_advantage_split,
    compute_sft_pure_loss,
    compute_token_on_off_policy_loss,
)

VERL_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def test_pure_module_does_not_import_verl():
    from mix_src.algo import loss_terms, token_maths

    for module in (core_alg, loss_terms, token_maths):  # the loss maths: torch only
        source = open(module.__file__).read()
        assert "import verl" not in source and "from verl" not in source, module.__name__


# ---------------------------------------------------------------------------------------------------
# grpo_split
# ---------------------------------------------------------------------------------------------------


def loop_grpo_split(rewards, mask, index, on_policy, epsilon=1e-6, use_std=True):
    """Naive per-row reference of the original's compute_grpo_outcome_advantage_split (+ the documented fallback and the exact-equality rule)."""
    scores = rewards.sum(-1).double()
    members, on_members = defaultdict(list), defaultdict(list)
    for i in range(len(index)):
        members[index[i]].append(float(scores[i]))
        if on_policy[i]:
            on_members[index[i]].append(float(scores[i]))
    adv = torch.zeros_like(rewards)
    for i in range(len(index)):
        s = on_members[index[i]] or members[index[i]]
        if len(s) == 1:
            mu, sigma = 0.0, 1.0
        elif max(s) == min(s):
            mu, sigma = s[0], 1.0
        else:
            mu, sigma = float(np.mean(s)), float(np.std(s, ddof=1))
        a = (float(scores[i]) - mu) / (sigma + epsilon) if use_std else float(scores[i]) - mu
        for t in range(rewards.shape[1]):
            adv[i, t] = a * float(mask[i, t] != 0)
    return adv


def _outcome_rewards(scores, lengths, width):
    rewards = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        if n > 0:
            rewards[i, n - 1] = s
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return rewards, mask


def test_grpo_split_hand_computed():
    # group "a": on-policy rewards 1, 0, 1 -> mu = 2/3, sigma (unbiased) = sqrt(1/3); its off-policy row
    # (reward 1) does not enter the statistics but is normalised with them.
    # group "b": a single on-policy row (reward 1) plus an off-policy row (reward 0) -> mu 0, sigma 1.
    # group "c": only off-policy rows, rewards 1 and 0 -> fallback to all rows: mu 0.5, sigma sqrt(0.5).
    # group "d": on-policy rewards 1, 1 -> all equal -> advantage 0.
    # groups "e" and "f": a single row (on- and off-policy) -> mu 0, sigma 1: A = R.
    scores = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.75, 0.25]
    index = np.array(["a", "a", "a", "a", "b", "b", "c", "c", "d", "d", "e", "f"], dtype=object)
    on = torch.tensor([False, True, True, True, True, False, False, False, True, True, True, False])
    rewards, mask = _outcome_rewards(scores, [3] * 12, 3)
    adv, ret = compute_grpo_outcome_advantage_split(rewards, mask, index, on, epsilon=0.0)
    s3 = math.sqrt(1 / 3)
    expected = [(1 / 3) / s3, (1 / 3) / s3, (-2 / 3) / s3, (1 / 3) / s3, 1.0, 0.0,
                0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0, 0.0, 0.75, 0.25]  # fmt: skip
    assert torch.allclose(adv[:, 0], torch.tensor(expected), atol=1e-6)
    assert torch.equal(adv[:, 0:1].expand(-1, 3), adv)  # broadcast over the valid tokens
    assert ret is adv
    assert adv[8].abs().sum() == 0 and adv[9].abs().sum() == 0  # exactly 0, no rounding residue

    adv_nostd, _ = compute_grpo_outcome_advantage_split(rewards, mask, index, on, use_std=False)
    assert torch.allclose(adv_nostd[:4, 0], torch.tensor([1 / 3, 1 / 3, -2 / 3, 1 / 3]), atol=1e-6)
    assert adv_nostd[4, 0] == 1.0  # single on-policy row: mu = 0


@pytest.mark.parametrize("use_std", [True, False])
@pytest.mark.parametrize("index_kind", ["uuid", "tensor"])
def test_grpo_split_matches_loop(use_std, index_kind):
    rng = np.random.default_rng(0)
    n, groups, width = 4, 12, 7
    rows = n * groups
    uids = [str(uuid.uuid4()) for _ in range(groups)]
    perm = rng.permutation(rows)  # rows of a group are not contiguous (after _balance_batch)
    group_of_row = np.repeat(np.arange(groups), n)[perm]
    scores = rng.choice([0.0, 0.5, 1.0], size=rows)
    scores[group_of_row == 0] = 1.0  # one all-equal group
    lengths = rng.integers(0, width + 1, size=rows)  # includes zero-length responses
    on = torch.tensor(rng.random(rows) < 0.7)
    on[torch.tensor(group_of_row == 1)] = False  # one all-off-policy group
    single = np.flatnonzero(group_of_row == 2)
    on[torch.tensor(single)] = False
    on[int(single[0])] = True  # one group with a single on-policy row
    rewards, mask = _outcome_rewards(scores.tolist(), lengths.tolist(), width)
    rewards += torch.tensor(rng.normal(size=(rows, width)), dtype=torch.float32) * mask * 0.1  # dense too
    index = np.array([uids[g] for g in group_of_row], dtype=object)
    if index_kind == "tensor":
        index = torch.tensor(group_of_row * 7 + 3)
    adv, _ = compute_grpo_outcome_advantage_split(rewards, mask, index, on, use_std=use_std)
    ref = loop_grpo_split(rewards, mask, list(index.tolist() if index_kind == "tensor" else index), on,
                          use_std=use_std)  # fmt: skip
    assert torch.allclose(adv, ref, atol=1e-5)
    assert torch.isfinite(adv).all()
    assert (adv[mask == 0] == 0).all()


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.bool, torch.float32])
def test_rows_times_mask_in_blocks(mask_dtype):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(37, generator=g)
    mask = (torch.rand(37, 4, generator=g) < 0.6).to(mask_dtype)
    before = mask.clone()
    out = core_alg._rows_times_mask(values, mask, block_elems=10)  # blocks of 2 rows
    assert torch.equal(out, values[:, None] * mask.float()) and torch.equal(mask, before)
    assert core_alg._rows_times_mask(values[:0], mask[:0]).shape == (0, 4)
    assert core_alg._rows_times_mask(values, mask[:, :0]).shape == (37, 0)


def test_grpo_split_equals_verl_grpo_when_all_rows_on_policy():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rng = np.random.default_rng(1)
    rows, width = 32, 5
    index = np.repeat(np.array([str(uuid.uuid4()) for _ in range(8)], dtype=object), 4)
    scores = rng.normal(size=rows)  # distinct values: no all-equal group, where the two differ
    rewards, mask = _outcome_rewards(scores.tolist(), rng.integers(1, width + 1, rows).tolist(), width)
    ours, _ = compute_grpo_outcome_advantage_split(rewards, mask, index, torch.ones(rows, dtype=torch.bool))
    theirs, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_grpo_split_hash_collision_falls_back_to_exact_grouping():
    class CollidingId(str):  # every id has the same hash: grouping by hash alone would merge groups
        def __hash__(self):
            return 0

    index = np.array([CollidingId(s) for s in ["x", "x", "y", "y"]], dtype=object)
    rewards, mask = _outcome_rewards([1.0, 0.0, 1.0, 1.0], [1] * 4, 1)
    adv, _ = compute_grpo_outcome_advantage_split(rewards, mask, index, torch.ones(4, dtype=torch.bool), epsilon=0)
    s = math.sqrt(0.5)
    assert torch.allclose(adv[:, 0], torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]), atol=1e-6)


def test_grpo_split_empty_and_bad_arguments():
    adv, _ = compute_grpo_outcome_advantage_split(torch.zeros(0, 4), torch.zeros(0, 4), np.array([]),
                                                  torch.zeros(0, dtype=torch.bool))  # fmt: skip
    assert adv.shape == (0, 4)
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="on_policy_mask"):
        compute_grpo_outcome_advantage_split(r, m, np.array(["a", "a"]), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="index has 3 entries"):
        compute_grpo_outcome_advantage_split(r, m, np.array(["a", "a", "b"]), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        compute_grpo_outcome_advantage_split(r, torch.ones(2, 4), np.array(["a", "a"]), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="epsilon"):
        compute_grpo_outcome_advantage_split(r, m, np.array(["a", "a"]), torch.ones(2, dtype=torch.bool), epsilon=-1)


# ---------------------------------------------------------------------------------------------------
# agg_loss
# ---------------------------------------------------------------------------------------------------


def _loss_and_mask(seed=0, rows=5, width=6):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, width, generator=g)
    mask = (torch.rand(rows, width, generator=g) < 0.7).long()
    mask[1] = 0  # a row without tokens
    return loss, mask


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("global_info", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_agg_loss_matches_verl(mode, global_info, mask_dtype):
    from verl.trainer.ppo.core_algos import agg_loss as verl_agg_loss

    loss, mask = _loss_and_mask()
    mask = mask.to(mask_dtype)
    kwargs = dict(dp_size=2, batch_num_tokens=37, global_batch_size=9, loss_scale_factor=11) if global_info else {}
    ours = agg_loss(loss, mask, mode, **kwargs)
    theirs = verl_agg_loss(loss, mask, mode, **kwargs)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), (ours, theirs)


def test_agg_loss_luffy_token_sum_norm_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    # sum over valid tokens = 1 + 2 + 5 + 6 + 7 = 21, divided by the width L = 4 (not by 5 tokens or 2 rows)
    assert agg_loss(loss, mask, "luffy-token-sum-norm").item() == pytest.approx(21 / 4)
    assert agg_loss(loss, mask, "luffy-token-sum-norm", loss_scale_factor=8).item() == pytest.approx(21 / 8)
    assert agg_loss(loss, mask, "luffy-token-sum-norm", dp_size=2).item() == pytest.approx(21 / 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batch_invariant_with_global_info(mode):
    loss, mask = _loss_and_mask(seed=3, rows=6)
    full = agg_loss(loss, mask, mode)
    info = dict(batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(-1) > 0).sum()))
    split = agg_loss(loss[:2], mask[:2], mode, **info) + agg_loss(loss[2:], mask[2:], mode, **info)
    assert torch.allclose(full, split, atol=1e-6)


def test_agg_loss_errors():
    loss, mask = _loss_and_mask()
    with pytest.raises(ValueError, match="loss_agg_mode='seq-mean'.*allowed values: token-mean"):
        agg_loss(loss, mask, "seq-mean")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(loss, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_loss(loss, mask, "seq-mean-token-mean", dp_size=2)


# ---------------------------------------------------------------------------------------------------
# the mixed token loss
# ---------------------------------------------------------------------------------------------------


def _num(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


def loop_token_loss(old, lp, adv, mask, prefix, *, cliprange=0.2, clip_upper_bound=1.0,
                    off_policy_reshape="no_reshape", off_policy_reshape_gamma=0.1, off_policy_reshape_weight=0.1,
                    off_policy_reshape_pow_exp=0.5, on_policy_reshape="no_reshape", on_policy_reshape_weight=0.1,
                    on_policy_reshape_pow_exp=0.5, off_max_clip=None, off_min_clip=None, all_max_clip=None,
                    loss_remove_clip=False, loss_agg_mode="token-mean", target_probs=None, clip_ratio_c=None,
                    rollout_is_weights=None, on_policy_reshape_gamma=None, dp_size=1, batch_num_tokens=None,
                    global_batch_size=None, loss_scale_factor=None):  # fmt: skip
    """Token-by-token reference of the original's compute_token_on_off_policy_loss, autograd on scalars."""
    aliases = {"p_div_p_0.1": 0.1, "p_div_p_0.3": 0.3, "p_div_p_0.5": 0.5}
    off_gamma = aliases.get(off_policy_reshape, off_policy_reshape_gamma)
    on_gamma = aliases.get(on_policy_reshape, off_policy_reshape_gamma if on_policy_reshape_gamma is None
                           else on_policy_reshape_gamma)  # fmt: skip
    off_mode = "p_div_p" if off_policy_reshape in aliases else off_policy_reshape
    on_mode = "p_div_p" if on_policy_reshape in aliases else on_policy_reshape
    B, L = lp.shape
    losses, keep = {}, {}
    m = defaultdict(float)
    n_on = n_off = n_valid = 0
    for i in range(B):
        for t in range(L):
            if not mask[i, t]:
                continue
            n_valid += 1
            l, lo, a = lp[i, t], old[i, t], adv[i, t]
            p = torch.exp(l)
            m["kl"] += -float(torch.clamp(l - lo, -20, 20).detach())
            if prefix[i, t]:
                n_off += 1
                if target_probs is not None:
                    f = p / (target_probs[i, t] + 1e-6)
                elif off_mode == "no_reshape":
                    f = p
                elif off_mode == "logp":
                    f = off_policy_reshape_weight * l
                elif off_mode == "p_logp":
                    f = off_policy_reshape_weight * l + p
                elif off_mode == "square_root":
                    f = torch.sqrt(p)
                elif off_mode == "pow":
                    f = torch.pow(p, off_policy_reshape_pow_exp)
                else:
                    f = p / (p + off_gamma)
                if off_max_clip is not None:
                    m["max_clip"] += _num(f > off_max_clip)
                    f = torch.clamp(f, max=off_max_clip)
                if off_min_clip is not None:
                    m["min_clip"] += _num(f < off_min_clip)
                    f = torch.clamp(f, min=off_min_clip)
                loss = -a * f
                m["off_loss"] += _num(loss)
                m["off_ratio"] += _num(f)
                m["off_prob"] += _num(p)
            else:
                n_on += 1
                d = torch.clamp(l - lo, -20, 20)
                if on_mode == "no_reshape":
                    r = torch.exp(d)
                elif on_mode == "logp":
                    r = d
                elif on_mode == "p_logp":
                    r = torch.exp(d) + on_policy_reshape_weight * d
                elif on_mode == "square_root":
                    r = torch.sqrt(torch.exp(d))
                elif on_mode == "pow":
                    r = torch.pow(torch.exp(d), on_policy_reshape_pow_exp)
                else:
                    po = torch.exp(lo)
                    r = (p / (p + on_gamma)) / (po / (po + on_gamma))
                loss = -a * r
                if not loss_remove_clip:
                    clipped = -a * torch.clamp(r, 1 - cliprange, max(clip_upper_bound, 1 + cliprange))
                    m["clipfrac"] += _num(clipped > loss)
                    loss = torch.maximum(loss, clipped)
                    if clip_ratio_c is not None and a < 0:
                        m["clipfrac_lower"] += _num(loss > -a * clip_ratio_c)
                        loss = torch.minimum(loss, -a * clip_ratio_c)
                if rollout_is_weights is not None:
                    loss = loss * rollout_is_weights[i, t]
                m["on_loss"] += _num(loss)
                m["on_prob"] += _num(torch.exp(lo))
            losses[i, t] = loss
            keep[i, t] = all_max_clip is None or _num(p) <= all_max_clip
    # aggregation, by loops
    kept = [k for k in losses if keep[k]]
    total = sum((losses[k] for k in kept), torch.zeros(()))
    row_sums = {i: sum((losses[k] for k in kept if k[0] == i), torch.zeros(())) for i in range(B)}
    row_counts = {i: sum(1 for k in kept if k[0] == i) for i in range(B)}
    rows_with_tokens = sum(1 for i in range(B) if row_counts[i] > 0)
    S = global_batch_size if global_batch_size is not None else max(rows_with_tokens, 1)  # no rows: 0, not NaN
    W = loss_scale_factor if loss_scale_factor is not None else L
    if loss_agg_mode == "token-mean":
        pg = total / (batch_num_tokens if batch_num_tokens is not None else max(len(kept), 1)) * dp_size
    elif loss_agg_mode == "token-sum":
        pg = total * dp_size
    elif loss_agg_mode == "luffy-token-sum-norm":
        pg = total / W * dp_size
    elif loss_agg_mode.startswith("seq-mean-token-sum"):
        pg = sum(row_sums[i] for i in range(B) if row_counts[i]) / S * dp_size
        pg = pg / W if loss_agg_mode.endswith("norm") else pg
    else:
        pg = sum(row_sums[i] / row_counts[i] for i in range(B) if row_counts[i]) / S * dp_size
    if not torch.is_tensor(pg) or not pg.requires_grad:
        pg = torch.as_tensor(pg, dtype=lp.dtype) + 0 * lp.sum()

    def mean(key, n):
        return m[key] / n if n else 0.0

    metrics = {
        "off_pg_loss": mean("off_loss", n_off), "on_pg_loss": mean("on_loss", n_on),
        "on_pg_clipfrac": mean("clipfrac", n_on), "on_pg_clipfrac_lower": mean("clipfrac_lower", n_on),
        "ppo_kl": mean("kl", n_valid), "off_policy_prob": mean("off_prob", n_off),
        "on_policy_prob": mean("on_prob", n_on), "off_ratio_mean": mean("off_ratio", n_off),
        "off_ratio_max_clip_frac": mean("max_clip", n_off), "off_ratio_min_clip_frac": mean("min_clip", n_off),
    }  # fmt: skip
    return pg, metrics


def _batch(seed=0, rows=6, width=5, spread=0.4):
    """(old, lp leaf, adv, mask, prefix): rows 0 and 3 full prefix, row 1 partial prefix, row 5 empty."""
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(rows, width, generator=g) * 2.5 - 0.05).requires_grad_()
    old = lp.detach() + spread * torch.randn(rows, width, generator=g)
    adv = torch.randn(rows, 1, generator=g).expand(rows, width).contiguous()
    lengths = torch.tensor([width, width - 1, width, 2, width, 0])[:rows]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    prefix = torch.zeros(rows, width, dtype=torch.bool)
    prefix[0], prefix[3], prefix[1, :2] = True, True, True
    return old, lp, adv, mask, prefix & mask.bool()


def _check_against_loop(kwargs, batch=None):
    old, lp, adv, mask, prefix = batch or _batch()
    out = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, **kwargs)
    (grad,) = torch.autograd.grad(out["pg_loss"], lp)
    ref_lp = lp.detach().clone().requires_grad_()
    ref, ref_metrics = loop_token_loss(old, ref_lp, adv, mask, prefix, **kwargs)
    (ref_grad,) = torch.autograd.grad(ref, ref_lp)
    assert torch.allclose(out["pg_loss"], ref, rtol=1e-5, atol=1e-6), (kwargs, out["pg_loss"], ref)
    assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6), (kwargs, grad, ref_grad)
    for key, value in ref_metrics.items():
        assert out[key].item() == pytest.approx(value, rel=1e-5, abs=1e-6), (kwargs, key)
        assert math.isfinite(out[key].item())
    return out, grad


RESHAPES = ["no_reshape", "logp", "p_logp", "square_root", "pow", "p_div_p", "p_div_p_0.1", "p_div_p_0.3", "p_div_p_0.5"]


@pytest.mark.parametrize("off_reshape", RESHAPES)
@pytest.mark.parametrize("on_reshape", RESHAPES)
def test_token_loss_every_reshape_matches_loop(off_reshape, on_reshape):
    _check_against_loop(dict(off_policy_reshape=off_reshape, on_policy_reshape=on_reshape,
                             off_policy_reshape_gamma=0.2, off_policy_reshape_weight=0.3,
                             off_policy_reshape_pow_exp=0.7, on_policy_reshape_weight=0.4,
                             on_policy_reshape_pow_exp=0.6))  # fmt: skip


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("remove_clip", [False, True])
def test_token_loss_every_agg_mode_matches_loop(mode, remove_clip):
    _check_against_loop(dict(loss_agg_mode=mode, loss_remove_clip=remove_clip, off_policy_reshape="p_div_p"))
    _check_against_loop(dict(loss_agg_mode=mode, loss_remove_clip=remove_clip, dp_size=4, batch_num_tokens=40,
                             global_batch_size=12, loss_scale_factor=9.0))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(clip_upper_bound=1.5),
        dict(cliprange=0.1, clip_ratio_c=1.5),
        dict(off_max_clip=0.3),
        dict(off_min_clip=0.2),
        dict(off_max_clip=0.6, off_min_clip=0.45, off_policy_reshape="square_root"),
        dict(all_max_clip=0.4),
        dict(all_max_clip=0.4, loss_agg_mode="seq-mean-token-mean"),
        dict(rollout_is_weights="rand"),
        dict(on_policy_reshape="p_div_p", on_policy_reshape_gamma=0.5, off_policy_reshape="p_div_p"),
        dict(target_probs="rand"),
    ],
)
def test_token_loss_options_match_loop(kwargs):
    batch = _batch(seed=1, spread=0.8)  # wide ratios: clipping and dual clip happen
    g = torch.Generator().manual_seed(7)
    kwargs = {k: (torch.rand(batch[1].shape, generator=g) + 0.1 if v == "rand" else v) for k, v in kwargs.items()}
    out, _ = _check_against_loop(kwargs, batch)
    if "clip_ratio_c" in kwargs:
        assert out["on_pg_clipfrac_lower"] > 0 and out["on_pg_clipfrac"] > 0
    if "off_max_clip" in kwargs:
        assert out["off_ratio_max_clip_frac"] > 0
    if "off_min_clip" in kwargs:
        assert out["off_ratio_min_clip_frac"] > 0


def test_token_loss_hand_computed():
    # row 0 on-policy, A = +1: token 0 ratio 0.6/0.4 = 1.5 -> clipped to 1.2, loss -1.2 (gradient 0);
    #                          token 1 ratio 1, loss -1 (d loss / d l = -1).
    # row 1 prefix, A = -1, p = 0.5 and 0.25, f = p/(p+0.1) = 5/6 and 5/7, loss = +f,
    #                          d loss / d l = -A f (1 - f) = 5/36 and 10/49.
    lp = torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.25]])).requires_grad_()
    old = torch.log(torch.tensor([[0.4, 0.3], [0.5, 0.25]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.long)
    prefix = torch.tensor([[0, 0], [1, 1]])
    out = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, off_policy_reshape="p_div_p_0.1")
    total = -1.2 - 1.0 + 5 / 6 + 5 / 7
    assert out["pg_loss"].item() == pytest.approx(total / 4, abs=1e-6)
    assert out["on_pg_loss"].item() == pytest.approx(-1.1, abs=1e-6)
    assert out["off_pg_loss"].item() == pytest.approx((5 / 6 + 5 / 7) / 2, abs=1e-6)
    assert out["off_ratio_mean"].item() == pytest.approx((5 / 6 + 5 / 7) / 2, abs=1e-6)
    assert out["on_pg_clipfrac"].item() == pytest.approx(0.5)  # the original's stock version reports 0
    assert out["off_policy_prob"].item() == pytest.approx(0.375, abs=1e-6)
    assert out["on_policy_prob"].item() == pytest.approx(0.35, abs=1e-6)
    assert out["ppo_kl"].item() == pytest.approx(math.log(0.4 / 0.6) / 4, abs=1e-6)
    (grad,) = torch.autograd.grad(out["pg_loss"], lp)
    assert torch.allclose(grad, torch.tensor([[0.0, -1.0], [5 / 36, 10 / 49]]) / 4, atol=1e-6)

    luffy = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, off_policy_reshape="p_div_p",
                                             loss_agg_mode="luffy-token-sum-norm", loss_remove_clip=True)  # fmt: skip
    # no clipping: token 0 loss is -1.5; sum / L with L = 2
    assert luffy["pg_loss"].item() == pytest.approx((-1.5 - 1.0 + 5 / 6 + 5 / 7) / 2, abs=1e-6)
    assert luffy["on_pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize("mode", VERL_MODES)
def test_token_loss_without_prefix_equals_verl_vanilla(mode):
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    old, lp, adv, mask, _ = _batch(seed=2, spread=1.5)  # large ratios: clip and dual clip both active
    info = {"dp_size": 2, "batch_num_tokens": 31, "global_batch_size": 7, "loss_scale_factor": None}
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                               "clip_ratio_c": 3.0, "global_batch_info": info})  # fmt: skip
    theirs, metrics = compute_policy_loss_vanilla(old, lp, adv, mask.bool(), mode, config=config)
    (their_grad,) = torch.autograd.grad(theirs, lp)
    ours = compute_token_on_off_policy_loss(old, lp, adv, mask, torch.zeros_like(mask), cliprange=0.2,
                                            clip_ratio_c=3.0, loss_agg_mode=mode, **info)  # fmt: skip
    (our_grad,) = torch.autograd.grad(ours["pg_loss"], lp)
    assert torch.equal(ours["pg_loss"], theirs)  # same numbers, bit for bit
    assert torch.allclose(our_grad, their_grad, rtol=1e-6, atol=1e-8)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0
    assert ours["on_pg_clipfrac"].item() == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
    assert ours["on_pg_clipfrac_lower"].item() == pytest.approx(metrics["actor/pg_clipfrac_lower"], abs=1e-6)
    assert ours["ppo_kl"].item() == pytest.approx(metrics["actor/ppo_kl"], abs=1e-6)


def test_token_loss_log_ratio_clamp_blocks_gradient_like_verl():
    old, lp, adv, mask, prefix = _batch(seed=4)
    old = old.clone()
    old[2, 0] = lp[2, 0].detach() - 25.0  # log-ratio +25 -> clamped to 20
    old[4, 1] = lp[4, 1].detach() + 25.0  # log-ratio -25 -> clamped to -20
    _, grad = _check_against_loop(dict(loss_remove_clip=True), (old, lp, adv, mask, prefix))
    assert grad[2, 0] == 0 and grad[4, 1] == 0


def test_token_loss_micro_batch_invariance():
    old, lp, adv, mask, prefix = _batch(seed=5)
    for mode in LOSS_AGG_MODES:
        kw = dict(off_policy_reshape="p_div_p", loss_agg_mode=mode)
        full = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, **kw)["pg_loss"]
        (g_full,) = torch.autograd.grad(full, lp)
        info = dict(batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(-1) > 0).sum()))
        parts = [
            compute_token_on_off_policy_loss(old[s], lp[s], adv[s], mask[s], prefix[s], **kw, **info)["pg_loss"]
            for s in (slice(0, 2), slice(2, 6))
        ]
        (g_split,) = torch.autograd.grad(sum(parts), lp)
        assert torch.allclose(full, sum(parts), atol=1e-6), mode
        assert torch.allclose(g_full, g_split, atol=1e-6), mode


@pytest.mark.parametrize(
    "case", ["empty_prefix", "all_prefix", "all_masked", "single_token", "empty_batch", "zero_length_rows"]
)
def test_token_loss_edge_cases_are_finite(case):
    old, lp, adv, mask, prefix = _batch(seed=6)
    if case == "empty_prefix":
        prefix = torch.zeros_like(prefix)
    elif case == "all_prefix":
        prefix = mask.bool()
    elif case == "all_masked":
        mask = torch.zeros_like(mask)
    elif case == "single_token":
        mask = torch.zeros_like(mask)
        mask[0, 0] = 1
    elif case == "empty_batch":
        old, lp, adv, mask, prefix = (t[:0] for t in (old, lp, adv, mask, prefix))
        lp = lp.detach().requires_grad_()
    elif case == "zero_length_rows":
        mask = mask.clone()
        mask[:3] = 0
    for mode in LOSS_AGG_MODES:
        kwargs = dict(loss_agg_mode=mode, off_policy_reshape="p_div_p", all_max_clip=0.9, off_max_clip=0.8)
        out = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, **kwargs)
        (grad,) = torch.autograd.grad(out["pg_loss"], lp)
        assert all(math.isfinite(v.item()) for v in out.values()), (case, mode, out)
        assert torch.isfinite(grad).all()
        if case != "empty_batch":
            _check_against_loop(kwargs, (old, lp, adv, mask, prefix))
    if case == "empty_prefix":
        assert out["off_pg_loss"] == 0 and out["off_policy_prob"] == 0 and out["off_ratio_mean"] == 0
    if case == "all_prefix":
        assert out["on_pg_loss"] == 0 and out["on_policy_prob"] == 0 and out["on_pg_clipfrac"] == 0
    if case in ("all_masked", "empty_batch"):
        assert out["pg_loss"] == 0 and (grad == 0).all()


def test_token_loss_all_max_clip_drops_confident_tokens():
    lp = torch.log(torch.tensor([[0.9, 0.2]])).requires_grad_()
    old = lp.detach()
    adv = torch.ones(1, 2)
    out = compute_token_on_off_policy_loss(old, lp, adv, torch.ones(1, 2), torch.zeros(1, 2), all_max_clip=0.5)
    assert out["pg_loss"].item() == pytest.approx(-1.0)  # only the p = 0.2 token remains: -A r = -1
    (grad,) = torch.autograd.grad(out["pg_loss"], lp)
    assert grad[0, 0] == 0 and grad[0, 1] == pytest.approx(-1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(off_policy_reshape="p_div_p_0.2"), r"off_policy_reshape='p_div_p_0.2'.*registered: no_reshape"),
        (dict(on_policy_reshape="exp"), r"on_policy_reshape='exp'.*aliases: .*p_div_p_0.5"),
        (dict(off_policy_reshape_gamma=0.0, off_policy_reshape="p_div_p"), "off_policy_reshape_gamma=0.0 must be > 0"),
        (dict(off_policy_reshape_gamma=-1.0), "off_policy_reshape_gamma=-1.0 must be > 0"),
        (dict(on_policy_reshape="p_div_p", on_policy_reshape_gamma=0.0), "on_policy_reshape_gamma=0.0 must be > 0"),
        (dict(loss_agg_mode="mean"), r"loss_agg_mode='mean' is not one of"),
        (dict(cliprange=1.0), "cliprange"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c"),
        (dict(all_max_clip=0.0), "all_max_clip"),
        (dict(off_min_clip=0.5, off_max_clip=0.1), "off_min_clip"),
        (dict(target_probs=torch.ones(6, 5), off_policy_reshape="p_div_p"), "target_probs"),
        (dict(rollout_is_weights=torch.ones(6, 4)), "shape"),
        (dict(dp_size=0), "dp_size"),
    ],
)
def test_token_loss_bad_arguments(kwargs, match):
    old, lp, adv, mask, prefix = _batch()
    with pytest.raises(ValueError, match=match):
        compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, **kwargs)


# ---------------------------------------------------------------------------------------------------
# sft loss, prefix weights, entropy coefficient
# ---------------------------------------------------------------------------------------------------


def test_sft_pure_loss():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1]])).requires_grad_()
    loss = compute_sft_pure_loss(lp, torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx((math.log(2) + math.log(4)) / 2)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad, torch.tensor([[-0.5, -0.5, 0.0]]))
    empty = compute_sft_pure_loss(lp, torch.zeros(1, 3))
    assert empty.item() == 0.0 and torch.isfinite(torch.autograd.grad(empty, lp)[0]).all()


def test_apply_prefix_advantage_weights():
    adv = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, 0.0]])
    prefix = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = apply_prefix_advantage_weights(adv, prefix, alpha=0.5, beta=2.0)
    assert torch.equal(out, torch.tensor([[0.5, 1.0, 6.0], [-2.0, -4.0, 0.0]]))
    assert torch.equal(apply_prefix_advantage_weights(adv, prefix, 1.0, 1.0), adv)


def test_adaptive_entropy_coef_moves_toward_target():
    above = AdaptiveEntropyCoef(init_coef=0.01, target_entropy=1.0, lr=0.1)
    below = AdaptiveEntropyCoef(init_coef=0.01, target_entropy=1.0, lr=0.1)
    for _ in range(3):
        metrics_above = above.update(entropy=2.0)  # too much entropy: lower the bonus
        below.update(entropy=0.5)  # too little: raise it
    assert above.coef < 0.01 < below.coef
    assert metrics_above["entropy_coeff"] == pytest.approx(above.coef)
    assert metrics_above["log_alpha"] == pytest.approx(math.log(above.coef))
    assert metrics_above["alpha_loss"] > 0

    capped = AdaptiveEntropyCoef(init_coef=0.01, target_entropy=1.0, lr=0.5, max_coef=0.02)
    for _ in range(20):
        capped.update(entropy=0.0)
    assert capped.coef == pytest.approx(0.02)
    for _ in range(10):
        capped.update(entropy=5.0)  # it comes back down from the cap (the original's clamp sticks there)
    assert capped.coef < 0.02
    # its options are checked once, as the config keys (init_coef = actor.entropy_coeff: tests/test_loss.py test_errors)
    from mix_src.config.mix_config import LossConfig

    with pytest.raises(ValueError, match=r"mix\.loss\.entropy_coeff_max=-0\.5 must be > 0"):
        LossConfig(use_adaptive_entropy=True, entropy_coeff_max=-0.5)
    with pytest.raises(ValueError, match=r"mix\.loss\.alpha_lr=0 must be > 0"):
        LossConfig(use_adaptive_entropy=True, alpha_lr=0)


def test_token_loss_options_cover_every_reshape_constant():
    # every name the docstring promises is accepted, and the aliases equal p_div_p with their gamma
    old, lp, adv, mask, prefix = _batch()
    for alias, gamma in [("p_div_p_0.1", 0.1), ("p_div_p_0.3", 0.3), ("p_div_p_0.5", 0.5)]:
        a = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, off_policy_reshape=alias)
        b = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix, off_policy_reshape="p_div_p",
                                             off_policy_reshape_gamma=gamma)  # fmt: skip
        assert torch.equal(a["pg_loss"], b["pg_loss"])
    for registry in (core_alg.ON_POLICY_RESHAPES, core_alg.OFF_POLICY_RESHAPES):  # the built-ins (other tests add more)
        builtin = {name for name in registry if registry.get(name).__module__ == "mix_src.algo.token_maths"}
        assert builtin | set(core_alg.P_DIV_P_ALIASES) == set(RESHAPES)
    assert list(itertools.chain(LOSS_AGG_MODES)) == VERL_MODES[:2] + [
        "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "luffy-token-sum-norm"]  # fmt: skip
