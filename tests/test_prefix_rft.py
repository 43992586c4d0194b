"""Prefix-RFT plugin (recipes/prefix_rft/prefix_rft.py) against a transcription of the official code, and
the core extension point it uses (mix_src.algo.prefix_select) through the worker loss.

Reference: https://github.com/ZeroYuHuang/prefix_rft at commit 5f5d2a1fb18f0efb6d5ac51839b2750490cefaf8,
recipe/prefix_rft/core_algos.py (compute_dr_grpo_prefix_outcome_advantage, compute_dr_grpo_prefix_v2_outcome_advantage),
recipe/prefix_rft/scheduler/global_step.py (CosineDecayController, BetaSampler) and
recipe/prefix_rft/dp_actor.py (DataParallelPPOActor.reshape_func, inner function ``entropy``). The official
lines are copied below unchanged except: prints removed, the reshaper lifted out of its closure (its
``self.ent_mask_ratio_ctrl.value(...)`` becomes the argument ``entropy_mask_ratio``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from e2e import batch_result, batch_run
from mix_src.extend import load_plugins

PLUGIN = str(Path(__file__).resolve().parents[1] / "recipes" / "prefix_rft" / "prefix_rft.py")


@pytest.fixture(scope="module")
def pr():
    import sys

    (name,) = load_plugins([PLUGIN])
    return sys.modules[name]


# ==== official code (transcription) ==================================================================
# recipe/prefix_rft/core_algos.py, lines 262-354
def compute_dr_grpo_prefix_outcome_advantage(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        prefix_mask: torch.Tensor,
        index: np.ndarray,
        prefix_index: np.ndarray,
        num_rollouts_per_prefix: int,
        epsilon: float = 1e-6
    ):
    scores = token_level_rewards.sum(dim=-1)
    p_scores = torch.zeros_like(scores)
    
    id2prefix_id2score = defaultdict(lambda: defaultdict(list))
    id2prefix_id2mean = defaultdict(dict)

    with torch.no_grad():
        bsz = scores.shape[0]
        
        for i in range(bsz):
            id2prefix_id2score[index[i]][prefix_index[i]].append(scores[i])
        
        for idx in id2prefix_id2score:
            prefix_id2score = id2prefix_id2score[idx]
            for prefix_id in prefix_id2score:
                if len(prefix_id2score[prefix_id]) == 1:
                    id2prefix_id2mean[idx][prefix_id] = torch.tensor(0.0)
                elif len(prefix_id2score[prefix_id]) > 1:
                    id2prefix_id2mean[idx][prefix_id] = torch.mean(torch.tensor(prefix_id2score[prefix_id]))
                else:
                    raise ValueError(f"no score for prefix index {prefix_id}")
        
        for i in range(bsz):
            # 对于 0000-0000-0000-0000来说，和纯RL等价
            # 对于其他prefix_prompt，因为只生成了一个conitinuation，如果对了就会有1reward，否则是0reward
            # 这个1reward再gr_grpo会比其他adv都大，可能影响训练
            scores[i] = (scores[i] - id2prefix_id2mean[index[i]][prefix_index[i]])

        # calculate the advantage for prefix
        for i in range(bsz):
            if prefix_index[i] != '0000-0000-0000-0000':
                # is prefix
                p_scores[i] = scores[i] - id2prefix_id2mean[index[i]]['0000-0000-0000-0000']
        # normalize for each prefix
        scores = scores.unsqueeze(-1) * response_mask
        p_scores = p_scores.unsqueeze(-1) / num_rollouts_per_prefix * prefix_mask
        scores = torch.where(prefix_mask.bool(), p_scores, scores)
    return scores, scores

def compute_dr_grpo_prefix_v2_outcome_advantage(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        prefix_mask: torch.Tensor,
        index: np.ndarray,
        prefix_index: np.ndarray,
        num_rollouts_per_prefix: int,
        epsilon: float = 1e-6
    ):
    scores = token_level_rewards.sum(dim=-1)
    p_scores = torch.zeros_like(scores)
    
    id2prefix_id2score = defaultdict(lambda: defaultdict(list))
    id2prefix_id2mean = defaultdict(dict)

    with torch.no_grad():
        bsz = scores.shape[0]
        
        for i in range(bsz):
            id2prefix_id2score[index[i]][prefix_index[i]].append(scores[i])
        
        for idx in id2prefix_id2score:
            prefix_id2score = id2prefix_id2score[idx]
            for prefix_id in prefix_id2score:
                if len(prefix_id2score[prefix_id]) >= 1:
                    id2prefix_id2mean[idx][prefix_id] = torch.mean(torch.tensor(prefix_id2score[prefix_id]))
                else:
                    raise ValueError(f"no score for prefix index {prefix_id}")
        
        for i in range(bsz):
            # 对于 0000-0000-0000-0000来说，和纯RL等价
            # 对于其他prefix_prompt，因为只生成了一个conitinuation，adv一定为0
            scores[i] = (scores[i] - id2prefix_id2mean[index[i]][prefix_index[i]])

        # calculate the advantage for prefix
        for i in range(bsz):
            if prefix_index[i] != '0000-0000-0000-0000':
                # is prefix
                p_scores[i] = scores[i] - id2prefix_id2mean[index[i]]['0000-0000-0000-0000']
        # normalize for each prefix
        scores = scores.unsqueeze(-1) * response_mask
        p_scores = p_scores.unsqueeze(-1) / num_rollouts_per_prefix * prefix_mask
        scores = torch.where(prefix_mask.bool(), p_scores, scores)
    return scores, scores



# recipe/prefix_rft/scheduler/global_step.py: CosineDecayController (print removed) and BetaSampler.value
class CosineDecayController:
    def __init__(self, init=0.1, target=1.0, n_steps=10000, warmup_ratio=0.0, **kwargs):
        self.n_steps = n_steps
        self.init = init
        self.target = target
        self.warmup_steps = int(warmup_ratio * n_steps)

        assert init != target, "init and target must be different"
        if init > target:
            self.mode = 'decay'
        else:
            self.mode = 'rise'

    def value(self, **kwargs):
        cur_global_step = kwargs.get("global_step", None)
        assert cur_global_step is not None

        # Warmup phase: linear increase from 0 to init
        if cur_global_step < self.warmup_steps:
            return (cur_global_step / self.warmup_steps) * self.init

        # Cosine phase
        cur_step_after_warmup = cur_global_step - self.warmup_steps
        if cur_step_after_warmup > self.n_steps:
            return self.target

        cos_progress = math.pi * cur_step_after_warmup / self.n_steps
        decay_ratio = 0.5 * (1 + math.cos(cos_progress))  # always goes from 1 -> 0

        if self.mode == 'decay':
            y = self.target + decay_ratio * (self.init - self.target)
        else:  # 'rise'
            y = self.init + (1 - decay_ratio) * (self.target - self.init)

        return y


def beta_sampler_value(low, high, out):  # BetaSampler.value with `out = np.random.beta(self.alpha, self.beta)` given
    lower = min(low, high)
    higher = max(low, high)
    out = lower + (higher - lower) * out
    return out, lower, higher


# recipe/prefix_rft/dp_actor.py, reshape_func's inner `entropy` (prints removed)
def official_entropy_reshape(adv, entropy, prefix_mask, entropy_mask_ratio):
    device = adv.device
    assert entropy is not None

    entropy = entropy[prefix_mask]
    _, indices = torch.sort(entropy)
    split_point = int(len(indices) * entropy_mask_ratio)
    bottom_n_percent_indices = indices[:split_point]

    adv_mask = torch.ones_like(adv, dtype=torch.bool)
    arange_tensor = torch.arange(len(adv[prefix_mask]))
    isin_mask = torch.isin(arange_tensor, bottom_n_percent_indices).to(device)

    adv_mask[prefix_mask] &= ~isin_mask

    adv[~adv_mask] = 0
    return adv
# ==== end of the official code =======================================================================


# ==== tests ==========================================================================================
def _random_groups(gen, num_prompts, rows_per_prefix, L=7):
    """Rows of several prompts: an empty-prefix group of 1..3 rows and 1..3 prefixes of rows_per_prefix rows
    each per prompt; prefix tokens are the first k tokens (k >= 1) of a prefixed row, as in the official batch."""
    index, prefix_index, plens = [], [], []
    for p in range(num_prompts):
        for _ in range(int(gen.integers(1, 4))):
            index.append(f"q{p}"), prefix_index.append("0000-0000-0000-0000"), plens.append(0)
        for j in range(int(gen.integers(1, 4))):
            k = int(gen.integers(1, L - 1))
            for _ in range(rows_per_prefix):
                index.append(f"q{p}"), prefix_index.append(f"q{p}-p{j}"), plens.append(k)
    order = gen.permutation(len(index))
    index, prefix_index = np.array(index, dtype=object)[order], np.array(prefix_index, dtype=object)[order]
    plens = np.array(plens)[order]
    B = len(index)
    lengths = np.maximum(plens + gen.integers(1, 4, size=B), 1).clip(max=L)
    response_mask = (torch.arange(L)[None, :] < torch.as_tensor(lengths)[:, None]).float()
    prefix_mask = (torch.arange(L)[None, :] < torch.as_tensor(plens)[:, None]).long()
    rewards = torch.zeros(B, L)
    rewards[torch.arange(B), torch.as_tensor(lengths) - 1] = torch.as_tensor(gen.integers(0, 2, size=B), dtype=torch.float32)
    rewards[:, 0] += torch.as_tensor(gen.normal(size=B), dtype=torch.float32) * 0.1 * (torch.as_tensor(lengths) > 1)
    return rewards, response_mask, prefix_mask, index, prefix_index


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("rows_per_prefix", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_advantage_matches_official(pr, v2, rows_per_prefix, seed):
    gen = np.random.default_rng(seed)
    rewards, response_mask, prefix_mask, index, prefix_index = _random_groups(gen, 4, rows_per_prefix)
    official = compute_dr_grpo_prefix_v2_outcome_advantage if v2 else compute_dr_grpo_prefix_outcome_advantage
    want, _ = official(rewards.clone(), response_mask, prefix_mask, index, prefix_index, rows_per_prefix)
    got = pr.prefix_advantage(rewards.clone(), response_mask, prefix_mask, list(index), list(prefix_index), rows_per_prefix, v2=v2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got[prefix_mask.bool()] != got.new_zeros(())).any() or v2  # the prefix advantage is not trivially 0


@pytest.mark.parametrize("v2", [False, True])
def test_registered_estimator_is_official_with_one_row_per_prefix(pr, v2):
    """Our batch: each prefixed row is its own prefix (the official rollout.n=1 case), on-policy rows form the
    empty-prefix group; the registered estimator sees only prefix_mask and must give the official numbers."""
    from mix_src.trainer.adv_estimators import ADV_ESTIMATORS

    gen = np.random.default_rng(7)
    rewards, response_mask, prefix_mask, index, prefix_index = _random_groups(gen, 5, 1)
    want, _ = (compute_dr_grpo_prefix_v2_outcome_advantage if v2 else compute_dr_grpo_prefix_outcome_advantage)(
        rewards.clone(), response_mask, prefix_mask, index, prefix_index, 1)
    from mix_src.algo.core_alg import group_ids

    est = ADV_ESTIMATORS.get("dr_grpo_prefix_v2" if v2 else "dr_grpo_prefix")
    got, _ = est(rewards.clone(), response_mask, group_ids(index), prefix_mask.bool(), {})
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_estimator_refuses_a_prompt_without_on_policy_rows(pr):
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    prefix = torch.tensor([[1, 0], [1, 0]])
    with pytest.raises(ValueError, match="no row without a prefix"):
        pr.prefix_advantage(rewards, mask, prefix, ["a", "a"], ["p0", "p1"], 1)


@pytest.mark.parametrize("init,target,n,warm", [(0.95, 0.05, 200, 0.0), (0.95, 0.05, 37, 0.1), (0.1, 0.9, 50, 0.0)])
def test_cosine_schedule_matches_official(pr, init, target, n, warm):
    ctrl = CosineDecayController(init=init, target=target, n_steps=n, warmup_ratio=warm)
    for step in range(0, n + 30):
        assert pr.cosine_decay(step, init, target, n, warm) == ctrl.value(global_step=step)
    draws = np.random.default_rng(0).beta(1.0, 1.0, size=50)
    for low, high in [(0.0, 0.7), (0.6, 0.2)]:
        want = np.array([beta_sampler_value(low, high, d)[0] for d in draws])
        np.testing.assert_array_equal(pr.beta_prefix_ratio(low, high, draws), want)


def test_prefix_strategy_draws_under_the_decaying_bound(pr):
    from mix_src.algo.prefix import compute_prefix_ratios

    kw = dict(strategy="prefix_rft_cosine", n_prefix=2, min_prefix_ratio=0.05, max_prefix_ratio=0.95, prefix_steps=100)
    for step in (1, 30, 60, 101, 500):
        r = compute_prefix_ratios(400, 4, global_step=step, rng=np.random.default_rng(step), **kw).reshape(400, 4)
        high = CosineDecayController(init=0.95, target=0.05, n_steps=100).value(global_step=step - 1)
        assert (r[:, 2:] == 0).all() and (r[:, :2] >= 0).all() and (r[:, :2] <= high).all()
        assert r[:, :2].mean() == pytest.approx(high / 2, rel=0.1)  # Beta(1, 1): uniform on [0, high]


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_entropy_selection_matches_official(pr, ratio, seed):
    g = torch.Generator().manual_seed(seed)
    B, L = 6, 9
    prefix_len = torch.randint(0, L, (B,), generator=g)
    prefix_mask = torch.arange(L)[None, :] < prefix_len[:, None]
    entropy = torch.rand(B, L, generator=g) * 3
    adv = torch.randn(B, L, generator=g)
    want = official_entropy_reshape(adv.clone(), entropy, prefix_mask, ratio)
    from mix_src.algo.prefix_select import apply_prefix_token_selection

    keep = pr.entropy_keep_mask(entropy, prefix_mask, ratio)
    torch.testing.assert_close(apply_prefix_token_selection(adv, prefix_mask, keep), want, rtol=0, atol=0)
    n = int(prefix_mask.sum())
    assert int((prefix_mask & ~keep).sum()) == int(n * ratio)


def test_loss_zeroes_dropped_prefix_tokens_and_clips_prefix_as_on_policy(pr):
    """Through MixPolicyLoss on the engine's micro-batch path (tests/test_loss.py's BigramLM batch): with
    prefix_rft_entropy the loss and its gradient equal the official compute_policy_loss (enable_clip=True:
    PPO dual-clip on every token, prefix tokens included, token-mean) on the entropy-masked advantages."""
    from test_loss import BigramLM, actor_config, make_batch, run_mini_batch
    from verl.workers.utils.padding import no_padding_2_padding

    from mix_src.worker.loss import MixPolicyLoss

    model = BigramLM(seed=1)
    data = make_batch(seed=4, model=model)  # row 0: all prefix, row 1: 2 prefix tokens
    loss_fn = MixPolicyLoss(actor_config(entropy_coeff=0.0, clip_ratio_c=3.0),
                            {"prefix_token_select": "prefix_rft_entropy", "prefix_token_select_ratio": 0.5})  # fmt: skip
    total, grad, (metrics,) = run_mini_batch(loss_fn, data, 6, model)

    model.zero_grad()
    out = model(data)
    logp = no_padding_2_padding(out["log_probs"], data)
    entropy = no_padding_2_padding(out["entropy"], data).detach()
    mask = data["response_mask"].bool()
    prefix = data["prefix_mask"].bool() & mask
    old, adv = data["old_log_probs"], data["advantages"].clone()
    adv = official_entropy_reshape(adv, entropy, prefix, 0.5)
    ratio = torch.exp(logp - old)  # official core_algos.py compute_policy_loss, lines 604-617, enable_clip=True
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * 3.0
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    want = pg_losses[mask].mean()  # agg_loss token-mean
    want.backward()
    assert total == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(grad, model.w.grad, rtol=1e-5, atol=1e-7)
    n = int(prefix.sum())
    assert metrics["actor/prefix_kept_frac"].values[0] == pytest.approx((n - int(n * 0.5)) / n)
    assert metrics["actor/off_policy_prob"].values[0] == 0  # no token took the off-policy branch


def test_entries_describe_themselves_and_check_the_config(pr):
    from omegaconf import OmegaConf

    from mix_src.trainer.adv_estimators import ADV_ESTIMATORS
    from mix_src.algo.prefix import PREFIX_STRATEGIES
    from mix_src.algo.prefix_select import PREFIX_TOKEN_SELECTS
    from mix_src.extend import EntryConfigError, check_selected_entries

    for reg, name in [(ADV_ESTIMATORS, "dr_grpo_prefix"), (PREFIX_STRATEGIES, "prefix_rft_cosine"),
                      (PREFIX_TOKEN_SELECTS, "prefix_rft_entropy")]:  # fmt: skip
        entry = reg.describe(name)
        assert set(entry.bases) == {"legacy", "v1"} and entry.check is not None and entry.reads
    assert PREFIX_TOKEN_SELECTS.describe("prefix_rft_entropy").options["prefix_tokens_on_policy"] is True

    def cfg(**over):
        base = {"trainer": {"use_v1": False}, "algorithm": {"adv_estimator": "dr_grpo_prefix"},
                "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"calculate_entropy": True, "entropy_coeff": 0.0}},
                "mix": {"n_prefix": 1, "prefix_strategy": "prefix_rft_cosine", "min_prefix_ratio": 0.05,
                        "max_prefix_ratio": 0.95, "prefix_steps": 10, "prefix_share_across_samples": False,
                        "loss": {"prefix_token_select": "prefix_rft_entropy", "prefix_token_select_ratio": 0.8}}}  # fmt: skip
        c = OmegaConf.create(base)
        for k, v in over.items():
            OmegaConf.update(c, k, v)
        return c

    check_selected_entries(cfg())
    check_selected_entries(cfg(**{"trainer.use_v1": True}))
    for over, msg in [({"mix.n_prefix": 4}, "mix.n_prefix must be in 1..rollout.n-1"),
                      ({"mix.n_prefix": -1}, "mix.n_prefix must be in"),
                      ({"actor_rollout_ref.actor.calculate_entropy": False}, "calculate_entropy=true"),
                      ({"mix.loss.prefix_token_select_ratio": 1.5}, "prefix_token_select_ratio=1.5"),
                      ({"mix.min_prefix_ratio": 0.95}, "needs min < max")]:  # fmt: skip
        with pytest.raises(EntryConfigError, match=msg):
            check_selected_entries(cfg(**over))


def test_mix_config_rejects_an_unknown_selection():
    from mix_src.config.mix_config import LossConfig, MixConfigError

    with pytest.raises(MixConfigError, match="mix.loss.prefix_token_select='nope' is not a registered"):
        LossConfig(prefix_token_select="nope")


# ---- the recipe, the harness entry and a real run ------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def _compare_entry():
    import yaml

    return yaml.safe_load((REPO / "recipes" / "prefix_rft" / "compare.yaml").read_text())


@pytest.mark.parametrize("use_v1", [False, True])
def test_recipe_and_harness_entry_pass_the_before_ray_checks(pr, use_v1):
    """recipes/prefix_rft/config.yaml (as run.sh composes it), and compare.yaml's overrides on the toy task's base
    settings (on_policy_grpo.yaml, as the harness applies them): the mix section validates and every selected
    entry accepts both trainer bases."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mix_src.config.mix_config import validate_mix_config
    from mix_src.extend import check_selected_entries

    entry = _compare_entry()
    assert set(entry) == {"kind", "plugins", "overrides"} and entry["kind"] == "rl" and all((REPO / p).is_file() for p in entry["plugins"])
    plugin_override = "mix.plugins=[" + ",".join(str(REPO / p) for p in entry["plugins"]) + "]"
    for folder, name, overrides in [("prefix_rft", "config", []), ("toy_addition", "on_policy_grpo", entry["overrides"])]:
        with initialize_config_dir(config_dir=str(REPO / "recipes" / folder), version_base=None):
            cfg = compose(config_name=name, overrides=[plugin_override, *overrides, f"trainer.use_v1={use_v1}"])
        OmegaConf.resolve(cfg)
        validate_mix_config(cfg)
        check_selected_entries(cfg)
        assert cfg.mix.loss.prefix_token_select == "prefix_rft_entropy" and cfg.algorithm.adv_estimator == "dr_grpo_prefix"


PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    score = float(len(solution_str) % 2)  # a reward the random tiny model earns about half the time
    return {"score": score, "acc": score}
"""


def prefix_rft_run(assets: dict, batch_dir: Path) -> list[str]:
    """The harness's Prefix-RFT settings (compare.yaml) on the tiny assets, 2 steps, the parity reward."""
    from e2e import MIX_CPU, tiny_overrides

    reward = batch_dir / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    entry = _compare_entry()
    plugins = "mix.plugins=[" + ",".join(str(REPO / p) for p in entry["plugins"]) + "]"
    overrides = MIX_CPU + tiny_overrides(
        assets, steps=2, n=4, batch_size=4, response_length=24,
        reward=[f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=compute_score"],
    )  # fmt: skip
    return overrides + [plugins, *entry["overrides"], "mix.prefix_steps=2"]


PREFIX_RFT = batch_run("legacy", "prefix_rft", prefix_rft_run, ["test_prefix_rft.py::test_prefix_rft_trains_two_steps"])


@pytest.mark.ray
def test_prefix_rft_trains_two_steps(legacy_batch):
    """2 steps of `python -m mix_src.main_mix_ppo +backend=cpu` with the harness's Prefix-RFT settings (compare.yaml)
    on tiny assets, a run of the legacy batch (tests/conftest.py ``legacy_batch``; its plugin gets a Ray cluster of
    its own there): prefixed rows, the entropy selection on the worker, prefix tokens on the PPO-clip path. The
    random tiny model never solves a task, so the reward here is the response length's parity (mixed rewards:
    non-zero advantages and a real update through the selection)."""
    result = batch_result(legacy_batch, PREFIX_RFT)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert 0 <= m["batch/avg_prefix_ratio"] <= 0.95 / 4  # 1 of 4 rows, ratio <= hi(s) <= 0.95
        assert m["actor/off_policy_prob"] == 0  # prefix tokens take the on-policy PPO-clip branch
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
    prefixed = [m for m in result.metrics if m["batch/prefix_token_frac"] > 0]
    assert prefixed, "no step had a prefix token"
    assert all(0.2 <= m["actor/prefix_kept_frac"] < 1.0 for m in prefixed)  # the top 20% (at least) kept, some dropped
