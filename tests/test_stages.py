"""mix_src.trainer.stages: the per-step pieces both trainer bases call (pure numpy/torch, hand-computed numbers)."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mix_src.config.mix_config import mix_config_from_dict
from mix_src.trainer.stages import (filter_metric_values, length_clip_metrics, luffy_advantages, luffy_metrics,
                                    prefix_mask_tensor, solved_rows)


def test_prefix_mask_tensor_pads_and_stays_inside_the_response():
    response_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    rows = [np.array([1, 1, 0], dtype=np.uint8), None, np.array([1, 1, 1, 1, 1], dtype=np.uint8)]
    out = prefix_mask_tensor(rows, response_mask)
    assert out.dtype == torch.bool
    assert out.int().tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]


def test_luffy_advantages_split_baseline_and_prefix_weights():
    # one group of 4 rows: row 0 is the expert (solved), rows 1-3 on-policy with rewards 1, 0, 0
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 0.0, 0.0])
    response_mask = torch.ones(4, 2)
    prefix_mask = torch.tensor([[True, True], [False, False], [False, False], [False, False]])
    algo = OmegaConf.create({"adv_estimator": "grpo_split", "norm_adv_by_std_in_grpo": False})
    mix = mix_config_from_dict({"prefix_reward_weight_alpha": 2.0, "prefix_reward_weight_beta": 0.5})

    def never():
        raise AssertionError("grpo_split must not call verl's estimator")

    adv, _ = luffy_advantages(rewards, response_mask, ["u"] * 4, prefix_mask, algo, mix, never)
    mu_on = 1.0 / 3.0  # baseline over the on-policy rows only
    expected = torch.tensor([(1 - mu_on) * 2.0, (1 - mu_on) * 0.5, -mu_on * 0.5, -mu_on * 0.5])
    assert torch.allclose(adv[:, 0], expected) and torch.allclose(adv[:, 1], expected)


def test_luffy_advantages_other_estimators_go_through_verl():
    algo = OmegaConf.create({"adv_estimator": "grpo"})
    mix = mix_config_from_dict({})
    adv = torch.full((2, 3), 0.5)
    out, ret = luffy_advantages(torch.zeros(2, 3), torch.ones(2, 3), ["a", "b"], torch.zeros(2, 3, dtype=torch.bool),
                                algo, mix, lambda: (adv, adv * 2))  # fmt: skip
    assert out is adv and torch.equal(ret, adv * 2)  # alpha = beta = 1: untouched


def test_solve_and_prefix_metrics():
    solved = np.array([1, 0, 0, 0, 1, 1, 1, 1], dtype=bool)
    prefix_mask = torch.zeros(8, 3, dtype=torch.bool)
    prefix_mask[0, :2] = prefix_mask[4, :1] = True  # rows 0 and 4 off-policy
    response_mask = torch.tensor([[1, 1, 1]] * 4 + [[1, 1, 0]] * 4)
    uids = ["a"] * 4 + ["b"] * 4
    m = luffy_metrics(solved, prefix_mask, response_mask, uids, [1.0, 0, 0, 0, 0.5, 0, 0, 0])
    assert m == {"batch/solve_none": 0.0, "batch/solve_all": 0.5, "batch/solved": 5 / 8,
                 "batch/on_solved": 3 / 6, "batch/off_solved": 1.0, "batch/avg_prefix_ratio": 1.5 / 8,
                 "batch/off_policy_rows": 2, "batch/prefix_token_frac": pytest.approx(3 / 20)}  # fmt: skip
    more = luffy_metrics(solved, prefix_mask, response_mask, uids, [0.0] * 8, [True] + [False] * 7, [0, 1] * 4)
    assert more["batch/prefix_truncated"] == 1 and more["reward/ungradable"] == 4


def test_solved_rows_prefers_acc_and_falls_back_to_scores():
    """One rule for both trainers: acc > 0 when every row has an acc, else summed score > 0."""
    scores = lambda: np.array([1.0, 0.0, 0.5, -1.0])  # noqa: E731
    assert solved_rows([1.0, 0.0, 0.0, True], None).tolist() == [True, False, False, True]  # acc decides alone
    assert solved_rows(np.array([1.0, float("nan"), 0.2, 0.0]), scores).tolist() == [True, False, True, False]
    assert solved_rows([1.0, None, 0.0, 1.0], scores).tolist() == [True, False, True, False]  # a row without acc
    assert solved_rows(None, scores).tolist() == [True, False, True, False]


# ---------------------------------------------------------------------------------------------------------
# one meaning per metric name: rollout vs actor over on-policy tokens (both bases call these)
def _rollout_batch():
    from verl import DataProto

    torch.manual_seed(0)
    old = torch.log(torch.rand(4, 6) * 0.9 + 0.05)
    prefix = torch.zeros(4, 6, dtype=torch.bool)
    prefix[0, :4] = True  # row 0: 4 prefix tokens, which the agent loop gives rollout log-prob 0
    rollout = torch.where(prefix, torch.zeros_like(old), old + 1e-4)
    data = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                        "response_mask": torch.ones(4, 6), "responses": torch.zeros(4, 6, dtype=torch.long)})  # fmt: skip
    return data, prefix


def test_rollout_vs_actor_metrics_leave_prefix_tokens_out():
    from verl.utils.debug.metrics import calculate_debug_metrics

    from mix_src.trainer.stages import on_policy_rollout_metrics

    data, prefix = _rollout_batch()
    whole = calculate_debug_metrics(data)  # what verl's V1 stage logs on its own
    ours = on_policy_rollout_metrics(data, prefix)
    assert whole["training/rollout_probs_diff_max"] > 0.5  # a prefix token: p_actor vs exp(0) = 1
    assert ours["training/rollout_probs_diff_max"] < 1e-3
    assert set(ours) == set(whole)  # the same names, one meaning
    assert on_policy_rollout_metrics(data, torch.ones(4, 6, dtype=torch.bool)) == {}


def test_rollout_correction_sees_on_policy_tokens_and_keeps_prefix_weights_at_one():
    from mix_src.trainer.stages import on_policy_rollout_correction

    data, prefix = _rollout_batch()
    seen = {}

    def correct(d, rc):
        seen["mask"] = d.batch["response_mask"].clone()
        d.batch["rollout_is_weights"] = torch.full_like(d.batch["old_log_probs"], 2.0)
        return d, {"rollout_corr/kl": 0.0}

    out, metrics = on_policy_rollout_correction(data, prefix, {"rollout_is": "token"}, correct)
    assert torch.equal(seen["mask"], (~prefix).float())  # verl's correction saw on-policy tokens only
    assert torch.equal(out.batch["response_mask"], torch.ones(4, 6))  # the prefix tokens are back in the mask
    assert torch.all(out.batch["rollout_is_weights"][prefix] == 1.0) and torch.all(out.batch["rollout_is_weights"][~prefix] == 2.0)
    assert metrics == {"rollout_corr/kl": 0.0}


# ---- group-filter metric: one meaning on both bases --------------------------------------------------------------
# Two groups of two rows: group "a" has summed token rewards (1, 1) (std 0: dropped), group "b" (0, 1) (kept); the
# reward's extra key "acc" is (1, 0) in group "a" (kept when it decides) and (1, 1) in group "b".
ROWS_UID = ["a", "a", "b", "b"]
ROWS_SCORES = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.0, 0.0], [0.0, 1.0]])
ROWS_ACC = [1.0, 0.0, 1.0, 1.0]


def _legacy_filter_values(metric):
    """The legacy base's reading (MIXRayPPOTrainer._filter_metric) of the rows above."""
    from types import SimpleNamespace

    from verl import DataProto

    from mix_src.trainer.legacy import MIXRayPPOTrainer

    batch = DataProto.from_dict(tensors={"token_level_scores": ROWS_SCORES},
                                non_tensors={"uid": np.array(ROWS_UID, dtype=object), "acc": np.array(ROWS_ACC)},
                                meta_info={"reward_extra_keys": ["acc"]})  # fmt: skip
    return MIXRayPPOTrainer._filter_metric(SimpleNamespace(filter_cfg=SimpleNamespace(metric=metric)), batch)


def _v1_evicted(metric, monkeypatch, extra=None):
    """The V1 base's replay-buffer classification (make_dapo_filtered_keys) of the rows above: the evicted uids."""
    from collections import defaultdict
    from types import SimpleNamespace

    from mix_src.trainer import v1 as mix_trainer_v1
    from mix_src.trainer import v1_replay  # the buffer's rules, read through mix_trainer_v1's re-export

    extra = extra if extra is not None else [{"reward_extra_info": {"acc": a}} for a in ROWS_ACC]
    keys = [f"{u}_{i}" for i, u in enumerate(ROWS_UID)]
    fake_tq = SimpleNamespace(kv_batch_get=lambda keys, partition_id, select_fields: {
        "extra_fields": extra, "rm_scores": list(ROWS_SCORES)})  # fmt: skip
    monkeypatch.setattr(v1_replay, "tq", fake_tq)
    buffer = SimpleNamespace(filter_groups_metric=metric, finished_keys={"train": {"a", "b"}},
                             _dapo_classification_cache=defaultdict(dict), partitions={"train": keys})  # fmt: skip
    evicted, _ = mix_trainer_v1.make_dapo_filtered_keys("nonzero_std", False)(buffer, "train")
    return evicted


@pytest.mark.parametrize("metric", ["reward", "seq_reward", None])
def test_filter_metric_reward_and_seq_reward_are_the_summed_token_reward_on_both_bases(metric, monkeypatch):
    assert _legacy_filter_values(metric).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert _legacy_filter_values(metric).dtype == np.float64
    if metric is not None:  # V1: an unset metric is set to "reward" before verl builds the buffer
        assert _v1_evicted(metric, monkeypatch) == {"a"}


def test_filter_metric_extra_key_on_both_bases_and_a_missing_one_names_the_metric(monkeypatch):
    assert _legacy_filter_values("acc").tolist() == ROWS_ACC
    assert _v1_evicted("acc", monkeypatch) == {"b"}
    with pytest.raises(KeyError, match=r"metric='score'.*seq_reward.*\['acc'\]"):
        _legacy_filter_values("score")
    with pytest.raises(KeyError, match=r"metric='score'.*seq_reward.*\['acc'\]"):
        _v1_evicted("score", monkeypatch)


def test_filter_metric_values_calls_only_what_it_needs():
    def never(*_):
        raise AssertionError("not needed")

    assert filter_metric_values("seq_reward", lambda: [2.0], never).tolist() == [2.0]
    assert filter_metric_values("acc", never, lambda name: [0.5]).tolist() == [0.5]


def test_length_clip_metrics_measure_against_the_configured_limits_not_the_batch_width():
    # prompts of 24 tokens with max_prompt_length 64: none clipped, although every prompt is as long as the longest
    # (verl's compute_data_metrics on V1's tensors, padded to the longest row, reported 1.0)
    prompt, response = torch.tensor([24, 24, 24, 24]), torch.tensor([24, 10, 0, 24])
    out = length_clip_metrics(prompt, response, max_prompt_length=64, max_response_length=24)
    assert out == {"prompt_length/clip_ratio": 0.0, "response_length/clip_ratio": 0.5,
                   "response_length_non_aborted/clip_ratio": torch.tensor(2 / 3).item()}  # float32 means, as verl's  # fmt: skip
    assert length_clip_metrics(prompt, response, 24, 32)["prompt_length/clip_ratio"] == 1.0
    assert np.isnan(length_clip_metrics(prompt, torch.zeros(4), 64, 24)["response_length_non_aborted/clip_ratio"])
