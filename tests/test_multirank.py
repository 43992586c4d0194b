"""Faithful at 8 GPUs: each paper-derived recipe's worker loss (mix_src.worker.loss.MixPolicyLoss, built from the composed
recipe) against a transcription of the official loss, on N = 1 and N = 8 data-parallel ranks with static and
dynamic micro-batches, through the exact simulation of FSDP's gradient averaging in tests/multirank.py. What users
run: each recipe composed as run.sh composes it, only data-shape keys overridden (lengths, micro-batch sizes); rows
of unequal length laid out by verl 0.9.1's own balancing (trainer.balance_batch, on by default) and micro-batching
(multirank.verl_split), the official side under the same layout. CHORD and Prefix-RFT:
tests/test_multirank_successors.py.

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
official token-sum losses are sum / (N * W * GA) over the mini-batch; the recipes' loss_scale_factor 65536 is that at
the official run's N = 8, W = 8192, GA = 1 (policy_scale below). The entropy (and HPT's SFT term) are the official
per-micro-batch token means themselves (mix.loss.entropy_agg / sft_loss_agg = micro_batch_token_mean): equal on any N.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from multirank import (dp_gradient, official_micro_losses, ours_micro_losses, random_batch, static_split,
                       verl_split)  # fmt: skip
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


def data_shape(kind: str) -> dict:
    """The only keys the tests change in a composed recipe: the data's shape (lengths, micro-batch sizes)."""
    return {"data.max_prompt_length": PROMPT, "data.max_response_length": RESPONSE,
            "actor_rollout_ref.actor.use_dynamic_bsz": kind == "dynamic",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": MAX_TOKENS,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": MICRO_ROWS}  # fmt: skip


@functools.lru_cache(maxsize=None)
def shaped(name: str, kind: str):
    """The recipe composed as run.sh composes it, with :func:`data_shape`'s keys as command-line overrides (so the
    recipe's own interpolations, e.g. prefix_rft's loss_scale_factor = ${data.max_response_length}, follow them)."""
    return compose_recipe(name, [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in data_shape(kind).items()])


def recipe_loss(name: str, kind: str = "dynamic"):
    """MixPolicyLoss built from the composed recipe (its plugins loaded) with :func:`data_shape`'s keys only."""
    from verl.utils.config import omega_conf_to_dataclass

    from mix_src.worker.loss import MixPolicyLoss
    from mix_src.config.mix_config import validate_mix_config
    from mix_src.extend import load_plugins

    cfg = shaped(name, kind)
    load_plugins(list(cfg.mix.plugins))
    return MixPolicyLoss(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), validate_mix_config(cfg).loss)


def split_of(kind: str, padded: dict, ranks: int):
    """(split, GA, micro_rows): verl 0.9.1's layout (balance_batch on, then the engine's micro-batches) and the
    official gradient-accumulation divisor (rank rows / micro rows static; 1 dynamic, as the official scripts)."""
    rows = len(padded["response_mask"])
    if kind == "static":
        return verl_split(padded["attention_mask"], ranks, micro_rows=MICRO_ROWS), rows // ranks // MICRO_ROWS, MICRO_ROWS
    return verl_split(padded["attention_mask"], ranks, max_token_len=MAX_TOKENS), 1, None


def assert_same_gradient(ours, official, model, factor: float = 1.0):
    """ours x factor == official (factor: a known constant of the run's scale)."""
    (g_ours,), _ = dp_gradient([model.w], ours)
    (g_off,), _ = dp_gradient([model.w], official)
    assert g_off.abs().sum() > 0
    torch.testing.assert_close(g_ours * factor, g_off, rtol=1e-4, atol=1e-7)
    return g_ours, g_off


def zero_advantages(padded: dict) -> dict:
    """The batch with every advantage 0: the policy term's gradient vanishes, the entropy and SFT terms stay."""
    return dict(padded, advantages=torch.zeros_like(padded["advantages"]))


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


OFFICIAL_ENTROPY_COEFF = 0.001  # LUFFY exp_scripts/train.sh, HPT exp_scripts/train.sh, ExGRPO run_exgrpo.sh


def luffy_official(sub, log_prob, entropy):
    """LUFFY's micro-batch loss: the policy token sum / W minus 0.001 x the micro-batch's token-mean entropy
    (mix_actor.py:202, :226)."""
    eos = sub["response_mask"].float()
    pg = official_luffy_pg_loss(sub["old_log_probs"], log_prob, sub["advantages"], eos, sub["prefix_mask"].bool())
    return pg - official_masked_mean(entropy, eos) * OFFICIAL_ENTROPY_COEFF


def policy_scale(ranks: int, ga: int) -> float:
    """ours x this = the official policy term: the official divides by N x W x GA, the recipe by its literal 65536
    (8 GPUs x 8192): 1 at the official run's N = 8, W = 8192, GA = 1."""
    return 65536 / (ranks * RESPONSE * ga)


# ---- LUFFY ------------------------------------------------------------------------------------------------


def test_luffy_paper_defaults_are_the_official_8_gpu_weights():
    """The paper base resolves to LUFFY's own numbers: loss_scale_factor = 8 x 8192 (the token sum / 8192 on each of 8
    GPUs, averaged) and the entropy bonus 0.001 x each micro-batch's token mean (mix.loss.entropy_agg), no constant
    resting on a token count; NGPUS=1 keeps both."""
    for name in ("luffy_zero", "hpt", "exgrpo"):
        cfg = composed(name)
        actor = cfg.actor_rollout_ref.actor
        assert actor.loss_scale_factor == 8 * cfg.data.max_response_length == 65536, name
        assert actor.entropy_coeff == OFFICIAL_ENTROPY_COEFF and cfg.mix.loss.entropy_agg == "micro_batch_token_mean"
        one = composed(name, one_gpu=True)
        assert one.actor_rollout_ref.actor.loss_scale_factor == 65536 and one.data.max_response_length == 3072
        assert one.actor_rollout_ref.actor.entropy_coeff == actor.entropy_coeff
        assert one.mix.loss.entropy_agg == "micro_batch_token_mean"


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_luffy_equals_official_on_n_ranks(ranks, kind):
    """The luffy_zero recipe's own loss (entropy included) against LUFFY's, both under verl 0.9.1's layout (balancing
    on, unequal lengths): the entropy term equals the official exactly (advantages 0: the policy term vanishes); the
    policy term (entropy output dropped) is the official x N W GA / 65536, so the whole loss equals the official at
    the official run's 8 GPUs x 8192 x GA 1."""
    model = BigramLM(seed=1)
    padded = random_batch(model, 0, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split, ga, micro_rows = split_of(kind, padded, ranks)
    ours = recipe_loss("luffy_zero", kind)
    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows)
    still = zero_advantages(padded)
    assert_same_gradient(ours_micro_losses(ours, model, still, split, **run),
                         official_micro_losses(luffy_official, model, still, split, ga), model)  # fmt: skip
    no_entropy = lambda sub, lp, ent: luffy_official(sub, lp, ent.detach() * 0)  # noqa: E731
    assert_same_gradient(ours_micro_losses(ours, model, padded, split, drop_entropy=True, **run),
                         official_micro_losses(no_entropy, model, padded, split, ga), model,
                         policy_scale(ranks, ga))  # fmt: skip


@pytest.mark.parametrize("ranks", RANKS)
def test_luffy_entropy_constant_differs_from_the_official(ranks):
    """The entropy weighting before (a constant aggregated like the policy term: 0.00033 / 65536 a token) is not the
    official per micro-batch mean: its ratio to the official is N_k / 24,824 tokens per micro-batch."""
    import dataclasses as dc

    model = BigramLM(seed=2)
    padded = zero_advantages(random_batch(model, 1, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE))
    split, ga, micro_rows = split_of("dynamic", padded, ranks)
    ours = recipe_loss("luffy_zero")
    ours.mix = dc.replace(ours.mix, entropy_agg=None)
    (g_const,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, padded, split, use_dynamic_bsz=True))
    (g_off,), _ = dp_gradient([model.w], official_micro_losses(luffy_official, model, padded, split, ga))
    assert not torch.allclose(g_const, g_off, rtol=1e-2, atol=1e-6)


def test_entropy_agg_refused_before_ray():
    """mix.loss.entropy_agg: a bad name is refused when the mix section is built (before Ray), naming key and value."""
    from mix_src.config.mix_config import MixConfigError, mix_config_from_dict

    assert mix_config_from_dict({"loss": {"entropy_agg": "micro_batch_token_mean"}}).loss.entropy_agg
    with pytest.raises(MixConfigError, match=r"mix.loss.entropy_agg='token_mean' is not an entropy aggregation"):
        mix_config_from_dict({"loss": {"entropy_agg": "token_mean"}})


# ---- HPT --------------------------------------------------------------------------------------------------


def hpt_batch(model, seed: int, plugin):
    """GROUPS prompts x GROUP rows through the hpt recipe's own rollout policy (``plugin.hpt``): the first pass
    on-policy, a prompt solved 0 times (every third prompt, and prompt 0) switched to SFT on its target, which the
    second pass writes into its rows. Returns (padded as the recipe hands it to the trainer, official rows: the RL
    rows and one target row per SFT prompt, as the official trainer keeps)."""
    from types import SimpleNamespace

    import numpy as np
    from verl import DataProto

    from mix_src.algo.row_loss import SFT_ROW

    padded = random_batch(model, seed, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE)
    sft_groups = [g for g in range(GROUPS) if g % 3 == 0]
    target = {key: value.clone() for key, value in padded.items()}  # a target per prompt: its row 0
    for g in sft_groups:
        rows = torch.arange(g * GROUP, (g + 1) * GROUP)
        for key in target:
            target[key][rows] = padded[key][rows[0]]
    target["prefix_mask"] = target["response_mask"].clone()
    scores = torch.ones(GROUPS * GROUP)
    scores[[r for g in sft_groups for r in range(g * GROUP, (g + 1) * GROUP)]] = 0.0

    def proto(source, rows, prefix):
        tensors = {key: source[key][rows].clone() for key in source}
        tensors["prefix_mask"] = tensors["response_mask"].clone() if prefix else torch.zeros_like(tensors["prefix_mask"])
        tensors["token_level_scores"] = scores[rows][:, None] * tensors["response_mask"]
        return DataProto.from_dict(tensors=tensors)

    def generate(ratios, rows=None):
        rows = np.arange(GROUPS * GROUP) if rows is None else np.asarray(rows)
        return proto(target if np.any(ratios > 0) else padded, torch.as_tensor(rows), bool(np.any(ratios > 0)))

    mix = SimpleNamespace(plugin_options={})
    ctx = SimpleNamespace(n=GROUP, batch=list(range(GROUPS * GROUP)), mix=mix, generate=generate,
                          prefix_ratios=lambda: np.ones(GROUPS * GROUP))  # fmt: skip
    out = plugin.hpt(ctx)
    ours = {key: out.batch[key] for key in (*padded, SFT_ROW)}
    assert set(torch.nonzero(ours[SFT_ROW]).flatten().tolist()) == {r for g in sft_groups for r in range(g * GROUP, (g + 1) * GROUP)}
    keep = [r for r in range(GROUPS * GROUP) if not (r // GROUP in sft_groups and r % GROUP)]
    return ours, keep


def hpt_official(sub, log_prob, entropy):
    """One micro-batch of the official HPT actor (Unify-Post-Training ae332f5, mix_actor.py:135-165, :477): the SFT
    token mean over the rows holding a prefix (0 when none: the official skips the NaN) x SFT_LOSS_COEF 1.0 + the
    on-policy rows' token sum / W (advantages 0 here) - 0.001 x the micro-batch's token-mean entropy."""
    eos = sub["response_mask"].float()
    off = sub["prefix_mask"].bool().any(-1)
    sft = official_masked_mean(-log_prob[off], eos[off]) if off.any() else torch.tensor(0.0)
    return sft * 1.0 - official_masked_mean(entropy, eos) * OFFICIAL_ENTROPY_COEFF


def hpt_plugin():
    import sys

    from mix_src.extend import load_plugins

    load_plugins(list(composed("hpt").mix.plugins))
    return next(m for name, m in sys.modules.items() if name.startswith("mix_plugin_hpt_"))


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("kind", SPLITS)
def test_hpt_equals_official_on_n_ranks(ranks, kind):
    """The hpt recipe (its rollout policy's batch, its composed loss) against the official HPT actor, laid out by
    verl 0.9.1 (balancing on, unequal lengths, static and dynamic micro-batches): the official batch is the RL rows
    and one row per SFT prompt, at the places verl's balancing gives those rows in ours. SFT and entropy terms
    (advantages 0) equal exactly, wherever the SFT prompts' other rows land: the recipe keeps one live target row
    per SFT prompt. f270849's recipe (8 live copies, spread over ranks and micro-batches) fails this."""
    from mix_src.algo.row_loss import SFT_ROW

    model = BigramLM(seed=1)
    padded, keep = hpt_batch(model, 3, hpt_plugin())
    padded = zero_advantages(padded)
    split, ga, micro_rows = split_of(kind, padded, ranks)
    keep_set = set(keep)
    if ranks == 8:  # verl's balancing spreads an SFT prompt's copies over ranks (what f270849's recipe weighed N times)
        copies = set(range(GROUP))  # prompt 0 is an SFT prompt
        assert sum(any(int(r) in copies for mb in rank for r in mb) for rank in split) > 1
    official_split = [[mb[torch.tensor([int(r) in keep_set for r in mb], dtype=torch.bool)] for mb in rank]
                      for rank in split]  # fmt: skip
    ours = recipe_loss("hpt", kind)
    assert ours.mix.sft_loss_agg == "micro_batch_token_mean" and ours.mix.entropy_agg == "micro_batch_token_mean"
    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows, extra=(SFT_ROW,))
    assert_same_gradient(ours_micro_losses(ours, model, padded, split, **run),
                         official_micro_losses(hpt_official, model, padded, official_split, ga), model)


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
    """The rl_with_sft_loss recipe (sft_loss_agg=micro_batch_token_mean, luffy_paper's entropy) under verl's layout:
    SFT + entropy terms (advantages 0) equal the official exactly; the policy term is the official x N W GA / 65536
    (equal at 8 x 8192 x 1). The policy-loss aggregation of the NLL (policy_loss_agg, the weighting before) is not."""
    model = BigramLM(seed=1)
    padded = random_batch(model, 4, GROUPS, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split, ga, micro_rows = split_of(kind, padded, ranks)
    ours = recipe_loss("rl_with_sft_loss", kind)
    assert ours.mix.use_sft_multitask_loss and ours.mix.sft_loss_agg == "micro_batch_token_mean"
    run = dict(use_dynamic_bsz=kind == "dynamic", micro_rows=micro_rows)

    def official(sub, log_prob, entropy):
        return official_rl_sft_loss(sub, log_prob, entropy) - official_masked_mean(
            entropy, sub["response_mask"].float()) * OFFICIAL_ENTROPY_COEFF

    still = zero_advantages(padded)
    g_ours, g_off = assert_same_gradient(ours_micro_losses(ours, model, still, split, **run),
                                         official_micro_losses(official, model, still, split, ga), model)
    ours.mix = dataclasses.replace(ours.mix, sft_loss_agg="policy_loss_agg")
    (g_policy,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, still, split, **run))
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
    the phase to the worker loss; verl's layout, unequal lengths; the recipe's 65536 = the official N W GA at 8 x 8192
    x 1 (policy_scale), as for LUFFY."""
    import sys

    from mix_src.worker.loss import REMOVE_CLIP
    from mix_src.algo.off_policy_behaviour import BEHAVIOUR_LOG_PROB
    from test_exgrpo import official_exgrpo_loss

    ours = recipe_loss("exgrpo", kind)
    assert ours.mix.entropy_agg == "micro_batch_token_mean"  # the entropy term: luffy_paper's, as test_luffy_*
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
                         official_micro_losses(official, model, padded, split, ga), model, policy_scale(ranks, ga))


def test_simulation_equals_gloo_averaging(tmp_path):
    """The harness's average equals real data parallelism: 2 gloo processes, DistributedDataParallel (no_sync over
    the micro-batches but the last, then the all-reduce average), the luffy_zero recipe's loss on 2 ranks."""
    from multirank import gloo_gradient

    model = BigramLM(seed=1)
    padded = random_batch(model, 0, 4, GROUP, vocab=VOCAB, prompt=PROMPT, response=RESPONSE, expert_rows=(0,))
    split = static_split(4 * GROUP, 2, MICRO_ROWS // 2)
    ours = recipe_loss("luffy_zero", "static")
    run = dict(use_dynamic_bsz=False, micro_rows=MICRO_ROWS // 2)
    (simulated,), _ = dp_gradient([model.w], ours_micro_losses(ours, model, padded, split, **run))
    (real,) = gloo_gradient(model, ours, padded, split, tmp_path, **run)
    assert simulated.abs().sum() > 0
    torch.testing.assert_close(real, simulated, rtol=1e-5, atol=1e-8)
