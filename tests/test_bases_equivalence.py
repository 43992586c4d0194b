"""One algorithm on both of verl's trainers: the legacy base (MIXRayPPOTrainer) and V1 ``sync`` compute the same
LUFFY step, and every metric name means the same thing on both.

Same tiny assets, same seeds (data, rollout, mix), filter groups off, 4 prompts x 4 samples, 2 of them with a
prefix whose ratio is drawn in [0.3, 0.7]; the adaptive entropy coefficient and all_max_clip on; 2 steps. The V1
run checkpoints step 1, and a third run resumes from it: its step 2 draws the prefix ratios of the uninterrupted
step 2 and continues the learned entropy coefficient saved with the V1 checkpoint. Both bases count the same
``flops/*`` (mix_src/algo/flops.py) for the same batches; the resumed run, of 3 steps with ``mix.flops_budget`` at the
uninterrupted run's FLOPs after step 2, continues the count saved with step 1 and stops at step 2, saving and
validating there (verl's own loop would have done neither: save_freq and test_freq are 5).
Three runs of ``python -m mix_src.main_mix_ppo +backend=cpu`` (tests/e2e.py): the V1 ones each in its own Ray
cluster; the legacy one (it checkpoints each step, as the V1 run does) is the run ``partial_prefix`` of the legacy
batch (tests/conftest.py ``legacy_batch``: one process for several tests' runs), which
tests/test_mix_trainer_e2e.py's legacy resume test reads too.
"""

from __future__ import annotations

import pytest

from e2e import MIX, batch_result, batch_run, partial_prefix_overrides, partial_prefix_saved, run_verl

pytestmark = pytest.mark.ray
TEST = "test_bases_equivalence.py::test_legacy_and_v1_sync_train_the_same_luffy_steps_and_v1_resumes_them"
LEGACY = batch_run("legacy", "partial_prefix", partial_prefix_saved, [TEST])

# Every metric both bases log is compared (below); these are not: wall-clock timings and what follows from them
# (throughput, MFU) and memory counters, which differ between any two runs.
UNCOMPARED = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "agent_loop/", "timing/")
# The metrics only one base logs, each with the reason; the test fails when a metric appears on, or disappears
# from, one base only, so this list stays complete.
LEGACY_ONLY: dict[str, str] = {}
V1_ONLY: dict[str, str] = {
    **{f"training/num_turns/{s}": "verl's V1 stage logs the turn counts twice, as num_turns/* (both bases) and under "
       "training/ (trainer_base.py _compute_metrics)" for s in ("max", "mean", "min")},
    **{f"training/off_policy/{m}/{s}": "V1's replay buffer: how many steps old a trained trajectory is; the legacy "
       "loop trains every row in the step that generated it"
       for m in ("trajectory_spans", "trajectory_staleness", "trajectory_staleness_worst") for s in ("max", "mean", "min")},
}  # fmt: skip


def _run(tiny_assets, tmp_path, *extra, steps=2, name="run"):
    overrides = partial_prefix_overrides(tiny_assets, *extra, steps=steps)  # e2e.PARTIAL_PREFIX_LUFFY
    return run_verl(MIX, overrides, tmp_path, timeout=420, name=name)


# The only tolerance, and why. The data side is compared bit for bit: prompts, prefix ratios, samples, scores,
# solve rates, advantages, returns, lengths. The actor's floats (actor/*: log-probs, entropy, losses, grad norm, the
# learned entropy coefficient; training/rollout_*: the actor's recomputed old log-probs against the rollout's) come
# from float32 forward/backward passes that each base runs on its own batch layout (legacy: the padded DataProto;
# V1: TransferQueue's nested rows through verl's workers), so they may differ in the last bits. Measured on the
# tiny assets, three runs (commits 5ee55e5, ae6933b, 5cb56fc): actor/* up to 1.0e-7 relative (entropy, off_policy_prob,
# off_ratio_mean; entropy_coeff 1e-14), training/rollout_probs_diff_* up to 2e-9 absolute (values 1e-9..1e-8),
# pearson 1.2e-7 relative; in one run every actor/* metric of step 2 was bit-identical.
ACTOR_FLOATS = ("actor/", "training/rollout_actor_probs_pearson_corr")
ROLLOUT_DIFF = "training/rollout_probs_diff_"
# verl's rollout-correction diagnostics (old log-probs, i.e. the actor's forward pass, against the rollout's), now
# compared too: measured on the tiny assets (this 2-core CPU machine, the checkout at 19e5254), step 1 identical,
# step 2 up to 1.8e-6 absolute (chi2_seq 1.2e-7 vs 1.9e-6), training_log_ppl 1.0e-7 relative.
ROLLOUT_CORR = "rollout_corr/"


def _compared(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(UNCOMPARED)}


def test_legacy_and_v1_sync_train_the_same_luffy_steps_and_v1_resumes_them(tiny_assets, tmp_path, legacy_batch):
    legacy = batch_result(legacy_batch, LEGACY)
    ckpt = tmp_path / "ckpt"
    v1_args = ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync", f"trainer.default_local_dir={ckpt}"]
    v1 = _run(tiny_assets, tmp_path / "v1", *v1_args, "trainer.save_freq=1", name="v1")
    assert [m["step"] for m in legacy.metrics] == [m["step"] for m in v1.metrics] == [1, 2]

    for a, b in zip(legacy.metrics, v1.metrics):
        ca, cb = _compared(a), _compared(b)
        assert "batch/avg_prefix_ratio" in ca and "actor/off_pg_loss" in ca and "critic/advantages/mean" in ca
        assert sorted(set(ca) - set(cb)) == sorted(LEGACY_ONLY), f"step {a['step']}: legacy only"
        assert sorted(set(cb) - set(ca)) == sorted(V1_ONLY), f"step {a['step']}: V1 only"
        la = {k: ca[k] for k in ca if k in cb}  # every metric both bases log
        lb = {k: cb[k] for k in la}
        exact = [k for k in la if not k.startswith((*ACTOR_FLOATS, ROLLOUT_DIFF, ROLLOUT_CORR))]
        diff = {k: (la[k], lb[k]) for k in exact if la[k] != lb[k] and not (la[k] != la[k] and lb[k] != lb[k])}
        assert not diff, f"step {a['step']}: legacy vs V1 differ (legacy, v1): {diff}"
        for k in la:
            if k.startswith(ACTOR_FLOATS):
                assert lb[k] == pytest.approx(la[k], rel=1e-6, abs=1e-12), (k, la[k], lb[k])
            elif k.startswith(ROLLOUT_DIFF):
                assert lb[k] == pytest.approx(la[k], abs=1e-7), (k, la[k], lb[k])
            elif k.startswith(ROLLOUT_CORR):
                assert lb[k] == pytest.approx(la[k], rel=1e-6, abs=1e-5), (k, la[k], lb[k])
        assert la["prompt_length/clip_ratio"] == 0.0  # prompts of ~24 tokens, none cut at 32 (V1 logged 1.0)
        # one meaning: rollout vs actor over on-policy tokens on both (prefix tokens have no rollout log-prob)
        assert lb["training/rollout_probs_diff_max"] < 0.05
        assert 0.3 * 2 / 4 <= lb["batch/avg_prefix_ratio"] <= 0.7 * 2 / 4

    budget = v1.metrics[1]["flops/total_full"]
    assert v1.metrics[0]["flops/total_full"] < budget  # step 1 alone does not reach it
    ckpt2 = tmp_path / "ckpt2"
    resumed = _run(tiny_assets, tmp_path / "resumed", "trainer.use_v1=true", "trainer.v1.trainer_mode=sync",
                   f"trainer.default_local_dir={ckpt2}", "trainer.resume_mode=resume_path",
                   f"trainer.resume_from_path={ckpt / 'global_step_1'}", "trainer.save_freq=5", "trainer.test_freq=5",
                   f"mix.flops_budget={budget!r}", steps=3, name="resumed")  # fmt: skip
    assert [m["step"] for m in resumed.metrics] == [2]  # of 3: the budget was reached
    r, full = resumed.metrics[0], v1.metrics[1]
    for key in [k for k in full if k.startswith("flops/")]:  # the same count, continued from the checkpoint
        assert r[key] == full[key], (key, r[key], full[key])
    assert (ckpt2 / "global_step_2").is_dir() and any(k.startswith("val-") for k in r)  # saved and validated there
    assert r["batch/avg_prefix_ratio"] == full["batch/avg_prefix_ratio"]  # the same draw (seed, step 2, fetch 0)
    assert r["batch/avg_prefix_ratio"] != v1.metrics[0]["batch/avg_prefix_ratio"]
    assert r["batch/prefix_token_frac"] == full["batch/prefix_token_frac"]
    coefs = [m["actor/entropy_coeff"] for m in v1.metrics]  # the coefficient each step's loss used
    assert coefs[0] == pytest.approx(0.01) and coefs[1] != pytest.approx(0.01)
    assert r["actor/entropy_coeff"] == pytest.approx(coefs[1], rel=1e-9)  # restored from the V1 checkpoint
    assert not any("mix_entropy_state" in k for m in v1.metrics + resumed.metrics for k in m)
