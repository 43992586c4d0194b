"""LUFFY guidance under every verl policy loss (mix_src/worker/onpolicy_losses.py through mix_src/worker/loss.py), driven the
way verl's engine drives a loss (tests/test_loss.py's helpers: a real model, verl's micro-batching)."""

from __future__ import annotations

import math
import re
from functools import partial

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
from verl.utils import tensordict_utils as tu
from verl.workers.config import PolicyLossConfig
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from mix_src.worker.loss import MixLossConfig, MixPolicyLoss
from mix_src.worker.onpolicy_losses import ON_POLICY_MODES, knob_refusals, mode_entry
from test_loss import BigramLM, actor_config, add_kept_counts, make_batch, run_mini_batch

# every policy loss verl 0.9.1 registers that can be the on-policy term (bypass_mode is refused)
MODES = ["vanilla", "gspo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro"]
MICRO_BATCH_EXACT = [m for m in MODES if ON_POLICY_MODES[m].micro_batch_exact]


def mode_config(mode, **overrides):
    """An ActorConfig with ``mode`` as verl's trainer builds it (PolicyLossConfig; DRO needs its beta)."""
    policy_loss = PolicyLossConfig(loss_mode=mode, dro_beta=0.1 if mode == "dro" else None, clip_cov_ratio=0.2,
                                   kl_cov_ratio=0.2)  # fmt: skip
    return actor_config(policy_loss=policy_loss, **overrides)


def one_micro_batch(data):
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=data["response_mask"].shape[0])
    (micro_batch,), _ = prepare_micro_batches(data)
    return micro_batch


def test_every_registered_verl_loss_has_an_entry():
    assert set(MODES) | {"bypass_mode"} == set(POLICY_LOSS_REGISTRY) <= set(ON_POLICY_MODES)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", MODES)
def test_no_prefix_rows_equal_verls_ppo_loss(mode, agg):
    """All-zero prefix_mask: the MIX loss is verl's ppo_loss with the same loss_mode (loss, gradient, metrics)."""
    config = mode_config(mode, loss_agg_mode=agg, clip_ratio=0.1, clip_ratio_low=0.1, clip_ratio_high=0.1)
    results = []
    for loss_fn in (MixPolicyLoss(config), partial(ppo_loss, config=config)):
        model = BigramLM(seed=1)
        data = make_batch(seed=4, prefix="none", model=model, spread=1.5)
        torch.manual_seed(0)  # clip_cov's random pick among its candidates
        results.append(run_mini_batch(loss_fn, data, 6, model))
    (our_loss, our_grad, (ours_m,)), (their_loss, their_grad, (theirs_m,)) = results
    assert our_grad.abs().sum() > 0
    assert our_loss == pytest.approx(their_loss, rel=1e-6, abs=1e-7)
    assert torch.allclose(our_grad, their_grad, rtol=1e-6, atol=1e-7)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        if key in theirs_m:
            a, b = ours_m[key], theirs_m[key]
            assert float(a.values[0]) == pytest.approx(float(b.values[0]), rel=1e-5, abs=1e-7), key


def _on_policy_only(data, prefix_mask):
    """``data`` with the prefix tokens taken out of the response mask (what verl would see of the on-policy part)."""
    on = data.clone()
    on["response_mask"] = data["response_mask"] * (1 - prefix_mask)
    on["loss_mask"] = on["response_mask"].clone()
    on["prefix_mask"] = torch.zeros_like(data["prefix_mask"])
    return on


@pytest.mark.parametrize("mode", [m for m in MODES if m != "vanilla" and ON_POLICY_MODES[m].aggregation == "actor"])
def test_with_prefixes_the_on_policy_term_is_verls_loss_on_the_on_policy_tokens(mode):
    """token-sum: the on-term (actor/on_pg_loss) equals verl's ppo_loss on a batch whose response mask holds the
    on-policy tokens only, and pg_loss - on-term is LUFFY's prefix term, the same under every mode."""
    config = mode_config(mode, loss_agg_mode="token-sum", entropy_coeff=0.0)
    model = BigramLM(seed=1)
    data = make_batch(seed=6, prefix="mixed", model=model, spread=0.5)
    padded = data.select("prefix_mask", "response_mask").to_padded_tensor()
    prefix = padded["prefix_mask"] * padded["response_mask"]
    assert prefix.sum() > 0 and (padded["response_mask"] * (1 - prefix)).sum() > 0
    torch.manual_seed(0)
    _, ours = MixPolicyLoss(config, MixLossConfig(off_policy_reshape="p_div_p"))(
        model_output=model(one_micro_batch(data)), data=one_micro_batch(data))
    on_data = _on_policy_only(data, prefix)
    torch.manual_seed(0)
    _, theirs = ppo_loss(config, model_output=model(one_micro_batch(on_data)), data=one_micro_batch(on_data))
    on_term = float(ours["actor/on_pg_loss"].values[0])
    assert on_term == pytest.approx(float(theirs["actor/pg_loss"].values[0]), rel=1e-5, abs=1e-6)
    # the prefix term: the LUFFY kernel with the on-policy tokens' advantage set to 0
    off_term = float(ours["actor/pg_loss"].values[0]) - on_term
    _, ref = MixPolicyLoss(actor_config(loss_agg_mode="token-sum", entropy_coeff=0.0),
                           MixLossConfig(off_policy_reshape="p_div_p"))(
        model_output=model(one_micro_batch(data)), data=one_micro_batch(_zero_on_policy_advantages(data, prefix)))
    assert off_term == pytest.approx(float(ref["actor/pg_loss"].values[0]), rel=1e-5, abs=1e-6)
    assert abs(off_term) > 1e-4 and abs(on_term) > 1e-4


def _zero_on_policy_advantages(data, prefix):
    out = data.clone()
    out["advantages"] = data["advantages"] * prefix
    return out


@pytest.mark.parametrize("mode", ["gspo", "geo_mean"])
def test_prefix_tokens_do_not_enter_a_sequence_ratio(mode):
    """GSPO's sequence ratio and GMPO's geometric mean run over a row's generated tokens: moving the old
    log-probs of its prefix tokens changes neither the loss nor the gradient."""
    config = mode_config(mode, entropy_coeff=0.0)
    model = BigramLM(seed=1)
    data = make_batch(seed=7, prefix="mixed", model=model, spread=0.5)
    padded = data.select("prefix_mask", "response_mask").to_padded_tensor()
    prefix = (padded["prefix_mask"] * padded["response_mask"]).bool()
    assert (prefix.any(-1) & (padded["response_mask"].bool() & ~prefix).any(-1)).any()  # a mixed row (row 1)
    results = []
    for shift in (0.0, 2.0):
        moved = data.clone()
        moved["old_log_probs"] = data["old_log_probs"] - shift * prefix
        results.append(run_mini_batch(MixPolicyLoss(config), moved, 6, model))
    (loss_a, grad_a, _), (loss_b, grad_b, _) = results
    assert grad_a.abs().sum() > 0
    assert loss_a == pytest.approx(loss_b, rel=1e-6, abs=1e-7)
    assert torch.allclose(grad_a, grad_b, rtol=1e-6, atol=1e-7)


def test_seq_mean_token_mean_divides_a_mixed_row_by_all_its_tokens():
    """gpg (loss -A log p per token) under seq-mean-token-mean: the on-term is sum over rows of the row's
    on-policy token losses / the row's valid tokens (prefix included), / rows."""
    config = mode_config("gpg", loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.0)
    model = BigramLM(seed=1)
    data = make_batch(seed=8, prefix="mixed", model=model)
    micro_batch = one_micro_batch(data)
    out = model(micro_batch)
    _, metrics = MixPolicyLoss(config)(model_output=out, data=micro_batch)
    padded = micro_batch.select("prefix_mask", "response_mask", "advantages").to_padded_tensor()
    valid = padded["response_mask"].bool()
    on = valid & ~padded["prefix_mask"].bool()
    log_prob = no_padding_2_padding(out["log_probs"], micro_batch).detach()
    per_row = ((-padded["advantages"] * log_prob) * on).sum(-1) / valid.sum(-1)
    expected = float(per_row.sum() / valid.shape[0])
    assert float(metrics["actor/on_pg_loss"].values[0]) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert (on.sum(-1) != valid.sum(-1)).any()  # a row where the count matters


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "luffy-token-sum-norm"])
@pytest.mark.parametrize("mode", [m for m in MICRO_BATCH_EXACT if m != "vanilla"])
def test_micro_batch_split_does_not_change_the_gradient(mode, agg):
    grads, losses = [], []
    for micro_batch_size in (6, 3, 2):
        model = BigramLM(seed=1)
        loss_fn = MixPolicyLoss(mode_config(mode, loss_agg_mode="token-mean"),
                                MixLossConfig(off_policy_reshape="p_div_p", loss_agg_mode=agg))  # fmt: skip
        data = make_batch(seed=3, model=model)
        total, grad, _ = run_mini_batch(loss_fn, data, micro_batch_size, model)
        grads.append(grad)
        losses.append(total)
    assert grads[0].abs().sum() > 0
    for grad, total in zip(grads[1:], losses[1:]):
        assert torch.allclose(grad, grads[0], rtol=1e-5, atol=1e-6), (grad - grads[0]).abs().max()
        assert total == pytest.approx(losses[0], rel=1e-5, abs=1e-6)


def test_clip_cov_and_kl_cov_are_declared_micro_batch_dependent():
    assert {m for m in MODES if not ON_POLICY_MODES[m].micro_batch_exact} == {"clip_cov", "kl_cov"}


@pytest.mark.parametrize("mode", [m for m in MODES if m != "vanilla"])
def test_rollout_is_weights_reach_verls_loss_and_finite(mode):
    """Decoupled rollout correction's weights (1 on prefix tokens, as stages.on_policy_rollout_correction writes
    them) multiply the on-policy term; the loss stays finite with prefixes."""
    model = BigramLM(seed=1)
    data = make_batch(seed=9, model=model)
    losses = []
    for scale in (1.0, 0.5):
        weighted = data.clone()
        padded = data.select("prefix_mask", "response_mask").to_padded_tensor()
        w = torch.where(padded["prefix_mask"].bool(), 1.0, scale) * padded["response_mask"]
        weighted["rollout_is_weights"] = w.float()
        torch.manual_seed(0)
        _, metrics = MixPolicyLoss(mode_config(mode, entropy_coeff=0.0))(
            model_output=model(one_micro_batch(weighted)), data=one_micro_batch(weighted))
        losses.append((float(metrics["actor/on_pg_loss"].values[0]), float(metrics["actor/off_pg_loss"].values[0])))
    (on_1, off_1), (on_half, off_half) = losses
    assert all(math.isfinite(v) for pair in losses for v in pair)
    assert on_half == pytest.approx(0.5 * on_1, rel=1e-4, abs=1e-7) and off_half == off_1


# ---- LUFFY's knobs under the other modes (the table in recipes/guided_gspo/README.md) ----------------------
@pytest.mark.parametrize(
    "mode, knobs, pattern",
    [
        ("gspo", dict(loss_remove_clip=True), r"loss_mode='gspo' clips its ratio.*loss_remove_clip=false"),
        ("cispo", dict(on_policy_reshape="p_div_p"), r"on_policy_reshape='p_div_p'.*set it to 'no_reshape'"),
        ("dppo_tv", dict(clip_upper_bound=2.0), r"clip_upper_bound=2\.0 widens"),
        ("gspo", dict(all_max_clip=0.5), r"all_max_clip=0\.5 .*sequence ratio"),
        ("sapo", dict(all_max_clip=0.5), r"all_max_clip=0\.5 .*own aggregation"),
        ("gpg", dict(use_sft_multitask_loss=True), r"use_sft_multitask_loss .*vanilla"),
        ("bypass_mode", {}, r"loss_mode='bypass_mode': verl selects it itself.*apply_bypass_mode"),
    ],
)  # fmt: skip
def test_knobs_refused_with_the_reason(mode, knobs, pattern):
    # checked once, before Ray (config/verl_parity.py: test_preflight_accepts_a_verl_loss_and_refuses_...)
    assert re.search(pattern, "; ".join(knob_refusals(mode, MixLossConfig(**knobs), mode_config(mode))))


def test_knobs_honoured_or_translated():
    assert knob_refusals("gpg", MixLossConfig(loss_remove_clip=True), mode_config("gpg")) == []  # no clip to remove
    assert knob_refusals("vanilla", MixLossConfig(loss_remove_clip=True, on_policy_reshape="p_div_p"),
                         mode_config("vanilla")) == []  # fmt: skip
    loss = MixPolicyLoss(mode_config("gspo", clip_ratio_high=0.2), MixLossConfig(clip_upper_bound=1.5))
    assert loss.on_policy_config.clip_ratio_high == pytest.approx(0.5) and loss.config.clip_ratio_high == 0.2
    # all_max_clip with a token-level mode: tokens with p > c leave verl's mask too, over the mini-batch's kept count
    results = []
    for micro_batch_size, knobs in ((6, dict(all_max_clip=0.15)), (2, dict(all_max_clip=0.15)), (6, {})):
        model = BigramLM(seed=1)
        data = make_batch(seed=3, model=model)
        loss_fn = MixPolicyLoss(mode_config("cispo"), MixLossConfig(**knobs))
        if loss_fn.kept_token_counts:
            add_kept_counts(data, 0.15)
        results.append(run_mini_batch(loss_fn, data, micro_batch_size, model))
    (one, grad_one, _), (split, grad_split, _), (full, grad_full, _) = results
    assert one == pytest.approx(split, rel=1e-5) and torch.allclose(grad_one, grad_split, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grad_one, grad_full)


def test_unknown_loss_mode_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"loss_mode='gspo2' is not a registered verl policy loss"):
        mode_entry("gspo2")


PLUGIN = '''
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss


@register_policy_loss("test_plain_pg")
def plain_pg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
    losses = -advantages * log_prob
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    return agg_loss(losses, response_mask, loss_agg_mode, **config.global_batch_info), {}
'''


def test_a_plugin_loss_is_the_on_policy_term_without_editing_mix_src(tmp_path):
    """A loss registered with verl's decorator in a mix.plugins file is usable as-is: here the same maths as gpg."""
    from mix_src.extend import load_plugins

    path = tmp_path / "my_loss.py"
    path.write_text(PLUGIN)
    load_plugins([str(path)])
    assert "test_plain_pg" in POLICY_LOSS_REGISTRY and mode_entry("test_plain_pg").name == "test_plain_pg"
    model = BigramLM(seed=1)
    data = make_batch(seed=5, model=model)
    mb = one_micro_batch(data)
    out = model(mb)
    theirs, _ = MixPolicyLoss(mode_config("gpg"))(model_output=out, data=mb)
    ours, metrics = MixPolicyLoss(mode_config("test_plain_pg"))(model_output=out, data=mb)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6) and metrics["actor/on_pg_loss"].values[0] != 0


def test_preflight_accepts_a_verl_loss_and_refuses_its_knob_conflicts_before_ray():
    from mix_src.config.mix_config import MixConfigError, validate_mix_config
    from mix_src.config.verl_parity import check_verl_keys
    from test_verl_key_parity import compose_mix

    check_verl_keys(compose_mix("actor_rollout_ref.actor.policy_loss.loss_mode=gspo"))
    with pytest.raises(MixConfigError, match=r"loss_mode='gspo' clips its ratio.*loss_remove_clip=false"):
        check_verl_keys(compose_mix("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "mix.loss.loss_remove_clip=true"))
    with pytest.raises(MixConfigError, match=r"loss_mode='no_such_loss' is not a registered verl policy loss"):
        check_verl_keys(compose_mix("actor_rollout_ref.actor.policy_loss.loss_mode=no_such_loss"))
    # decoupled rollout correction with prefixes is no longer refused; bypass mode is (verl_parity, once)
    validate_mix_config(compose_mix("mix.n_prefix=1", "algorithm.rollout_correction.rollout_is=token"))
    with pytest.raises(MixConfigError, match=r"bypass_mode=true replaces old log-probs"):
        check_verl_keys(compose_mix("mix.n_prefix=1", "algorithm.rollout_correction.bypass_mode=true"))
