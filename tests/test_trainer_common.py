"""mix_src/trainer/common.py: what both trainer bases do once (issue #38 item 2). No Ray; 34-61 s on the shared 2-core CPU
under load (nearly all of it importing verl's V1 trainers), well under 1 s of tests.

``mix_state.pt`` keeps its file format: files written before the shared module, by either base, restore."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mix_src.trainer.stages import MIX_STATE_FILE
from mix_src.trainer.common import MixTrainerCommon

# the two formats as written before the shared module (dfc224e: mix_trainer.py and mix_trainer_v1.py _save_checkpoint)
LEGACY = {"epoch": 1, "carry": None, "dataloader": {"pos": 3}, "entropy_coef": {"log_alpha": -4.2, "step": 3.0},
          "flops": {"6n": 5.0, "full": 7.0}, "rollout_policy": {"buffer": [1, 2]}}  # fmt: skip
V1 = {"entropy_coef": None, "rollout_policy": {"mix_data_epoch": ["k"]}, "flops": {"6n": 1.0, "full": 2.0},
      "flops_counted_rows": ["a_0_0"]}  # fmt: skip


def _trainer(tmp_path, step=2):
    t = object.__new__(MixTrainerCommon)
    t.config = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path), "resume_mode": "auto",
                                             "resume_from_path": None}})  # fmt: skip
    t.global_steps = step
    return t


@pytest.mark.parametrize("saved", [LEGACY, V1], ids=["legacy", "v1"])
def test_a_mix_state_written_before_the_shared_module_restores(tmp_path, saved):
    (tmp_path / "global_step_2").mkdir()
    torch.save(saved, tmp_path / "global_step_2" / MIX_STATE_FILE)
    t = _trainer(tmp_path)
    policy = t._policy_state()  # the rollout policy holds this dict: it is refilled in place
    assert t._load_mix_state() == saved  # the base reads its own keys from it
    assert t._entropy_state == saved["entropy_coef"] and t._flops_totals() == saved["flops"]
    assert t._policy_state() is policy and policy == saved["rollout_policy"]


def test_the_saved_state_round_trips_and_keeps_the_format(tmp_path):
    (tmp_path / "global_step_2").mkdir()
    t = _trainer(tmp_path)
    t._entropy_state = {"log_alpha": -1.0}
    t._policy_state()["x"] = 1
    t._flops_totals()["6n"] += 3.0
    t._save_mix_state(epoch=4)
    saved = torch.load(tmp_path / "global_step_2" / MIX_STATE_FILE, weights_only=False)
    assert saved == {"entropy_coef": {"log_alpha": -1.0}, "rollout_policy": {"x": 1}, "flops": {"6n": 3.0, "full": 0.0},
                     "epoch": 4}  # fmt: skip
    assert _trainer(tmp_path, step=0)._load_mix_state() is None  # no such step folder: nothing restored


def test_generation_flops_wait_for_the_next_count_then_reset(tiny_assets):
    from mix_src.algo.flops import COUNTS, rollout_flops

    t = object.__new__(MixTrainerCommon)
    t.config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": tiny_assets["model"]}}})
    t.add_rollout_flops(np.array([5, 3]), np.array([4, 3]), np.array([4, 0]))
    t.add_rollout_flops(np.array([6]), np.array([2]), np.array([2]))
    shape = t._model_shape()
    got = t._pending_rollout_flops()
    assert got == {c: rollout_flops(shape, [5, 3], [4, 3], [4, 0], c) + rollout_flops(shape, [6], [2], [2], c)
                   for c in COUNTS}  # fmt: skip
    assert t._pending_rollout_flops() == {c: 0.0 for c in COUNTS}


def test_the_trainer_mode_is_read_from_verls_trainer_class_not_its_name():
    from mix_src.trainer.v1 import MixPPOTrainerColocateAsync, MixPPOTrainerSeparateAsync, MixPPOTrainerSync

    assert object.__new__(MixPPOTrainerSync)._steps_in_sync
    assert not object.__new__(MixPPOTrainerColocateAsync)._steps_in_sync
    assert not object.__new__(MixPPOTrainerSeparateAsync)._steps_in_sync


def test_the_generate_contract_is_checked_the_same_on_both_bases():
    """stages.pass_arguments: the checks both bases' generate() ran as two copies (legacy _generate, V1PolicyRunner)."""
    from mix_src.stages import pass_arguments

    ratios, targets, _ = pass_arguments([0.5, 1], ("a", "b"), [0, 0], 1, 0)
    assert ratios.dtype == np.float64 and ratios.tolist() == [0.5, 1.0] and targets == ["a", "b"]
    assert pass_arguments(np.zeros((1, 3)), None, [0] * 3, 1, 0)[1] is None
    with pytest.raises(ValueError, match=r"rollout policy: 3 ratios for 2 rows"):
        pass_arguments([0.1, 0.2, 0.3], None, [0, 0], 1, 0)
    with pytest.raises(ValueError, match=r"rollout policy: 1 targets for 2 rows"):
        pass_arguments([0.1, 0.2], ["a"], [0, 0], 1, 0)
    with pytest.raises(ValueError, match=r"generate\(prompts=\.\.\.\) takes no rows"):
        pass_arguments([0.1], None, [0], 1, 0, rows_given=True, prompts_given=True)


def test_a_later_pass_and_kept_prompts_are_reseeded_the_same_on_both_bases():
    """stages.pass_arguments' seeds: the pass-seed rule both bases' generate() wrote as two copies (legacy
    legacy_collect._generate, V1PolicyRunner): pass 0 keeps the rows' seeds, a later pass redraws, prompt rows kept from
    an earlier step take a pass index of this step (<0.01 s)."""
    from mix_src.algo.seeding import pass_seeds
    from mix_src.trainer.stages import pass_arguments

    def pass_row_seeds(seeds, step, passes, kept):
        return pass_arguments([0.0] * len(seeds), None, seeds, step, passes, prompts_given=kept)[2]

    seeds = np.array([3, 5, 7], dtype=np.int64)
    assert np.array_equal(pass_row_seeds(seeds, 4, 0, False), seeds)
    assert np.array_equal(pass_row_seeds(seeds, 4, 2, False), pass_seeds(seeds, 2))
    kept = pass_row_seeds(seeds.astype(object), 4, 2, True)  # a record's seeds may come back as an object array
    assert kept.dtype == np.int64 and np.array_equal(kept, pass_seeds(seeds, (4 << 16) + 3))
    assert not np.array_equal(kept, pass_row_seeds(seeds, 5, 2, True))  # another step's kept rows draw anew
