"""CHORD as a plugin (recipes/chord/chord.py) on the loss-combination registry (mix_src/algo/loss_combine.py).

Faithfulness: the plugin's maths against a transcription of the official code (Trinity-RFT's ``mix_chord``),
on random inputs: the mu schedule, the phi-weighted SFT loss (value and gradient: phi is detached), and the
whole worker loss (mix_src.worker.loss.MixPolicyLoss with mix.loss.combine=chord, driven like verl's engine drives a
loss) against MIXCHORDPolicyLossFn on one micro-batch. Plus: the worker loss does not depend on the
micro-batch split, the entry's checks and its V1 refusal come before Ray, and 2 real training steps (Ray, CPU).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from mix_src.worker.loss import COMBINE_FIELDS, MixLossConfig, MixPolicyLoss, add_combine_inputs
from mix_src.algo.loss_combine import LOSS_COMBINES
from mix_src.config.mix_config import MixConfigError
from mix_src.extend import EntryConfigError, check_selected_entries, load_plugins
from test_loss import PROMPT, RESPONSE, VOCAB, BigramLM, actor_config, run_mini_batch

PLUGIN = Path(__file__).resolve().parents[1] / "recipes" / "chord" / "chord.py"
chord = __import__(load_plugins([str(PLUGIN)])[0])

# --------------------------------------------------------------------------------------------------
# Reference: Trinity-RFT's code, transcribed (modelscope/Trinity-RFT):
#   trinity/algorithm/policy_loss_fn/chord_policy_loss.py @ b458e2c26ff13b2f538ecbc819a2e0a40e98fc73
#     (mu_schedule_function, phi_function, SFTPhiLossFn.__call__, MIXCHORDPolicyLossFn.__init__/__call__)
#   trinity/algorithm/policy_loss_fn/sft_loss.py @ 51d229f5ccb1d5ed5cd376c39f6d576789f54d4a (SFTLossFn)
#   trinity/algorithm/policy_loss_fn/ppo_policy_loss.py @ 221b0759e0d11c51b1bd3b7512c8b5c6c8431d69
#     (PPOPolicyLossFn.__call__, enable_sequence_masking=False)
#   trinity/algorithm/utils.py @ b458e2c26ff13b2f538ecbc819a2e0a40e98fc73 (masked_mean, masked_loss)
# Only the lines that compute the loss are kept (metrics and asserts dropped).
# --------------------------------------------------------------------------------------------------


def ref_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def ref_masked_loss(values, mask, loss_agg_mode="token-mean"):
    if loss_agg_mode == "token-mean":
        return ref_masked_mean(values, mask)
    if loss_agg_mode == "seq-mean-token-mean":
        return ref_masked_mean(values, mask, axis=-1).mean()
    raise NotImplementedError(loss_agg_mode)


def mu_schedule_function(global_step, mu_warmup_steps, mu_decay_steps, mu_peak, mu_valley):
    # Warmup
    if global_step < mu_warmup_steps:
        return (global_step / mu_warmup_steps) * mu_peak
    # Decay
    if global_step >= (mu_warmup_steps + mu_decay_steps):
        return mu_valley
    adjusted_step = global_step - mu_warmup_steps
    cosine_decay = 0.5 * (1 + math.cos(math.pi * adjusted_step / mu_decay_steps))
    decayed_mu = (mu_peak - mu_valley) * cosine_decay + mu_valley
    return decayed_mu


def phi_function(token_prob):
    return token_prob * (1 - token_prob)


def sft_phi_loss(logprob, action_mask, use_token_level_loss=True, cutoff_prob=1.0):  # SFTPhiLossFn.__call__
    token_prob = torch.exp(logprob)
    if cutoff_prob < 1.0:
        logprob = torch.clamp(logprob, max=math.log(cutoff_prob))
    weighted_phi = phi_function(token_prob)
    if use_token_level_loss:
        return ref_masked_loss(-logprob * weighted_phi.detach(), action_mask, loss_agg_mode="token-mean")
    return ref_masked_loss(-logprob * weighted_phi.detach(), action_mask, loss_agg_mode="seq-mean-token-mean")


def sft_loss(logprob, action_mask, use_token_level_loss=True):  # SFTLossFn.__call__
    if use_token_level_loss:
        return ref_masked_mean(-logprob, action_mask)
    return ref_masked_mean(-logprob, action_mask, axis=1).mean()


def ppo_loss(logprob, old_logprob, action_mask, advantages, clip_range_low=0.2, clip_range_high=0.2,
             clip_ratio_c=3.0, loss_agg_mode="token-mean"):  # PPOPolicyLossFn.__call__  # fmt: skip
    negative_approx_kl = logprob - old_logprob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_range_low, 1.0 + clip_range_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return ref_masked_loss(pg_losses, action_mask, loss_agg_mode=loss_agg_mode)


def mix_chord_loss(logprob, old_logprob, action_mask, advantages, expert_mask, step, *, mu_warmup_steps=0,
                   mu_decay_steps=0, mu_peak=0.1, mu_valley=0.1, enable_phi_function=True, use_dynamic_bsz=None,
                   ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, ngpus_trainer=1, train_batch_size_usual=1,
                   train_batch_size_expert=1, use_token_level_loss_in_sft=True, grpo_loss_agg_mode="token-mean"):
    """MIXCHORDPolicyLossFn(...)(logprob, old_logprob, action_mask, advantages, expert_mask, step)[0]."""  # fmt: skip
    experience_per_gpu = ppo_mini_batch_size // ngpus_trainer
    gradient_accumulation = ppo_mini_batch_size // ppo_micro_batch_size_per_gpu
    train_batch_size_usual = train_batch_size_usual // ngpus_trainer
    train_batch_size_expert = train_batch_size_expert // ngpus_trainer
    current_step = step.max().item()
    n_usual_exp = torch.sum(~expert_mask).item()
    n_expert_exp = torch.sum(expert_mask).item()
    if use_dynamic_bsz:
        per_micro_batch_weight_usual = experience_per_gpu / (logprob.shape[0] * train_batch_size_usual)
        per_micro_batch_weight_expert = experience_per_gpu / (logprob.shape[0] * train_batch_size_expert)
    else:
        per_micro_batch_weight_usual = gradient_accumulation / train_batch_size_usual
        per_micro_batch_weight_expert = gradient_accumulation / train_batch_size_expert
    if n_usual_exp > 0:
        grpo_loss = ppo_loss(logprob[~expert_mask], old_logprob[~expert_mask], action_mask[~expert_mask],
                             advantages[~expert_mask], loss_agg_mode=grpo_loss_agg_mode)  # fmt: skip
        grpo_loss = grpo_loss * n_usual_exp * per_micro_batch_weight_usual
    else:
        grpo_loss = torch.tensor(0.0, device=logprob.device)
    if n_expert_exp > 0:
        sft = sft_phi_loss if enable_phi_function else sft_loss
        sft_value = sft(logprob[expert_mask], action_mask[expert_mask], use_token_level_loss=use_token_level_loss_in_sft)
        sft_value = sft_value * n_expert_exp * per_micro_batch_weight_expert
    else:
        sft_value = torch.tensor(0.0, device=logprob.device)
    mu = mu_schedule_function(current_step, mu_warmup_steps, mu_decay_steps, mu_peak, mu_valley)
    return (1 - mu) * grpo_loss + mu * sft_value


# --------------------------------------------------------------------------------------------------
# the core maths on random inputs
# --------------------------------------------------------------------------------------------------


def test_mu_schedule_matches_trinity():
    rng = random.Random(0)
    for _ in range(2000):
        warmup, decay = rng.choice([0, 1, 5, 200]), rng.choice([0, 1, 7, 400])
        peak, valley = rng.random(), rng.random() * 0.2
        step = rng.randint(0, warmup + decay + 5)
        ours = chord.mu_schedule(step, warmup, decay, peak, valley)
        assert ours == pytest.approx(mu_schedule_function(step, warmup, decay, peak, valley), abs=1e-12)
    # the paper's example schedule (examples/mix_chord/mix_chord.yaml): 0 -> 0.5 over 200 steps, then to 0.02
    assert chord.mu_schedule(100, 200, 400, 0.5, 0.02) == pytest.approx(0.25)
    assert chord.mu_schedule(200, 200, 400, 0.5, 0.02) == pytest.approx(0.5)
    assert chord.mu_schedule(600, 200, 400, 0.5, 0.02) == pytest.approx(0.02)


@pytest.mark.parametrize("use_phi", [True, False])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_sft_loss_and_its_gradient_match_trinity(use_phi, mode):
    """phi is a detached weight: d/dlogp of -phi(p) log p is -phi(p), not the derivative of the product."""
    from mix_src.algo.core_alg import agg_loss

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=g) * 2
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[:, 0] = True
    ours_in = torch.nn.functional.logsigmoid(logits).requires_grad_(True)
    theirs_in = ours_in.detach().clone().requires_grad_(True)
    ours = agg_loss(chord.sft_token_loss(ours_in, use_phi), mask, mode)
    ref = (sft_phi_loss if use_phi else sft_loss)(theirs_in, mask.float(), use_token_level_loss=mode == "token-mean")
    ours.backward()
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-8)
    if use_phi:  # the gradient is -phi(p) / count on each masked token
        p = ours_in.detach().exp()
        count = mask.sum() if mode == "token-mean" else None
        if count is not None:
            assert torch.allclose(ours_in.grad, -(p * (1 - p)) * mask / count, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# the whole worker loss against MIXCHORDPolicyLossFn
# --------------------------------------------------------------------------------------------------

ROWS, EXPERT_ROWS = 8, (1, 5)  # 6 on-policy rows, 2 expert rows (whole responses are the target)


def chord_batch(seed=0, model=None, step=1, expert_advantage=None):
    """A padded batch as the trainer has it at update_actor (expert rows: prefix_mask = response_mask), with
    the trainer's add_combine_inputs fields, then nested as the engine gets it."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, PROMPT + 1, (ROWS,), generator=g)
    response_lens = torch.randint(1, RESPONSE + 1, (ROWS,), generator=g)
    prompts = torch.randint(1, VOCAB, (ROWS, PROMPT), generator=g)
    responses = torch.randint(1, VOCAB, (ROWS, RESPONSE), generator=g)
    prompt_mask = torch.arange(PROMPT)[None, :] >= (PROMPT - prompt_lens)[:, None]
    response_mask = torch.arange(RESPONSE)[None, :] < response_lens[:, None]
    prompts[~prompt_mask] = 0
    responses[~response_mask] = 0
    expert = torch.zeros(ROWS, dtype=torch.bool)
    expert[list(EXPERT_ROWS)] = True
    prefix_mask = response_mask & expert[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    padded = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask.long(), "prefix_mask": prefix_mask.long(),
        "advantages": torch.randn(ROWS, 1, generator=g).expand(ROWS, RESPONSE) * response_mask,
    }  # fmt: skip
    if expert_advantage is not None:
        padded["advantages"] = torch.where(expert[:, None], expert_advantage, padded["advantages"]) * response_mask
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": ROWS}, "rollout": {"n": 1}}})
    holder = SimpleNamespace(batch=padded)  # add_combine_inputs reads/writes DataProto.batch
    add_combine_inputs(holder, config, MixLossConfig(combine="chord"), lambda: 1, step)
    td = left_right_2_no_padding(tu.get_tensordict(dict(padded)))
    model = model or BigramLM(seed=1)
    with torch.no_grad():
        current = no_padding_2_padding(model(td)["log_probs"], td)
    td["old_log_probs"] = (current + 0.3 * torch.randn(current.shape, generator=g)) * response_mask
    tu.assign_non_tensor(td, global_batch_size=ROWS, calculate_entropy=True, use_remove_padding=True,
                         use_dynamic_bsz=False)  # fmt: skip
    tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1)
    return td, expert


ARGS = [
    dict(mu_warmup_steps=0, mu_decay_steps=0, mu_peak=0.1, mu_valley=0.1, enable_phi_function=True),  # CHORD-phi
    dict(mu_warmup_steps=0, mu_decay_steps=200, mu_peak=0.9, mu_valley=0.05, enable_phi_function=False),  # CHORD-mu
    dict(mu_warmup_steps=200, mu_decay_steps=400, mu_peak=0.5, mu_valley=0.02, enable_phi_function=True),  # example
]


@pytest.mark.parametrize("args", ARGS)
@pytest.mark.parametrize("step", [1, 150, 333])
def test_worker_loss_matches_mix_chord(args, step):
    """One micro-batch, one GPU (Trinity's per-micro-batch weights are then 1/rows of each kind): the loss and
    the model's gradient equal MIXCHORDPolicyLossFn's; with 2 or 4 micro-batches ours is unchanged."""
    model = BigramLM(seed=1)
    data, expert = chord_batch(seed=step, model=model, step=step)
    loss_fn = MixPolicyLoss(actor_config(entropy_coeff=0.0), MixLossConfig(combine="chord", combine_args=args))
    total, grad, metrics = run_mini_batch(loss_fn, data, ROWS, model)
    assert metrics[0]["actor/chord_mu"].values[0] == pytest.approx(mu_schedule_function(
        step, args["mu_warmup_steps"], args["mu_decay_steps"], args["mu_peak"], args["mu_valley"]))  # fmt: skip

    padded = data.select("response_mask", "old_log_probs", "advantages").to_padded_tensor()
    model.zero_grad()
    logprob = no_padding_2_padding(model(data)["log_probs"], data)
    n_expert = int(expert.sum())
    ref = mix_chord_loss(
        logprob, padded["old_log_probs"], padded["response_mask"].float(), padded["advantages"], expert,
        torch.full((ROWS,), step), ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=ROWS,
        train_batch_size_usual=ROWS - n_expert, train_batch_size_expert=n_expert, **args,
    )  # fmt: skip
    ref.backward()
    assert total == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(grad, model.w.grad, rtol=1e-4, atol=1e-7)
    for micro_batch_size in (4, 2):
        split_total, split_grad, _ = run_mini_batch(loss_fn, data, micro_batch_size, model)
        assert split_total == pytest.approx(total, rel=1e-5, abs=1e-7)
        assert torch.allclose(split_grad, grad, rtol=1e-4, atol=1e-7)


def test_expert_rows_get_no_rl_gradient_and_on_policy_rows_no_sft_gradient():
    """mu = 1: only the expert rows' SFT term moves the model; mu = 0: only the on-policy rows' PPO term."""
    model = BigramLM(seed=1)
    data, expert = chord_batch(seed=4, model=model)
    sft_only = MixPolicyLoss(actor_config(entropy_coeff=0.0),
                             MixLossConfig(combine="chord", combine_args=dict(mu_peak=1.0, mu_valley=1.0)))  # fmt: skip
    total, _, _ = run_mini_batch(sft_only, data, ROWS, model)
    logprob = no_padding_2_padding(model(data)["log_probs"], data).detach()
    mask = data.select("response_mask").to_padded_tensor()["response_mask"].float()
    assert total == pytest.approx(sft_phi_loss(logprob[expert], mask[expert]).item(), rel=1e-5)
    # the advantages of the expert rows do not matter
    rl_only = MixPolicyLoss(actor_config(entropy_coeff=0.0),
                            MixLossConfig(combine="chord", combine_args=dict(mu_peak=0.0, mu_valley=0.0)))  # fmt: skip
    before, grad_before, _ = run_mini_batch(rl_only, data, ROWS, model)
    data2, _ = chord_batch(seed=4, model=model, expert_advantage=100.0)
    after, grad_after, _ = run_mini_batch(rl_only, data2, ROWS, model)
    assert after == pytest.approx(before, rel=1e-6) and torch.allclose(grad_after, grad_before)
    assert grad_before.abs().sum() > 0


def test_combine_inputs_are_required_and_counted_per_mini_batch():
    model = BigramLM(seed=1)
    data, _ = chord_batch(seed=2, model=model, step=7)
    assert data["mix_global_step"].tolist() == [7.0] * ROWS
    on_tokens = int(((data.select("response_mask").to_padded_tensor()["response_mask"].sum(-1)) *
                     (~torch.tensor([i in EXPERT_ROWS for i in range(ROWS)]))).sum())  # fmt: skip
    assert data["mix_on_tokens"].tolist() == [float(on_tokens)] * ROWS
    assert data["mix_on_rows"].tolist() == [6.0] * ROWS and data["mix_expert_rows"].tolist() == [2.0] * ROWS
    del data["mix_global_step"]
    loss_fn = MixPolicyLoss(actor_config(), MixLossConfig(combine="chord"))
    with pytest.raises(KeyError, match="mix_global_step"):
        run_mini_batch(loss_fn, data, ROWS, model)
    assert set(COMBINE_FIELDS) > {"mix_global_step"}


# --------------------------------------------------------------------------------------------------
# config: the entry describes itself, refuses bad settings and V1 before Ray
# --------------------------------------------------------------------------------------------------


def recipe_config(**over):
    base = {
        "trainer": {"use_v1": False},
        "algorithm": {"adv_estimator": "grpo_split"},
        "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean"}},
        "mix": {"n_prefix": 1, "min_prefix_ratio": 1.0, "max_prefix_ratio": 1.0, "prefix_strategy": "random",
                "loss": {"combine": "chord", "combine_args": {}, "loss_agg_mode": "token-mean"}},
    }  # fmt: skip
    cfg = OmegaConf.create(base)
    for key, value in over.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def test_entry_checks_and_bases():
    entry = LOSS_COMBINES.describe("chord")
    assert entry.bases == ("legacy", "v1") and "mix.loss.combine_args" in entry.reads
    check_selected_entries(recipe_config())
    check_selected_entries(recipe_config(**{"trainer.use_v1": True}))  # V1 writes its inputs too (MixV1Mixin)
    bad = {
        "algorithm.adv_estimator": ("grpo", "grpo_split"),
        "mix.n_prefix": (0, "n_prefix=0"),
        "mix.min_prefix_ratio": (0.5, "whole targets"),
        "mix.loss.combine_args": ({"mu_peek": 0.1}, "unknown key"),
        "mix.loss.loss_agg_mode": ("luffy-token-sum-norm", "token-mean"),
        "mix.loss.loss_remove_clip": (True, "PPO-clip"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(EntryConfigError, match=message):
            check_selected_entries(recipe_config(**{key: value}))
    with pytest.raises(EntryConfigError, match="mu_peak"):
        check_selected_entries(recipe_config(**{"mix.loss.combine_args": {"mu_peak": 1.5}}))


def test_loss_config_refuses_what_a_combination_would_ignore():
    with pytest.raises(MixConfigError, match="not a registered loss combination"):
        MixLossConfig(combine="nope")
    with pytest.raises(MixConfigError, match="would be ignored"):
        MixLossConfig(combine="chord", use_sft_multitask_loss=True)
    with pytest.raises(MixConfigError, match="combine is not"):
        MixLossConfig(combine_args={"mu_peak": 0.2})


# --------------------------------------------------------------------------------------------------
# 2 real training steps: the recipe's own config (recipes/chord/config.yaml) on the CPU backend, tiny assets
# --------------------------------------------------------------------------------------------------


@pytest.mark.ray
def test_chord_recipe_trains_two_steps(tiny_assets, tmp_path):
    """`python -m mix_src.main_mix_ppo --config-path recipes/chord --config-name config +backend=cpu` with the
    recipe's settings (n 9 = 8 on-policy + 1 expert row per prompt, grpo_split, the chord combination) on the
    tiny assets: 2 steps, the expert rows are trained, mu is the recipe's, the loss is finite and moves weights."""
    from e2e import MIX_CPU, run_verl, tiny_overrides

    recipe = PLUGIN.parent
    overrides = ["--config-path", str(recipe), "--config-name", "config", *MIX_CPU,
                 *tiny_overrides(tiny_assets, steps=2, n=9, batch_size=2, response_length=24),
                 f"mix.plugins=[{PLUGIN}]"]  # fmt: skip
    result = run_verl("mix_src.main_mix_ppo", overrides, tmp_path, timeout=420)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert m["batch/off_policy_rows"] == 2 and m["batch/avg_prefix_ratio"] == pytest.approx(1 / 9)
        assert m["actor/chord_mu"] == pytest.approx(0.1)
        assert 0 < m["actor/chord_phi_mean"] <= 0.25 and m["actor/chord_sft_loss"] > 0
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0


def test_compare_yaml_composes_on_the_toy_task():
    """recipes/chord/compare.yaml (the comparison harness's contract: plugins + overrides on the toy task's base
    settings, recipes/toy_addition/on_policy_grpo.yaml) composes, validates and passes the entry's checks."""
    import yaml
    from hydra import compose, initialize_config_dir

    from mix_src.config.mix_config import validate_mix_config

    spec = yaml.safe_load((PLUGIN.parent / "compare.yaml").read_text())
    assert set(spec) <= {"kind", "plugins", "overrides"} and spec.get("kind", "rl") == "rl"
    root = PLUGIN.parents[2]
    plugins = [str(root / p) for p in spec["plugins"]]
    assert all(Path(p).is_file() for p in plugins)
    with initialize_config_dir(config_dir=str(root / "recipes" / "toy_addition"), version_base=None):
        cfg = compose(config_name="on_policy_grpo", overrides=[f"mix.plugins=[{','.join(plugins)}]", *spec["overrides"]])
    mix = validate_mix_config(cfg)
    check_selected_entries(cfg)
    assert mix.loss.combine == "chord" and mix.n_prefix == 1 and cfg.actor_rollout_ref.rollout.n == 9


def test_settings_reach_the_worker_loss_through_the_one_channel():
    """mix.plugin_options.chord (the one channel) and mix.loss.combine_args (its older spelling) are checked once on
    the driver and written back, so the worker loss's LossConfig hands CHORD the checked settings. < 0.1 s."""
    cfg = recipe_config(**{"mix.plugin_options": {"chord": {"mu_peak": 0.5}}})
    check_selected_entries(cfg)
    args = MixLossConfig.from_dict(OmegaConf.to_container(cfg.mix.loss)).combine_args
    assert LOSS_COMBINES.settings("chord", args) == {"mu_warmup_steps": 0, "mu_decay_steps": 0, "mu_peak": 0.5,
                                                     "mu_valley": 0.1, "enable_phi_function": True}  # fmt: skip
    with pytest.raises(EntryConfigError, match=r"mix\.plugin_options\.chord\.mu_peak=1\.5 must be a number in \[0\.0, 1\.0\]"):
        check_selected_entries(recipe_config(**{"mix.plugin_options": {"chord": {"mu_peak": 1.5}}}))
