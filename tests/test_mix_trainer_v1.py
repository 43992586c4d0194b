"""LUFFY on verl's V1 trainer (``trainer.use_v1=true``, mix_src/trainer/v1.py) on the CPU backend.

The end-to-end runs (marked ``ray``) are ``python -m mix_src.main_mix_ppo +backend=cpu trainer.use_v1=true ...``
in their own process tree and Ray cluster (tests/e2e.py), with verl's TransferQueue; about a minute each.
The refusals run on the driver before Ray starts.
"""

from __future__ import annotations

import dataclasses

import math
from pathlib import Path

import numpy as np
import pytest
import ray
from hydra import compose, initialize_config_module
from test_dataset_agent_loop import TARGET, RecordingServer, _agent_loop, _run, tokenizer  # noqa: F401 (fixture)

import composed
from e2e import MIX_CPU, batch_result, batch_run, run_verl, tiny_overrides
from mix_src.config.mix_config import MixConfigError

MIX = "mix_src.main_mix_ppo"
GUIDE_ON_FAILURE = Path(__file__).resolve().parents[1] / "recipes/guide_on_failure/guide_on_failure.py"
CHORD = Path(__file__).resolve().parents[1] / "recipes/chord/chord.py"
LUFFY = ["mix.n_prefix=1", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0", "algorithm.adv_estimator=grpo_split"]


def v1_overrides(tiny_assets, mode, *extra, steps=2) -> list[str]:
    overrides = MIX_CPU + tiny_overrides(tiny_assets, steps=steps, n=4, batch_size=4, response_length=24)
    return overrides + ["trainer.use_v1=true", f"trainer.v1.trainer_mode={mode}", *extra]


def v1_run(tiny_assets, tmp_path, mode, *extra, steps=2, name="run", timeout=420):
    return run_verl(MIX, v1_overrides(tiny_assets, mode, *extra, steps=steps), tmp_path, timeout=timeout, name=name)


def assert_luffy_step(m: dict) -> None:
    """One trained step: one full expert row per prompt, graded correct, with a non-zero loss on its tokens."""
    assert m["batch/avg_prefix_ratio"] == pytest.approx(0.25)  # 1 of 4 rows at ratio 1.0
    assert m["batch/off_policy_rows"] == 4  # one per prompt
    assert 0 < m["batch/prefix_token_frac"] < 1
    assert m["batch/off_solved"] == 1.0  # the expert solutions are graded correct
    for key in ("actor/off_policy_prob", "actor/on_policy_prob", "actor/off_pg_loss", "actor/grad_norm"):
        assert key in m and math.isfinite(m[key]), key
    assert 0.0 < m["actor/off_policy_prob"] < 1.0  # the shaped term saw the prefix tokens
    assert m["actor/off_pg_loss"] != 0.0  # loss on prefix tokens
    assert m["actor/grad_norm"] > 0


KEEP_ALL = """
import numpy as np
from mix_src.algo.filter_groups import register_group_filter

@register_group_filter("keep_all")
def keep_all(stats):
    return np.ones(len(stats.count), dtype=bool)
"""


@pytest.mark.ray
def test_v1_sync_group_filter_registry_and_a_two_pass_rollout_policy(tiny_assets, tmp_path):
    """Sync mode, 2 steps, filter groups on, the group-filter registry deciding what verl's replay buffer evicts,
    and the two-pass rollout policy ``guide_on_failure`` (recipes/guide_on_failure) generating the groups.

    Half the rows keep their target (mix.data.sample_target_ratio=0.5): a group without one has only failing
    on-policy rows (acc std 0), which verl's own rule (and ``nonzero_std``) evicts. With ``mix.filter_groups.rule``
    set to a plugin rule that keeps every group, nothing is evicted and those groups train.
    guide_on_failure (mix_src/trainer/rollout_policy_v1.py on V1): pass 1 generates all 16 rows on-policy; for each prompt
    with a target whose 4 samples all failed, sample 0 is generated again from the whole target (n_prefix=1,
    ratio 1.0) and replaces the failed one; so every row of pass 2 is a trained expert row.
    (The resume of a V1 run is checked in tests/test_bases_equivalence.py.)
    """
    plugin = tmp_path / "keep_all.py"
    plugin.write_text(KEEP_ALL)
    common = [*LUFFY, "mix.data.sample_target_ratio=0.5", "algorithm.filter_groups.enable=true",
              "algorithm.filter_groups.metric=acc", f"mix.plugins=[{plugin},{GUIDE_ON_FAILURE}]",
              "mix.filter_groups.rule=keep_all", "mix.rollout_policy=guide_on_failure"]  # fmt: skip
    first = v1_run(tiny_assets, tmp_path / "first", "sync", *common, steps=2)
    assert [m["step"] for m in first.metrics] == [1, 2]
    assert sum(m.get("training/filter_groups/evicted_samples", 0) for m in first.metrics) == 0
    assert sum(m["batch/off_policy_rows"] for m in first.metrics) < 8  # groups without a target were trained
    for m in first.metrics:
        assert m["actor/off_pg_loss"] != 0.0 and m["actor/grad_norm"] > 0
        # two passes; the second regenerated exactly the rows that train as expert rows (one per failed prompt)
        assert m["rollout_policy/passes"] == 2
        assert m["rollout_policy/rows_generated"] == 16 + m["batch/off_policy_rows"]
        assert m["batch/off_solved"] == 1.0 and m["batch/avg_prefix_ratio"] == m["batch/off_policy_rows"] / 16


CARRY_OVER_CKPT = "carry_over_ckpt"  # in the V1 batch's directory


def carry_over_run(assets, batch_dir) -> list[str]:
    return v1_overrides(assets, "sync", *LUFFY, "mix.data.sample_target_ratio=0.5", "algorithm.filter_groups.enable=true",
                        "algorithm.filter_groups.metric=acc", "data.gen_batch_size=1",
                        "algorithm.filter_groups.max_inflight_gen_batches=2", "algorithm.filter_groups.max_num_gen_batches=40",
                        "mix.filter_groups.carry_over=true", "trainer.save_freq=2",
                        f"trainer.default_local_dir={batch_dir / CARRY_OVER_CKPT}")  # fmt: skip


# two runs that need no process of their own share the V1 batch's (tests/conftest.py ``v1_batch``)
CARRY_OVER = batch_run("v1", "carry_over", carry_over_run,
                       ["test_mix_trainer_v1.py::test_v1_sync_filter_groups_carry_over_and_generation_budget"])
COLOCATE_ASYNC = batch_run("v1", "colocate_async_luffy", lambda assets, _: v1_overrides(assets, "colocate_async", *LUFFY),
                           ["test_mix_trainer_v1.py::test_v1_colocate_async_luffy"])  # fmt: skip


def test_v1_sync_filter_groups_carry_over_and_generation_budget(v1_batch):
    """Sync mode, 2 steps, verl's own group filter with mix_src's carry_over and a per-step generation budget
    (MixV1Mixin._build_replay_buffer). Half the prompts have no target: their groups (all failing) are evicted and
    verl's buffer refills two prompts per eviction, one prompt per generation batch (data.gen_batch_size=1), up to 8
    in flight, so it overshoots; the surplus kept groups verl's sync sample would discard are carried into step 2,
    which trains them first. The carried groups are saved with the step-2 checkpoint (TransferQueue's own
    checkpoint). (A budget of 12 batches ran out in step 1 of one such run, raising FilterGroupsExhausted; the
    unit test above checks that path.)"""
    result = batch_result(v1_batch, CARRY_OVER)
    step1, step2 = result.metrics
    for m in result.metrics:
        assert 4 <= m["train/num_gen_batches"] <= 40  # within the budget of 40 one-prompt batches
    assert sum(m.get("training/filter_groups/evicted_samples", 0) for m in result.metrics) > 0
    assert step1.get("train/num_surplus_carried", 0) > 0
    assert step2["train/num_carried_prompts"] == min(step1["train/num_surplus_carried"], 4)
    assert not any("training/filter_groups/discarded_surplus_samples" in m for m in result.metrics)  # carried instead
    assert (result.log_path.parent / CARRY_OVER_CKPT / "global_step_2" / "transfer_queue").exists()  # the batch's dir


def test_v1_colocate_async_luffy(v1_batch):
    result = batch_result(v1_batch, COLOCATE_ASYNC)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert_luffy_step(m)
        assert "training/off_policy/trajectory_staleness/mean" in m


@pytest.mark.ray
def test_v1_colocate_async_chord_stops_at_the_flops_budget(tiny_assets, tmp_path):
    """colocate_async, LUFFY's expert rows trained by CHORD (mix.loss.combine=chord, recipes/chord) and a FLOPs
    budget that the first step reaches, of 3 steps: the run stops after step 1 and saves it (save_freq 5 would not
    have), with the FLOPs in the checkpoint's mix_state.pt. CHORD's loss runs only with the per-population counts
    and the global step that MixV1Mixin._add_update_inputs writes to TransferQueue (else a KeyError in the worker):
    its mu is the schedule's at step 1 (warm-up over 4 steps)."""
    import torch

    from mix_src.algo.flops import COUNTS
    from mix_src.extend import load_plugins

    mu_schedule = __import__(load_plugins([str(CHORD)])[0]).mu_schedule

    ckpt = tmp_path / "ckpt"
    chord = [f"mix.plugins=[{CHORD}]", "mix.loss.combine=chord", "mix.loss.loss_agg_mode=token-mean",
             "+mix.loss.combine_args={mu_warmup_steps:4,mu_peak:0.5}", "actor_rollout_ref.actor.entropy_coeff=0.0"]
    result = v1_run(tiny_assets, tmp_path, "colocate_async", *LUFFY, *chord, "mix.flops_budget=1", "trainer.save_freq=5",
                    f"trainer.default_local_dir={ckpt}", steps=3)  # fmt: skip
    assert [m["step"] for m in result.metrics] == [1]
    m = result.metrics[0]
    assert m["batch/off_policy_rows"] == 4 and m["batch/off_solved"] == 1.0
    assert m["actor/chord_mu"] == pytest.approx(mu_schedule(1, 4, 0, 0.5, 0.1)) and 0 < m["actor/chord_mu"] < 0.5
    assert m["actor/chord_sft_loss"] > 0 and 0 < m["actor/chord_phi_mean"] <= 0.25 and m["actor/grad_norm"] > 0
    for c in COUNTS:
        assert m[f"flops/total_{c}"] == m[f"flops/step_{c}"] > m[f"flops/rollout_{c}"] > 0
    assert "mix.flops_budget=1 reached at step 1" in result.log_tail(200000)
    state = torch.load(ckpt / "global_step_1" / "mix_state.pt", weights_only=False)
    assert state["flops"] == {c: m[f"flops/total_{c}"] for c in COUNTS}


SEPARATE_ASYNC_CPU = [
    "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo",  # mix_src/cpu/checkpoint_engine.py
    "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",  # the standalone pool
    "ray_kwargs.ray_init.num_gpus=2",  # fake Ray GPUs: the trainer's one and the pool's one
    "trainer.v1.separate_async.parameter_sync_step=1",  # = train_batch_size / ppo_mini_batch_size
]


@pytest.mark.ray
def test_v1_separate_async_luffy_weights_reach_the_standalone_pool(tiny_assets, tmp_path):
    """separate_async on CPU, 2 LUFFY steps: the standalone rollout pool (an hf server behind verl's
    CheckpointEngineWorker) gets the actor's weights through the cpu_gloo checkpoint engine after each step.

    ``hybrid_engine=false``: every rollout comes from that pool. ``num_warmup_batches=0``: step 2's prompts are
    generated after step 1's weight sync. So step 2's rows carry weight version 1 (staleness 0: the server reports
    the version it received with the weights), and their rollout log-probs equal the updated actor's old log-probs
    to float noise; had the pool kept the initial weights they would differ by the step-1 update (6e-4 measured,
    the stale rows of a run with one warm-up batch; 9e-4 in a control run whose server skipped loading them).
    The groups come from the two-pass rollout policy ``guide_on_failure`` (mix_src/trainer/rollout_policy_v1.py): its passes
    go to the standalone pool like verl's own single pass, and each prompt whose 4 on-policy samples all failed
    (every prompt: the tiny model never solves one) gets its expert row from the second pass."""
    result = v1_run(tiny_assets, tmp_path, "separate_async", *LUFFY, *SEPARATE_ASYNC_CPU,
                    "actor_rollout_ref.hybrid_engine=false", "trainer.v1.separate_async.num_warmup_batches=0",
                    f"mix.plugins=[{GUIDE_ON_FAILURE}]", "mix.rollout_policy=guide_on_failure", steps=2)  # fmt: skip
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert_luffy_step(m)
        # the sync at the end of each step: one rollout rank acknowledged every tensor the actor sent
        assert m["checkpoint_engine/receivers"] == 1
        assert m["checkpoint_engine/tensors"] > 0 and m["checkpoint_engine/payload_mbytes"] > 0
        assert m["training/off_policy/trajectory_staleness/max"] == 0  # rows sampled from the latest weights
        assert m["training/rollout_probs_diff_max"] < 1e-5  # ... which are the actor's, loaded in the pool
        assert m["rollout_policy/passes"] == 2 and m["rollout_policy/rows_generated"] == 16 + 4
    assert result.metrics[0]["actor/grad_norm"] > 0  # step 1 moved the weights that step 2 samples from


# ---------------------------------------------------------------------------------------------------
# on the driver, before Ray: what V1 cannot honour is refused, naming the key and why


def compose_v1(tiny_assets, *overrides):
    return composed.compose_mix([*MIX_CPU, *tiny_overrides(tiny_assets), "trainer.use_v1=true", *overrides])


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["trainer.v1.trainer_mode=fully_async"], r"trainer\.v1\.trainer_mode='fully_async': use one of sync, colocate_async"),
        (["trainer.v1.trainer_mode=colocate_async", "algorithm.filter_groups.enable=true",
          "algorithm.filter_groups.max_num_gen_batches=10"],
         r"max_num_gen_batches=10 is not supported on trainer\.use_v1=true: in the async modes no step has generation "
         r"batches of its own .*wait_for_sampleable"),
        (["mix.n_prefix=1", "algorithm.rollout_correction.bypass_mode=true"], r"rollout_correction\.bypass_mode=true replaces"),
        (["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=1",
          "actor_rollout_ref.rollout.nnodes=1"],
         r"checkpoint_engine\.backend=naive: on the CPU backend separate_async .*set it to cpu_gloo"),
    ],
)  # fmt: skip
def test_v1_refusals_before_ray(tiny_assets, overrides, pattern):
    from mix_src.main_mix_ppo import run_mix_ppo

    with pytest.raises(ValueError, match=pattern):  # MixConfigError, or a registry entry's EntryConfigError
        run_mix_ppo(compose_v1(tiny_assets, *overrides))
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
         r"checkpoint_engine\.backend=nccl: on the CPU backend separate_async .*set it to cpu_gloo"),
        (["ray_kwargs.ray_init.num_gpus=1"], r"ray_kwargs\.ray_init\.num_gpus=1: .* 2 in all, .*set it to 2"),
        (["trainer.v1.separate_async.parameter_sync_step=4"],
         r"data\.train_batch_size=4 must equal trainer\.v1\.separate_async\.parameter_sync_step \(4\) x .*\(4\)"),
        (["actor_rollout_ref.rollout.nnodes=0"], r"actor_rollout_ref\.rollout\.nnodes=0: separate_async runs a standalone"),
    ],
)  # fmt: skip
def test_separate_async_on_cpu_refusals_before_ray(tiny_assets, overrides, pattern):
    from mix_src.main_mix_ppo import config_stage

    config = compose_v1(tiny_assets, "trainer.v1.trainer_mode=separate_async", *LUFFY, *SEPARATE_ASYNC_CPU)
    config_stage(config)  # the test's own settings pass
    with pytest.raises(ValueError, match=pattern):
        config_stage(compose_v1(tiny_assets, "trainer.v1.trainer_mode=separate_async", *LUFFY, *SEPARATE_ASYNC_CPU,
                                *overrides))  # fmt: skip
    assert not ray.is_initialized()


@pytest.mark.parametrize("overrides", [
    ["mix.loss.all_max_clip=-1"],  # LUFFY's "off", translated by the mix: validation before the V1 checks
    ["mix.loss.all_max_clip=0.9"],  # kept-token counts written to TransferQueue before the update
    ["mix.loss.use_adaptive_entropy=true", "actor_rollout_ref.actor.entropy_coeff=0.01"],  # state in V1 checkpoints
    ["algorithm.filter_groups.enable=true", "mix.filter_groups.on_policy_only=true"],  # the replay buffer uses the registry
    ["algorithm.filter_groups.enable=true", "mix.filter_groups.rule=nonzero_std"],
    # sync: the step's generation budget and the carried groups are replay-buffer hooks (MixV1Mixin._build_replay_buffer)
    ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=10", "mix.filter_groups.carry_over=true"],
    # the async buffers keep the surplus for later steps themselves
    ["trainer.v1.trainer_mode=colocate_async", "algorithm.filter_groups.enable=true", "mix.filter_groups.carry_over=true"],
    # a rollout policy with several passes (mix_src/trainer/rollout_policy_v1.py)
    ["mix.plugins=[recipes/guide_on_failure/guide_on_failure.py]", "mix.rollout_policy=guide_on_failure"],
    ["trainer.v1.trainer_mode=colocate_async", "mix.plugins=[recipes/guide_on_failure/guide_on_failure.py]",
     "mix.rollout_policy=guide_on_failure"],
])  # fmt: skip
def test_v1_accepts_before_ray(tiny_assets, overrides):
    from mix_src.main_mix_ppo import config_stage

    config_stage(compose_v1(tiny_assets, *overrides))
    assert not ray.is_initialized()


# ---------------------------------------------------------------------------------------------------
# the agent loop under V1: one list of ratios per prompt, sample ``session_id`` takes its own


def test_agent_loop_takes_its_sessions_ratio_and_tags_no_call_rows(tokenizer):  # noqa: F811
    server = RecordingServer(tokenizer.convert_tokens_to_ids("7"))
    loop = _agent_loop(tokenizer, server)
    target_ids = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    ratios = [1.0, 0.5, 0.0]
    seeds = [11, 12, 13]
    outs = [_run(loop, target=TARGET, prefix_ratios=ratios, rollout_seeds=seeds, session_id=i, global_steps=3)
            for i in range(3)]  # fmt: skip
    assert [o.extra_fields["prefix_ratio"] for o in outs] == ratios
    assert [c["sampling_params"]["seed"] for c in server.calls] == [12, 13]  # each sample its own seed
    assert [int(o.extra_fields["prefix_token_mask"].sum()) for o in outs] == [len(target_ids), len(target_ids) // 2, 0]
    assert len(server.calls) == 2  # the whole-target row made no call
    # V1 casts every row's version tags to int: the no-call row carries the version the trainer held at dispatch
    assert outs[0].extra_fields["min_global_steps"] == outs[0].extra_fields["max_global_steps"] == 2


def test_v1_rows_draw_the_shared_seeded_ratios():
    """The V1 trainer attaches draw_prefix_ratios(seed, step, fetch index) per prompt; same inputs, same ratios."""
    from mix_src.config.mix_config import mix_config_from_dict
    from mix_src.trainer.stages import draw_prefix_ratios

    mix = mix_config_from_dict({"n_prefix": 2, "min_prefix_ratio": 0.3, "max_prefix_ratio": 0.7})
    kw = dict(seed=7, global_step=2, targets=[TARGET] * 8)
    a = draw_prefix_ratios(mix, 2, 4, gen_index=0, **kw)
    assert np.array_equal(a, draw_prefix_ratios(mix, 2, 4, gen_index=0, **kw))
    assert not np.array_equal(a, draw_prefix_ratios(mix, 2, 4, gen_index=1, **kw))
    per_prompt = a.reshape(2, 4)
    assert (per_prompt[:, 2:] == 0).all() and ((per_prompt[:, :2] >= 0.3) & (per_prompt[:, :2] <= 0.7)).all()


def test_separate_async_composes_for_a_gpu_config():
    """With a GPU-style config (nccl checkpoint engine) the LUFFY separate_async trainer builds (no Ray)."""
    from mix_src.trainer.v1 import MixPPOTrainerSeparateAsync, MixV1Mixin
    from verl.trainer.ppo.v1 import PPOTrainerSeparateAsync, get_trainer_cls

    with initialize_config_module(config_module="mix_src.config", version_base=None):
        cfg = compose(config_name="mix_ppo", overrides=[
            "trainer.use_v1=true", "trainer.v1.trainer_mode=separate_async", *LUFFY, "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ])  # fmt: skip
    assert get_trainer_cls("mix_separate_async") is MixPPOTrainerSeparateAsync
    trainer = MixPPOTrainerSeparateAsync(cfg)
    assert isinstance(trainer, MixV1Mixin) and isinstance(trainer, PPOTrainerSeparateAsync)
    assert trainer.mix.n_prefix == 1 and trainer.parameter_sync_step == 4  # 4 local updates of 2 prompts per step
    assert type(trainer.replay_buffer).__name__ == "ReplayBufferAsync"


# ---------------------------------------------------------------------------------------------------
# the recipes' V1 variant (recipes/README.md): every GPU recipe composes with trainer.use_v1=true


V1_EXTRAS = {  # the async modes: no per-step generation budget (sync runs the recipes as they are)
    "dapo_filter": ["algorithm.filter_groups.max_num_gen_batches=0"],
    "luffy_filter": ["algorithm.filter_groups.max_num_gen_batches=0"],
}


@pytest.mark.parametrize("name", ["luffy_zero", "on_policy_grpo", "rl_with_sft_loss", "sft_then_rl", "dapo_filter",
                                  "luffy_filter", "prefix_curriculum"])  # fmt: skip
@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_recipes_v1_variant(name, mode):
    from test_recipes import compose_recipe

    from mix_src.main_mix_ppo import check_v1_config
    from mix_src.config.mix_config import validate_mix_config

    v1 = ["trainer.use_v1=true", f"trainer.v1.trainer_mode={mode}"]
    extras = V1_EXTRAS.get(name, []) if mode != "sync" else []
    if extras:  # refused as is, naming the key
        with pytest.raises(MixConfigError, match=r"max_num_gen_batches=10 .*no step has generation batches"):
            refused = compose_recipe(name, v1)
            validate_mix_config(refused)
            check_v1_config(refused)
    cfg = compose_recipe(name, v1 + extras)
    validate_mix_config(cfg)
    check_v1_config(cfg)


def test_cpu_backend_shortens_the_replay_buffer_poll():
    """verl polls TransferQueue every 2 s (replay_buffer.py:144, not configurable); on the CPU backend 0.05 s."""
    import mix_src.cpu as cpu_backend
    from mix_src.cpu.worker_patches import CPU_POLL_INTERVAL_S
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    assert cpu_backend.is_active()
    kw = dict(trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop", sampler_kwargs={})
    assert ReplayBuffer(trainer_mode="sync", **kw).poll_interval == CPU_POLL_INTERVAL_S == 0.05
    assert ReplayBufferAsync(trainer_mode="colocate_async", **kw).poll_interval == CPU_POLL_INTERVAL_S
    assert ReplayBuffer(trainer_mode="sync", poll_interval=1.5, **kw).poll_interval == 1.5  # explicit value wins


def test_values_call_does_not_inherit_the_references_adapter_switch():
    """verl's V1 _compute_ref_log_prob leaves no_lora_adapter=True in batch.extra_info; the critic must not get it
    (its model has no adapter to disable: AttributeError in the LoRA + critic + reference run before the fix)."""
    from types import SimpleNamespace

    from mix_src.trainer.v1 import MixV1Mixin

    class VerlV1:
        def _compute_values(self, batch, metrics):
            self.critic_saw = dict(batch.extra_info)
            return batch

    trainer = object.__new__(type("T", (MixV1Mixin, VerlV1), {}))
    batch = SimpleNamespace(extra_info={"no_lora_adapter": True, "temperature": 1.0})
    trainer._compute_values(batch, {})
    assert trainer.critic_saw == {"temperature": 1.0}


# ---------------------------------------------------------------------------------------------------
# the group-filter registry in verl's V1 replay buffer: its ``_dapo_filtered_keys`` contract, with the rows'
# fields served by a stand-in for TransferQueue's kv_batch_get


class _Buffer:
    """The attributes of verl's ReplayBuffer that ``_dapo_filtered_keys`` reads (replay_buffer.py 261-315)."""

    def __init__(self, rows: dict, metric: str = "acc"):
        self.filter_groups_metric = metric
        self.partitions = {"train": list(rows)}
        self.finished_keys = {"train": {k.split("_")[0] for k in rows}}
        self._dapo_classification_cache = {"train": {}}


def _classify(monkeypatch, rows, rule="nonzero_std", on_policy_only=False):
    import types

    import mix_src.trainer.v1 as v1

    def kv_batch_get(keys, partition_id, select_fields):
        return {"extra_fields": [rows[k] for k in keys]}

    monkeypatch.setattr(v1.tq, "kv_batch_get", kv_batch_get)
    buffer = _Buffer(rows)
    return types.MethodType(v1.make_dapo_filtered_keys(rule, on_policy_only), buffer)("train")


def _row(acc, prefix=False):
    return {"reward_extra_info": {"acc": acc}, "prefix_token_mask": [1, 1, 0] if prefix else [0, 0, 0]}


ROWS = {  # group a: expert row solved, on-policy rows failed; group b: all failed; group c: mixed on-policy
    "a_0_0": _row(1.0, prefix=True), "a_1_0": _row(0.0), "a_2_0": _row(0.0),
    "b_0_0": _row(0.0), "b_1_0": _row(0.0), "b_2_0": _row(0.0),
    "c_0_0": _row(1.0), "c_1_0": _row(0.0), "c_2_0": _row(0.0),
}  # fmt: skip


def test_v1_replay_buffer_evicts_what_the_group_filter_registry_says(monkeypatch):
    evicted, counts = _classify(monkeypatch, ROWS)  # nonzero_std over every row: as verl's own rule
    assert evicted == {"b"} and counts == {0.0: 1}
    evicted, _ = _classify(monkeypatch, ROWS, on_policy_only=True)  # a's on-policy rows all failed: evicted too
    assert evicted == {"a", "b"}
    from mix_src.algo.filter_groups import GROUP_FILTERS

    from mix_src.extend import Entry

    monkeypatch.setitem(GROUP_FILTERS._entries, "keep_all_test",
                        Entry("keep_all_test", lambda stats: np.ones(len(stats.count), dtype=bool)))  # fmt: skip
    evicted, counts = _classify(monkeypatch, ROWS, rule="keep_all_test")
    assert evicted == set() and not counts


def test_v1_advantage_stage_runs_grpo_split_once_with_the_prefix_mask():
    """In V1's ``_compute_advantage`` LUFFY's advantages replace verl's estimator call: ``grpo_split`` runs once,
    with the rows' prefix mask (before, verl's stage ran it too, with an all-zero mask); other estimators: verl's."""
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto

    from mix_src.trainer import adv_estimators
    from mix_src.config.mix_config import mix_config_from_dict
    from mix_src.trainer.v1 import luffy_advantage_stage

    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    prefix = torch.zeros(4, 3, dtype=torch.bool)
    prefix[0] = True  # row 0: the expert row of group a
    uids = np.array(["a", "a", "b", "b"], dtype=object)

    def data():
        return DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": torch.ones(4, 3)},
                                   non_tensors={"uid": uids})  # fmt: skip

    verl_calls, split_calls = [], []
    entry = adv_estimators.ADV_ESTIMATORS._entries["grpo_split"]
    original = entry.fn

    def counting_split(*args, **kwargs):
        split_calls.append(args[3])
        return original(*args, **kwargs)

    def verl(d, **kwargs):
        verl_calls.append(kwargs)
        d.batch["advantages"], d.batch["returns"] = torch.ones(4, 3), torch.ones(4, 3)
        return d

    mix = mix_config_from_dict({})
    adv_estimators.ADV_ESTIMATORS._entries["grpo_split"] = dataclasses.replace(entry, fn=counting_split)
    try:
        out = luffy_advantage_stage(verl, prefix, OmegaConf.create({"adv_estimator": "grpo_split"}), mix)(data(), gamma=1.0)
    finally:
        adv_estimators.ADV_ESTIMATORS._entries["grpo_split"] = entry
    assert verl_calls == [] and len(split_calls) == 1 and torch.equal(split_calls[0], prefix)
    expected, _ = original(rewards, torch.ones(4, 3), torch.tensor([0, 0, 1, 1]), prefix, {})
    assert torch.equal(out.batch["advantages"], expected)
    out = luffy_advantage_stage(verl, prefix, OmegaConf.create({"adv_estimator": "grpo"}), mix)(data(), gamma=1.0)
    assert verl_calls == [{"gamma": 1.0}] and torch.equal(out.batch["advantages"], torch.ones(4, 3))


def test_v1_accepts_the_loss_extensions_whose_inputs_it_writes(tiny_assets):
    """A loss combination, a row loss and an off-policy behaviour (built in or a plugin's, declaring both bases)
    pass the V1 checks: MixV1Mixin._add_update_inputs writes the combination's counts and the SFT-token counts to
    TransferQueue before the update, and V1PolicyRunner carries a rollout policy's per-row tensors (sft_row,
    behaviour_log_prob) to the rows' fields. (Until then V1_REFUSALS refused all three.)"""
    from mix_src.algo.loss_combine import register_loss_combine
    from mix_src.main_mix_ppo import config_stage

    @register_loss_combine("test_both_bases_combine")
    def _combine(inputs, args):
        return inputs.rl_loss, {}

    for overrides in (["mix.loss.combine=test_both_bases_combine", "mix.n_prefix=1"], ["mix.loss.row_loss=sft_rows"],
                      ["mix.loss.off_policy_behaviour=stored_log_prob"], ["mix.flops_budget=1e12"]):
        config_stage(compose_v1(tiny_assets, *overrides))
    assert not ray.is_initialized()


def test_row_loss_with_shuffled_mini_batches_is_refused(tiny_assets):
    from mix_src.config.mix_config import MixConfigError, validate_mix_config
    from mix_src.algo.row_loss import ROW_LOSSES

    with initialize_config_module(config_module="mix_src.config", version_base=None):
        cfg = compose(config_name="mix_ppo", overrides=[*MIX_CPU, *tiny_overrides(tiny_assets),
                      f"mix.loss.row_loss={next(iter(ROW_LOSSES))}", "actor_rollout_ref.actor.shuffle=true"])  # fmt: skip
    with pytest.raises(MixConfigError, match=r"mix\.loss\.row_loss=.* needs verl's unshuffled mini-batches"):
        validate_mix_config(cfg)


# ---------------------------------------------------------------------------------------------------
# sync mode: the step's generation budget (max_num_gen_batches) and carry_over, as hooks on verl's own ReplayBuffer


def _sync_trainer(tiny_assets, *overrides):
    """MixPPOTrainerSync built from a composed config (verl's constructor and replay buffer; no Ray, no workers)."""
    from mix_src.trainer.v1 import MixPPOTrainerSync

    cfg = compose_v1(tiny_assets, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                     "data.gen_batch_size=2", *overrides)  # fmt: skip
    trainer = MixPPOTrainerSync(cfg)
    trainer.global_steps = 3
    trainer.replay_buffer.poll_interval = 0.0
    return trainer


def test_v1_sync_generation_budget_dispatches_within_it_then_raises(tiny_assets, monkeypatch):
    """max_num_gen_batches=3 with gen batches of 2 prompts: 6 prompts a step. A refill beyond that is cut to what is
    left, the next is not dispatched, and the buffer's wait raises once nothing is in flight (verl's ReplayBuffer
    would poll forever). Without the hook verl ignores the key (trainer_base.py _resolve_filter_groups_metric)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from mix_src.trainer.legacy import FilterGroupsExhausted

    trainer = _sync_trainer(tiny_assets, "algorithm.filter_groups.max_num_gen_batches=3")
    dispatched = []
    monkeypatch.setattr(PPOTrainer, "_add_prompts_to_generate", lambda self, k: dispatched.append(k) or k)
    trainer._fetch_step, trainer._fetch_prompts = 3, 0
    assert trainer._add_prompts_to_generate(1) == 2 and dispatched == [2]  # whole gen batches (verl raises otherwise)
    dispatched.clear()
    trainer._fetch_step, trainer._fetch_prompts = 3, 4  # the step's first batch and one refill went out
    assert trainer._add_prompts_to_generate(4) == 2 and dispatched == [2]  # 2 left of the budget of 6
    trainer._fetch_prompts = 6
    assert trainer._add_prompts_to_generate(2) == 0 and dispatched == [2]
    buffer = trainer.replay_buffer
    buffer.running_keys["train"].add("uid-in-flight")
    buffer._wait_for_next_poll("train", 0.0)  # groups still in flight may fill the batch: verl's wait
    buffer.running_keys["train"].clear()
    buffer.finished_keys["train"].update({"a"})
    with pytest.raises(FilterGroupsExhausted, match=r"after 3 generation batches of 2 prompts \(algorithm\.filter_groups\."
                                                    r"max_num_gen_batches=3\) only 1 of data\.train_batch_size=4"):
        buffer._wait_for_next_poll("train", 0.0)
    trainer.global_steps = 4  # a new step has its own budget
    buffer._wait_for_next_poll("train", 0.0)
    assert trainer._add_prompts_to_generate(2) == 2


def test_v1_sync_carry_over_keeps_the_surplus_groups_verl_would_discard(tiny_assets, monkeypatch):
    """verl's sync sample clears the groups it did not select (replay_buffer.py, "discarded_surplus_samples"); with
    mix.filter_groups.carry_over they stay for the next step, whose sample takes the oldest groups first."""
    import verl.trainer.ppo.v1.replay_buffer as rb

    cleared = []
    monkeypatch.setattr(rb.tq, "kv_clear", lambda partition_id, keys: cleared.append(sorted(keys)))
    for carry in (False, True):
        cleared.clear()
        trainer = _sync_trainer(tiny_assets, f"mix.filter_groups.carry_over={str(carry).lower()}")
        buffer = trainer.replay_buffer
        buffer.prompt_global_steps["train"].update({"old": 2, "a": 3, "b": 3, "c": 3})
        selected, _, _ = buffer._select_prompt_uids("train", {"old", "a", "b", "c"}, 2)
        assert selected[0] == "old"  # a carried group (an earlier step's prompt) goes first
        surplus = {"a", "b", "c"} - set(selected)
        buffer._clear_groups("train", {"evicted"})  # an eviction is verl's, either way
        buffer._clear_groups("train", surplus)  # what verl's sample does with the surplus
        assert cleared == ([["evicted"]] if carry else [["evicted"], sorted(surplus)])
        if carry:
            assert trainer._carry_metrics == {"train/num_carried_prompts": 1, "train/num_surplus_carried": 2}


def test_v1_counts_the_generation_of_every_trajectory_once(tiny_assets, monkeypatch):
    """mix.flops_budget with a streamed rollout: the replay buffer's metadata sync (verl's ReplayBuffer, wrapped by
    MixV1Mixin._install_generation_count) counts each new ``train`` trajectory's generation once, F(P + R) with R
    minus its prefix tokens (mix_src.algo.flops.rollout_flops), whether it is later trained or evicted; a row of a
    whole target generated nothing. TransferQueue's listing and reads are stood in by a dict here."""
    import torch
    import transfer_queue

    from mix_src.algo.flops import COUNTS, rollout_flops

    trainer = _sync_trainer(tiny_assets)
    shape = trainer._model_shape()
    rows = {  # key -> (prompt_len, response_len, prefix_token_mask)
        "a_0_0": (5, 4, None), "a_1_0": (5, 4, [1, 1, 0, 0]), "b_0_0": (3, 3, [1, 1, 1]), "c_0_0": (6, 2, []),
    }  # fmt: skip
    listed = {"a": {"is_prompt": True, "status": "finished", "global_steps": 3},
              "b": {"is_prompt": True, "status": "finished", "global_steps": 3}}  # fmt: skip

    def kv_list(partition_id=None):
        train = dict(listed, **{k: {"prompt_len": p, "response_len": r, "status": "success"} for k, (p, r, _) in rows.items()
                                if k.split("_")[0] in listed})  # fmt: skip
        return {"train": train, "val": {"v_0_0": {"prompt_len": 9, "response_len": 9}}}

    read = []

    class Data(dict):
        def to_padded_tensor(self):
            return {"response_mask": self["response_mask"]}

    def kv_batch_get(keys, partition_id, select_fields):
        read.append(list(keys))
        width = max(rows[k][1] for k in keys)
        mask = torch.tensor([[1] * rows[k][1] + [0] * (width - rows[k][1]) for k in keys])
        return Data(response_mask=mask, extra_fields=[{"prefix_token_mask": rows[k][2]} for k in keys])

    monkeypatch.setattr(transfer_queue, "kv_list", kv_list)
    monkeypatch.setattr(transfer_queue, "kv_batch_get", kv_batch_get)
    trainer._pending_rollout_flops()  # start from zero
    buffer = trainer.replay_buffer
    buffer._sync_metadata_from_transfer_queue()
    buffer._sync_metadata_from_transfer_queue()  # nothing new: nothing read, nothing counted twice
    assert read == [["a_0_0", "a_1_0", "b_0_0"]]
    got = trainer._pending_rollout_flops()
    for c in COUNTS:  # b_0_0 is a whole target: 0; a_1_0 generated 2 of its 4 response tokens
        assert got[c] == rollout_flops(shape, [5, 5, 3], [4, 4, 3], [4, 2, 0], c) > 0
    del listed["b"]  # evicted (cleared) ...
    listed["c"] = {"is_prompt": True, "status": "finished", "global_steps": 3}  # ... and a refill finished
    buffer._sync_metadata_from_transfer_queue()
    assert read[-1] == ["c_0_0"] and trainer._counted_rows == {"a_0_0", "a_1_0", "c_0_0"}
    assert trainer._pending_rollout_flops() == {c: rollout_flops(shape, [6], [2], [2], c) for c in COUNTS}
