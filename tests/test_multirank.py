"""Faithful at 8 GPUs: each paper-derived recipe's worker loss (mix_src.worker.loss.MixPolicyLoss, built from the composed
recipe) against a transcription of the official loss, on N = 1 and N = 8 data-parallel ranks with static and
dynamic micro-batches, through the exact simulation of FSDP's gradient averaging in tests/multirank.py.

The official losses (transcriptions reused from the per-method tests):
  LUFFY      ElliottYan/LUFFY 01f4ae0, luffy/verl/verl/mix_src/mix_core_alg.py:69-240 (compute_token_on_off_policy_loss,
             loss_remove_token_mean: token sum / W per micro-batch), mix_actor.py:201-244 (minus entropy_coeff x the
             micro-batch's token-mean entropy, / gradient_accumulation; exp_scripts/train.sh: micro = mini, so 1)
  HPT        tests/test_hpt.py official_sft_branch_loss (Unify-Post-Training ae332f5, mix_actor.py:135-170, :477)
  RL+SFT     LUFFY's "RL w/ SFT loss" baseline (recipes/rl_with_sft_loss): mix_actor.py:112-142, official_rl_sft_loss
  CHORD      tests/test_chord.py mix_chord_loss (Trinity-RFT MIXCHORDPolicyLossFn) and Trinity's actor scaling
             (trinity/trainer/verl/dp_actor.py: loss / gradient_accumulation, or x rows / ppo_mini_batch_size)
  ExGRPO     the LUFFY loss with ExGRPO's per-step loss_remove_clip (LUFFY repo ExGRPO/exgrpo/verl/verl/mix_src/
             mix_trainer_experience.py:429-436: False during the warm-up) and recorded old log-probs
             (tests/test_exgrpo.py official_exgrpo_loss)
  Prefix-RFT tests/test_prefix_rft.py official_entropy_reshape + PPO-clip on every token + its README's reading of
             the official "dr_grpo" aggregation (token sum / max_tokens per micro-batch; the package defining it,
             recipe.prefix_rft_v2, is not in the official repository) and dp_actor.py:705-711's scaling.

With W the response width and GA the official gradient-accumulation divisor (rank rows / micro-batch rows with static
micro-batches; 1 with dynamic ones, as in every official script: ppo_micro_batch_size = ppo_mini_batch_size), the
official token-sum losses are sum / (N * W * GA) over the mini-batch: actor.loss_scale_factor = N * W * GA reproduces
them on N GPUs (the recipes' default: 8 x 8192 = 65536, tested below).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from omegaconf import OmegaConf

from multirank import (dp_gradient, dynamic_split, group_split, official_micro_losses, ours_micro_losses,
                       random_batch, static_split)  # fmt: skip
from test_loss import PROMPT, RESPONSE, VOCAB, BigramLM
from test_recipes import compose_recipe

RANKS = (1, 8)
SPLITS = ("static", "dynamic")
GROUPS, GROUP = 16, 4  # 64 rows: 8 per rank on 8 ranks
MICRO_ROWS = 4  # static micro-batches: 2 per rank on 8 ranks, 16 on 1
MAX_TOKENS = 3 * (PROMPT + RESPONSE)  # dynamic micro-batches: at most 30 tokens (prompt + response)


@functools.lru_cache(maxsize=None)
def composed(name: str, one_gpu: bool = False):
    """The composed recipe (as run.sh composes it; NGPUS=1's overrides with one_gpu), composed once per session."""
    from test_recipes import one_gpu_overrides

    return compose_recipe(name, one_gpu_overrides() if one_gpu else ())


def recipe_loss(name: str, **actor):
    """MixPolicyLoss built from the composed recipe (its plugins loaded), with ``actor_rollout_ref.actor`` keys
    replaced by ``actor``."""
    from verl.utils.config import omega_conf_to_dataclass

    from mix_src.worker.loss import MixPolicyLoss
    from mix_src.config.mix_config import validate_mix_config
    from mix_src.extend import load_plugins

    cfg = copy.deepcopy(composed(name))
    for key, value in actor.items():
        OmegaConf.update(cfg, f"actor_rollout_ref.actor.{key}", value)
    load_plugins(list(cfg.mix.plugins))
    return MixPolicyLoss(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), validate_mix_config(cfg).loss)


def split_of(kind: str, padded: dict, ranks: int):
    """(split, GA, micro_rows): the same row split for ours and the official loss."""
    rows = len(padded["response_mask"])
    if kind == "static":
        return static_split(rows, ranks, MICRO_ROWS), rows // ranks // MICRO_ROWS, MICRO_ROWS
    return dynamic_split(padded["attention_mask"], ranks, MAX_TOKENS), 1, None


def assert_same_gradient(ours, official, model):
    (g_ours,), _ = dp_gradient([model.w], ours)
    (g_off,), _ = dp_gradient([model.w], official)
    assert g_off.abs().sum() > 0
    torch.testing.assert_close(g_ours, g_off, rtol=1e-4, atol=1e-7)
    return g_ours, g_off


# ---- the official losses, per micro-batch -----------------------------------------------------------------


def official_luffy_pg_loss(old_log_prob, log_prob, advantages, eos_mask, prefix_mask, *, cliprange=0.2,
                           clip_upper_bound=1.0, loss_remove_clip=True, gamma=0.1):  # fmt: skip
    """mix_core_alg.py compute_token_on_off_policy_loss with on_policy_reshape=no_reshape, off_policy_reshape=
    p_div_p_0.1, target_probs=None, no off/all clips, loss_remove_token_mean=True (lines 119-160, 164-240)."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    on_pg_losses = -advantages * ratio
    upper_bound = max(clip_upper_bound, 1.0 + cliprange)
    if loss_remove_clip is False:
        on_pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, upper_bound)
        on_pg_losses = torch.max(on_pg_losses, on_pg_losses2)
    off_ratio = torch.exp(log_prob)
    off_ratio = off_ratio / (off_ratio + gamma)
    off_pg_losses = -advantages * off_ratio
    prefix_mask = prefix_mask.float()
    pg_losses = off_pg_losses * prefix_mask + on_pg_losses * (1 - prefix_mask)
    return (pg_losses * eos_mask).sum() / eos_mask.shape[-1]


def official_masked_mean(values, mask):  # verl_F.masked_mean of the official forks
    return (values * mask).sum() / mask.sum()


def luffy_official(entropy_coeff: float):
    def loss(sub, log_prob, entropy):
        eos = sub["response_mask"].float()
        pg = official_luffy_pg_loss(sub["old_log_probs"], log_prob, sub["advantages"], eos, sub["prefix_mask"].bool())
        return pg - official_masked_mean(entropy, eos) * entropy_coeff  # mix_actor.py:202, :226
    return loss


# ---- LUFFY ------------------------------------------------------------------------------------------------


def test_luffy_paper_defaults_are_the_official_8_gpu_weights():
    """The paper base resolves to LUFFY's effective weights on its 8 GPUs: loss_scale_factor = 8 x 8192 and the
    entropy coefficient 0.001 x 8192 / 24,576 (recipes/luffy_zero/README.md); NGPUS=1 keeps both numbers, so the
    per-token scale (1/65536) and the entropy : policy ratio of the 8-GPU run."""
    for name in ("luffy_zero", "hpt", "exgrpo"):
        cfg = composed(name)
        actor = cfg.actor_rollout_ref.actor
        assert actor.loss_scale_factor == 8 * cfg.data.max_response_length == 65536, name
        assert actor.entropy_coeff == pytest.approx(0.001 * 8192 / 24576, rel=0.02), name
        one = composed(name, one_gpu=True)
        assert one.actor_rollout_ref.actor.loss_scale_factor == 65536 and one.data.max_response_length == 3072
        assert one.actor_rollout_ref.actor.entropy_coeff == actor.entropy_coeff
    nominal = compose_recipe("luffy_zero", ["actor_rollout_ref.actor.loss_scale_factor=${data.max_response_length}",
                                            "actor_rollout_ref.actor.entropy_coeff=0.001"])  # fmt: skip
    assert nominal.actor_rollout_ref.actor.loss_scale_factor == 8192  # the documented nominal override


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_luffy_policy_loss_equals_official_on_n_ranks(ranks, kind):
    """The luffy_zero recipe's loss with loss_scale_factor = N x W x GA gives the official gradient on N ranks for
    any split (the policy term; the entropy term: next test)."""
    model = BigramLM(seed=1)
    padded = random_batch(model, 0, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split, ga, micro_rows = split_of(kind, padded, ranks)
    ours = recipe_loss("luffy_zero", loss_scale_factor=ranks * RESPONSE * ga, entropy_coeff=0.0)
    assert_same_gradient(
        ours_micro_losses(ours, model, padded, split, use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows,
                          drop_entropy=True),
        official_micro_losses(luffy_official(0.0), model, padded, split, ga), model)  # fmt: skip


@pytest.mark.parametrize("ranks", RANKS)
def test_luffy_entropy_weight_equals_official_at_equal_micro_batches(ranks):
    """LUFFY's entropy bonus is a token mean per micro-batch, so its weight depends on the split: with micro-batches
    of N_mb response tokens each, c = 0.001 x W / N_mb reproduces it exactly (recipes/luffy_zero/README.md: 0.00033
    for the official ~24,576 response tokens per micro-batch); the whole loss then equals the official one."""
    model = BigramLM(seed=2)
    padded = random_batch(model, 1, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,),
                          full_length=True)  # fmt: skip
    split, ga, micro_rows = split_of("static", padded, ranks)
    coeff = 0.001 * RESPONSE / (MICRO_ROWS * RESPONSE)
    ours = recipe_loss("luffy_zero", loss_scale_factor=ranks * RESPONSE * ga, entropy_coeff=coeff)
    assert_same_gradient(
        ours_micro_losses(ours, model, padded, split, use_dynamic_bsz=False, micro_rows=micro_rows),
        official_micro_losses(luffy_official(0.001), model, padded, split, ga), model)  # fmt: skip


# ---- HPT --------------------------------------------------------------------------------------------------


def hpt_batch(model, seed: int):
    """GROUPS prompts x GROUP rows; every third prompt (and prompt 0) an SFT prompt: its GROUP rows are copies of one
    target (prefix_mask = response_mask, sft_row 1), as the hpt rollout policy makes them. Returns (padded for ours
    with sft_row, the official rows of each group: one row for an SFT prompt, as the official trainer keeps)."""
    from mix_src.algo.row_loss import SFT_ROW

    padded = random_batch(model, seed, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE)
    sft_groups = [g for g in range(GROUPS) if g % 3 == 0]
    sft_row = torch.zeros(GROUPS * GROUP)
    official_rows = []
    for g in range(GROUPS):
        rows = torch.arange(g * GROUP, (g + 1) * GROUP)
        if g in sft_groups:
            for key in padded:
                padded[key][rows] = padded[key][rows[0]].clone()
            padded["prefix_mask"][rows] = padded["response_mask"][rows]
            sft_row[rows] = 1.0
            official_rows.append(rows[:1])
        else:
            official_rows.append(rows)
    padded[SFT_ROW] = sft_row
    return padded, official_rows


def hpt_official(sub, log_prob, entropy):
    from test_hpt import official_sft_branch_loss

    return official_sft_branch_loss(log_prob, sub["old_log_probs"], sub["advantages"], sub["response_mask"].float(),
                                    sub["prefix_mask"].bool(), 1.0)  # official SFT_LOSS_COEF=1.0, the recipe's too


def hpt_case(ranks: int, kind: str, seed: int = 3):
    """(ours per rank/micro-batch, official per rank/micro-batch, GA, model) under one group-level split."""
    from mix_src.algo.core_alg import kept_tokens_per_mini_batch
    from mix_src.algo.row_loss import SFT_ROW, SFT_TOKENS

    model = BigramLM(seed=1)
    padded, official_rows = hpt_batch(model, seed)
    group_rows = [torch.arange(g * GROUP, (g + 1) * GROUP) for g in range(GROUPS)]
    tokens = [int(padded["attention_mask"][r].sum()) for r in group_rows]
    groups_per_micro = 1 if kind == "static" else None
    ours_split = group_split(tokens, group_rows, ranks, 2 * GROUP * (PROMPT + RESPONSE), groups_per_micro)
    official_split = group_split(tokens, official_rows, ranks, 2 * GROUP * (PROMPT + RESPONSE), groups_per_micro)
    ga = GROUPS // ranks if kind == "static" else 1  # one group per static micro-batch
    sft_mask = padded["response_mask"].bool() & padded[SFT_ROW].bool()[:, None]
    padded[SFT_TOKENS] = kept_tokens_per_mini_batch(sft_mask, ranks, GROUPS * GROUP).float()
    return padded, ours_split, official_split, ga, model


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_hpt_equals_official_on_n_ranks(ranks, kind):
    """The hpt recipe (sft_loss_agg=micro_batch_token_mean, loss_scale_factor = N x W x GA) gives the official
    gradient on N ranks: the SFT term a token mean per micro-batch summed over (rank, micro-batch) pairs. The global
    token mean (sft_loss_agg=global_token_mean, the weighting before) does not at N = 8: the official SFT : RL weight
    is M times larger, M = the (rank, micro-batch) pairs holding an SFT row."""
    from mix_src.algo.row_loss import SFT_ROW, SFT_TOKENS

    padded, ours_split, official_split, ga, model = hpt_case(ranks, kind)
    ours = recipe_loss("hpt", loss_scale_factor=ranks * RESPONSE * ga, entropy_coeff=0.0)
    assert ours.mix.sft_loss_agg == "micro_batch_token_mean"
    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=GROUP if kind == "static" else None,
               extra=(SFT_ROW, SFT_TOKENS), drop_entropy=True)  # fmt: skip
    official = official_micro_losses(hpt_official, model, padded, official_split, ga)
    g_ours, g_off = assert_same_gradient(ours_micro_losses(ours, model, padded, ours_split, **run), official, model)
    if ranks == 8:
        ours.mix = dataclasses.replace(ours.mix, sft_loss_agg="global_token_mean")
        (g_global,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, padded, ours_split, **run))
        assert not torch.allclose(g_global, g_off, rtol=1e-2, atol=1e-6)


# ---- RL w/ SFT loss (LUFFY's baseline) ---------------------------------------------------------------------


def official_rl_sft_loss(sub, log_prob, entropy, sft_loss_coef=1.0):
    """One micro-batch of LUFFY's RL+SFT baseline (ElliottYan/LUFFY 01f4ae0, luffy/verl/verl/mix_src/mix_actor.py:112-142,
    train_rl_sft_loss.sh): compute_sft_pure_loss (mix_core_alg.py:7-10: the token mean of -log p over the response
    tokens of the rows holding a prefix; 0 when none) x sft_loss_coef + core_algos.compute_policy_loss
    (trainer/ppo/core_algos.py:247-286, loss_remove_clip and loss_remove_token_mean: token sum / W) on the other rows."""
    eos = sub["response_mask"].float()
    off = sub["prefix_mask"].bool().any(-1)
    sft = official_masked_mean(-log_prob[off], eos[off]) if off.any() else torch.tensor(0.0)
    on_eos = eos[~off]
    ratio = torch.exp(log_prob[~off] - sub["old_log_probs"][~off])
    pg = (-sub["advantages"][~off] * ratio * on_eos).sum() / on_eos.shape[-1]
    return sft * sft_loss_coef + pg


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_rl_with_sft_loss_equals_official_on_n_ranks(ranks, kind):
    """The rl_with_sft_loss recipe (sft_loss_agg=micro_batch_token_mean, loss_scale_factor = N x W x GA) gives the
    official gradient on N ranks: the NLL a token mean per micro-batch, like HPT's. The policy-loss aggregation
    (policy_loss_agg, the recipe's weighting before: token sum / W) does not."""
    model = BigramLM(seed=1)
    padded = random_batch(model, 4, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split, ga, micro_rows = split_of(kind, padded, ranks)
    ours = recipe_loss("rl_with_sft_loss", loss_scale_factor=ranks * RESPONSE * ga, entropy_coeff=0.0)
    assert ours.mix.use_sft_multitask_loss and ours.mix.sft_loss_agg == "micro_batch_token_mean"
    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows, drop_entropy=True)
    official = official_micro_losses(official_rl_sft_loss, model, padded, split, ga)
    g_ours, g_off = assert_same_gradient(ours_micro_losses(ours, model, padded, split, **run), official, model)
    ours.mix = dataclasses.replace(ours.mix, sft_loss_agg="policy_loss_agg")
    (g_policy,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, padded, split, **run))
    assert not torch.allclose(g_policy, g_off, rtol=1e-2, atol=1e-6)


def test_sft_loss_agg_defaults_and_refusals():
    """mix.loss.sft_loss_agg: null resolves per SFT term (row loss: global_token_mean; multitask: policy_loss_agg, the
    weighting before); set without an SFT term, or global_token_mean on the multitask term (no count), refused."""
    from mix_src.config.mix_config import MixConfigError, mix_config_from_dict

    loss = lambda **kw: mix_config_from_dict({"loss": kw}).loss  # noqa: E731
    assert loss(row_loss="sft_rows").sft_loss_agg == "global_token_mean"
    assert loss(use_sft_multitask_loss=True).sft_loss_agg == "policy_loss_agg"
    assert loss().sft_loss_agg is None
    with pytest.raises(MixConfigError, match="sft_loss_agg='micro_batch_token_mean' aggregates the SFT term"):
        loss(sft_loss_agg="micro_batch_token_mean")
    with pytest.raises(MixConfigError, match="sft_loss_agg=global_token_mean counts"):
        loss(use_sft_multitask_loss=True, sft_loss_agg="global_token_mean")
    with pytest.raises(MixConfigError, match="nope"):
        loss(use_sft_multitask_loss=True, sft_loss_agg="nope")


# ---- ExGRPO -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
@pytest.mark.parametrize("phase", ["warm-up", "mixed"])
def test_exgrpo_equals_official_on_n_ranks(ranks, kind, phase):
    """The exgrpo recipe against the official loss, per phase: during the warm-up the official trainer sets
    loss_remove_clip=False (PPO clip 0.2 on every on-policy token), once mixed the script's True, with each replayed
    row's old log-probs replaced by its recorded ones. The rollout policy's per-row ``mix_loss_remove_clip`` carries
    the phase to the worker loss; loss_scale_factor = N x W x GA as for LUFFY."""
    import sys

    from mix_src.worker.loss import REMOVE_CLIP
    from mix_src.algo.off_policy_behaviour import BEHAVIOUR_LOG_PROB
    from test_exgrpo import official_exgrpo_loss

    ours = recipe_loss("exgrpo", entropy_coeff=0.0, loss_scale_factor=1)  # scale set below, once GA is known
    ex = next(m for name, m in sys.modules.items() if name.startswith("mix_plugin_exgrpo_"))
    mixed = phase == "mixed"
    model = BigramLM(seed=1)
    padded = random_batch(model, 5, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE,
                          expert_rows=(0,) if mixed else ())  # fmt: skip
    g = torch.Generator().manual_seed(6)
    padded[BEHAVIOUR_LOG_PROB] = (padded["old_log_probs"] + 0.3 * torch.randn(padded["old_log_probs"].shape,
                                                                              generator=g)) * padded["prefix_mask"]
    remove_clip = ex.warmup_remove_clip(mixed, ours.mix.loss_remove_clip)
    assert remove_clip is mixed  # official: False during the warm-up, the script's True afterwards
    padded[REMOVE_CLIP] = torch.full((GROUPS * GROUP,), float(remove_clip))
    split, ga, micro_rows = split_of(kind, padded, ranks)
    ours = recipe_loss("exgrpo", entropy_coeff=0.0, loss_scale_factor=ranks * RESPONSE * ga)

    def official(sub, log_prob, entropy):
        eos, prefix = sub["response_mask"].float(), sub["prefix_mask"].bool()
        if mixed:
            return official_exgrpo_loss(sub["old_log_probs"], log_prob, sub["advantages"], eos, prefix,
                                        sub[BEHAVIOUR_LOG_PROB])  # fmt: skip
        return official_luffy_pg_loss(sub["old_log_probs"], log_prob, sub["advantages"], eos, prefix,
                                      loss_remove_clip=False)  # fmt: skip

    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows, extra=(BEHAVIOUR_LOG_PROB, REMOVE_CLIP),
               drop_entropy=True)  # fmt: skip
    assert_same_gradient(ours_micro_losses(ours, model, padded, split, **run),
                         official_micro_losses(official, model, padded, split, ga), model)


# ---- CHORD ------------------------------------------------------------------------------------------------


def chord_case(ranks: int, kind: str, step: int = 7):
    from types import SimpleNamespace

    from mix_src.worker.loss import MixLossConfig, add_combine_inputs

    model = BigramLM(seed=1)
    padded = random_batch(model, 8, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(3,),
                          full_length=True)  # fmt: skip
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": GROUPS}, "rollout": {"n": GROUP}}})
    add_combine_inputs(SimpleNamespace(batch=padded), config, MixLossConfig(combine="chord"), lambda: ranks, step)
    split, _, micro_rows = split_of(kind, padded, ranks)
    return model, padded, split, micro_rows


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_chord_equals_official_on_n_ranks(ranks, kind):
    """The chord recipe against MIXCHORDPolicyLossFn under Trinity's actor scaling (loss x rows / per-GPU mini-batch
    with dynamic micro-batches, / gradient_accumulation with static ones), rows of equal length: with dynamic
    micro-batches equal on any N (Trinity's per-micro-batch weights make its sum the global mean, as ours); with static
    ones equal on 1 GPU and N times ours on N GPUs (its policy loss's gradient_accumulation is computed from the
    global ppo_mini_batch_size, the actor's from the per-GPU one: Trinity docs, "ppo_mini_batch_size ... per GPU in
    update_policy"). Rows of unequal length: Trinity averages micro-batch token means weighted by rows, ours is the
    token mean of the whole mini-batch (mix_src/README.md, loss options)."""
    from mix_src.worker.loss import COMBINE_FIELDS
    from test_chord import mix_chord_loss

    step = 7
    model, padded, split, micro_rows = chord_case(ranks, kind, step)
    ours = recipe_loss("chord")
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
    return (pg_losses * eos).sum() / eos.shape[-1]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_prefix_rft_against_official_on_n_ranks(ranks, kind):
    """Our Prefix-RFT settings are our own (the official repository ships no experiment config): Dr. GRPO's token sum
    / (W x rows of the global mini-batch). The official "dr_grpo" with static micro-batches is the token sum /
    (N x W x GA): a constant factor rows / (N x GA) from ours, on any N. With dynamic micro-batches the official
    scales micro-batch k by its rows / the per-GPU mini-batch (dp_actor.py:705-708), which no constant reproduces:
    its gradient points elsewhere than ours."""
    model = BigramLM(seed=1)
    padded = random_batch(model, 9, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split, ga, micro_rows = split_of(kind, padded, ranks)
    ours = recipe_loss("prefix_rft", entropy_coeff=0.0, loss_scale_factor=RESPONSE)
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
    if kind == "static":
        torch.testing.assert_close(g_ours * rows / (ranks * ga), g_off, rtol=1e-4, atol=1e-7)
    else:
        cosine = torch.nn.functional.cosine_similarity(g_ours.flatten(), g_off.flatten(), dim=0)
        assert cosine < 1 - 1e-4


def test_simulation_equals_gloo_averaging(tmp_path):
    """The harness's average equals real data parallelism: 2 gloo processes, DistributedDataParallel (no_sync over
    the micro-batches but the last, then the all-reduce average), the luffy_zero recipe's loss on 2 ranks."""
    from multirank import gloo_gradient

    model = BigramLM(seed=1)
    padded = random_batch(model, 0, 4, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split = static_split(4 * GROUP, 2, MICRO_ROWS // 2)
    ours = recipe_loss("luffy_zero", loss_scale_factor=2 * RESPONSE, entropy_coeff=0.001)
    run = dict(use_dynamic_bsz=False, micro_rows=MICRO_ROWS // 2)
    (simulated,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, padded, split, **run))
    (real,) = gloo_gradient(model, ours, padded, split, tmp_path, **run)
    assert simulated.abs().sum() > 0
    torch.testing.assert_close(real, simulated, rtol=1e-5, atol=1e-8)
