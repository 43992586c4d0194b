"""MIXRayPPOTrainer's batch collection (stages 1-3) without Ray: filter groups, accumulation across
generation batches, carry-over, the max_num_gen_batches error and the data running out.

Stage 1 (generation through Ray) is replaced by a function that returns rows with a chosen per-group
accuracy; everything after it is the trainer's own code.
"""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto

from mix_src.config.mix_config import mix_config_from_dict
from mix_src.trainer.legacy import FilterGroupsExhausted, MIXRayPPOTrainer

N = 4  # samples per prompt


def make_trainer(acc_per_batch, *, train_batch_size=2, filtering=True, max_gen=0, carry_over=False):
    """A trainer whose k-th generation batch has prompts with the given per-group success counts."""
    trainer = object.__new__(MIXRayPPOTrainer)
    trainer.config = OmegaConf.create({
        "data": {"train_batch_size": train_batch_size},
        "algorithm": {"filter_groups": {"enable": filtering, "metric": "acc", "max_num_gen_batches": max_gen}},
    })  # fmt: skip
    trainer.mix = mix_config_from_dict({"n_prefix": 1, "filter_groups": {"carry_over": carry_over}})
    trainer.filter_cfg = trainer.config.algorithm.filter_groups
    trainer.n, trainer._carry, trainer.global_steps = N, None, 1
    trainer.use_rm = False
    counter = iter(range(10**6))

    def generate(batch_dict, gen_index, timing):
        solved = batch_dict["solved"]  # successes per prompt group
        rows = len(solved) * N
        acc = np.array([j < k for k in solved for j in range(N)], dtype=float)
        scores = torch.zeros(rows, 3)
        scores[:, -1] = torch.tensor(acc)
        prefix = torch.zeros(rows, 3, dtype=torch.bool)
        prefix[::N] = True
        uid = np.array([f"g{next(counter)}" for _ in solved for _ in range(N)][::N], dtype=object).repeat(N)
        batch = DataProto.from_dict(
            tensors={"rm_scores": scores, "prefix_mask": prefix, "response_mask": torch.ones(rows, 3)},
            non_tensors={"uid": uid, "acc": acc, "prefix_ratio": np.where(prefix[:, 0].numpy(), 1.0, 0.0)},
            meta_info={"reward_extra_keys": ["acc"]},
        )
        return batch

    trainer._generate = generate
    batches = iter([{"solved": s} for s in acc_per_batch])
    return trainer, batches


def test_accumulates_until_enough_groups_and_trains_on_exactly_that_many():
    # batch 1: groups with 0/4 and 4/4 solved (both dropped) ; batch 2: 2/4 (kept), 0/4 ; batch 3: 1/4, 3/4
    trainer, batches = make_trainer([[0, 4], [2, 0], [1, 3]], train_batch_size=2)
    metrics = {}
    batch = trainer._collect_batch(batches, metrics, {})
    assert len(batch) == 2 * N and len(set(batch.non_tensor_batch["uid"])) == 2
    assert metrics["train/num_gen_batches"] == 3 and metrics["train/num_kept_prompts"] == 2
    assert metrics["train/filter_rate"] == pytest.approx(3 / 6)
    assert metrics["train/num_surplus_dropped"] == 1 and trainer._carry is None
    # solve metrics over the trained groups (2/4 and 1/4 solved), the population V1 reports too
    assert metrics["batch/solve_none"] == 0.0 and metrics["batch/solve_all"] == 0.0
    assert metrics["batch/solved"] == pytest.approx(3 / 8)


def test_carry_over_keeps_surplus_groups_for_the_next_step():
    trainer, batches = make_trainer([[1, 2, 3], [1, 1, 1]], train_batch_size=2, carry_over=True)
    first = {}
    trainer._collect_batch(batches, first, {})
    assert first["train/num_surplus_carried"] == 1 and len(trainer._carry) == N
    carried_uid = trainer._carry.non_tensor_batch["uid"][0]
    second = {}
    batch = trainer._collect_batch(batches, second, {})
    assert second["train/num_carried_prompts"] == 1
    assert batch.non_tensor_batch["uid"][0] == carried_uid  # carried groups are trained on first


def test_max_num_gen_batches_error_says_what_to_change():
    trainer, batches = make_trainer([[0, 0], [4, 4], [0, 4]], max_gen=2)
    with pytest.raises(FilterGroupsExhausted, match=r"after 2 generation batches .*only 0 of data.train_batch_size=2"
                       r".*Raise algorithm.filter_groups.max_num_gen_batches"):  # fmt: skip
        trainer._collect_batch(batches, {}, {})


def test_data_running_out_mid_accumulation_ends_training_with_a_count(capsys):
    trainer, batches = make_trainer([[2, 0], [0, 0]], train_batch_size=2)
    assert trainer._collect_batch(batches, {}, {}) is None
    assert "the training data ran out with 1 of 2 prompt groups collected" in capsys.readouterr().out


def test_without_filtering_one_generation_batch_is_the_training_batch():
    trainer, batches = make_trainer([[0, 0]], filtering=False)
    metrics = {}
    batch = trainer._collect_batch(batches, metrics, {})
    assert len(batch) == 2 * N and "train/num_gen_batches" not in metrics
    assert torch.equal(batch.batch["token_level_scores"], batch.batch["rm_scores"])
