"""Tests of mix_src/worker/loss.py, driven the way verl 0.9.1's engine drives a loss: a padded batch becomes a
TensorDict, `left_right_2_no_padding` nests it, the engine's global numbers (dp_size, batch_num_tokens,
global_batch_size) are assigned, `prepare_micro_batches` splits it, and a real (tiny) model computes
nested log-probs and entropy for each micro-batch with verl's own functions."""

from __future__ import annotations

import math
import pickle
from functools import partial

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from verl.workers.config import ActorConfig
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from mix_src.algo.core_alg import agg_loss, compute_token_on_off_policy_loss, kept_tokens_per_mini_batch, masked_mean
from mix_src.worker.loss import KEPT_TOKENS, MixLossConfig, MixPolicyLoss
from mix_src.worker.onpolicy_losses import knob_refusals

VOCAB, PROMPT, RESPONSE = 13, 4, 6


class BigramLM(torch.nn.Module):
    """logits(next | token) = W[token]: the smallest real model with per-token log-probs and entropy."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g))

    def forward(self, micro_batch) -> dict:
        """Like FSDPEngineWithLMHead.prepare_model_outputs with remove-padding: nested (bsz, j) outputs."""
        input_ids = micro_batch["input_ids"]  # nested (bsz, prompt_i + response_i)
        ids = input_ids.values()
        logits = self.w[ids]  # (total_nnz, vocab)
        log_probs = logprobs_from_logits(logits, torch.roll(ids, shifts=-1, dims=0))
        entropy = entropy_from_logits(logits)
        offsets = input_ids.offsets()
        return {
            "log_probs": torch.nested.nested_tensor_from_jagged(log_probs, offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(entropy, offsets),
        }


def make_batch(seed=0, rows=6, prefix="mixed", model=None, spread=0.3):
    """A padded batch as the trainer has it, then the trainer's and the engine's steps up to
    prepare_micro_batches. prefix: "mixed" (row 0 full demo, row 1 partial), "none", "all"."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, PROMPT + 1, (rows,), generator=g)
    response_lens = torch.randint(1, RESPONSE + 1, (rows,), generator=g)
    response_lens[0] = RESPONSE
    prompts = torch.randint(1, VOCAB, (rows, PROMPT), generator=g)
    responses = torch.randint(1, VOCAB, (rows, RESPONSE), generator=g)
    prompt_mask = torch.arange(PROMPT)[None, :] >= (PROMPT - prompt_lens)[:, None]  # left padded
    response_mask = torch.arange(RESPONSE)[None, :] < response_lens[:, None]  # right padded
    prompts[~prompt_mask] = 0
    responses[~response_mask] = 0
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    prefix_mask = torch.zeros(rows, RESPONSE, dtype=torch.bool)
    if prefix == "mixed":
        prefix_mask[0] = response_mask[0]
        prefix_mask[1, :2] = response_mask[1, :2]
    elif prefix == "all":
        prefix_mask = response_mask.clone()
    td = tu.get_tensordict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask.long(),
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, RESPONSE) * response_mask,
        "prefix_mask": prefix_mask.long(),
    })  # fmt: skip
    td = left_right_2_no_padding(td)  # what RayPPOTrainer._update_actor does
    model = model or BigramLM(seed=1)
    with torch.no_grad():  # old and reference log-probs near the current policy
        current = no_padding_2_padding(model(td)["log_probs"], td)
    td["old_log_probs"] = (current + spread * torch.randn(current.shape, generator=g)) * response_mask
    td["ref_log_prob"] = (current + 0.3 * torch.randn(current.shape, generator=g)) * response_mask
    # the trainer's non-tensor fields and the engine's global numbers (forward_backward_batch)
    tu.assign_non_tensor(td, global_batch_size=rows, calculate_entropy=True, use_remove_padding=True,
                         use_dynamic_bsz=False)  # fmt: skip
    tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1)
    return td


def run_mini_batch(loss_fn, data, micro_batch_size, model):
    """One mini-batch through the engine's micro-batch loop: forward, loss, backward per micro-batch.
    Returns the summed loss, the parameter gradient and the per-micro-batch metrics."""
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=micro_batch_size)
    micro_batches, _ = prepare_micro_batches(data)
    model.zero_grad()
    total, metrics = 0.0, []
    for micro_batch in micro_batches:
        loss, m = loss_fn(model_output=model(micro_batch), data=micro_batch)
        loss.backward()
        total += loss.item()
        metrics.append(m)
    return total, model.w.grad.clone(), metrics


def actor_config(**overrides):
    kwargs = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01)
    return ActorConfig(**{**kwargs, **overrides})


CONFIGS = {
    "default": ({}, {}),
    "luffy_recipe": ({}, dict(off_policy_reshape="p_div_p", loss_remove_clip=True, loss_agg_mode="luffy-token-sum-norm")),
    "seq_mean_token_mean_kl": (dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True), dict(off_max_clip=0.5)),
    "seq_mean_token_sum_norm": (dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8), {}),
    "token_sum_kl_k2": (dict(loss_agg_mode="token-sum", use_kl_loss=True, kl_loss_type="k2"), dict(all_max_clip=0.6)),
    "sft_multitask": (dict(use_kl_loss=True), dict(use_sft_multitask_loss=True, sft_loss_coef=0.5)),
    "adaptive_entropy": ({}, dict(use_adaptive_entropy=True, target_entropy=1.0, alpha_lr=0.05)),
    "all_max_clip_token_mean": ({}, dict(all_max_clip=0.15)),
    "all_max_clip_token_mean_kl": (dict(use_kl_loss=True), dict(all_max_clip=0.15, off_max_clip=0.5)),
}  # fmt: skip


def add_kept_counts(data, all_max_clip, dp_size=1, mini_batch_rows=None):
    """What add_kept_token_counts puts into the batch on the driver (one DP rank, one mini-batch)."""
    kept = data["response_mask"].bool() & (data["old_log_probs"] <= math.log(all_max_clip))
    rows = data["response_mask"].shape[0]
    data[KEPT_TOKENS] = kept_tokens_per_mini_batch(kept, dp_size, mini_batch_rows or rows).float()
    return kept


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_micro_batches_give_the_same_gradient_as_one(name):
    actor_kw, mix_kw = CONFIGS[name]
    grads, losses, coefs = [], [], []
    for micro_batch_size in (6, 3, 2):  # 1, 2 and 3 micro-batches of one mini-batch of 6 rows
        model = BigramLM(seed=1)
        loss_fn = MixPolicyLoss(actor_config(**actor_kw), MixLossConfig(**mix_kw))
        data = make_batch(seed=3, model=model)
        if loss_fn.kept_token_counts:
            kept = add_kept_counts(data, mix_kw["all_max_clip"])
            assert 0 < kept.sum() < data["response_mask"].sum()  # some tokens really leave the loss
        total, grad, _ = run_mini_batch(loss_fn, data, micro_batch_size, model)
        grads.append(grad)
        losses.append(total)
        if loss_fn._entropy_coef is not None:
            coefs.append(loss_fn._entropy_coef.coef)
    assert grads[0].abs().sum() > 0
    for grad, total in zip(grads[1:], losses[1:]):
        assert torch.allclose(grad, grads[0], rtol=1e-5, atol=1e-6), (grad - grads[0]).abs().max()
        assert total == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    if name == "adaptive_entropy":  # stepped once per mini-batch, however it is split
        assert len(coefs) == 3 and coefs[0] != 0.01 and max(coefs) - min(coefs) < 1e-12


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])  # fmt: skip
@pytest.mark.parametrize("kl_type", [None, "low_var_kl", "k1"])
def test_all_zero_prefix_mask_equals_verl_ppo_loss(mode, kl_type):
    config = actor_config(loss_agg_mode=mode, use_kl_loss=kl_type is not None, kl_loss_type=kl_type or "low_var_kl",
                          clip_ratio=0.1, clip_ratio_low=0.1, clip_ratio_high=0.1)  # fmt: skip
    ours, theirs = MixPolicyLoss(config), partial(ppo_loss, config=config)
    results = []
    for loss_fn in (ours, theirs):
        model = BigramLM(seed=1)
        data = make_batch(seed=4, prefix="none", model=model, spread=1.5)  # wide ratios: both clips act
        results.append(run_mini_batch(loss_fn, data, 3, model))
    (our_loss, our_grad, our_metrics), (their_loss, their_grad, their_metrics) = results
    assert max(m["actor/pg_clipfrac_lower"].values[0] for m in their_metrics) > 0
    assert max(m["actor/pg_clipfrac"].values[0] for m in their_metrics) > 0
    assert our_loss == pytest.approx(their_loss, rel=1e-6, abs=1e-7)
    assert torch.allclose(our_grad, their_grad, rtol=1e-6, atol=1e-7)
    assert our_grad.abs().sum() > 0
    for ours_m, theirs_m in zip(our_metrics, their_metrics):
        assert set(theirs_m) <= set(ours_m)  # every verl metric is there, under the same name
        for key in theirs_m:
            a, b = ours_m[key], theirs_m[key]
            a, b = (a.values[0], b.values[0]) if hasattr(a, "values") else (a, b)
            assert float(a) == pytest.approx(float(b), rel=1e-5, abs=1e-7), key
            if hasattr(ours_m[key], "aggregation"):
                assert ours_m[key].aggregation == theirs_m[key].aggregation, key


def test_kl_loss_together_with_off_policy_loss():
    mix = MixLossConfig(off_policy_reshape="p_div_p_0.1")
    with_kl = MixPolicyLoss(actor_config(use_kl_loss=True, kl_loss_coef=0.3), mix)
    without = MixPolicyLoss(actor_config(use_kl_loss=False), mix)
    model = BigramLM(seed=1)
    data = make_batch(seed=5, model=model)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=6)
    (micro_batch,), _ = prepare_micro_batches(data)
    loss_kl, metrics = with_kl(model_output=model(micro_batch), data=micro_batch)
    loss_plain, _ = without(model_output=model(micro_batch), data=micro_batch)
    kl = metrics["kl_loss"].values[0]
    assert kl > 0 and metrics["kl_coef"] == 0.3
    assert loss_kl.item() == pytest.approx(loss_plain.item() + 0.3 * kl, rel=1e-6)
    assert metrics["actor/off_policy_prob"].values[0] > 0 and metrics["actor/off_pg_loss"].values[0] != 0
    loss_kl.backward()
    assert torch.isfinite(model.w.grad).all() and model.w.grad.abs().sum() > 0


def test_metrics_names_and_values():
    model = BigramLM(seed=1)
    data = make_batch(seed=6, model=model)
    loss_fn = MixPolicyLoss(actor_config(), dict(off_policy_reshape="p_div_p"))
    _, _, (metrics,) = run_mini_batch(loss_fn, data, 6, model)
    luffy = ["actor/off_policy_prob", "actor/on_policy_prob", "actor/off_pg_loss", "actor/on_pg_loss",
             "actor/off_ratio_mean", "actor/off_ratio_max_clip_frac", "actor/off_ratio_min_clip_frac"]  # fmt: skip
    verl = ["actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy_loss"]
    assert set(luffy + verl) <= set(metrics)
    # the same numbers as the pure function on the padded tensors
    with torch.no_grad():
        log_prob = no_padding_2_padding(model(data)["log_probs"], data)
    mask = data["response_mask"].bool()
    ref = compute_token_on_off_policy_loss(data["old_log_probs"], log_prob, data["advantages"], mask,
                                           data["prefix_mask"], off_policy_reshape="p_div_p", clip_ratio_c=3.0,
                                           batch_num_tokens=int(mask.sum()), global_batch_size=6)  # fmt: skip
    for key in luffy:
        assert metrics[key].values[0] == pytest.approx(ref[key.removeprefix("actor/")].item(), rel=1e-5), key
    assert metrics["actor/off_policy_prob"].values[0] > 0 and metrics["actor/on_policy_prob"].values[0] > 0


def test_sft_multitask_loss_value():
    model = BigramLM(seed=1)
    data = make_batch(seed=7, model=model)
    loss_fn = MixPolicyLoss(actor_config(entropy_coeff=0.0), dict(use_sft_multitask_loss=True, sft_loss_coef=0.5))
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=6)
    (micro_batch,), _ = prepare_micro_batches(data)
    out = model(micro_batch)
    out.pop("entropy")
    loss, metrics = loss_fn(model_output=out, data=micro_batch)
    log_prob = no_padding_2_padding(out["log_probs"], micro_batch).detach()
    mask, prefix = micro_batch["response_mask"].bool(), micro_batch["prefix_mask"].bool()
    n = int(mask.sum())
    sft = -(log_prob * prefix).sum() / n  # prefix-token NLL over the mini-batch's tokens (token-mean)
    on_rows = mask & ~prefix.any(-1, keepdim=True)
    pg = compute_token_on_off_policy_loss(micro_batch["old_log_probs"], log_prob, micro_batch["advantages"], on_rows,
                                          torch.zeros_like(prefix), clip_ratio_c=3.0, batch_num_tokens=n,
                                          global_batch_size=6)["pg_loss"]  # fmt: skip
    assert metrics["actor/sft_loss"].values[0] == pytest.approx(sft.item(), rel=1e-6)
    assert loss.item() == pytest.approx(pg.item() + 0.5 * sft.item(), rel=1e-6)
    assert metrics["actor/sft_nll"].values[0] == pytest.approx(-(log_prob[prefix]).mean().item(), rel=1e-6)


@pytest.mark.parametrize("target, direction", [(5.0, +1), (0.1, -1)])
def test_adaptive_entropy_coefficient_moves_toward_target(target, direction):
    model = BigramLM(seed=1)  # its token entropy is between 0.1 and log(13) = 2.56
    loss_fn = MixPolicyLoss(actor_config(entropy_coeff=0.01),
                            dict(use_adaptive_entropy=True, target_entropy=target, alpha_lr=0.1))  # fmt: skip
    coefs = []
    for step in range(3):  # three mini-batches of two micro-batches each
        _, _, metrics = run_mini_batch(loss_fn, make_batch(seed=10 + step, model=model), 3, model)
        assert metrics[0]["actor/entropy_coeff"] == metrics[1]["actor/entropy_coeff"]  # fixed in a mini-batch
        assert "actor/alpha_loss" not in metrics[0] and "actor/alpha_loss" in metrics[1]  # one step, at the end
        coefs.append(loss_fn._entropy_coef.coef)
    assert all(direction * (b - a) > 0 for a, b in zip([0.01] + coefs, coefs))

    capped = MixPolicyLoss(actor_config(entropy_coeff=0.01),
                           dict(use_adaptive_entropy=True, target_entropy=5.0, alpha_lr=0.5, entropy_coeff_max=0.012))
    for step in range(3):
        run_mini_batch(capped, make_batch(seed=20 + step, model=model), 6, model)
    assert capped._entropy_coef.coef == pytest.approx(0.012)


def test_adaptive_entropy_fixed_variant():
    model = BigramLM(seed=1)
    data = make_batch(seed=8, model=model)
    loss_fn = MixPolicyLoss(actor_config(entropy_coeff=0.01), dict(adaptive_entropy_fixed=True, target_entropy=0.5))
    _, _, (metrics,) = run_mini_batch(loss_fn, data, 6, model)
    with torch.no_grad():
        entropy = no_padding_2_padding(model(data)["entropy"], data)
    mask = data["response_mask"].bool()
    assert metrics["actor/entropy_coeff"] == pytest.approx(0.01 * 0.5 / entropy[mask].mean().item(), rel=1e-5)


def test_all_prefix_batch_and_pickling():
    model = BigramLM(seed=1)
    loss_fn = MixPolicyLoss(actor_config(use_kl_loss=True), dict(off_policy_reshape="p_div_p", use_adaptive_entropy=True))
    loss_fn = pickle.loads(pickle.dumps(loss_fn))  # set_loss_fn sends it to the workers pickled
    total, grad, metrics = run_mini_batch(loss_fn, make_batch(seed=9, prefix="all", model=model), 3, model)
    assert math.isfinite(total) and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert all(m["actor/on_pg_loss"].values[0] == 0 and m["actor/on_policy_prob"].values[0] == 0 for m in metrics)


def test_errors():
    model = BigramLM(seed=1)
    data = make_batch(seed=2, model=model)
    del data["prefix_mask"]
    with pytest.raises(KeyError, match="prefix_mask"):
        run_mini_batch(MixPolicyLoss(actor_config()), data, 6, model)
    data = make_batch(seed=2, model=model)
    data["prefix_mask"] = data["prefix_mask"][:, :3]
    with pytest.raises(ValueError, match="prefix_mask has shape"):
        run_mini_batch(MixPolicyLoss(actor_config()), data, 6, model)
    # refused before Ray (onpolicy_losses.knob_refusals via config/verl_parity.py); other verl losses: test_onpolicy_losses
    assert "loss_mode='bypass_mode'" in knob_refusals("bypass_mode", MixLossConfig(), actor_config())[0]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['mix.loss.use_off_policy_loss'\]; valid keys of mix.loss: \['off_policy_reshape'"):
        MixPolicyLoss(actor_config(), {"use_off_policy_loss": True})
    with pytest.raises(ValueError, match="mix.loss.off_policy_reshape='p_div_p_0.2' is not a registered off-policy reshape"):
        MixLossConfig(off_policy_reshape="p_div_p_0.2")
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        MixLossConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"\['off_max_clip', 'off_policy_reshape'\] would be ignored"):
        MixLossConfig(use_sft_multitask_loss=True, off_policy_reshape="no_reshape", off_max_clip=0.5)
    with pytest.raises(ValueError, match="on_policy_reshape_gamma=-0.1 must be > 0"):
        MixLossConfig(on_policy_reshape_gamma=-0.1)
    with pytest.raises(ValueError, match="exclude each other"):
        MixLossConfig(use_adaptive_entropy=True, adaptive_entropy_fixed=True)
    with pytest.raises(ValueError, match="entropy_coeff, which must be > 0"):
        MixPolicyLoss(actor_config(entropy_coeff=0.0), dict(use_adaptive_entropy=True))
    with pytest.raises(ValueError, match="clip_ratio_high"):
        MixPolicyLoss(actor_config(clip_ratio_low=0.3, clip_ratio_high=0.2))
    with pytest.raises(ValueError, match="off_policy_reshape_gamma=0 must be > 0"):
        MixLossConfig(off_policy_reshape_gamma=0)


def test_agg_matches_what_loss_uses_for_entropy():
    # the entropy term is agg_loss over every valid token (prefix included), as in verl and LUFFY
    model = BigramLM(seed=1)
    data = make_batch(seed=11, model=model)
    loss_fn = MixPolicyLoss(actor_config(entropy_coeff=0.02), {})
    _, _, (metrics,) = run_mini_batch(loss_fn, data, 6, model)
    with torch.no_grad():
        entropy = no_padding_2_padding(model(data)["entropy"], data)
    mask = data["response_mask"].bool()
    expected = agg_loss(entropy, mask, "token-mean", batch_num_tokens=int(mask.sum()), global_batch_size=6)
    assert metrics["actor/entropy_loss"].values[0] == pytest.approx(expected.item(), rel=1e-6)


def test_accepts_the_trainer_config_dataclass():
    # the trainer passes its validated mix_config.LossConfig; every one of its fields must be understood
    from mix_src.config.mix_config import mix_config_from_dict

    mix = mix_config_from_dict({"loss": {"off_policy_reshape": "p_div_p_0.5", "loss_remove_clip": True,
                                         "on_policy_reshape": "p_div_p", "on_policy_reshape_gamma": 0.3}})  # fmt: skip
    loss_fn = MixPolicyLoss(actor_config(), mix.loss)
    assert loss_fn.mix.off_policy_reshape == "p_div_p" and loss_fn.mix.off_policy_reshape_gamma == 0.5
    assert loss_fn.mix.on_policy_reshape_gamma == 0.3 and loss_fn.mix.loss_remove_clip
    model = BigramLM(seed=1)
    total, grad, _ = run_mini_batch(loss_fn, make_batch(seed=12, model=model), 3, model)
    assert math.isfinite(total) and grad.abs().sum() > 0


@pytest.mark.parametrize("micro_batch_size", [6, 3, 2])
def test_all_max_clip_token_mean_is_the_mean_over_kept_tokens(micro_batch_size):
    """all_max_clip + token-mean: the policy loss is sum(kept losses) / (kept tokens of the mini-batch), as
    LUFFY's token mean over its kept tokens, for 1, 2 or 3 micro-batches (verl's batch_num_tokens counts
    every token, which made it (kept/total) x that)."""
    c = 0.15
    model = BigramLM(seed=1)
    data = make_batch(seed=3, model=model, spread=0.0)  # old = current log-probs, as on an on-policy step
    kept = add_kept_counts(data, c)
    loss_fn = MixPolicyLoss(actor_config(entropy_coeff=0.0), MixLossConfig(all_max_clip=c))
    total, _, _ = run_mini_batch(loss_fn, data, micro_batch_size, model)
    padded = data.select("response_mask", "old_log_probs", "advantages", "prefix_mask").to_padded_tensor()
    with torch.no_grad():
        current = no_padding_2_padding(model(data)["log_probs"], data)
    reference = compute_token_on_off_policy_loss(
        padded["old_log_probs"], current, padded["advantages"], padded["response_mask"], padded["prefix_mask"].bool(),
        all_max_clip=c, loss_agg_mode="token-mean", off_policy_reshape="p_div_p", off_policy_reshape_gamma=0.1,
        clip_ratio_c=3.0)["pg_loss"]  # the whole mini-batch at once: the mean over its kept tokens
    assert 0 < kept.sum() < padded["response_mask"].sum()
    assert total == pytest.approx(reference.item(), rel=1e-5, abs=1e-7)


def test_kept_tokens_follow_verls_mini_batch_layout():
    """8 rows, 2 DP ranks, mini-batches of 4 rows: rank 0 holds rows 0-3, rank 1 rows 4-7; global mini-batch 0
    is rows 0, 1, 4, 5 and mini-batch 1 rows 2, 3, 6, 7."""
    kept = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0], [1, 1], [0, 1], [1, 1], [1, 1]], dtype=torch.bool)
    out = kept_tokens_per_mini_batch(kept, dp_size=2, mini_batch_rows=4)
    assert out.tolist() == [6.0, 6.0, 5.0, 5.0, 6.0, 6.0, 5.0, 5.0]
    assert kept_tokens_per_mini_batch(kept, 1, 8).tolist() == [11.0] * 8
    with pytest.raises(ValueError, match="cannot be split"):
        kept_tokens_per_mini_batch(kept, dp_size=3, mini_batch_rows=3)
    # the loss refuses a micro-batch whose rows come from different mini-batches, or a missing count
    loss_fn = MixPolicyLoss(actor_config(), MixLossConfig(all_max_clip=0.5))
    model = BigramLM(seed=1)
    data = make_batch(seed=3, model=model)
    with pytest.raises(KeyError, match="mix_kept_tokens"):
        run_mini_batch(loss_fn, data, 6, model)
    data[KEPT_TOKENS] = torch.arange(6, dtype=torch.float32)
    with pytest.raises(ValueError, match="differs within one micro-batch"):
        run_mini_batch(loss_fn, data, 6, model)


def test_adaptive_entropy_state_round_trips_through_the_metrics():
    """A resumed run continues the learned coefficient: its state leaves the worker in the metrics, and a loss
    built with it continues exactly where an uninterrupted one is (log_alpha and AdamW's moments)."""
    from mix_src.worker.loss import pop_entropy_state

    mix = MixLossConfig(use_adaptive_entropy=True, target_entropy=1.0, alpha_lr=0.05)
    batches = [make_batch(seed=s, model=BigramLM(seed=1)) for s in (3, 4, 5)]

    def run(loss_fn, data):
        _, _, metrics = run_mini_batch(loss_fn, data, 3, BigramLM(seed=1))
        merged: dict = {}
        for m in metrics:  # what the engine hands the trainer: per-key lists over micro-batches
            for k, v in m.items():
                merged.setdefault(k, []).append(v)
        return merged

    straight = MixPolicyLoss(actor_config(), mix)
    for data in batches:
        run(straight, data)

    first = MixPolicyLoss(actor_config(), mix)
    metrics = run(first, batches[0])
    state = pop_entropy_state({f"actor/{k}" if not k.startswith("actor/") else k: v for k, v in metrics.items()})
    assert state is not None and state["step"] == 1.0 and state["exp_avg"] != 0.0
    resumed = MixPolicyLoss(actor_config(), mix, entropy_state=state)
    for data in batches[1:]:
        run(resumed, data)
    assert resumed._entropy_coef.state() == straight._entropy_coef.state()
    assert resumed._entropy_coef.coef != 0.01  # it moved
    # without the state, a resumed run would restart from entropy_coeff
    fresh = MixPolicyLoss(actor_config(), mix)
    for data in batches[1:]:
        run(fresh, data)
    assert fresh._entropy_coef.coef != straight._entropy_coef.coef


def test_a_registered_loss_term_is_checked_at_config_time_and_added_to_the_loss():
    """One decorator adds a term (mix_src/algo/loss_terms.py): its config check runs when mix.loss is built, and the worker
    loss adds its value after the built-in terms (policy, sft, entropy, kl), outside actor/pg_loss. ~1 s."""
    from mix_src.algo.loss_terms import LOSS_TERMS, register_loss_term
    from mix_src.config.mix_config import MixConfigError

    def check(loss, p):
        if loss.sft_loss_coef == 0.125:
            raise ValueError(f"{p}.sft_loss_coef=0.125 is refused by the test term")

    @register_loss_term("test_mean_logp", stage="scalar", inputs=("response_mask",), writes="0.5 * mean log p",
                        check_loss=check)  # fmt: skip
    def mean_logp(t):
        t.log("actor/test_term", float(masked_mean(t.log_prob.detach(), t.response_mask)))
        return 0.5 * masked_mean(t.log_prob, t.response_mask)

    try:
        with pytest.raises(MixConfigError, match=r"mix\.loss\.sft_loss_coef=0\.125 is refused by the test term"):
            MixLossConfig(sft_loss_coef=0.125)
        model = BigramLM(seed=1)
        data = make_batch(seed=2, model=model)
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=6)
        (micro,), _ = prepare_micro_batches(data)
        out = model(micro)
        with_term, metrics = MixPolicyLoss(actor_config())(model_output=out, data=micro)
    finally:
        LOSS_TERMS._entries.pop("test_mean_logp")  # one dict since 676e072 (extend.Entry holds fn)
    without, base_metrics = MixPolicyLoss(actor_config())(model_output=out, data=micro)
    log_prob = no_padding_2_padding(out["log_probs"], micro)
    mask = micro.select("response_mask").to_padded_tensor()["response_mask"].bool()
    assert torch.equal(with_term, without + 0.5 * masked_mean(log_prob, mask))
    assert "actor/test_term" in metrics and "actor/test_term" not in base_metrics
    assert metrics["actor/pg_loss"].values == base_metrics["actor/pg_loss"].values
