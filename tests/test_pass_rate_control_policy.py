"""The pass-rate control rollout policy (recipes/pass_rate_control/pass_rate_control.py) on scripted generation passes
(no Ray): which groups are steered and with what, the closed loop through the policy, the failure side, the state's
save/restore, the replay mask. Its 2 real training steps on both bases: tests/test_pass_rate_control_e2e.py."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from verl import DataProto

from mix_src.algo.prefix_select import PREFIX_TOKEN_SELECTS, PrefixTokenView, select_prefix_tokens
from mix_src.config.mix_config import mix_config_from_dict
from mix_src.extend import load_plugins
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES, RolloutContext

PLUGIN = Path(__file__).resolve().parents[1] / "recipes" / "pass_rate_control" / "pass_rate_control.py"
load_plugins([str(PLUGIN)])  # once, at import (its verl imports are the file's, not a test's, time)
N, L, NAME = 4, 6, "pass_rate_control"


class Tok:
    eos_token_id = 99

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def scripted(unaided, guided_rate, *, targets=None, failure_prefixes=False, n_prefix=-1, state=None, **settings):
    """A context over len(unaided) prompts: pass 1 solves the rows ``unaided[i][j]``; a regenerated row j of prompt i
    with ratio r solves iff j-th of the group's regenerated rows < round(len * guided_rate(i, r, target)). Every call
    is recorded as (rows, ratios, targets)."""
    P, calls = len(unaided), []
    B = P * N
    targets = ["demo%d" % i for i in range(P)] if targets is None else targets

    def generate(ratios, rows=None, targets=None):
        idx = np.arange(B) if rows is None else np.asarray(rows)
        ratios = np.asarray(ratios, dtype=float)
        calls.append((idx.copy(), ratios.copy(), None if targets is None else list(targets)))
        acc = np.zeros(len(idx))
        if rows is None:
            acc = np.asarray([unaided[r // N][r % N] for r in idx], dtype=float)
        else:
            for i in sorted({r // N for r in idx}):
                mine = [k for k, r in enumerate(idx) if r // N == i]
                rate = guided_rate(i, ratios[mine[0]], targets[mine[0]])
                for pos, k in enumerate(mine):
                    acc[k] = float(pos < round(len(mine) * rate))
        prompts = torch.tensor([[0, 10 + r // N, 20 + r // N] for r in idx])  # left-padded prompt ids
        att = torch.cat([torch.tensor([[0, 1, 1]] * len(idx)), torch.ones(len(idx), L, dtype=torch.long)], dim=-1)
        prefix = torch.zeros(len(idx), L, dtype=torch.bool)
        for k, r in enumerate(ratios):
            prefix[k, : int(math.floor(r * L))] = True
        responses = torch.arange(L).repeat(len(idx), 1) + 100 * torch.as_tensor(idx)[:, None]
        return DataProto.from_dict(
            tensors={"prompts": prompts, "attention_mask": att, "responses": responses, "prefix_mask": prefix,
                     "response_mask": torch.ones(len(idx), L, dtype=torch.long), "row": torch.as_tensor(idx)},
            non_tensors={"acc": acc, "prefix_ratio": ratios})  # fmt: skip

    options = {NAME: {"failure_prefixes": failure_prefixes, **settings}}
    mix = mix_config_from_dict({"n_prefix": n_prefix, "plugins": [str(PLUGIN)], "plugin_options": options,
                               "rollout_policy": NAME})
    rows_target = np.asarray([t for t in targets for _ in range(N)], dtype=object)
    batch = DataProto.from_dict(tensors={"row": torch.arange(B)})  # as on the legacy base: no target column here ...

    def records(rows):  # ... but in the rows' records
        return DataProto.from_dict(non_tensors={"target": rows_target[np.asarray(rows)]})

    ctx = RolloutContext(batch=batch, n=N, global_step=1, mix=mix, generate=generate, prefix_ratios=lambda: None,
                         rng=np.random.default_rng(0), records=records, state={} if state is None else state,
                         tokenizer=Tok())
    return ctx, calls


def run(ctx):
    return ROLLOUT_POLICIES.get(NAME)(ctx)


def test_only_skewed_groups_with_a_source_are_steered():
    # prompt 0: 0/4 (head start); 1: 2/4 (in band); 2: 4/4 (above, but failure prefixes off); 3: 1/4, no target
    unaided = [[0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]]
    ctx, calls = scripted(unaided, lambda i, r, t: 0.5, targets=["demo0", "demo1", "demo2", None])
    out = run(ctx)
    assert len(calls) == 2 and calls[0][1].tolist() == [0.0] * 16
    assert calls[1][0].tolist() == [0, 1, 2, 3] and calls[1][1].tolist() == [0.5] * 4  # init_ratio 0.5
    assert calls[1][2] == ["demo0"] * 4
    assert out.batch["row"].tolist() == list(range(16))
    assert out.non_tensor_batch["acc"].tolist() == [1, 1, 0, 0] + [1, 0, 1, 0] + [1] * 4 + [0, 1, 0, 0]
    st = ctx.state[NAME]
    assert len(st["head_start"]) == 1 and not st["handicap"]
    (entry,) = st["head_start"].values()
    assert entry == {"ratio": 0.5, "rate": 0.5, "visits": 1}  # after 2/4 = target: unchanged
    m = ctx.metrics
    assert m[f"{NAME}/pass_rate_before"] == pytest.approx((0 + 0.5 + 1 + 0.25) / 4)
    assert m[f"{NAME}/pass_rate_after"] == pytest.approx((0.5 + 0.5 + 1 + 0.25) / 4)
    assert m[f"{NAME}/informative_before"] == 0.5 and m[f"{NAME}/informative_after"] == 0.75
    assert m[f"{NAME}/head_start_groups"] == 1 and m[f"{NAME}/handicap_groups"] == 0
    assert m[f"{NAME}/head_start_ratio"] == 0.5 and m[f"{NAME}/guided_rows"] == 4
    assert m[f"{NAME}/prefix_tokens"] == 3.0  # floor(0.5 * 6)


def test_n_prefix_limits_the_regenerated_rows_to_failed_ones():
    ctx, calls = scripted([[1, 0, 0, 0]], lambda i, r, t: 1.0, n_prefix=2, band_low=0.3, target=0.5)
    run(ctx)
    assert calls[1][0].tolist() == [1, 2]  # 1/4 < 0.3: the first 2 failed rows; the solved row 0 is kept


def curve(r, c=0.7, w=0.1):
    return 1.0 / (1.0 + math.exp(-(r - c) / w))


def test_closed_loop_through_the_policy_reaches_the_band():
    state, rates = {}, []
    for _ in range(6):
        ctx, _ = scripted([[0, 0, 0, 0]], lambda i, r, t: curve(r), state=state)
        run(ctx)
        rates.append(ctx.metrics[f"{NAME}/pass_rate_after"])
    assert rates[0] < 0.25 and all(0.25 <= p <= 0.75 for p in rates[1:])  # ratio 0.5 -> 0.75 -> ...


def test_failure_prefixes_store_failures_and_handicap_passing_groups():
    state = {}
    ctx, _ = scripted([[1, 0, 1, 1]], lambda i, r, t: 0.0, failure_prefixes=True, state=state)
    run(ctx)  # 3/4 is in the band: nothing steered, the failed row 1 stored
    (failure,) = state[NAME]["failures"].values()
    assert failure == " ".join(str(100 + j) for j in range(L))
    seen = []
    ctx, calls = scripted([[1, 1, 1, 1]], lambda i, r, t: seen.append(t) or 0.5, failure_prefixes=True, state=state)
    run(ctx)
    assert calls[1][0].tolist() == [0, 1, 2, 3] and calls[1][2] == [failure] * 4 and seen == [failure]
    assert ctx.metrics[f"{NAME}/handicap_groups"] == 1
    ctx, calls = scripted([[1, 1, 1, 1]], lambda i, r, t: 0.5, failure_prefixes=False)
    run(ctx)
    assert len(calls) == 1  # off by default: no handicap


def test_state_survives_a_checkpoint_and_the_run_continues_identically():
    def steps(state, k):
        trace = []
        for step in range(k):
            unaided = [[0, 0, 0, 0], [0, 0, 1, 0], [1, 0, 1, 1]]
            ctx, calls = scripted(unaided, lambda i, r, t: curve(r, c=0.5 + 0.1 * i), failure_prefixes=True,
                                  state=state)
            run(ctx)
            trace.append([(c[0].tolist(), c[1].tolist(), c[2]) for c in calls])
        return trace

    state = {}
    steps(state, 3)
    buf = io.BytesIO()
    torch.save({"rollout_policy": state}, buf)  # what mix_state.pt holds
    buf.seek(0)
    restored = torch.load(buf, weights_only=False)["rollout_policy"]
    twin = copy.deepcopy(state)
    assert restored == state
    assert steps(restored, 4) == steps(twin, 4) and restored == twin


def test_replay_masked_zeroes_every_prefix_advantage():
    pm = torch.tensor([[True, True, False], [False, False, False]])
    view = PrefixTokenView(entropy=None, log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3),
                           advantages=torch.ones(2, 3), response_mask=torch.ones(2, 3, dtype=torch.bool),
                           prefix_mask=pm, ratio=0.0)  # fmt: skip
    scripted([[0, 0, 0, 0]], lambda i, r, t: 0.0)  # loads the plugin
    assert "ratio" in PREFIX_TOKEN_SELECTS.settings("replay_masked", {})  # what the worker loss reads
    adv, kept, on_policy = select_prefix_tokens("replay_masked", view)
    assert adv.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]] and not kept.any() and not on_policy


@pytest.mark.parametrize("options,match", [({"band_low": 0.6}, "band_low <= target"), ({"gain": 0}, "gain")])
def test_bad_settings_refused_before_ray(options, match):
    from omegaconf import OmegaConf

    from mix_src.extend import EntryConfigError, check_selected_entries, resolve_settings

    cfg = OmegaConf.create({"mix": {"rollout_policy": NAME, "n_prefix": -1, "plugins": [str(PLUGIN)],
                                    "plugin_options": {NAME: options}}, "actor_rollout_ref": {"rollout": {"n": 4}}})
    mix_config_from_dict({"plugins": [str(PLUGIN)]})
    with pytest.raises(EntryConfigError, match=match):
        resolve_settings(cfg)
        check_selected_entries(cfg)


def test_policy_metrics_reach_the_step_metrics_through_the_trainer():
    from mix_src.trainer.common import MixTrainerCommon

    trainer = MixTrainerCommon()
    for unaided in ([[0, 0, 0, 0]], [[1, 0, 1, 0]]):  # two generation batches of one step (filter groups)
        ctx, _ = scripted(unaided, lambda i, r, t: 0.5)
        trainer.mix, trainer.n, trainer.global_steps, trainer.prefix_seed = ctx.mix, N, 1, 0
        trainer._rollout_state = {}
        trainer._run_rollout_policy(ctx.batch, 0, generate=ctx.generate, prefix_ratios=ctx.prefix_ratios,
                                    records=ctx.records)
    m = trainer._pop_policy_metrics()
    assert m[f"{NAME}/pass_rate_before"] == 0.25 and m[f"{NAME}/head_start_groups"] == 0.5  # means over the 2
    assert f"{NAME}/head_start_ratio" in m and trainer._pop_policy_metrics() == {}
