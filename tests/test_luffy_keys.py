"""The original LUFFY launch script's overrides go through the entry point's config stage (no Ray):
every LUFFY key is renamed (one printed line naming the new key), converted, dropped with a reason, or
refused; the result is LUFFY's main recipe in our keys."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import composed
from mix_src.config.luffy_keys import LUFFY_KEYS, translate_overrides
from mix_src.main_mix_ppo import config_stage
from mix_src.config.mix_config import MixConfigError, validate_mix_config


def train_sh_overrides(data_dir: str) -> list[str]:
    """The overrides of LUFFY's exp_scripts/train.sh (github.com/ElliottYan/LUFFY), with $DATA_DIR filled in
    and the shell quoting removed (what `python -m` receives)."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data_dir}/openr1.parquet",
        f"data.val_files={data_dir}/valid.parquet",
        "data.train_batch_size=128",
        "data.val_batch_size=512",
        "data.max_prompt_length=1024",
        "data.max_response_length=8192",
        "actor_rollout_ref.model.path=Elliott/Qwen2.5-Math-7B-16k-think",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "actor_rollout_ref.actor.ppo_micro_batch_size=64",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768",
        "actor_rollout_ref.actor.kl_loss_coef=0.00",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.grad_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.val_temperature=0.6",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.80",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.n_val=1",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "actor_rollout_ref.rollout.max_prefix_len=8192",
        "algorithm.kl_ctrl.kl_coef=0.000",
        "actor_rollout_ref.actor.entropy_coeff=0.001",
        "trainer.critic_warmup=0",
        "trainer.logger=['console','wandb']",
        "trainer.project_name=luffy-math-test",
        "trainer.experiment_name=LUFFY_TEST",
        "+trainer.val_before_train=False",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=50",
        "trainer.test_freq=10",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.use_sft_prefix_reward=False",
        "actor_rollout_ref.rollout.prefix_share_across_samples=False",
        "actor_rollout_ref.rollout.prefix_strategy=random",
        "actor_rollout_ref.rollout.n_prefix=1",
        "actor_rollout_ref.rollout.min_prefix_ratio=1.0",
        "actor_rollout_ref.rollout.max_prefix_ratio=1.0",
        "actor_rollout_ref.rollout.prefix_reward_weight_alpha=1.0",
        "actor_rollout_ref.ref.use_ref=False",
        "actor_rollout_ref.actor.use_off_policy_loss=True",
        "actor_rollout_ref.actor.off_policy_normalize=False",
        "actor_rollout_ref.actor.off_policy_reshape=p_div_p_0.1",
        "actor_rollout_ref.actor.off_policy_loss_impl=token",
        "algorithm.grpo_use_std=False",
        "actor_rollout_ref.actor.loss_remove_token_mean=True",
        "actor_rollout_ref.actor.loss_remove_clip=True",
        "data.reward_impl_version=3",
        "trainer.max_optim_to_keep=2",
        "data.shuffle=True",
        "trainer.default_hdfs_dir=null",
        "trainer.total_epochs=30",
    ]


def compose_mix(overrides):
    return composed.compose_mix(overrides)  # tests/composed.py: the YAML read once per session


def test_train_sh_runs_through_the_config_stage(tiny_assets, tmp_path):
    rows = pq.read_table(tiny_assets["train"])  # train.sh's batch is 128 prompts: repeat the 32 tiny rows to 128
    pq.write_table(pa.concat_tables([rows] * 4), tmp_path / "openr1.parquet")
    shutil.copy(tiny_assets["val"], tmp_path / "valid.parquet")
    original = train_sh_overrides(str(tmp_path))
    with pytest.raises(Exception, match="Could not override"):  # verl's config refuses LUFFY's keys as they are
        compose_mix(original)

    lines: list[str] = []
    translated = translate_overrides(original, log=lines.append)
    cfg = compose_mix([*translated, f"trainer.default_local_dir={tmp_path / 'ckpt'}",  # probed before Ray (save_freq 50)
                       f"++actor_rollout_ref.model.tokenizer_path={tiny_assets['tokenizer']}"])  # prompt lengths, offline
    config_stage(cfg)  # ours and verl's checks, as the entry point runs them before Ray
    mix = validate_mix_config(cfg)

    assert (mix.n_prefix, mix.prefix_strategy, mix.min_prefix_ratio, mix.max_prefix_ratio) == (1, "random", 1.0, 1.0)
    assert (mix.loss.off_policy_reshape, mix.loss.off_policy_reshape_gamma) == ("p_div_p", 0.1)
    assert mix.loss.loss_remove_clip and mix.loss.loss_agg_mode == "luffy-token-sum-norm"
    assert mix.data.max_target_length == 8191 and mix.prefix_reward_weight_alpha == 1.0  # 8192 = the response: EOS kept
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0.6 and cfg.actor_rollout_ref.rollout.val_kwargs.n == 1
    assert cfg.trainer.max_actor_ckpt_to_keep == 2 and cfg.trainer.val_before_train is False

    luffy_items = [o for o in original if o.split("=")[0] in LUFFY_KEYS or o.split("=")[0].lstrip("+") in LUFFY_KEYS]
    assert len(lines) - 3 == len(luffy_items) == 22  # one printed line per LUFFY key, the cap's, scale's, entropy's:
    assert lines[-3].startswith("[mix_src] LUFFY cap mix.data.max_target_length=8192 >= data.max_response_length=8192 -> null")
    # LUFFY's sum / 8192 per GPU, averaged over its 8 GPUs: sum / 65536 (tests/test_multirank.py checks the maths)
    assert lines[-2].endswith("-> actor_rollout_ref.actor.loss_scale_factor=65536")
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == 65536
    # its entropy bonus: 0.001 x each micro-batch's token mean
    assert lines[-1].endswith("-> mix.loss.entropy_agg=micro_batch_token_mean")
    assert mix.loss.entropy_agg == "micro_batch_token_mean" and cfg.actor_rollout_ref.actor.entropy_coeff == 0.001
    assert "[mix_src] LUFFY key actor_rollout_ref.rollout.n_prefix -> mix.n_prefix" in lines
    assert "[mix_src] LUFFY key algorithm.grpo_use_std -> algorithm.norm_adv_by_std_in_grpo" in lines
    assert ("[mix_src] LUFFY key actor_rollout_ref.actor.loss_remove_token_mean=True -> "
            "mix.loss.loss_agg_mode=luffy-token-sum-norm") in lines  # fmt: skip
    assert any(line.startswith("[mix_src] LUFFY key actor_rollout_ref.actor.off_policy_normalize=False dropped: ")
               for line in lines)  # fmt: skip
    others = [o for o in original if o not in luffy_items]
    assert all(o in translated for o in others)  # verl's own keys pass through untouched


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["actor_rollout_ref.actor.use_off_policy_probs=True"], r"use_off_policy_probs=True is not supported"),
        (["trainer.acc_rebatch=True"], r"acc_rebatch=True is not supported.*filter_groups"),
        (["actor_rollout_ref.actor.off_policy_loss_impl=seq"], r"off_policy_loss_impl=seq is not supported"),
        (["actor_rollout_ref.rollout.n_prefix=1", "actor_rollout_ref.actor.use_off_policy_loss=False"],
         r"use_off_policy_loss=False with n_prefix=1.*use_sft_multitask_loss=True"),
        (["mix.n_prefix=2", "actor_rollout_ref.actor.use_off_policy_loss=False"],  # our key, LUFFY's switch
         r"use_off_policy_loss=False with n_prefix=2.*use_sft_multitask_loss=True"),
    ],
)  # fmt: skip
def test_luffy_values_without_a_mix_src_behaviour_are_refused(overrides, pattern):
    with pytest.raises(MixConfigError, match=pattern):
        translate_overrides(overrides, log=lambda _: None)


def test_rl_with_sft_loss_script_keys():
    """train_rl_sft_loss.sh: grpo_split + SFT loss on prefix tokens, use_off_policy_loss=False."""
    lines = []
    out = translate_overrides(["algorithm.adv_estimator=grpo_split", "actor_rollout_ref.rollout.n_prefix=1",
                               "actor_rollout_ref.actor.use_off_policy_loss=False",
                               "actor_rollout_ref.actor.use_sft_multitask_loss=True"], log=lines.append)  # fmt: skip
    assert out == ["algorithm.adv_estimator=grpo_split", "mix.n_prefix=1", "mix.loss.use_sft_multitask_loss=True",
                   "mix.loss.sft_loss_agg=micro_batch_token_mean"]  # the official per-micro-batch token mean
    assert len(lines) == 4


def test_our_own_sft_key_keeps_our_weighting():
    """Only LUFFY's key brings LUFFY's per-micro-batch SFT mean; ``mix.loss.use_sft_multitask_loss=true`` is ours
    (the guard's recorded runs set it and were re-weighted when the translation read it too)."""
    out = translate_overrides(["mix.loss.use_sft_multitask_loss=true"], log=lambda _: None)
    assert out == ["mix.loss.use_sft_multitask_loss=true"]


def test_verls_own_resume_key_is_no_luffy_command_line():
    """trainer.resume_from_path is a LUFFY key and verl's: alone it must not turn a verl run's entropy into LUFFY's
    per-micro-batch mean (a resumed run would train under another loss than the run it resumes)."""
    out = translate_overrides(["actor_rollout_ref.actor.entropy_coeff=0.01", "trainer.resume_from_path=/x/global_step_1"],
                              log=lambda _: None)  # fmt: skip
    assert not any(o.startswith("mix.loss.entropy_agg") for o in out), out
    luffy = translate_overrides(["actor_rollout_ref.actor.entropy_coeff=0.01",
                                 "actor_rollout_ref.actor.loss_remove_token_mean=True"], log=lambda _: None)
    assert "mix.loss.entropy_agg=micro_batch_token_mean" in luffy
