"""HPT, built only as a plugin (recipes/hpt/hpt.py) on the core's row-loss registry (mix_src/algo/row_loss.py):

* its switch and rollout policy on scripted generation passes (no Ray);
* faithfulness: the worker loss (mix_src.worker.loss.MixPolicyLoss with mix.loss.row_loss=sft_rows), driven the way
  verl's engine drives it, against a transcription of the official code's maths on random inputs;
* the config checks (refused before Ray) and 2 real training steps through the entry point (Ray, CPU).

Official code transcribed below: github.com/TsinghuaC3I/Unify-Post-Training at commit
ae332f5fa4dc8b4c3d3cd77ebc9cff3a3abab2d0, files hpt/verl/verl/mix_src/mix_trainer.py,
hpt/verl/verl/mix_src/mix_actor.py, hpt/verl/verl/mix_src/mix_core_alg.py, hpt/verl/verl/trainer/ppo/core_algos.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from e2e import MIX_CPU, batch_result, batch_run, tiny_overrides
from mix_src.algo.core_alg import kept_tokens_per_mini_batch
from mix_src.worker.loss import MixPolicyLoss, add_kept_token_counts
from mix_src.config.mix_config import MixConfigError, mix_config_from_dict
from mix_src.extend import EntryConfigError, check_selected_entries, load_plugins
from mix_src.trainer.rollout_policy import ROLLOUT_POLICIES, RolloutContext
from mix_src.algo.row_loss import ROW_LOSSES, SFT_ROW, SFT_TOKENS

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "recipes" / "hpt" / "hpt.py"
load_plugins([str(PLUGIN)])
import sys  # noqa: E402

hpt_plugin = next(m for name, m in sys.modules.items() if name.startswith("mix_plugin_hpt_"))

VOCAB, PROMPT, RESPONSE = 13, 4, 6
N = 4


# ---- the official maths, transcribed ----------------------------------------------------------------------


def official_select_on_off_ada_balance(on_solve_num, switch_gate, switch_gate_off):
    # mix_trainer.py, MIXRayPPOTrainer.select_on_off_ada_balance, unify_strategy == 'switch' (verbatim logic)
    on_add_num = 0
    if on_solve_num <= switch_gate:
        on_remove_num = 8
        off_add_num = 1
    elif on_solve_num <= switch_gate_off:
        on_remove_num = 8
        off_add_num = -1
    else:
        on_remove_num = 0
        off_add_num = 0
    return on_remove_num, on_add_num, off_add_num


def official_masked_mean(values, mask):  # verl_F.masked_mean (the fork's verl/utils/torch_functional.py)
    return (values * mask).sum() / mask.sum()


def official_compute_sft_pure_loss(log_prob, eos_mask):  # mix_core_alg.py
    sft_losses = -log_prob
    sft_loss = official_masked_mean(sft_losses, eos_mask)
    return sft_loss


def official_compute_policy_loss(old_log_prob, log_prob, advantages, eos_mask, cliprange,
                                 loss_remove_token_mean=False, loss_remove_clip=False):  # core_algos.py
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    if loss_remove_clip is False:
        pg_losses = torch.max(pg_losses, pg_losses2)
    if loss_remove_token_mean is True:
        pg_loss = (pg_losses * eos_mask).sum() / eos_mask.shape[-1]
    else:
        pg_loss = official_masked_mean(pg_losses, eos_mask)
    return pg_loss


def official_sft_branch_loss(log_prob, old_log_prob, advantages, response_mask, prefix_mask, sft_loss_coef,
                             loss_remove_token_mean=True, loss_remove_clip=True, clip_ratio=0.2):
    # mix_actor.py, update_policy, `if self.config.offline_loss_type == "sft" or use_sft:` (one micro-batch,
    # gradient_accumulation = 1; the entropy and KL terms are left out here and in ours)
    off_policy_mask = prefix_mask.any(-1)
    off_policy_logprob = log_prob[off_policy_mask]
    off_policy_eos_mask = response_mask[off_policy_mask]
    sft_loss = official_compute_sft_pure_loss(log_prob=off_policy_logprob, eos_mask=off_policy_eos_mask)
    on_policy_mask = ~off_policy_mask
    pg_loss = official_compute_policy_loss(
        old_log_prob=old_log_prob[on_policy_mask], log_prob=log_prob[on_policy_mask],
        advantages=advantages[on_policy_mask], eos_mask=response_mask[on_policy_mask], cliprange=clip_ratio,
        loss_remove_token_mean=loss_remove_token_mean, loss_remove_clip=loss_remove_clip)
    if torch.isnan(sft_loss):
        return pg_loss
    return sft_loss * sft_loss_coef + pg_loss


# ---- a tiny model and batches as verl's engine hands them to the loss -------------------------------------


class BigramLM(torch.nn.Module):
    """logits(next | token) = W[token]; nested outputs like FSDPEngineWithLMHead with remove-padding."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)))

    def forward(self, micro_batch) -> dict:
        from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

        ids = micro_batch["input_ids"].values()
        logits = self.w[ids]
        log_probs = logprobs_from_logits(logits, torch.roll(ids, shifts=-1, dims=0))
        offsets = micro_batch["input_ids"].offsets()
        return {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, offsets),
                "entropy": torch.nested.nested_tensor_from_jagged(entropy_from_logits(logits), offsets)}


def hpt_batch(seed, solved_counts, switch_gate):
    """Rows i*N + j of prompts i: SFT prompts (official switch) get N copies of their target (prefix_mask on
    every response token), the others N random on-policy responses. Returns the padded tensors."""
    g = torch.Generator().manual_seed(seed)
    num_prompts = len(solved_counts)
    sft_prompt = np.array([official_select_on_off_ada_balance(k, switch_gate, switch_gate)[2] == 1
                           for k in solved_counts])  # fmt: skip
    rows = num_prompts * N
    prompt_lens = torch.randint(1, PROMPT + 1, (num_prompts,), generator=g).repeat_interleave(N)
    prompts = torch.randint(1, VOCAB, (num_prompts, PROMPT), generator=g).repeat_interleave(N, 0)
    response_lens = torch.randint(1, RESPONSE + 1, (rows,), generator=g)
    responses = torch.randint(1, VOCAB, (rows, RESPONSE), generator=g)
    targets = torch.randint(1, VOCAB, (num_prompts, RESPONSE), generator=g)
    target_lens = torch.randint(2, RESPONSE + 1, (num_prompts,), generator=g)
    response_lens[0] = target_lens[0] = RESPONSE  # the padded width is RESPONSE (verl's fixed response length)
    for i in np.flatnonzero(sft_prompt):  # the N rows of an SFT prompt are its whole target
        responses[i * N:(i + 1) * N] = targets[i]
        response_lens[i * N:(i + 1) * N] = target_lens[i]
    prompt_mask = torch.arange(PROMPT)[None, :] >= (PROMPT - prompt_lens)[:, None]
    response_mask = torch.arange(RESPONSE)[None, :] < response_lens[:, None]
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    sft_row = torch.as_tensor(np.repeat(sft_prompt, N))
    prefix_mask = response_mask & sft_row[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    return dict(
        prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask, position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        response_mask=response_mask.long(), prefix_mask=prefix_mask.long(),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, RESPONSE) * response_mask,
        sft_row=sft_row.float(), noise=torch.randn(rows, RESPONSE, generator=g),
    ), sft_prompt  # fmt: skip


def engine_batch(padded, model, dp_size=1):
    td = tu.get_tensordict({k: v for k, v in padded.items() if k != "noise"})
    td = left_right_2_no_padding(td)
    with torch.no_grad():
        current = no_padding_2_padding(model(td)["log_probs"], td)
    response_mask = padded["response_mask"]
    td["old_log_probs"] = (current + 0.3 * padded["noise"]) * response_mask
    rows = response_mask.shape[0]
    tu.assign_non_tensor(td, global_batch_size=rows, calculate_entropy=True, use_remove_padding=True,
                         use_dynamic_bsz=False, batch_num_tokens=int(response_mask.sum()), dp_size=dp_size)  # fmt: skip
    # what add_kept_token_counts / add_sft_token_counts put into the batch on the driver (one mini-batch)
    _, sft_mask = ROW_LOSSES.get("sft_rows")(response_mask.bool(), padded["prefix_mask"].bool(), padded["sft_row"].bool())
    td[SFT_TOKENS] = kept_tokens_per_mini_batch(sft_mask, dp_size, rows).float()
    return td, td["old_log_probs"].clone()


def ours_loss_and_grad(padded, micro_batch_size, coef, seed=1):
    model = BigramLM(seed)
    data, old = engine_batch(padded, model)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.0,
                         loss_scale_factor=RESPONSE)  # fmt: skip
    loss_fn = MixPolicyLoss(config, dict(row_loss="sft_rows", sft_loss_coef=coef, loss_remove_clip=True,
                                         loss_agg_mode="luffy-token-sum-norm"))  # fmt: skip
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=micro_batch_size)
    micro_batches, _ = prepare_micro_batches(data)
    total, metrics = 0.0, []
    for mb in micro_batches:
        out = model(mb)
        out.pop("entropy")
        loss, m = loss_fn(model_output=out, data=mb)
        loss.backward()
        total += loss.item()
        metrics.append(m)
    return total, model.w.grad.clone(), old, metrics


def official_loss_and_grad(padded, sft_prompt, old_padded, coef, seed=1):
    """The official batch: one target row per SFT prompt (its N on-policy rows removed), N rows otherwise."""
    keep = []
    for i, is_sft in enumerate(sft_prompt):
        keep += [i * N] if is_sft else list(range(i * N, (i + 1) * N))
    keep = torch.as_tensor(keep)
    model = BigramLM(seed)
    sub = {k: v[keep] for k, v in padded.items() if k not in ("noise", "sft_row")}
    td = left_right_2_no_padding(tu.get_tensordict(sub))
    log_prob = no_padding_2_padding(model(td)["log_probs"], td)
    loss = official_sft_branch_loss(log_prob, old_padded[keep], sub["advantages"], sub["response_mask"].float(),
                                    sub["prefix_mask"].bool(), coef)  # fmt: skip
    loss.backward()
    return loss.item(), model.w.grad.clone()


# ---- tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_switch_matches_the_official_rule(seed):
    rng = np.random.default_rng(seed)
    solved = rng.integers(0, 9, size=32)
    for gate in (0, 2, 8):
        official = np.array([official_select_on_off_ada_balance(int(k), gate, gate)[2] == 1 for k in solved])
        ours = hpt_plugin.switch_to_sft(solved, np.ones(32, dtype=bool), gate)
        assert ours.tolist() == official.tolist()
    assert not hpt_plugin.switch_to_sft(np.zeros(3), np.zeros(3, dtype=bool), 0).any()  # no target: stays RL


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("micro_batch_size", [16, 8, 4])
def test_loss_matches_the_official_sft_branch(seed, micro_batch_size):
    """Random batches of 4 prompts x N: ours (N target copies per SFT prompt, any micro-batch split) gives the
    official loss (one target row per SFT prompt, one micro-batch) and its gradient."""
    rng = np.random.default_rng(100 + seed)
    solved = rng.integers(0, N + 1, size=4)
    solved[0], solved[1] = 0, N  # at least one SFT and one RL prompt
    coef = float(rng.uniform(0.1, 2.0))
    padded, sft_prompt = hpt_batch(seed, solved, switch_gate=0)
    ours, ours_grad, old, metrics = ours_loss_and_grad(padded, micro_batch_size, coef)
    official, official_grad = official_loss_and_grad(padded, sft_prompt, old, coef)
    assert ours == pytest.approx(official, rel=1e-5, abs=1e-6)
    assert official_grad.abs().sum() > 0
    assert torch.allclose(ours_grad, official_grad, rtol=1e-4, atol=1e-6), (ours_grad - official_grad).abs().max()
    assert "actor/sft_loss" in metrics[0] and "actor/sft_nll" in metrics[0]


def test_rl_rows_with_prefixes_keep_the_off_policy_loss():
    """sft_rows decides per row: a prefixed row that is not an SFT row keeps LUFFY's off-policy token loss."""
    response = torch.ones(3, 4, dtype=torch.bool)
    prefix = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    rl, sft = ROW_LOSSES.get("sft_rows")(response, prefix, torch.tensor([0.0, 1.0, 0.0]))
    assert rl.tolist() == [[True] * 4, [False] * 4, [True] * 4] and sft.tolist() == [[False] * 4, [True] * 4, [False] * 4]
    assert ROW_LOSSES.describe("sft_rows").bases == ("legacy", "v1")


def scripted_context(solved_first_pass, *, gate=0, has_target=None):
    calls = []
    total = len(solved_first_pass)

    def generate(ratios, rows=None):
        idx = np.arange(total) if rows is None else np.asarray(rows)
        calls.append((idx.copy(), np.asarray(ratios, dtype=float).copy()))
        guided = np.asarray(ratios) > 0
        acc = np.where(guided, 1.0, np.asarray(solved_first_pass, dtype=float)[idx])
        prefix = torch.zeros(len(idx), 3, dtype=torch.bool)
        prefix[torch.as_tensor(guided)] = True
        return DataProto.from_dict(tensors={"prefix_mask": prefix, "row": torch.as_tensor(idx)},
                                   non_tensors={"acc": acc, "prefix_ratio": np.asarray(ratios, dtype=float)})

    targets = np.ones(total, dtype=bool) if has_target is None else np.asarray(has_target)
    mix = mix_config_from_dict({"n_prefix": -1, "plugins": [str(PLUGIN)], "plugin_options": {"hpt": {"switch_gate": gate}},
                                "loss": {"row_loss": "sft_rows"}})  # fmt: skip
    ctx = RolloutContext(batch=DataProto.from_dict(tensors={"row": torch.arange(total)}), n=N, global_step=1, mix=mix,
                         generate=generate, prefix_ratios=lambda: np.where(targets, 1.0, 0.0),
                         rng=np.random.default_rng(0))  # fmt: skip
    return ctx, calls


def test_rollout_policy_replaces_whole_groups_and_marks_them():
    # prompt 0: 1 of 4 solved (RL); prompt 1: none (SFT); prompt 2: none but no target (RL: nothing to imitate)
    solved = [0, 1, 0, 0] + [0] * 4 + [0] * 4
    ctx, calls = scripted_context(solved, has_target=[True] * 8 + [False] * 4)
    out = ROLLOUT_POLICIES.get("hpt")(ctx)
    assert len(calls) == 2 and calls[0][1].tolist() == [0.0] * 12
    assert calls[1][0].tolist() == [4, 5, 6, 7] and calls[1][1].tolist() == [1.0] * 4  # whole target + EOS
    assert out.batch["row"].tolist() == list(range(12))
    # one SFT row per SFT prompt, as the official; its copies SFT_COPY (-1): no term counts them (hpt.drop_copies)
    assert out.batch[SFT_ROW].tolist() == [0.0] * 4 + [1.0] + [-1.0] * 3 + [0.0] * 4
    assert out.batch["prefix_mask"].any(-1).tolist() == [False] * 4 + [True] * 4 + [False] * 4
    # gate 1: prompt 0 (1 solved) switches to SFT as well
    ctx, calls = scripted_context(solved, gate=1)
    assert ROLLOUT_POLICIES.get("hpt")(ctx).batch[SFT_ROW].tolist() == ([1.0] + [-1.0] * 3) * 3
    # every prompt solved once or more, gate 0: one pass, no SFT row, the field still there
    ctx, calls = scripted_context([1, 0, 0, 0] * 3)
    out = ROLLOUT_POLICIES.get("hpt")(ctx)
    assert len(calls) == 1 and out.batch[SFT_ROW].tolist() == [0.0] * 12


def test_driver_adds_the_sft_token_counts():
    padded, _ = hpt_batch(0, [0, N, 1, 0], switch_gate=0)
    batch = DataProto.from_dict(tensors={k: padded[k] for k in ("response_mask", "prefix_mask", SFT_ROW)})
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}, "rollout": {"n": N}}})
    add_kept_token_counts(batch, config, mix_config_from_dict({"loss": {"row_loss": "sft_rows"}}).loss, lambda: 1)
    sft_tokens = (padded["response_mask"] * padded["sft_row"][:, None]).sum(-1)
    expected = torch.cat([sft_tokens[:8].sum().repeat(8), sft_tokens[8:].sum().repeat(8)])
    assert batch.batch[SFT_TOKENS].tolist() == expected.tolist()
    batch.batch.pop(SFT_ROW)
    with pytest.raises(KeyError, match="sft_row"):
        add_kept_token_counts(batch, config, mix_config_from_dict({"loss": {"row_loss": "sft_rows"}}).loss, lambda: 1)


def recipe_config(*overrides):
    """The recipe's mix settings on a minimal config, as check_selected_entries sees the composed one."""
    base = OmegaConf.load(ROOT / "recipes" / "hpt" / "compare.yaml")
    cfg = OmegaConf.create({"trainer": {"use_v1": False}, "actor_rollout_ref": {"rollout": {"n": 8}},
                            "mix": OmegaConf.load(ROOT / "mix_src" / "config" / "mix_ppo_trainer.yaml").mix})  # fmt: skip
    for item in [*base.overrides, *overrides]:
        key, value = item.lstrip("+").split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def test_config_checks_refuse_before_ray():
    check_selected_entries(recipe_config())
    check_selected_entries(recipe_config("trainer.use_v1=true"))  # both bases (V1: mix_src/trainer/rollout_policy_v1.py)
    with pytest.raises(EntryConfigError, match="mix.loss.row_loss=sft_rows"):
        check_selected_entries(recipe_config("mix.loss.row_loss=null"))
    with pytest.raises(EntryConfigError, match="switch_gate=9 must be an integer"):
        check_selected_entries(recipe_config("+mix.plugin_options.hpt.switch_gate=9"))
    with pytest.raises(EntryConfigError, match="unknown key"):
        check_selected_entries(recipe_config("+mix.plugin_options.hpt.switch_gate_off=2"))
    with pytest.raises(EntryConfigError, match="n_prefix=-1"):
        check_selected_entries(recipe_config("mix.n_prefix=1"))
    with pytest.raises(MixConfigError, match="pick one"):
        mix_config_from_dict({"loss": {"row_loss": "sft_rows", "use_sft_multitask_loss": True}})
    with pytest.raises(MixConfigError, match="plugin_options.nope"):
        mix_config_from_dict({"plugin_options": {"nope": {}}})


BASES = {"legacy": [], "v1": ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]}


def hpt_run(base: str):
    """The batch run of ``base``: compare.yaml's plugin and overrides on the tiny assets, 2 steps."""

    def overrides(assets: dict, _) -> list[str]:
        compare = yaml.safe_load((ROOT / "recipes" / "hpt" / "compare.yaml").read_text())
        return MIX_CPU + tiny_overrides(assets, steps=2, n=N, batch_size=4, response_length=24) + [
            f"mix.plugins=[{','.join(str(ROOT / p) for p in compare['plugins'])}]", *compare["overrides"], *BASES[base],
        ]  # fmt: skip

    return overrides


# one run on each base, in that base's batch (tests/conftest.py legacy_batch / v1_batch: the plugin's runs get a Ray
# cluster of their own there, tests/mix_modes_run.py)
HPT_RUNS = {base: batch_run(base, f"hpt_{base}", hpt_run(base), [f"test_hpt.py::test_hpt_plugin_trains_two_steps_{base}"])
            for base in BASES}  # fmt: skip


def check_hpt_run(base: str, result) -> None:
    """The compare.yaml settings on tiny assets, on each trainer base: the random tiny model solves nothing, so
    with switch_gate=0 every prompt is an SFT prompt at step 1; the SFT loss is finite and positive and the weights
    move. On V1 (mix_src/trainer/rollout_policy_v1.py) the policy's two passes run through verl's agent loop, its
    ``sft_row`` tensor becomes a TransferQueue field of the rows and the driver's ``mix_sft_tokens`` another
    (MixV1Mixin._add_update_inputs): the SFT loss exists only when both reached the worker."""
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        if base == "v1":
            assert m["rollout_policy/passes"] == 2 and m["rollout_policy/rows_generated"] == 2 * 4 * N
        assert m["batch/off_policy_rows"] == 4 * N  # every group became N target rows (1 SFT row + N - 1 SFT_COPY rows)
        assert np.isfinite(m["actor/sft_loss"]) and m["actor/sft_loss"] > 0
        # no RL row: the policy term is exactly the SFT term (coefficient 1), the on-policy loss is 0
        assert m["actor/pg_loss"] == pytest.approx(m["actor/sft_loss"], rel=1e-5)
        assert m["actor/on_pg_loss"] == 0.0


@pytest.mark.ray
def test_hpt_plugin_trains_two_steps_legacy(legacy_batch):
    check_hpt_run("legacy", batch_result(legacy_batch, HPT_RUNS["legacy"]))


@pytest.mark.ray
def test_hpt_plugin_trains_two_steps_v1(v1_batch):
    check_hpt_run("v1", batch_result(v1_batch, HPT_RUNS["v1"]))


def test_compare_entry_composes_on_the_toy_task():
    """compare.yaml's plugin and overrides on top of the toy task's base settings (the harness's composition):
    the mix section validates and every selected entry accepts the config, before Ray."""
    from hydra import compose, initialize_config_dir

    from mix_src.config.mix_config import validate_mix_config

    spec = yaml.safe_load((ROOT / "recipes" / "hpt" / "compare.yaml").read_text())
    assert spec["kind"] == "rl" and set(spec) == {"kind", "plugins", "overrides"}
    plugins = "mix.plugins=[" + ",".join(str(ROOT / p) for p in spec["plugins"]) + "]"
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "toy_addition"), version_base=None):
        cfg = compose(config_name="on_policy_grpo", overrides=[plugins, *spec["overrides"]])
    mix = validate_mix_config(cfg)
    check_selected_entries(cfg)
    assert mix.rollout_policy == "hpt" and mix.loss.row_loss == "sft_rows" and mix.n_prefix == -1
