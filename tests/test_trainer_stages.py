"""MIXRayPPOTrainer's stage methods on real DataProto batches, without Ray.

The trainer is made with ``object.__new__`` and only the attributes the stages read (config, mix, n ...):
no worker group is involved in these stages. Each test pins one branch of the trainer that no pure-layer
test can see: deleting the branch fails the test.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto

from mix_src.mix_config import mix_config_from_dict
from mix_src.mix_trainer import MIXRayPPOTrainer

N = 4  # rollout.n
L = 3  # response width


def make_trainer(adv_estimator="grpo_split", mix=None, use_std=True, filter_metric="acc"):
    trainer = object.__new__(MIXRayPPOTrainer)
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": adv_estimator, "norm_adv_by_std_in_grpo": use_std, "use_kl_in_reward": False,
                      "gamma": 1.0, "lam": 1.0,
                      "filter_groups": {"enable": True, "metric": filter_metric, "max_num_gen_batches": 0}},
        "actor_rollout_ref": {"rollout": {"n": N}},
    })
    trainer.mix = mix_config_from_dict(mix or {})
    trainer.n = N
    trainer.filter_cfg = trainer.config.algorithm.filter_groups
    trainer.prefix_seed = 0
    trainer.global_steps = 1
    return trainer


def make_batch(scores, off_rows, acc=None, ungradable=None):
    """Rows i*N + j of prompt i; a row's score sits on its last token; off-policy rows have a 2-token prefix."""
    b = len(scores)
    token_scores = torch.zeros(b, L)
    token_scores[:, -1] = torch.tensor(scores, dtype=torch.float32)
    prefix = torch.zeros(b, L, dtype=torch.bool)
    prefix[list(off_rows), :2] = True
    non_tensors = {"uid": np.array([f"p{i // N}" for i in range(b)], dtype=object),
                   "prefix_ratio": np.array([1.0 if i in off_rows else 0.0 for i in range(b)])}
    if acc is not None:
        non_tensors["acc"] = np.array(acc, dtype=bool)
    if ungradable is not None:
        non_tensors["ungradable"] = np.array(ungradable, dtype=bool)
    return DataProto.from_dict(tensors={"token_level_scores": token_scores, "response_mask": torch.ones(b, L),
                                        "prefix_mask": prefix}, non_tensors=non_tensors)


# prompt 0: the demonstration (row 0) solved, the model's own samples 1 / 0 / 0
# prompt 1: all on-policy, 1 / 1 / 0 / 0
SCORES = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
OFF = {0}


def test_grpo_split_baseline_comes_from_on_policy_rows_only():
    trainer = make_trainer("grpo_split")
    out = trainer._compute_advantages(make_batch(SCORES, OFF), {}, {})
    adv = out.batch["advantages"][:, 0]
    # prompt 0: on-policy rows 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3); every row uses them
    mu, sd = 1 / 3, math.sqrt(1 / 3)
    expected0 = [(r - mu) / (sd + 1e-6) for r in SCORES[:4]]
    # prompt 1: 1, 1, 0, 0 -> mean 1/2, std sqrt(1/3)
    expected1 = [(r - 0.5) / (math.sqrt(1 / 3) + 1e-6) for r in SCORES[4:]]
    assert adv.tolist() == pytest.approx(expected0 + expected1, rel=1e-5)
    # verl's own grpo over all rows would give the demonstration (1 - 1/2)/sqrt(1/3): not what we want
    assert adv[0].item() == pytest.approx((1 - 1 / 3) / sd, rel=1e-5)
    assert torch.equal(out.batch["returns"], out.batch["advantages"])
    # norm_adv_by_std_in_grpo=false: A = R - mean(on-policy rows)
    plain = make_trainer("grpo_split", use_std=False)._compute_advantages(make_batch(SCORES, OFF), {}, {})
    assert plain.batch["advantages"][:4, 0].tolist() == pytest.approx([r - mu for r in SCORES[:4]], rel=1e-6)


def test_prefix_advantage_weights_alpha_beta():
    base = make_trainer("grpo")._compute_advantages(make_batch(SCORES, OFF), {}, {}).batch["advantages"]
    weighted = make_trainer("grpo", mix={"prefix_reward_weight_alpha": 2.0, "prefix_reward_weight_beta": 0.5}) \
        ._compute_advantages(make_batch(SCORES, OFF), {}, {}).batch["advantages"]
    prefix = make_batch(SCORES, OFF).batch["prefix_mask"]
    assert prefix.any() and (~prefix).any() and base.abs().sum() > 0
    torch.testing.assert_close(weighted[prefix], 2.0 * base[prefix])
    torch.testing.assert_close(weighted[~prefix], 0.5 * base[~prefix])


def test_filter_groups_on_policy_only():
    # prompt 0: the demonstration solved, the model's own samples all failed: its std is 0 on-policy only
    acc = [True, False, False, False, True, True, False, False]
    batch = make_batch([float(a) for a in acc], OFF, acc=acc)
    every_row = make_trainer(mix={})._filter_groups(batch)
    assert every_row.keep_rows.tolist() == [True] * 8
    on_only = make_trainer(mix={"filter_groups": {"on_policy_only": True}})._filter_groups(batch)
    assert on_only.keep_rows.tolist() == [False] * 4 + [True] * 4
    assert on_only.num_kept == 1 and on_only.num_groups == 2


def test_ungradable_rows_reach_the_step_metrics():
    batch = make_batch(SCORES, OFF, acc=[s > 0 for s in SCORES], ungradable=[False, True] + [False] * 5 + [True])
    metrics: dict = {}
    make_trainer()._add_rollout_metrics(batch, metrics)
    assert metrics["reward/ungradable"] == 2
    assert metrics["batch/off_solved"] == 1.0 and metrics["batch/on_solved"] == pytest.approx(3 / 7)


def test_non_default_target_key_reaches_the_prefix_ratios(tmp_path, tiny_assets):
    """mix.data.target_key names the parquet column; the rows carry the target as `target`, which the agent
    loop and the trainer's prefix-ratio draw read."""
    from transformers import AutoTokenizer

    from mix_src.dataset import RLHFDatasetWithTarget

    rows = [{"data_source": "t", "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i},
             "expert": [{"role": "assistant", "content": f"<think>x</think> \\boxed{{{i}}}"}] if i == 0 else []}
            for i in range(2)]
    path = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(path)
    mix = {"n_prefix": 1, "data": {"target_key": "expert"}}
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 256, "filter_overlong_prompts": False,
                            "seed": 3, "cache_dir": str(tmp_path / "cache"), "mix": mix})
    ds = RLHFDatasetWithTarget(str(path), AutoTokenizer.from_pretrained(tiny_assets["tokenizer"]), cfg)
    targets = [ds[i]["target"] for i in range(2)]
    assert targets == ["<think>x</think> \\boxed{0}", ""]

    gen = DataProto.from_dict(tensors={"x": torch.zeros(2 * N, 1)},
                              non_tensors={"target": np.array([t for t in targets for _ in range(N)], dtype=object)})
    ratios = make_trainer(mix=mix)._prefix_ratios(gen, gen_index=0)
    assert ratios.tolist() == [1.0, 0.0, 0.0, 0.0] + [0.0] * N  # one full demonstration for the prompt with one


class _FakeActorGroup:
    """Only what the driver reads from the actor worker group here: its DP layout (2 ranks)."""

    _dispatch_info = {"actor": [0, 1]}
    world_size = 2


class _FakeCheckpointManager:
    def update_weights(self, step):
        self.step = step


def test_update_adds_all_max_clip_kept_counts_for_the_workers():
    """Stage 6 puts each row's global mini-batch kept-token count into the batch before update_actor
    (all_max_clip with token-mean), laid out for verl's DP split."""
    trainer = make_trainer("grpo", mix={"loss": {"all_max_clip": 0.5}})
    trainer.config = OmegaConf.merge(trainer.config, {
        "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "ppo_mini_batch_size": 1}},
        "trainer": {"critic_warmup": 0, "save_freq": -1}})
    trainer.use_critic = False
    trainer.actor_rollout_wg = _FakeActorGroup()
    trainer.checkpoint_manager = _FakeCheckpointManager()
    sent = []
    trainer._update_actor = lambda batch: sent.append(batch) or DataProto(meta_info={"metrics": {}})
    batch = make_batch(SCORES, OFF)
    # p_old: row r keeps its first r % 3 tokens (p = 0.1), the others have p = 0.9 > 0.5
    old = torch.full((8, L), math.log(0.9))
    for r in range(8):
        old[r, : r % 3] = math.log(0.1)
    batch.batch["old_log_probs"] = old
    trainer._update(batch, {}, {}, is_last_step=False)
    # 8 rows, 2 ranks (rows 0-3, 4-7), mini-batches of 1 prompt x 4 rows = 2 rows per rank:
    # global mini-batch 0 = rows 0, 1, 4, 5 (kept 0+1+1+2 = 4), mini-batch 1 = rows 2, 3, 6, 7 (2+0+0+1 = 3)
    assert sent[0].batch["mix_kept_tokens"].tolist() == [4, 4, 3, 3, 4, 4, 3, 3]
    # token-sum (or no all_max_clip): nothing added
    trainer.config.actor_rollout_ref.actor.loss_agg_mode = "token-sum"
    trainer._update(make_batch(SCORES, OFF), {}, {}, is_last_step=False)
    assert "mix_kept_tokens" not in sent[1].batch.keys()
