"""Resume only what is yours (#51 item 3; mix_src/config/run_identity.py).

The unit tests write checkpoint folders as the trainers do (``write_run_file`` and verl's tracker file) and run the
pre-Ray check on composed configs. The two end-to-end tests read the checkpoints real runs wrote -- the legacy batch's
``partial_prefix`` (2 steps, a checkpoint after each) and the V1 batch's ``carry_over`` (sync, saved at step 2) --
and run the whole pre-Ray stage (``config_stage``) with the run's own overrides again: another ``loss_mode`` is
refused naming it, the unchanged re-run of the finished run is refused with "nothing to train".
"""

from __future__ import annotations

import json
import re

import pytest

from composed import compose_mix
from e2e import PARTIAL_PREFIX_CKPT, batch_result, batch_run, partial_prefix_saved
from mix_src.config.mix_config import MixConfigError
from mix_src.config.run_identity import RUN_FILE, check_resume, write_run_file
from test_mix_trainer_v1 import CARRY_OVER, CARRY_OVER_CKPT, carry_over_run

MAIN = ["+backend=cpu", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "mix.n_prefix=1",
        "algorithm.adv_estimator=grpo_split", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]  # fmt: skip
GSPO = "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"


def saved_run(tmp_path, *overrides, step=2):
    """A checkpoint folder of step ``step`` as a run with ``overrides`` leaves it; returns its directory override."""
    root = tmp_path / "ckpt"
    folder = root / f"global_step_{step}"
    folder.mkdir(parents=True)
    write_run_file(str(folder), compose_mix(MAIN + [f"trainer.default_local_dir={root}", *overrides]))
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return f"trainer.default_local_dir={root}"


def test_a_checkpoint_of_another_loss_mode_is_refused_naming_the_key_and_the_ways_out(tmp_path):
    where = saved_run(tmp_path)
    with pytest.raises(MixConfigError, match=r"policy_loss\.loss_mode: checkpoint 'vanilla', this run 'gspo'") as e:
        check_resume(compose_mix(MAIN + [where, GSPO]), count_steps=lambda _: 4)
    for way in ("trainer.resume_mode=disable", "trainer.experiment_name", "trainer.resume_from_path"):
        assert way in str(e.value)


def test_a_finished_run_is_refused_with_nothing_to_train(tmp_path, capsys):
    where = saved_run(tmp_path)
    with pytest.raises(MixConfigError, match="nothing to train: .* at step 2, and this run has 2 steps"):
        check_resume(compose_mix(MAIN + [where]), count_steps=lambda _: 2)
    assert re.search(r"\[mix_src\] resuming from .*global_step_2 \(step 2 of 2", capsys.readouterr().out)


def test_the_same_run_resumes_with_one_line_and_layout_keys_may_change(tmp_path, capsys):
    where = saved_run(tmp_path)
    layout = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_dynamic_bsz=true",
              "trainer.total_training_steps=4", "mix.flops_budget=1e12", "trainer.save_freq=3"]  # fmt: skip
    folder = check_resume(compose_mix(MAIN + [where, *layout]), count_steps=lambda _: 4)
    assert folder.endswith("global_step_2")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[mix_src]")]
    assert len(lines) == 1 and "step 2 of 4" in lines[0]


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.model.path=/elsewhere/model", "actor_rollout_ref.model.path"),
    ("data.train_files=/elsewhere/train.parquet", "data.train_files"),
    ("algorithm.adv_estimator=grpo", "algorithm.adv_estimator"),
    ("mix.loss.off_policy_reshape_gamma=0.2", "mix.loss.off_policy_reshape_gamma"),
    ("mix.max_prefix_ratio=0.5", "mix.max_prefix_ratio"),
    ("mix.seed=3", "mix.seed"),
    ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_rank"),
    ("trainer.use_v1=true", "trainer.use_v1"),
])  # fmt: skip
def test_each_identity_key_is_compared(tmp_path, override, key):
    where = saved_run(tmp_path)
    with pytest.raises(MixConfigError, match=re.escape(key)):
        check_resume(compose_mix(MAIN + [where, override]), count_steps=lambda _: 4)


def test_disable_and_no_checkpoint_start_afresh_and_an_old_checkpoint_resumes_with_a_warning(tmp_path, capsys):
    where = saved_run(tmp_path)
    four = lambda _: 4  # noqa: E731
    assert check_resume(compose_mix(MAIN + [where, GSPO, "trainer.resume_mode=disable"]), count_steps=four) is None
    assert check_resume(compose_mix(MAIN + [f"trainer.default_local_dir={tmp_path / 'none'}"]), count_steps=four) is None
    (tmp_path / "ckpt" / "global_step_2" / RUN_FILE).unlink()  # a checkpoint written before this check
    assert check_resume(compose_mix(MAIN + [where, GSPO]), count_steps=lambda _: 4).endswith("global_step_2")
    assert f"has no {RUN_FILE}" in capsys.readouterr().out


def test_resume_path_is_checked_too(tmp_path):
    saved_run(tmp_path)
    step = tmp_path / "ckpt" / "global_step_2"
    cfg = compose_mix(MAIN + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}", GSPO])
    with pytest.raises(MixConfigError, match="loss_mode"):
        check_resume(cfg, count_steps=lambda _: 4)


# ---- the checkpoints real runs wrote, both bases -----------------------------------------------------------------
HERE = "test_resume_identity.py::"
batch_run("legacy", "partial_prefix", partial_prefix_saved, [HERE + "test_legacy_checkpoint_is_resumed_only_by_its_run"])


batch_run("v1", "carry_over", carry_over_run, [HERE + "test_v1_checkpoint_is_resumed_only_by_its_run"])


def _refusals(overrides: list[str], folder, mode: str = "gspo") -> None:
    """The run's own overrides again through the whole pre-Ray stage: with another loss_mode (one its mix.loss knobs
    allow), unchanged, and with more steps."""
    from mix_src.main_mix_ppo import config_stage

    saved = json.loads((folder / RUN_FILE).read_text())  # written by the trainer, inside Ray
    assert saved["identity"]["actor_rollout_ref.actor.policy_loss.loss_mode"] == "vanilla"
    assert saved["config"]["trainer"]["default_local_dir"] == str(folder.parent)
    with pytest.raises(MixConfigError, match=rf"policy_loss\.loss_mode: checkpoint 'vanilla', this run '{mode}'"):
        config_stage(compose_mix([*overrides, f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"]))
    with pytest.raises(MixConfigError, match="nothing to train"):
        config_stage(compose_mix(overrides))
    # the same run with more steps passes the whole stage: the identity the trainer saved is the one checked here
    more = [o for o in overrides if not o.startswith("trainer.total_training_steps=")]
    config_stage(compose_mix([*more, "trainer.total_training_steps=3"]))


def test_legacy_checkpoint_is_resumed_only_by_its_run(tiny_assets, legacy_batch):
    result = batch_result(legacy_batch, "partial_prefix")
    batch_dir = result.log_path.parent
    # cispo: the run's mix.loss.all_max_clip refuses gspo (a sequence ratio) before the identity is compared
    _refusals(partial_prefix_saved(tiny_assets, batch_dir), batch_dir / PARTIAL_PREFIX_CKPT / "global_step_2", "cispo")


def test_v1_checkpoint_is_resumed_only_by_its_run(tiny_assets, v1_batch):
    result = batch_result(v1_batch, CARRY_OVER)
    batch_dir = result.log_path.parent
    _refusals(carry_over_run(tiny_assets, batch_dir), batch_dir / CARRY_OVER_CKPT / "global_step_2")
