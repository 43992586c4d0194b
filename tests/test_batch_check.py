"""Batch arithmetic and the target cap refused before Ray (mix_src/config/batch_check.py, mix_src/config/mix_config.py):
each case is one the pre-Ray stage passed before issue #41 and verl failed on inside Ray (or trained nothing).
The tiny e2e setup is composed once per module (scripts/probe_bad_inputs.py ``Composer``)."""

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from e2e import MIX_CPU, tiny_overrides
from mix_src.config.batch_check import check_batch_arithmetic
from mix_src.config.data_check import check_data
from mix_src.config.mix_config import MixConfigError, validate_mix_config
from mix_src.config.resources import rows_of
from scripts.probe_bad_inputs import Composer

@pytest.fixture(scope="module")
def compose(tiny_assets):
    """``compose(*overrides)``: the tiny e2e setup with ``overrides``."""
    base = [*MIX_CPU, *tiny_overrides(tiny_assets)]
    composer = Composer(base)
    return lambda *overrides: composer([*base, *overrides])


A = "actor_rollout_ref.actor."


@pytest.mark.parametrize("overrides, pattern", [
    ([A + "ppo_mini_batch_size=3"], r"ppo_mini_batch_size=3 does not divide data\.train_batch_size=4: .* 8 % 6 == 0"),
    (["actor_rollout_ref.rollout.n=0", "mix.n_prefix=0"], r"actor_rollout_ref\.rollout\.n=0"),
    ([A + "ppo_micro_batch_size_per_gpu=0"], r"ppo_micro_batch_size_per_gpu=0: a micro-batch of 0 rows"),
    ([A + "ppo_micro_batch_size_per_gpu=3"], r"ppo_micro_batch_size_per_gpu=3 does not divide a rank's mini-batch of 8"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0"], r"rollout\.log_prob_micro_batch_size_per_gpu=0"),
    ([A + "optim.lr=-1e-4"], r"optim\.lr=-0\.0001: the actor would not learn"),
    ([A + "optim.lr=0"], r"optim\.lr=0"),
    (["trainer.total_epochs=0"], r"trainer\.total_epochs=0: the run would exit having trained nothing"),
    (["trainer.total_training_steps=0"], r"trainer\.total_training_steps=0"),
])
def test_batch_arithmetic_refused_naming_keys_and_numbers(compose, overrides, pattern):
    cfg = compose(*overrides)
    with pytest.raises(MixConfigError, match=pattern):
        check_batch_arithmetic(cfg)


@pytest.mark.parametrize("overrides, pattern", [
    (["data.train_batch_size=64", A + "ppo_mini_batch_size=64"],
     r"data\.train_files: 32 usable rows .*fewer than data\.train_batch_size=64"),
    (["data.train_max_samples=3"], r"data\.train_files: 3 usable rows .*fewer than data\.train_batch_size=4"),
    (["data.gen_batch_size=40"], r"32 usable rows .*fewer than data\.gen_batch_size=40.*lower data\.gen_batch_size"),
    # a smaller loader batch (filter groups) still needs one training batch of rows
    (["data.train_batch_size=64", A + "ppo_mini_batch_size=64", "data.gen_batch_size=8",
      "algorithm.filter_groups.enable=true"], r"32 usable rows .*fewer than data\.train_batch_size=64"),
])
def test_too_few_rows_for_one_batch_refused_once_by_the_data_check(compose, overrides, pattern):
    """The rows must fill one of the loader's batches (gen_batch_size, else train_batch_size): the data check
    (preflight slot 4) counts them after its drops, so the batch check does not count them again."""
    with pytest.raises(MixConfigError, match=pattern):
        check_data(compose(*overrides))


def test_evaluation_only_needs_no_loader_batch(compose):
    check_data(compose("data.gen_batch_size=40", "algorithm.filter_groups.enable=true", "trainer.val_only=true"))


def test_settings_that_train_pass(compose, tiny_assets):
    check_batch_arithmetic(compose())  # the tiny e2e settings
    check_batch_arithmetic(compose("trainer.use_v1=true", A + "ppo_mini_batch_size=3"))  # V1 pads
    check_batch_arithmetic(compose("trainer.total_epochs=0", "trainer.val_only=true"))  # evaluation only
    assert rows_of([tiny_assets["train"]]) == pq.ParquetFile(tiny_assets["train"]).metadata.num_rows == 32


def test_target_cap_follows_the_response_length(compose):
    cfg = compose()  # data.max_response_length=16, mix.data.max_target_length unset (null)
    assert OmegaConf.select(cfg, "mix.data.max_target_length") is None
    assert validate_mix_config(cfg).data.max_target_length == 15
    assert cfg.mix.data.max_target_length == 15  # written back: the datasets built in Ray read the same number
    assert validate_mix_config(compose("mix.data.max_target_length=15")).data.max_target_length == 15


@pytest.mark.parametrize("cap", [16, 8192])
def test_target_cap_that_cannot_fit_is_refused(compose, cap):
    with pytest.raises(MixConfigError, match=rf"mix\.data\.max_target_length={cap} cannot fit data\.max_response_length=16"
                                              r".* <= 15"):
        validate_mix_config(compose(f"mix.data.max_target_length={cap}"))
