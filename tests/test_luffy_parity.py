"""Recipe settings checked against LUFFY's loss (arXiv 2504.14945, github.com/ElliottYan/LUFFY), without Ray:
the on-policy baseline's PPO has no dual clip, and the luffy_zero README's matching entropy coefficient."""

from __future__ import annotations

import pytest
import torch

from test_recipes import compose_recipe


def _recipe_loss_fn(name: str, overrides=()):
    from verl.utils.config import omega_conf_to_dataclass

    from mix_src.worker.loss import MixPolicyLoss
    from mix_src.config.mix_config import validate_mix_config

    cfg = compose_recipe(name, overrides)
    return MixPolicyLoss(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), validate_mix_config(cfg).loss)


def test_on_policy_grpo_has_no_dual_clip():
    """LUFFY's on-policy loss is max(-A r, -A clip(r, 0.8, 1.2)); verl's dual clip would cap it at -A*3."""
    from mix_src.algo.core_alg import compute_token_on_off_policy_loss

    fn = _recipe_loss_fn("on_policy_grpo")
    assert fn.clip_ratio_c is None and fn.mix.loss_remove_clip is False
    old, new = torch.zeros(1, 1), torch.log(torch.tensor([[5.0]]))  # r = 5, A = -1
    out = compute_token_on_off_policy_loss(
        old, new, -torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.bool), cliprange=fn.cliprange,
        clip_upper_bound=fn.clip_upper_bound, clip_ratio_c=fn.clip_ratio_c, loss_agg_mode="token-mean")
    assert out["pg_loss"].item() == pytest.approx(5.0)  # max(5, 1.2): not capped at 3
    verl_default = _recipe_loss_fn("on_policy_grpo", ["actor_rollout_ref.actor.clip_ratio_c=3.0"])
    capped = compute_token_on_off_policy_loss(
        old, new, -torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.bool), cliprange=0.2,
        clip_ratio_c=verl_default.clip_ratio_c, loss_agg_mode="token-mean")
    assert capped["pg_loss"].item() == pytest.approx(3.0)


def test_luffy_zero_entropy_is_the_official_micro_batch_mean():
    """README (luffy_zero): LUFFY's per-GPU loss sum_k [sum ell / 8192 - 0.001 * mean_k(H)] over micro-batches of
    unequal token counts, averaged over 8 GPUs, equals ours: sum ell / 65536 and 0.001 x each micro-batch's token
    mean (mix.loss.entropy_agg=micro_batch_token_mean), whatever the micro-batches hold."""
    from mix_src.algo.core_alg import agg_loss
    from mix_src.algo.loss_terms import micro_batch_token_mean

    g = torch.Generator().manual_seed(0)
    gpus, micro, width = 8, 3, 8192
    ell = torch.randn(gpus, micro, 2, 12, generator=g, dtype=torch.float64)
    ent = torch.rand(gpus, micro, 2, 12, generator=g, dtype=torch.float64)
    masks = torch.rand(gpus, micro, 2, 12, generator=g) < 0.6  # unequal token counts per micro-batch
    masks[..., 0] = True
    luffy = sum((ell[d, k] * masks[d, k]).sum() / width - 0.001 * ent[d, k][masks[d, k]].mean()
                for d in range(gpus) for k in range(micro)) / gpus
    ours = sum(agg_loss(ell[d, k], masks[d, k], "luffy-token-sum-norm", dp_size=gpus, loss_scale_factor=gpus * width)
               - 0.001 * micro_batch_token_mean(ent[d, k], masks[d, k], 1.0)
               for d in range(gpus) for k in range(micro)) / gpus  # FSDP averages the DP ranks' gradients
    assert ours.item() == pytest.approx(luffy.item(), rel=1e-12)
