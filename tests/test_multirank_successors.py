"""Faithful at 8 GPUs, the successors without a LUFFY-fork actor: CHORD (Trinity-RFT) and Prefix-RFT, each recipe's
composed loss against a transcription of the official one under verl 0.9.1's layout (tests/test_multirank.py: the
harness, the helpers and the LUFFY-family recipes)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from multirank import dp_gradient, official_micro_losses, ours_micro_losses, random_batch
from test_loss import PROMPT, RESPONSE, VOCAB, BigramLM
from test_multirank import (GROUP, GROUPS, OFFICIAL_ENTROPY_COEFF, RANKS, SPLITS, composed, recipe_loss,
                            split_of)  # fmt: skip


# ---- CHORD ------------------------------------------------------------------------------------------------


def chord_case(ranks: int, kind: str, step: int = 7, equal_lengths: bool = True):
    from types import SimpleNamespace

    from mix_src.worker.loss import MixLossConfig, add_combine_inputs

    model = BigramLM(seed=1)
    padded = random_batch(model, 8, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(3,),
                          full_length=equal_lengths)  # fmt: skip
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": GROUPS}, "rollout": {"n": GROUP}}})
    add_combine_inputs(SimpleNamespace(batch=padded), config, MixLossConfig(combine="chord"), lambda: ranks, step)
    split, _, micro_rows = split_of(kind, padded, ranks)
    return model, padded, split, micro_rows


@pytest.mark.parametrize("lengths", ["equal", "unequal"])
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_chord_equals_official_on_n_ranks(ranks, kind, lengths):
    """The chord recipe against MIXCHORDPolicyLossFn under Trinity's actor scaling (loss x rows / per-GPU mini-batch
    with dynamic micro-batches, / gradient_accumulation with static ones), rows of equal length: with dynamic
    micro-batches equal on any N (Trinity's per-micro-batch weights make its sum the global mean, as ours); with static
    ones equal on 1 GPU and N times ours on N GPUs (its policy loss's gradient_accumulation is computed from the
    global ppo_mini_batch_size, the actor's from the per-GPU one: Trinity docs, "ppo_mini_batch_size ... per GPU in
    update_policy"). Rows of unequal length: Trinity averages micro-batch token means weighted by rows, ours is the
    token mean of the whole mini-batch (mix_src/README.md, loss options): no constant relates them. verl 0.9.1's
    layout (balancing on) for both sides."""
    from mix_src.worker.loss import COMBINE_FIELDS
    from test_chord import mix_chord_loss

    step = 7
    model, padded, split, micro_rows = chord_case(ranks, kind, step, equal_lengths=lengths == "equal")
    ours = recipe_loss("chord", kind)
    cfg = composed("chord")
    rows = GROUPS * GROUP
    expert_rows = int(padded["prefix_mask"].bool().any(-1).sum())
    mini_per_gpu = rows // ranks

    def official(sub, log_prob, entropy):
        expert = sub["prefix_mask"].bool().any(-1)
        value = mix_chord_loss(
            log_prob, sub["old_log_probs"], sub["response_mask"].float(), sub["advantages"], expert,
            torch.full((len(expert),), step), use_dynamic_bsz=kind == "dynamic", ppo_mini_batch_size=rows,
            ppo_micro_batch_size_per_gpu=micro_rows or 1, ngpus_trainer=ranks,
            train_batch_size_usual=rows - expert_rows, train_batch_size_expert=expert_rows,
            **OmegaConf.to_container(cfg.mix.loss.combine_args),
        )  # fmt: skip
        if kind == "dynamic":  # trinity/trainer/verl/dp_actor.py update_policy
            return value * (len(expert) / mini_per_gpu)
        return value / (mini_per_gpu // micro_rows)

    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows, extra=COMBINE_FIELDS, drop_entropy=True)
    (g_ours,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, padded, split, **run))
    (g_off,), _ = dp_gradient([model.w], official_micro_losses(official, model, padded, split))
    factor = ranks if kind == "static" else 1
    assert g_off.abs().sum() > 0
    if lengths == "unequal":
        cosine = torch.nn.functional.cosine_similarity(g_ours.flatten(), g_off.flatten(), dim=0)
        assert cosine < 1 - 1e-4
        return
    torch.testing.assert_close(g_ours * factor, g_off, rtol=1e-4, atol=1e-7)


# ---- Prefix-RFT -------------------------------------------------------------------------------------------


def official_prefix_rft_loss(sub, log_prob, entropy, mask_ratio=0.8, cliprange=0.2, clip_ratio_c=3.0):
    """One micro-batch of the official Prefix-RFT actor (dp_actor.py:636-690): the entropy reshape of the prefix
    tokens' advantages (tests/test_prefix_rft.py official_entropy_reshape), verl's dual-clip PPO loss on every token,
    and "dr_grpo": the token sum / max_tokens (W) (recipes/prefix_rft/README.md's reading)."""
    from test_prefix_rft import official_entropy_reshape

    eos, prefix = sub["response_mask"].float(), sub["prefix_mask"].bool()
    adv = official_entropy_reshape(sub["advantages"].clone(), entropy.detach(), prefix, mask_ratio)
    ratio = torch.exp(log_prob - sub["old_log_probs"])
    clip1 = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange))
    pg_losses = torch.where(adv < 0, torch.min(-adv * clip_ratio_c, clip1), clip1)
    return ((pg_losses - OFFICIAL_ENTROPY_COEFF * entropy) * eos).sum() / eos.shape[-1]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_prefix_rft_against_official_on_n_ranks(ranks, kind):
    """Our Prefix-RFT settings are our own (the official repository ships no experiment config): Dr. GRPO's token sum
    / (W x rows of the global mini-batch), entropy 0.001 aggregated the same way (the official's verl agg_loss of its
    mode). The official "dr_grpo" with static micro-batches is the token sum / (N x W x GA): a constant factor
    rows / (N x GA) from ours, on any N. With dynamic micro-batches the official Prefix-RFT
    scales micro-batch k by its rows / the per-GPU mini-batch (dp_actor.py:705-708): one constant (rows_k x rows /
    (mini x N)) where verl's layout gives every micro-batch the same rows, else none, and its gradient points
    elsewhere than ours. Measured against: the README's reading of "dr_grpo" (recipe.prefix_rft_v2 is not shipped)."""
    model = BigramLM(seed=1)
    padded = random_batch(model, 9, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split, ga, micro_rows = split_of(kind, padded, ranks)
    ours = recipe_loss("prefix_rft", kind)
    assert ours.config.entropy_coeff == OFFICIAL_ENTROPY_COEFF and ours.mix.entropy_agg is None
    rows = GROUPS * GROUP
    mini_per_gpu = rows // ranks

    def official(sub, log_prob, entropy):
        value = official_prefix_rft_loss(sub, log_prob, entropy)
        if kind == "dynamic":
            return value * (len(sub["response_mask"]) / mini_per_gpu)
        return value / ga

    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows)
    (g_ours,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, padded, split, **run))
    (g_off,), _ = dp_gradient([model.w], official_micro_losses(official, model, padded, split))
    assert g_off.abs().sum() > 0
    micro_rows_seen = {len(mb) for rank in split for mb in rank}
    if kind == "static" or len(micro_rows_seen) == 1:  # every micro-batch the same rows: one constant factor
        factor = rows / (ranks * ga) if kind == "static" else micro_rows_seen.pop() * rows / (mini_per_gpu * ranks)
        torch.testing.assert_close(g_ours * factor, g_off, rtol=1e-4, atol=1e-7)
    else:  # rows / per-GPU mini-batch differs between micro-batches: no constant reproduces it
        cosine = torch.nn.functional.cosine_similarity(g_ours.flatten(), g_off.flatten(), dim=0)
        assert cosine < 1 - 1e-4
