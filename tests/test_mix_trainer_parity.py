"""MIXRayPPOTrainer honours what verl's RayPPOTrainer.fit honours (no Ray): critic values for GAE, rollout
correction off prefix tokens, ESI expiry checkpoints, rollout dumps, a final checkpoint and validation
when the data runs out, resume at the exact data position, a colocated reward model only while the
rollout sleeps, and per-step rollout timing over several generation batches.

Ray worker-group calls (``_update_actor``, ``_compute_values`` ...) are replaced by small functions that
record what they were given; the trainer code and verl's helpers it calls are the real ones.
"""

import json
import os
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto

from mix_src.config.mix_config import mix_config_from_dict
from mix_src.trainer.legacy import MIXRayPPOTrainer, merge_rollout_timing

N = 2  # samples per prompt


class Recorder:
    def __init__(self, events):
        self.events = events

    def sleep_replicas(self):
        self.events.append("sleep")

    def update_weights(self, step):
        self.events.append("wake")


def make_trainer(tmp_path=None, **config):
    trainer = object.__new__(MIXRayPPOTrainer)
    base = {
        "data": {"train_batch_size": 2},
        "trainer": {"save_freq": 4, "test_freq": 5, "critic_warmup": 0, "esi_redundant_time": 0,
                    "balance_batch": False, "default_local_dir": str(tmp_path or "unused"),
                    "default_hdfs_dir": None, "resume_mode": "auto", "resume_from_path": None,
                    "del_local_ckpt_after_load": False, "total_epochs": 3},
        "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "use_kl_in_reward": False,
                      "kl_penalty": "kl", "filter_groups": {"enable": False}, "rollout_correction": None},
        "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "checkpoint": {"async_save": False}},
                              "rollout": {"temperature": 1.0}},
    }  # fmt: skip
    trainer.config = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(config))
    trainer.mix = mix_config_from_dict({})
    trainer.filter_cfg = trainer.config.algorithm.filter_groups
    trainer.n, trainer._carry, trainer._epoch, trainer.global_steps, trainer.prefix_seed = N, None, 0, 1, 0
    trainer.use_rm = trainer.use_critic = trainer.use_reference_policy = False
    trainer._rollout_awake, trainer.max_steps_duration = True, 0.0
    trainer.events = []
    trainer.checkpoint_manager = Recorder(trainer.events)
    trainer.train_dataset = None  # verl's __init__ sets it; no rollout policy here retires prompts from it
    return trainer


def rows_batch(rows=4, width=5, prefix_rows=(0,), prefix_len=2):
    response_mask = torch.ones(rows, width, dtype=torch.int64)
    response_mask[:, -1] = 0
    prefix = torch.zeros(rows, width, dtype=torch.bool)
    for r in prefix_rows:
        prefix[r, :prefix_len] = True
    scores = torch.zeros(rows, width)
    scores[::2, 3] = 1.0
    return DataProto.from_dict(
        tensors={"response_mask": response_mask, "prefix_mask": prefix, "token_level_scores": scores,
                 "attention_mask": torch.ones(rows, 3 + width, dtype=torch.int64),
                 "responses": torch.zeros(rows, width, dtype=torch.int64)},
        non_tensors={"uid": np.array([f"g{i // N}" for i in range(rows)], dtype=object),
                     "prefix_ratio": np.array([1.0 if i in prefix_rows else 0.0 for i in range(rows)])},
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
def test_gae_gets_critic_values_and_advantages():
    trainer = make_trainer(algorithm={"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95})
    trainer.use_critic = True
    calls = []

    def old_log_prob(batch):
        calls.append("old")
        shape = batch.batch["response_mask"].shape
        return DataProto.from_dict({"old_log_probs": torch.full(shape, -1.0), "entropys": torch.ones(shape)}), 0.0

    def values(batch):
        calls.append("values")
        return DataProto.from_dict({"values": torch.full(batch.batch["response_mask"].shape, 0.25)})

    trainer._compute_old_log_prob, trainer._compute_values = old_log_prob, values
    metrics = {}
    batch = trainer._compute_log_probs(rows_batch(), metrics, {})
    assert calls == ["old", "values"] and torch.all(batch.batch["values"] == 0.25)
    batch = trainer._compute_advantages(batch, metrics, {})  # verl's GAE: KeyError 'values' without them
    assert batch.batch["advantages"].shape == (4, 5) and torch.isfinite(batch.batch["returns"]).all()


def test_rollout_correction_never_touches_prefix_tokens():
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    rc = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
          "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_1.5", "bypass_mode": False}  # fmt: skip
    trainer = make_trainer(algorithm={"rollout_correction": rc})
    batch = rows_batch(prefix_rows=(0, 2))
    gen = torch.Generator().manual_seed(0)
    batch.batch["old_log_probs"] = -torch.rand(4, 5, generator=gen)
    rollout = batch.batch["old_log_probs"] + 2.0 * (torch.rand(4, 5, generator=gen) - 0.5)
    rollout[batch.batch["prefix_mask"]] = 0.0  # the agent loop's placeholder for target tokens
    batch.batch["rollout_log_probs"] = rollout
    prefix = batch.batch["prefix_mask"].clone()
    full = batch.batch["response_mask"].clone()

    metrics = {}
    out = trainer._apply_rollout_correction(batch, metrics)
    weights, mask = out.batch["rollout_is_weights"], out.batch["response_mask"]
    assert torch.all(weights[prefix] == 1.0) and torch.equal(mask[prefix], full[prefix])
    assert any(k.startswith("rollout_corr/") for k in metrics)
    # on-policy tokens get exactly verl's weights and rejections computed over on-policy tokens only
    ref = DataProto.from_dict({"old_log_probs": batch.batch["old_log_probs"], "rollout_log_probs": rollout,
                               "response_mask": full * (~prefix).long()})  # fmt: skip
    ref, _ = compute_rollout_correction_and_add_to_batch(ref, OmegaConf.create(rc))
    on = ~prefix
    torch.testing.assert_close(weights[on], ref.batch["rollout_is_weights"][on])
    assert torch.equal(mask[on], ref.batch["response_mask"][on])
    assert mask[on].sum() < full[on].sum()  # the rejection did reject on-policy tokens

    # a batch of target tokens only (every row a whole target, e.g. n_prefix=-1): nothing to correct
    only_targets = rows_batch(rows=2, prefix_rows=(0, 1), prefix_len=4)
    only_targets.batch["old_log_probs"] = torch.full((2, 5), -1.0)
    only_targets.batch["rollout_log_probs"] = torch.zeros(2, 5)
    out = trainer._apply_rollout_correction(only_targets, {})
    assert "rollout_is_weights" not in out.batch.keys()


def _update_fakes(trainer):
    trainer._update_actor = lambda batch: DataProto.from_single_dict({}, meta_info={"metrics": {"actor/x": [1.0]}})
    trainer._save_checkpoint = lambda: trainer.events.append(f"save{trainer.global_steps}")


def test_esi_expiry_forces_a_checkpoint(monkeypatch):
    trainer = make_trainer()
    _update_fakes(trainer)
    trainer.global_steps, trainer.max_steps_duration = 3, 10.0
    trainer._update(rows_batch(), {}, {}, is_last_step=False)
    assert "save3" not in trainer.events
    monkeypatch.setenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", str(time.time() + 30))
    trainer._update(rows_batch(), {}, {}, is_last_step=False)  # 30 s left < 60 s save + 10 s step
    assert trainer.events[-2:] == ["save3", "wake"]


def test_rollout_data_dir_dumps_rows_with_prefix_info(tmp_path, tiny_assets):
    from transformers import AutoTokenizer

    trainer = make_trainer()
    trainer.tokenizer = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    trainer._init_dump_executor()
    batch = rows_batch()
    batch.batch["prompts"] = torch.zeros(4, 3, dtype=torch.int64)
    batch.batch["rm_scores"] = batch.batch["token_level_scores"]
    trainer._dump_rollouts(batch, {}, str(tmp_path))
    trainer._shutdown_dump_executor()
    rows = [json.loads(line) for line in open(tmp_path / "1.jsonl")]
    assert len(rows) == 4 and [r["prefix_ratio"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
    assert [r["prefix_tokens"] for r in rows] == [2, 0, 0, 0] and rows[0]["score"] == 1.0


@pytest.mark.parametrize("last_done, saves, validates", [(5, True, False), (4, False, True), (2, True, True)])
def test_data_running_out_saves_and_validates_the_last_step(last_done, saves, validates):
    """save_freq=4, test_freq=5: the last finished step gets what its own step did not already do."""
    trainer = make_trainer()
    _update_fakes(trainer)
    trainer._validate = lambda: trainer.events.append(f"val{trainer.global_steps}") or {"val/x": 1.0}
    logged = []
    tracker = type("T", (), {"log": lambda self, data, step: logged.append(step)})()
    trainer.global_steps = last_done + 1  # the step that could not be filled
    trainer._end_of_data(tracker, first_step=1)
    assert trainer.global_steps == last_done
    assert (f"save{last_done}" in trainer.events) == saves and (f"val{last_done}" in trainer.events) == validates
    assert logged == ([last_done] if validates else [])


def test_resume_continues_the_data_where_it_stopped(tmp_path):
    """Filter groups: 4 steps used all 4 batches of epoch 0 and 1 of epoch 1. verl takes global_steps=4 for
    an epoch boundary (4 % 4 == 0) and drops the dataloader state: epoch 1 would start over."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))

    class WorkerGroup:
        def save_checkpoint(self, *a, **k):
            pass

        def load_checkpoint(self, *a, **k):
            pass

    def trainer_at(step):
        t = make_trainer(tmp_path)
        t.train_dataloader, t.actor_rollout_wg, t.global_steps = loader(), WorkerGroup(), step
        return t

    first = trainer_at(4)
    batches = first._train_batches()
    seen = [next(batches).tolist() for _ in range(5)]
    first._save_checkpoint()
    rest = [b.tolist() for b in batches]

    resumed = trainer_at(0)
    resumed._load_checkpoint()
    assert resumed.global_steps == 4 and resumed._epoch == 1
    after = [b.tolist() for b in resumed._train_batches()]
    assert after[:3] == rest[:3]  # the rest of epoch 1, exactly as the first run would have had it
    assert len(seen) + len(after) == 3 * 4  # no batch replayed or skipped over the 3 epochs
    assert sorted(sum(after[3:], [])) == list(range(8))  # then one whole epoch 2


def test_resume_at_an_epoch_end_moves_to_the_next_epoch(tmp_path):
    """Without filter groups, step 4 of 4 batches: verl skips the exhausted dataloader state; the MIX
    loop must not run epoch 0 again."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    class WorkerGroup:
        def save_checkpoint(self, *a, **k):
            pass

        def load_checkpoint(self, *a, **k):
            pass

    def trainer_at(step):
        t = make_trainer(tmp_path, trainer={"total_epochs": 2})
        t.train_dataloader = StatefulDataLoader(list(range(8)), batch_size=2, shuffle=False)
        t.actor_rollout_wg, t.global_steps = WorkerGroup(), step
        return t

    first = trainer_at(4)
    batches = first._train_batches()
    [next(batches) for _ in range(4)]
    first._save_checkpoint()
    resumed = trainer_at(0)
    resumed._load_checkpoint()
    assert len(list(resumed._train_batches())) == 4  # epoch 1 only


def test_colocated_reward_model_runs_while_the_rollout_sleeps():
    trainer = make_trainer()
    trainer.use_rm = True

    def reward(batch):
        trainer.events.append("reward")
        return DataProto.from_dict({"rm_scores": batch.batch["token_level_scores"].clone()})

    trainer._compute_reward_colocate = reward

    class Rollout:
        def generate_sequences(self, gen_batch):
            trainer.events.append("generate")
            rows = len(gen_batch)
            mask = np.empty(rows, dtype=object)
            mask[:] = [np.array([1, 1], dtype=np.uint8) if r > 0 else np.zeros(0, dtype=np.uint8)
                       for r in gen_batch.non_tensor_batch["prefix_ratio"]]  # fmt: skip
            return DataProto.from_dict(
                tensors={"responses": torch.zeros(rows, 4, dtype=torch.int64),
                         "response_mask": torch.ones(rows, 4, dtype=torch.int64),
                         "token_level_scores": torch.zeros(rows, 4)},
                non_tensors={"prefix_token_mask": mask}, meta_info={"timing": {}},
            )  # fmt: skip

    trainer.async_rollout_manager = Rollout()
    batch_dict = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "raw_prompt": np.array(["a", "b"], dtype=object)}
    for gen_index in range(2):  # two generation batches of one step (filter groups)
        gen = trainer._generate(dict(batch_dict), gen_index=gen_index, timing={})
        trainer._extract_reward(gen)
    assert trainer.events == ["generate", "sleep", "reward", "wake", "generate", "sleep", "reward"]
    trainer._sleep_rollout()  # stage 4 does not put a sleeping rollout to sleep twice
    assert trainer.events[-1] == "reward"


def test_rollout_timing_over_generation_batches_keeps_min_max_meaning():
    a = {"agent_loop/generate_sequences/min": 1.0, "agent_loop/generate_sequences/max": 4.0,
         "agent_loop/generate_sequences/mean": 2.0, "agent_loop/slowest/generate_sequences": 4.0,
         "agent_loop/slowest/response_length": 10, "generate_sequences": 5.0}  # fmt: skip
    b = {"agent_loop/generate_sequences/min": 0.5, "agent_loop/generate_sequences/max": 6.0,
         "agent_loop/generate_sequences/mean": 3.0, "agent_loop/slowest/generate_sequences": 6.0,
         "agent_loop/slowest/response_length": 7, "generate_sequences": 7.0}  # fmt: skip
    merged = merge_rollout_timing([(a, 8), (b, 24)])
    assert merged["agent_loop/generate_sequences/min"] == 0.5
    assert merged["agent_loop/generate_sequences/max"] == 6.0
    assert merged["agent_loop/generate_sequences/mean"] == pytest.approx((2.0 * 8 + 3.0 * 24) / 32)
    assert merged["agent_loop/slowest/response_length"] == 7  # from the batch with the slowest sample
    assert merged["generate_sequences"] == 12.0  # wall times add up
    assert merge_rollout_timing([(a, 8)]) == a


def test_two_pass_rollout_policy_merges_timing_and_reseeds_the_second_pass():
    from mix_src.trainer.rollout_policy import register_rollout_policy

    @register_rollout_policy("test_two_passes")
    def two_passes(ctx):
        first = ctx.generate(np.zeros(len(ctx.batch)))
        ctx.generate(np.zeros(2), rows=np.array([0, 1]))  # resample two rows on-policy
        return first

    trainer = make_trainer()
    trainer.mix = mix_config_from_dict({"rollout_policy": "test_two_passes"})
    trainer.config.actor_rollout_ref.rollout.seed = 5
    seen = []

    class Rollout:
        def generate_sequences(self, gen_batch):
            rows = len(gen_batch)
            seen.append(list(gen_batch.non_tensor_batch["rollout_seed"]))
            mask = np.empty(rows, dtype=object)
            mask[:] = [np.zeros(0, dtype=np.uint8)] * rows
            timing = {"agent_loop/generate_sequences/max": 4.0 if len(seen) == 1 else 1.0,
                      "agent_loop/generate_sequences/mean": 2.0 if len(seen) == 1 else 1.0}  # fmt: skip
            return DataProto.from_dict(
                tensors={"responses": torch.zeros(rows, 4, dtype=torch.int64),
                         "response_mask": torch.ones(rows, 4, dtype=torch.int64),
                         "rm_scores": torch.zeros(rows, 4)},
                non_tensors={"prefix_token_mask": mask}, meta_info={"timing": timing},
            )  # fmt: skip

    trainer.async_rollout_manager = Rollout()
    batch_dict = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "raw_prompt": np.array(["a", "b"], dtype=object)}
    timing = {}
    trainer._generate(batch_dict, gen_index=0, timing=timing)
    assert timing["agent_loop/generate_sequences/max"] == 4.0  # a max, not the sum of the passes
    rows = 2 * N
    assert timing["agent_loop/generate_sequences/mean"] == pytest.approx((2.0 * rows + 1.0 * 2) / (rows + 2))
    assert seen[1] != seen[0][:2]  # the second pass over rows 0 and 1 samples anew
