"""ExGRPO plugin (recipes/exgrpo): the core maths against a transcription of the official code
(github.com/ElliottYan/LUFFY, ExGRPO/exgrpo/verl/verl/mix_src/, commit 01f4ae0), config refusals, and a
2-step CPU run whose replay buffer fills, replays and is saved with the checkpoint."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from e2e import MIX_CPU, run_verl, tiny_overrides
from mix_src.algo.core_alg import compute_token_on_off_policy_loss
from mix_src.config.mix_config import MixConfigError, mix_config_from_dict
from mix_src.algo.off_policy_behaviour import BEHAVIOUR_LOG_PROB, OFF_POLICY_BEHAVIOURS
from mix_src.extend import EntryConfigError, check_selected_entries, load_plugins

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "recipes" / "exgrpo" / "exgrpo.py"
load_plugins([str(PLUGIN)])
ex = next(m for name, m in sys.modules.items() if name.startswith("mix_plugin_exgrpo_"))


@pytest.fixture(autouse=True)
def _keep_the_bound_env(monkeypatch):
    """The plugin's check exports skip_grad_bound to this process's environment: undo it after each test."""
    monkeypatch.setenv("MIX_EXGRPO_SKIP_GRAD_BOUND", "")


# ---- the official code, transcribed (commit 01f4ae0) ------------------------------------------------------
class OfficialWeightedBucketSampler:
    # experience/weighted_bucket_sampler.py, WeightedBucketSampler (verbatim but for the prints)
    def __init__(self, buckets, n_rollout, weighting_method="linear", beta: float = 0.01):
        def _normal_mapping(x, rollout):
            mu = rollout / 2
            sigma = 1
            coeff = 1 / np.sqrt(2 * np.pi * sigma**2)
            exponent = -((x - mu) ** 2) / (2 * sigma**2)
            return coeff * np.exp(exponent)

        def _linear_clip_mapping(x, rollout):
            if x > rollout/2:
                return 0.5
            else:
                return x / rollout

        def _sqrt_mapping(x, rollout):
            return np.sqrt(x/rollout)

        self.buckets = buckets.copy()
        if weighting_method == "linear":
            self.weights = {k: k/n_rollout for k in buckets.keys()}
        elif weighting_method == "normal":
            self.weights = {k: _normal_mapping(k, n_rollout) for k in buckets.keys()}
        elif weighting_method == "sqrt":
            self.weights = {k: _sqrt_mapping(k, n_rollout) for k in buckets.keys()}
        elif weighting_method == "linear_clip":
            self.weights = {k: _linear_clip_mapping(k, n_rollout) for k in buckets.keys()}
        self.valid_buckets = {k: v for k, v in self.buckets.items() if len(v) > 0}
        self.valid_weights = {k: self.weights.get(k, 0) for k in self.valid_buckets.keys()}
        self.total_weight = sum(self.valid_weights.values())
        self.probabilities = {k: w / self.total_weight for k, w in self.valid_weights.items()}

    def sample(self, n, seed=None):
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed)
        bucket_names = list(self.valid_buckets.keys())
        bucket_probs = [self.probabilities[name] for name in bucket_names]
        counts = np.random.multinomial(n, bucket_probs)
        adjusted_counts = []
        excess_samples = 0
        for i, count in enumerate(counts):
            bucket_name = bucket_names[i]
            bucket_size = len(self.valid_buckets[bucket_name])
            if count > bucket_size:
                adjusted_counts.append(bucket_size)
                excess_samples += count - bucket_size
            else:
                adjusted_counts.append(count)
        while excess_samples > 0:
            available_buckets = []
            available_probs = []
            for i, bucket_name in enumerate(bucket_names):
                bucket_size = len(self.valid_buckets[bucket_name])
                current_count = adjusted_counts[i]
                if current_count < bucket_size:
                    available_buckets.append(i)
                    available_probs.append(self.probabilities[bucket_name])
            if not available_buckets:
                break
            total_prob = sum(available_probs)
            available_probs = [p / total_prob for p in available_probs]
            chosen_idx = np.random.choice(available_buckets, p=available_probs)
            adjusted_counts[chosen_idx] += 1
            excess_samples -= 1
        samples = []
        for i, count in enumerate(adjusted_counts):
            if count > 0:
                bucket_name = bucket_names[i]
                bucket_data = self.valid_buckets[bucket_name]
                if count >= len(bucket_data):
                    bucket_samples = bucket_data.copy()
                else:
                    bucket_samples = random.sample(bucket_data, count)
                samples.extend(bucket_samples)
        return samples, []


def official_select_best(uids, uid_exp_indices, postcal_metrics, exp_select_mode):
    # experience/experience_helpers.py, select_best_experiences (returns the index instead of the entry)
    best = {}
    for uid in uids:
        start, end = uid_exp_indices[uid]
        uid_postcal_metrics = postcal_metrics[start:end]
        if exp_select_mode == 'argmin':
            best[uid] = int(np.argmin(uid_postcal_metrics))
        elif exp_select_mode == 'argmax':
            best[uid] = int(np.argmax(uid_postcal_metrics))
    return best


def official_entropy_metrics(ents, responses, pad_token_id, batch_size, fixed=False):
    """experience/experience_helpers.py:143-146 (``exp_metric == 'ent'``): ``ents`` = the actor's per-token
    entropies of all candidates, ``responses`` = the LAST micro-batch of BATCH_SIZE rows (``ppl_batch``, the loop
    variable left over). fixed=True: the intended mask, the candidate's own non-pad tokens."""
    postcal_metrics = []
    for i in range(ents.shape[0]):
        if fixed:
            mask = responses[i] != pad_token_id
        else:
            mask = ~(responses[i % batch_size] != pad_token_id)
        ent = ents[i][mask].mean().item()
        postcal_metrics.append(ent)
    return postcal_metrics


def official_optimizer_step(module, optimizer, grad_clip, skip_grad_bound):
    """mix_actor.py:244-256 ``_optimizer_step`` (the non-FSDP branch; no alpha optimizer)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=grad_clip)
    if not torch.isfinite(grad_norm) or (grad_norm > skip_grad_bound).any():
        optimizer.zero_grad()
    else:
        optimizer.step()
    return grad_norm


def official_exgrpo_loss(old_log_prob, log_prob, advantages, eos_mask, prefix_mask, recorded_old_log_prob):
    """experience/experience_trainer_ops.py replace_recorded_old_log_probs (exp_is_correct=True: the replayed
    rows' old_log_probs become the recorded ones) + mix_core_alg.py compute_token_on_off_policy_loss with the
    launch script's settings (off_policy_reshape="p_div_p_0.1", loss_remove_clip=True,
    loss_remove_token_mean=True, target_probs=None, no off/all clips)."""
    old_log_prob = old_log_prob.clone()
    off_policy_mask = prefix_mask.any(-1)
    for i in range(len(off_policy_mask)):
        if off_policy_mask[i] and recorded_old_log_prob[i].sum().item() != 0.0:
            old_log_prob[i] = recorded_old_log_prob[i]
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    on_pg_losses = -advantages * ratio
    off_ratio = torch.exp(negative_approx_kl)
    off_ratio = off_ratio / (off_ratio + 0.1)
    off_pg_losses = -advantages * off_ratio
    prefix_mask = prefix_mask.float()
    pg_losses = off_pg_losses * prefix_mask + on_pg_losses * (1 - prefix_mask)
    pg_loss = (pg_losses * eos_mask).sum() / eos_mask.shape[-1]
    return pg_loss


# ---- unit tests of the maths ------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ex.WEIGHTINGS)
@pytest.mark.parametrize("seed", range(6))
def test_bucket_sampling_matches_the_official_sampler(method, seed):
    rng = np.random.default_rng(seed)
    n_rollout = 8
    buckets, uid = {}, 0
    for k in rng.choice(np.arange(1, 8), size=rng.integers(1, 6), replace=False):
        size = int(rng.integers(1, 5))
        buckets[int(k)] = list(range(uid, uid + size))
        uid += size
    n = int(rng.integers(1, uid + 3))
    official = OfficialWeightedBucketSampler(buckets, n_rollout, method)
    for k in buckets:
        assert ex.bucket_weight(k, n_rollout, method) == pytest.approx(float(official.weights[k]), rel=1e-12)
    s = 1000 + seed
    expected, _ = official.sample(n, seed=s)
    got = ex.sample_from_buckets(buckets, n, n_rollout, method, np.random.RandomState(s), random.Random(s))
    assert got == expected
    assert len(set(got)) == len(got) == min(n, uid)  # without replacement; at most the buffer


def test_normal_weights_prefer_medium_difficulty():
    w = [ex.bucket_weight(k, 8, "normal") for k in range(1, 8)]
    assert max(w) == w[3] and w[0] < w[2] and w[6] < w[4]  # k = n/2 = 4 weighs most


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", ["argmin", "argmax"])
def test_trajectory_choice_matches_the_official_selection(seed, mode):
    g = torch.Generator().manual_seed(seed)
    uids, indices, metrics, start = [], {}, [], 0
    per_uid = {}
    for u in range(4):
        t = int(torch.randint(1, 5, (1,), generator=g))
        vals = torch.rand(t, 7, generator=g)
        mask = torch.rand(t, 7, generator=g) > 0.3
        mask[:, 0] = True
        m = ex.token_mean(vals, mask)
        for i in range(t):  # the official per-trajectory mean over its tokens (all_metrics[i][mask].mean())
            assert m[i].item() == pytest.approx(vals[i][mask[i]].mean().item(), rel=1e-6)
        uids.append(u), indices.__setitem__(u, (start, start + t))
        metrics += m.tolist()
        per_uid[u] = m.tolist()
        start += t
    official = official_select_best(uids, indices, metrics, mode)
    assert {u: ex.choose_trajectory(per_uid[u], mode) for u in uids} == official


@pytest.mark.parametrize("seed", range(4))
def test_entropy_metric_is_the_official_one_with_the_padding_mask_fixed(seed):
    """mean_entropy = the official ``exp_metric=ent`` metric with the intended mask (each candidate's own tokens);
    the official mask (padding positions of a row of the last micro-batch) gives other numbers on the same input."""
    g = torch.Generator().manual_seed(seed)
    T, L, pad = 6, 10, 0
    lengths = torch.randint(2, L, (T,), generator=g)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    responses = torch.where(mask, torch.randint(1, 50, (T, L), generator=g), torch.full((T, L), pad))
    ents = torch.rand(T, L, generator=g) * 3
    ours = ex.mean_entropy(ents, mask).tolist()
    assert ours == pytest.approx(official_entropy_metrics(ents, responses, pad, T, fixed=True), rel=1e-6)
    assert ours != pytest.approx(official_entropy_metrics(ents, responses, pad, T), rel=1e-3)


@pytest.mark.parametrize("seed", range(5))
def test_loss_with_recorded_log_probs_matches_the_official_loss(seed):
    """Replayed rows (all prefix tokens) weighed by w = exp(l - l_recorded), shaped w/(w+0.1); on-policy rows
    plain ratio; token sum / width: value and gradient equal the official loss."""
    g = torch.Generator().manual_seed(seed)
    B, L = 6, 9
    resp = torch.rand(B, L, generator=g) > 0.2
    resp[:, 0] = True
    prefix = torch.zeros(B, L, dtype=torch.bool)
    prefix[[0, 3]] = resp[[0, 3]]  # rows 0 and 3 are replayed trajectories
    old = -torch.rand(B, L, generator=g) * 3 * resp
    recorded = (-torch.rand(B, L, generator=g) * 3) * prefix
    adv = torch.randn(B, 1, generator=g).expand(B, L).contiguous()
    lp = (old + 0.3 * torch.randn(B, L, generator=g)).clamp(max=-1e-3) * resp
    lp1 = lp.clone().requires_grad_(True)
    ref = official_exgrpo_loss(old, lp1, adv, resp.float(), prefix, recorded)
    ref.backward()
    lp2 = lp.clone().requires_grad_(True)
    beh = OFF_POLICY_BEHAVIOURS.get("stored_log_prob")(prefix, {BEHAVIOUR_LOG_PROB: recorded})
    out = compute_token_on_off_policy_loss(old, lp2, adv, resp, prefix, off_policy_reshape="p_div_p",
                                           off_policy_reshape_gamma=0.1, loss_remove_clip=True,
                                           loss_agg_mode="luffy-token-sum-norm", behaviour_log_prob=beh)
    out["pg_loss"].backward()
    assert out["pg_loss"].item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp2.grad, lp1.grad, rtol=1e-5, atol=1e-7)
    # without the recorded log-probs (LUFFY: p_b = 1) the loss differs: the weights reach the loss
    luffy = compute_token_on_off_policy_loss(old, lp, adv, resp, prefix, off_policy_reshape="p_div_p",
                                             loss_remove_clip=True, loss_agg_mode="luffy-token-sum-norm")
    assert luffy["pg_loss"].item() != pytest.approx(ref.item(), rel=1e-4)


# ---- config ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1e-3, 10.0, 1e4, float("nan")])
def test_skip_grad_bound_matches_the_official_optimizer_step(scale, monkeypatch):
    """verl 0.9.1's FSDPEngine.optimizer_step (its own code, on a plain module: the torch clip branch) wrapped by
    the plugin with skip_grad_bound=500 leaves the parameters, optimiser state and gradients as the official
    ``_optimizer_step`` does: a step below the bound, none above it or at a non-finite norm."""
    from types import SimpleNamespace

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    assert getattr(FSDPEngine.optimizer_step, "_mix_exgrpo", False)  # the plugin wrapped verl's class
    monkeypatch.setenv(ex.SKIP_GRAD_BOUND_ENV, "500.0")
    ours, official = (torch.nn.Linear(4, 3) for _ in range(2))
    official.load_state_dict(ours.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01) for m in (ours, official)]
    torch.optim.lr_scheduler.LambdaLR(opts[0], lambda _: 1.0)  # wraps opts[0].step as an instance attribute
    scheduled_step = opts[0].step
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # twice: the second step sees the first one's optimiser state
        for m, o in zip((ours, official), opts):
            o.zero_grad()
            (m(x).sum() * scale).backward()
        engine = SimpleNamespace(module=ours, optimizer=opts[0], optimizer_config=SimpleNamespace(clip_grad=1.0),
                                 scaler=None, _qat_enabled=False)
        got = FSDPEngine.optimizer_step(engine)
        want = official_optimizer_step(official, opts[1], 1.0, 500)
        assert got == pytest.approx(float(want), nan_ok=True)
        for a, b in zip(ours.parameters(), official.parameters()):
            torch.testing.assert_close(a, b, equal_nan=True)
            torch.testing.assert_close(a.grad, b.grad, equal_nan=True)
        assert len(opts[0].state) == len(opts[1].state) and opts[0].step is scheduled_step
    assert ex.skip_step(600.0, 500) and not ex.skip_step(600.0, None) and ex.skip_step(float("inf"), None)


def recipe_config(*overrides):
    """compare.yaml's settings on a minimal config, as check_selected_entries sees the composed one."""
    base = OmegaConf.load(ROOT / "recipes" / "exgrpo" / "compare.yaml")
    cfg = OmegaConf.create({"trainer": {"use_v1": False}, "actor_rollout_ref": {"rollout": {"n": 8}},
                            "mix": OmegaConf.load(ROOT / "mix_src" / "config" / "mix_ppo_trainer.yaml").mix})  # fmt: skip
    for item in [*base.overrides, *overrides]:
        key, value = item.lstrip("+").split("=", 1)
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def test_config_checks_refuse_before_ray():
    check_selected_entries(recipe_config())
    check_selected_entries(recipe_config("trainer.use_v1=true", "+mix.plugin_options.exgrpo.trajectory_metric="
                                         "recorded_nll", "+mix.plugin_options.exgrpo.retire_from_data=false"))  # both
    # bases (V1: mix_src/trainer/rollout_policy_v1.py)
    with pytest.raises(EntryConfigError, match="trajectory_metric=recorded_nll there"):
        check_selected_entries(recipe_config("trainer.use_v1=true"))
    with pytest.raises(EntryConfigError, match="retire_from_data=false there"):
        check_selected_entries(recipe_config("trainer.use_v1=true", "+mix.plugin_options.exgrpo.trajectory_metric="
                                             "recorded_nll"))
    with pytest.raises(EntryConfigError, match="retire_from_data='yes' must be true or false"):
        check_selected_entries(recipe_config("+mix.plugin_options.exgrpo.retire_from_data='yes'"))
    with pytest.raises(EntryConfigError, match="trajectory_metric='ppl'"):
        check_selected_entries(recipe_config("+mix.plugin_options.exgrpo.trajectory_metric=ppl"))
    with pytest.raises(EntryConfigError, match="skip_grad_bound=-1"):
        check_selected_entries(recipe_config("+mix.plugin_options.exgrpo.skip_grad_bound=-1"))
    with pytest.raises(EntryConfigError, match="strategy='megatron'"):
        check_selected_entries(recipe_config("+actor_rollout_ref.actor.strategy=megatron"))
    cfg = recipe_config("+mix.plugin_options.exgrpo.skip_grad_bound=7")
    check_selected_entries(cfg)  # exported to the workers' environment
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars[ex.SKIP_GRAD_BOUND_ENV] == "7.0"
    with pytest.raises(EntryConfigError, match="off_policy_behaviour=stored_log_prob"):
        check_selected_entries(recipe_config("mix.loss.off_policy_behaviour=null"))
    with pytest.raises(EntryConfigError, match="calculate_log_probs=true"):
        check_selected_entries(recipe_config("actor_rollout_ref.rollout.calculate_log_probs=false"))
    with pytest.raises(EntryConfigError, match="bucket_weighting"):
        check_selected_entries(recipe_config("+mix.plugin_options.exgrpo.bucket_weighting=cubic"))
    with pytest.raises(EntryConfigError, match="rbound"):
        check_selected_entries(recipe_config("+mix.plugin_options.exgrpo.rbound=8"))
    with pytest.raises(EntryConfigError, match="unknown key"):
        check_selected_entries(recipe_config("+mix.plugin_options.exgrpo.exp_metric=ent"))
    with pytest.raises(MixConfigError, match="pick one"):
        mix_config_from_dict({"loss": {"off_policy_behaviour": "stored_log_prob", "use_sft_multitask_loss": True}})
    with pytest.raises(MixConfigError, match="stored_log_probz"):
        mix_config_from_dict({"loss": {"off_policy_behaviour": "stored_log_probz"}})


def test_compare_entry_composes_on_the_toy_task():
    from hydra import compose, initialize_config_dir

    from mix_src.config.mix_config import validate_mix_config

    spec = yaml.safe_load((ROOT / "recipes" / "exgrpo" / "compare.yaml").read_text())
    assert spec["kind"] == "rl" and set(spec) == {"kind", "plugins", "overrides"}
    plugins = "mix.plugins=[" + ",".join(str(ROOT / p) for p in spec["plugins"]) + "]"
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "toy_addition"), version_base=None):
        cfg = compose(config_name="on_policy_grpo", overrides=[plugins, *spec["overrides"]])
    mix = validate_mix_config(cfg)
    check_selected_entries(cfg)
    assert mix.rollout_policy == "exgrpo" and mix.loss.off_policy_behaviour == "stored_log_prob"


# ---- the CPU run -------------------------------------------------------------------------------------------
N = 4


BASES = {"legacy": [], "v1": ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync",
                              "++mix.plugin_options.exgrpo.trajectory_metric=recorded_nll",  # no actor entropy on V1
                              "++mix.plugin_options.exgrpo.retire_from_data=false"]}  # no raw_prompt in V1's view


@pytest.mark.ray
@pytest.mark.parametrize("base", list(BASES))
def test_exgrpo_plugin_trains_two_steps_and_saves_its_buffer(tiny_assets, tmp_path, base):
    """compare.yaml's settings on tiny assets, on each trainer base, recording from step 1 (start_solved_ratio=-1)
    with a stand-in reward (tests/exgrpo_stand_in_reward.py: about half the samples pass). Step 1 records; step 2
    replays buffered prompts as off-policy rows (one per replayed group) and the loss weighs them; the checkpoint's
    mix_state.pt holds the buffer: trajectories with their recorded log-probs, one per token; a run resumed
    from it replays at its first step (step 3). On V1 the replayed rows' ``behaviour_log_prob`` reaches the worker
    loss as a TransferQueue field (mix_src/trainer/rollout_policy_v1.py), which ``off_ratio_mean`` measures."""
    compare = yaml.safe_load((ROOT / "recipes" / "exgrpo" / "compare.yaml").read_text())
    reward = [f"reward.custom_reward_function.path={Path(__file__).parent / 'exgrpo_stand_in_reward.py'}",
              "reward.custom_reward_function.name=compute_score"]
    ckpt = tmp_path / "ckpt"
    overrides = MIX_CPU + tiny_overrides(tiny_assets, steps=2, n=N, batch_size=4, response_length=16,
                                         reward=reward) + [
        f"mix.plugins=[{','.join(str(ROOT / p) for p in compare['plugins'])}]", *compare["overrides"],
        "++mix.plugin_options.exgrpo.start_solved_ratio=-1", "trainer.save_freq=2",
        f"trainer.default_local_dir={ckpt}", *BASES[base],
    ]  # fmt: skip
    result = run_verl("mix_src.main_mix_ppo", overrides, tmp_path, timeout=420)
    assert [m["step"] for m in result.metrics] == [1, 2], result.log_tail()
    assert result.metrics[0]["batch/off_policy_rows"] == 0  # step 1: nothing buffered yet, all on-policy
    replayed = result.metrics[1]["batch/off_policy_rows"]
    assert 1 <= replayed <= 2  # step 2: int(4 prompts * 0.5) groups at most, one replayed row each
    assert np.isfinite(result.metrics[1]["actor/off_ratio_mean"]) and result.metrics[1]["actor/off_ratio_mean"] > 0
    # the replayed tokens are weighed by w = exp(l - l_recorded) ~ 1, f = w / (w + 0.1) ~ 0.91 (0.9105 on both bases,
    # commit 1e10684), not by LUFFY's w = p ~ off_policy_prob ~ 0.01 (f ~ 0.09): the recorded log-probs arrived
    assert result.metrics[1]["actor/off_ratio_mean"] > 0.5 > 10 * result.metrics[1]["actor/off_policy_prob"]
    if base == "legacy":  # trajectory_metric=entropy: the actor scored the stored candidates (two+ per prompt here)
        assert "[exgrpo] step 2: scored" in result.log_path.read_text(errors="replace"), result.log_tail()
    state = torch.load(ckpt / "global_step_2" / "mix_state.pt", weights_only=False)
    buf = state["rollout_policy"]["exgrpo"]
    assert buf["mixed"] and len(buf["pool"]) >= 1
    if base == "legacy":  # retire_from_data: every retired prompt is listed for the data by its messages
        from mix_src.trainer.stages import DATA_DROP

        drop = state["rollout_policy"].get(DATA_DROP, {"keys": set()})
        assert len(drop["keys"]) == len(buf["retired"]), (len(drop["keys"]), len(buf["retired"]))
    for key, entry in buf["pool"].items():
        assert 1 <= buf["bucket"][key] <= N - 1 and entry["trajs"]
        for t in entry["trajs"]:
            assert t["ids"].shape == t["log_prob"].shape and (t["log_prob"] <= 0).all()
    # resume from the step-2 checkpoint for one more step: the restored buffer replays at once (an empty one
    # could not: nothing is buffered before a step's rollouts are recorded)
    resumed = [o for o in overrides if not o.startswith("trainer.total_training_steps=")]
    result = run_verl("mix_src.main_mix_ppo", [*resumed, "trainer.total_training_steps=3", "trainer.resume_mode=auto"],
                      tmp_path, timeout=420, name="resume")
    assert [m["step"] for m in result.metrics] == [3], result.log_tail()
    assert result.metrics[0]["batch/off_policy_rows"] >= 1


# ---- the rollout policy on a fake generator (no Ray) -------------------------------------------------------
class _Tok:
    eos_token_id = 1

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def _fake_ctx(step, state, prompt_ids, solved_fn, mix, n=N, L=6, P=3, entropy=None):
    """A RolloutContext whose generate makes rows like the trainer's: prompts (P, 3) prompt ids, responses of
    random ids ending in EOS (on-policy) or the target's ids + EOS (ratio 1.0), rollout_log_probs, acc."""
    from verl import DataProto

    from mix_src.trainer.rollout_policy import RolloutContext

    g = torch.Generator().manual_seed(step)
    raw_prompt = np.empty(len(prompt_ids) * n, dtype=object)  # chat messages: only the trainer's records carry them
    pid = np.repeat(np.arange(len(prompt_ids)), n)
    raw_prompt[:] = [[{"role": "user", "content": f"question {int(p)}"}] for p in pid]
    batch = DataProto.from_single_dict({"dummy_tensor": torch.zeros(len(prompt_ids) * n, 1),
                                        "pid": pid.astype(object), "raw_prompt": raw_prompt})

    def make(pids, ratios, targets):
        rows = len(pids)
        resp = torch.randint(2, 9, (rows, L), generator=g)
        rmask = torch.zeros(rows, L, dtype=torch.long)
        pmask = torch.zeros(rows, L, dtype=torch.bool)
        for r in range(rows):
            if ratios[r] == 1.0:
                ids = [int(x) for x in targets[r].split()] + [1]
                resp[r, : len(ids)] = torch.tensor(ids)
                rmask[r, : len(ids)] = 1
                pmask[r, : len(ids)] = True
            else:
                k = int(torch.randint(2, L + 1, (1,), generator=g))
                resp[r, k - 1] = 1
                rmask[r, :k] = 1
        prompts = torch.tensor([[0, 10 + int(p), 20 + int(p)] for p in pids])
        acc = np.array([float(solved_fn(int(p), resp[r][rmask[r].bool()].tolist())) for r, p in enumerate(pids)])
        return DataProto.from_single_dict({
            "prompts": prompts, "responses": resp, "response_mask": rmask, "prefix_mask": pmask,
            "attention_mask": torch.cat([torch.ones(rows, 3, dtype=torch.long), rmask], -1),
            "rollout_log_probs": -torch.rand(rows, L, generator=g) * rmask,
            "pid": np.asarray(pids, dtype=object), "acc": acc, "prefix_ratio": np.asarray(ratios, dtype=float),
        })  # fmt: skip

    calls = []

    def generate(ratios, rows=None, targets=None, prompts=None):
        if prompts is not None:
            pids = list(prompts.non_tensor_batch["pid"])
        else:
            idx = np.arange(len(batch)) if rows is None else np.asarray(rows)
            pids = list(batch.non_tensor_batch["pid"][idx])
        calls.append((pids, np.asarray(ratios), targets))
        return make(pids, list(ratios), targets)

    def records(rows):
        return batch[np.asarray(rows)]

    ctx = RolloutContext(batch=batch, n=n, global_step=step, mix=mix, generate=generate, prefix_ratios=None,
                         rng=np.random.default_rng(step), records=records, state=state, tokenizer=_Tok(),
                         entropy=entropy)
    return ctx, calls


def test_rollout_policy_records_replays_and_survives_a_pickle():
    """Step 1 (mixed from the start) records the solved samples of groups with 0 < k < n; the state survives a
    pickle round trip (as in mix_state.pt); step 2 replaces int(3 * 0.5) = 1 group by a buffered prompt whose
    row 0 is the stored trajectory (target = its ids), with behaviour_log_prob = the recorded log-probs on
    exactly its tokens; a prompt solved n/n is retired."""
    import pickle

    mix = mix_config_from_dict({"rollout_policy": "exgrpo", "loss": {"off_policy_behaviour": "stored_log_prob"},
                                "plugin_options": {"exgrpo": {"start_solved_ratio": -1,
                                                              "trajectory_metric": "recorded_nll"}}})
    # prompt 0: samples of even length pass (mixed groups); prompt 1: never; prompt 2: always (retired)
    solved_fn = lambda p, ids: (len(ids) % 2 == 0) if p == 0 else (p == 2)  # noqa: E731
    state: dict = {}
    ctx, calls = _fake_ctx(1, state, [0, 1, 2], solved_fn, mix)
    out1 = ROLLOUT(ctx)
    assert len(out1) == 3 * N and not out1.batch["prefix_mask"].any()
    buf = state["exgrpo"]
    ok0 = out1.non_tensor_batch["acc"][:N]
    if not 0 < ok0.sum() < N:
        pytest.skip("the fake draw gave no mixed group for prompt 0")
    assert len(buf["pool"]) == 1 and list(buf["bucket"].values()) == [int(ok0.sum())]
    (entry,) = buf["pool"].values()
    assert len(entry["trajs"]) == len({tuple(out1.batch["responses"][j][out1.batch["response_mask"][j].bool()].tolist())
                                        for j in range(N) if ok0[j]})
    assert len(buf["retired"]) == 1  # prompt 2
    state = pickle.loads(pickle.dumps(state))
    ctx, calls = _fake_ctx(2, state, [1, 2, 1], solved_fn, mix)
    out2 = ROLLOUT(ctx)
    assert len(out2) == 3 * N and [len(c[0]) for c in calls] == [2 * N, N]
    assert list(out2.non_tensor_batch["pid"][2 * N:]) == [0] * N  # the replayed prompt took the last group
    assert calls[1][1].tolist() == [1.0] + [0.0] * (N - 1)
    traj = min(entry["trajs"], key=lambda t: t["metric"])  # argmin of the mean NLL
    row = 2 * N
    pm = out2.batch["prefix_mask"][row]
    assert out2.batch["responses"][row][pm].tolist() == traj["ids"].tolist()
    beh = out2.batch[BEHAVIOUR_LOG_PROB]
    torch.testing.assert_close(beh[row][pm], traj["log_prob"])
    assert (beh[~out2.batch["prefix_mask"]] == 0).all()


ROLLOUT = __import__("mix_src.trainer.rollout_policy", fromlist=["ROLLOUT_POLICIES"]).ROLLOUT_POLICIES.get("exgrpo")


def test_rollout_policy_clips_the_warm_up():
    """The official trainer sets loss_remove_clip=False until the run is mixed (mix_trainer_experience.py:429-436),
    then the script's True: the policy's rows carry it as mix_loss_remove_clip (0 during the warm-up, the step that
    switches included; then mix.loss.loss_remove_clip), which the worker loss reads per row."""
    from mix_src.worker.loss import REMOVE_CLIP

    mix = mix_config_from_dict({"rollout_policy": "exgrpo", "loss": {"off_policy_behaviour": "stored_log_prob",
                                                                     "loss_remove_clip": True}})  # fmt: skip
    state: dict = {}
    ctx, _ = _fake_ctx(1, state, [0, 1, 2], lambda p, ids: False, mix)  # nothing solved: still warming up
    assert ROLLOUT(ctx).batch[REMOVE_CLIP].tolist() == [0.0] * 3 * N
    ctx, _ = _fake_ctx(2, state, [0, 1, 2], lambda p, ids: True, mix)  # all solved: this step switches
    assert ROLLOUT(ctx).batch[REMOVE_CLIP].tolist() == [0.0] * 3 * N and state["exgrpo"]["mixed"]
    ctx, _ = _fake_ctx(3, state, [0, 1, 2], lambda p, ids: True, mix)
    assert ROLLOUT(ctx).batch[REMOVE_CLIP].tolist() == [1.0] * 3 * N


def _fake_entropy(rows):
    """Per-token entropies of scored rows, a function of the tokens (so the choice depends on the trajectory)."""
    return torch.sin(rows.batch["responses"].float() * 1.7 + torch.arange(rows.batch["responses"].shape[-1])) + 1.5


def test_rollout_policy_replays_the_lowest_current_entropy_trajectory():
    """trajectory_metric=entropy (the default, official exp_metric=ent): the drawn prompt's stored trajectories
    are turned into ratio-1.0 rows by one extra generate pass and scored by ctx.entropy; the replayed one is the
    official select_best_experiences over the official metric with the padding mask fixed (its own tokens)."""
    mix = mix_config_from_dict({"rollout_policy": "exgrpo", "loss": {"off_policy_behaviour": "stored_log_prob"},
                                "plugin_options": {"exgrpo": {"start_solved_ratio": -1}}})
    solved_fn = lambda p, ids: p == 0 and len(ids) >= 3  # noqa: E731
    state: dict = {}
    for step in range(1, 40):  # a step whose prompt 0 records >= 2 trajectories that differ in entropy
        state = {}
        ctx, _ = _fake_ctx(step, state, [0, 1, 1], solved_fn, mix, entropy=_fake_entropy)
        ex_out = ROLLOUT(ctx)
        pool = state["exgrpo"]["pool"]
        if pool and len(next(iter(pool.values()))["trajs"]) >= 2:
            break
    else:
        pytest.skip("the fake draws gave no prompt with two trajectories")
    (entry,) = pool.values()
    trajs = entry["trajs"]
    scored = []
    ctx, calls = _fake_ctx(100, state, [1, 1, 1], solved_fn, mix, entropy=lambda rows: scored.append(rows) or
                           _fake_entropy(rows))
    out = ROLLOUT(ctx)
    assert [len(c[0]) for c in calls] == [2 * N, len(trajs), N]  # kept prompts, the candidates, the replay
    assert calls[1][1].tolist() == [1.0] * len(trajs) and len(scored) == 1
    rows = scored[0]
    pad = -1
    responses = torch.where(rows.batch["response_mask"].bool(), rows.batch["responses"], torch.tensor(pad))
    metrics = official_entropy_metrics(_fake_entropy(rows), responses, pad, len(rows), fixed=True)
    best = official_select_best([0], {0: (0, len(trajs))}, metrics, "argmin")[0]
    pm = out.batch["prefix_mask"][2 * N]
    assert out.batch["responses"][2 * N][pm].tolist() == trajs[best]["ids"].tolist()
    assert ex_out is not None


def test_warm_up_retires_prompts_solved_by_every_sample():
    """Official fit (mix_trainer_experience.py:370-388) adds a prompt solved n/n to skip_uid_set on every step,
    the warm-up included: such a prompt is never recorded once the run is mixed."""
    mix = mix_config_from_dict({"rollout_policy": "exgrpo", "loss": {"off_policy_behaviour": "stored_log_prob"}})
    state: dict = {}
    ctx, _ = _fake_ctx(1, state, [0, 1, 2], lambda p, ids: p == 0, mix)  # warm-up: 1/3 solved <= 0.35
    ROLLOUT(ctx)
    buf = state["exgrpo"]
    assert not buf["mixed"] and len(buf["retired"]) == 1
    ctx, _ = _fake_ctx(2, state, [0, 1, 2], lambda p, ids: p in (0, 1), mix)  # 2/3 solved: switches
    ROLLOUT(ctx)
    assert buf["mixed"] and len(buf["retired"]) == 2
    ctx, _ = _fake_ctx(3, state, [0, 1, 2], lambda p, ids: len(ids) % 2 == 0, mix)  # mixed groups everywhere
    ROLLOUT(ctx)
    assert not set(buf["pool"]) & buf["retired"]  # the retired prompts 0 and 1 recorded nothing
    # ... and they leave the data at the next epoch start (retire_from_data, official): keyed by their messages,
    # left out while more than one batch + 20 prompts remain
    from mix_src.trainer.stages import DATA_DROP, prompt_data_key

    assert state[DATA_DROP] == {"keys": {prompt_data_key([{"role": "user", "content": f"question {p}"}]) for p in (0, 1)},
                                "min_left": 3 + 20}  # fmt: skip
    off = mix_config_from_dict({"rollout_policy": "exgrpo", "loss": {"off_policy_behaviour": "stored_log_prob"},
                                "plugin_options": {"exgrpo": {"retire_from_data": False}}})
    state = {}
    ROLLOUT(_fake_ctx(1, state, [0, 1, 2], lambda p, ids: p == 0, off)[0])
    assert len(state["exgrpo"]["retired"]) == 1 and DATA_DROP not in state


# ---- retired prompts leave the data at each epoch start (no Ray) ---------------------------------------------


class OfficialExperienceData:
    """Transcription of the official data side (LUFFY repo 01f4ae0, ExGRPO/exgrpo/verl/verl/mix_src/
    experience/rl_dataset_with_experience.py:31-48 RLHFDatasetWithTargetExperience: skip_uid_set, valid_indices,
    set_skip_uid_set, __len__) and of the epoch loop's gate (mix_trainer_experience.py:245-250)."""

    def __init__(self, uids):
        self.uids = list(uids)
        self.skip_uid_set = set()
        self.valid_indices = list(range(len(self.uids)))

    def set_skip_uid_set(self):
        self.valid_indices = [i for i in range(len(self.uids)) if self.uids[i] not in self.skip_uid_set]

    def __len__(self):
        return len(self.valid_indices)

    def start_epoch(self, train_batch_size):
        BATCH_TOLERANCE = 20
        if len(self) > train_batch_size + BATCH_TOLERANCE:
            self.set_skip_uid_set()


def _question_dataset(tmp_path, tokenizer_path, rows=30):
    import pandas as pd
    from transformers import AutoTokenizer

    from mix_src.trainer.dataset import RLHFDatasetWithTarget

    path = tmp_path / "q.parquet"
    pd.DataFrame([{"data_source": "t", "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
                   "reward_model": {"style": "rule", "ground_truth": str(i)}, "target": f"{i}",
                   "extra_info": {"split": "train", "index": i}} for i in range(rows)]).to_parquet(path)  # fmt: skip
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 256, "filter_overlong_prompts": False,
                            "cache_dir": str(tmp_path / "cache"), "mix": {"n_prefix": 1}})  # fmt: skip
    return RLHFDatasetWithTarget(str(path), AutoTokenizer.from_pretrained(tokenizer_path), cfg)


class _Loader:  # what start_data_epoch reads of torchdata's StatefulDataLoader
    def __init__(self, next_iter_state=None):
        self.next_iter_state = next_iter_state


def test_retired_prompts_leave_the_data_as_the_official_epoch_loop(tmp_path, tiny_assets):
    """mix_src.trainer.stages.start_data_epoch on RLHFDatasetWithTarget against the official epoch gate + set_skip_uid_set
    over 4 epochs of a growing retired set (batch 4, 30 prompts: dropped while > 24 are left, then frozen); a run
    resumed mid-epoch (the loader holds a loaded state) re-applies the epoch's recorded choice even though more
    prompts were retired since; a batch row's raw_prompt gives the same key as the data row."""
    import pickle

    from mix_src.trainer.stages import DATA_DROP, DATA_EPOCH, prompt_data_key, start_data_epoch

    ds = _question_dataset(tmp_path, tiny_assets["tokenizer"])
    official = OfficialExperienceData(range(30))
    state: dict = {}
    assert start_data_epoch(_Loader(), ds, state) is None and len(ds) == 30  # no policy retires: untouched
    batch = 4
    for epoch, retire in enumerate([[3, 7, 11], [0, 1, 2, 4], [5, 6], [8]]):
        for i in retire:  # retired during the previous epoch
            official.skip_uid_set.add(i)
            drop = state.setdefault(DATA_DROP, {"keys": set(), "min_left": batch + 20})
            drop["keys"].add(prompt_data_key(ds.dataframe[i]["prompt"]))
        official.start_epoch(batch)
        start_data_epoch(_Loader(), ds, state)
        ours = [ds[j]["raw_prompt"][0]["content"] for j in range(len(ds))]
        assert ours == [f"q{i}" for i in official.valid_indices], epoch
    assert len(ds) == 23  # 30 - 7: epoch 3 and 4 found 23 <= 24 left and kept epoch 2's data
    assert prompt_data_key(ds[0]["raw_prompt"]) == prompt_data_key(ds.dataframe[ds._rows[0]]["prompt"])
    state = pickle.loads(pickle.dumps(state))  # as mix_state.pt
    state[DATA_DROP]["keys"] = set()  # a fresh epoch would now bring every prompt back ...
    start_data_epoch(_Loader(next_iter_state={"resumed": True}), ds, state)  # ... a resumed one keeps its data
    assert len(ds) == 23 and len(state[DATA_EPOCH]) == 7
    official.skip_uid_set = set()
    official.start_epoch(batch)  # the gate holds (23 <= 24 left): the official data keeps its 23 rows too
    start_data_epoch(_Loader(), ds, state)
    assert len(ds) == len(official) == 23


def test_both_trainer_bases_drop_retired_prompts_at_each_new_pass(tmp_path, tiny_assets):
    """The epoch stage runs where each base starts a pass over the data: the legacy _train_batches and the V1
    _fetch_one_gen_batch (verl's own method under the mixin, with verl's StatefulDataLoader): prompts retired
    during epoch 1 are absent from epoch 2, whose length shrinks accordingly."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.utils.dataset.rl_dataset import collate_fn

    from mix_src.trainer.legacy import MIXRayPPOTrainer
    from mix_src.trainer.v1 import MixPPOTrainerSync
    from mix_src.trainer.stages import DATA_DROP, prompt_data_key

    rows, batch, retired = 40, 4, [2, 5, 9, 30]

    def loader(ds):
        return StatefulDataLoader(ds, batch_size=batch, drop_last=True, collate_fn=collate_fn, shuffle=False)

    def retire(state, ds):
        state[DATA_DROP] = {"keys": {prompt_data_key(ds.dataframe[i]["prompt"]) for i in retired},
                            "min_left": batch + 20}  # fmt: skip

    def prompts(batches):
        return [m[0]["content"] for b in batches for m in b["raw_prompt"]]

    legacy = object.__new__(MIXRayPPOTrainer)
    legacy.train_dataset = _question_dataset(tmp_path, tiny_assets["tokenizer"], rows)
    legacy.train_dataloader, legacy._epoch = loader(legacy.train_dataset), 0
    legacy.config = OmegaConf.create({"trainer": {"total_epochs": 2}})
    it = legacy._train_batches()
    first = [next(it) for _ in range(rows // batch)]
    retire(legacy._policy_state(), legacy.train_dataset)
    second = list(it)
    assert prompts(first) == [f"q{i}" for i in range(rows)]
    assert prompts(second) == [f"q{i}" for i in range(rows) if i not in retired]

    v1 = object.__new__(MixPPOTrainerSync)  # MixV1Mixin on verl's PPOTrainerSync
    v1.train_dataset = _question_dataset(tmp_path, tiny_assets["tokenizer"], rows)
    v1.train_dataloader, v1.train_dataloader_it, v1._rollout_state = loader(v1.train_dataset), None, {}
    first = [v1._fetch_one_gen_batch() for _ in range(rows // batch)]
    retire(v1._policy_state(), v1.train_dataset)
    second = [v1._fetch_one_gen_batch() for _ in range((rows - len(retired)) // batch)]
    assert prompts([{"raw_prompt": list(b["raw_prompt"])} for b in first]) == [f"q{i}" for i in range(rows)]
    assert prompts([{"raw_prompt": list(b["raw_prompt"])} for b in second]) == [
        f"q{i}" for i in range(rows) if i not in retired]
    assert v1._fetch_one_gen_batch() is not None and len(v1.train_dataset) == rows - len(retired)
