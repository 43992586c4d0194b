"""The comparison harness (scripts/experiments/compare.py): method plug-in contract, statistics, and one tiny
grid end to end through the real entry points (2 methods x 2 seeds, a budget of a few RL steps), which checks
the budget stop, the FLOPs records, the outputs and that a finished grid is not re-run."""

import json
import math
import os
import subprocess
import sys

import pytest

import composed
from scripts.experiments import compare as cmp

LAUNCH = ["luffy", "grpo", "sft", "sft_rl", "guide_on_failure"]


def test_launch_methods_load_by_name():
    kinds = {m: cmp.load_method(m).kind for m in LAUNCH}
    assert kinds == {"luffy": "rl", "grpo": "rl", "sft": "sft", "sft_rl": "sft_rl", "guide_on_failure": "rl"}
    gof = cmp.load_method("guide_on_failure")
    assert gof.plugins and os.path.exists(gof.plugins[0])
    assert cmp.rl_args(gof)[0].startswith("mix.plugins=[") and "mix.rollout_policy=guide_on_failure" in cmp.rl_args(gof)
    assert cmp.load_method("sft_rl").rl_method == "grpo"


def test_a_new_method_plugs_in_by_name(tmp_path):
    (tmp_path / "my_method").mkdir()
    (tmp_path / "my_method" / "compare.yaml").write_text("plugins: []\noverrides: [mix.n_prefix=2]\n")
    m = cmp.load_method("my_method", recipes_dir=str(tmp_path))
    assert (m.kind, m.overrides) == ("rl", ["mix.n_prefix=2"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "compare.yaml").write_text("overides: []\n")
    with pytest.raises(SystemExit, match="unknown keys.*overides"):
        cmp.load_method("bad", recipes_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="no .*nope/compare.yaml"):
        cmp.load_method("nope", recipes_dir=str(tmp_path))


def _compose_toy(name, overrides=()):
    return composed.compose(name, overrides, config_dir=os.path.join(cmp.REPO_ROOT, "recipes", "toy_addition"))


def test_luffy_compare_yaml_is_the_toy_luffy_recipe():
    """compare.yaml's overrides on the toy base give exactly recipes/toy_addition/luffy.yaml's config."""
    from omegaconf import OmegaConf

    ours = _compose_toy("on_policy_grpo", cmp.rl_args(cmp.load_method("luffy")))
    ref = _compose_toy("luffy")
    assert OmegaConf.to_container(ours, resolve=True) == OmegaConf.to_container(ref, resolve=True)


def test_statistics():
    assert cmp.t975(1) == 12.706 and cmp.t975(4) == 2.776 and cmp.t975(100) == 1.96
    t = cmp.interval([0.2, 0.4])  # mean 0.3, sd 0.1414, half-width 12.706 * 0.1414 / sqrt(2) = 1.2706
    assert t["method"] == "t" and t["n"] == 2 and t["mean"] == pytest.approx(0.3)
    assert t["hi"] - t["mean"] == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))
    b = cmp.interval([0.1, 0.2, 0.3, 0.4, 0.5])
    assert b["method"] == "bootstrap" and 0.1 <= b["lo"] < 0.3 < b["hi"] <= 0.5
    run = {"evals": [{"heldout": 0.0, "optimizer_steps": 0}, {"heldout": 0.5, "optimizer_steps": 4},
                     {"heldout": 1.0, "optimizer_steps": 8}]}
    assert cmp.smoothed(run, "heldout", 2) == 0.75
    assert cmp.at_optimizer_steps(run, "heldout", 6) == (0.5, 4)
    assert cmp.binomial_se(0.5, 100) == pytest.approx(0.05)


def test_run_jobs_runs_every_job_n_at_a_time_and_raises_the_first_failure():
    import threading
    import time

    lock, running, peak, ran = threading.Lock(), [0], [0], []

    def fn(job):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            ran.append(job)
        if job in (2, 4):
            raise RuntimeError(f"run {job} failed")

    with pytest.raises(RuntimeError, match="run 2 failed"):
        cmp.run_jobs(fn, list(range(6)), 2)
    assert sorted(ran) == list(range(6)) and peak[0] == 2  # a failure does not stop the other runs
    ran.clear(), peak.__setitem__(0, 0)
    cmp.run_jobs(fn, [0, 1, 3], 1)
    assert ran == [0, 1, 3] and peak[0] == 1


@pytest.mark.ray
def test_tiny_grid_end_to_end(tmp_path):
    """grpo and sft x seeds 0, 1 on the addition task with a barely trained base and 4-prompt RL batches, two runs
    at a time (--jobs 2: each run is one mostly single-threaded process tree, OMP_NUM_THREADS=1)."""
    budget = 1.5e10  # about 3 RL steps of 4 prompts x 8, 4 SFT steps of 32 sequences
    args = ["--tasks", "addition", "--methods", "grpo", "sft", "--seeds", "0", "1", "--budget", str(budget),
            "--evals", "2", "--pretrain-steps", "3", "--out", str(tmp_path), "--baseline", "grpo", "--jobs", "2", "--rl-overrides",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32"]
    env = {**os.environ, "PYTHONPATH": cmp.REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-m", "scripts.experiments.compare", *args], cwd=cmp.REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.load(open(tmp_path / "results.json"))
    for seed in ("0", "1"):
        rl = out["runs"]["addition"]["grpo"][seed]
        # the trainer stopped at the first step whose cumulative FLOPs reached the budget
        assert rl["flops"]["full"] >= budget > rl["flops"]["full"] - rl["last_step_flops"]["full"]
        assert rl["steps"] < cmp.RL_STEP_CAP and rl["evals"][0]["step"] == 0 and rl["evals"][-1]["step"] == rl["steps"]
        assert rl["flops"]["6n"] < rl["flops"]["full"]
        assert rl["commit"].split("+")[0] == cmp.git_commit().split("+")[0]  # the tree each run started from
        sft = out["runs"]["addition"]["sft"][seed]
        assert sft["flops"]["full"] >= budget and sft["steps"] == out["plans"]["addition"]["sft_steps"]
        # the SFT FLOPs were counted from the tokens verl's SFT trainer actually trains on
        assert sft["tokens_per_step"]["logged_by_verl"] == [sft["tokens_per_step"]["counted"]]
        assert all(0.0 <= e["heldout"] <= 1.0 and 0.0 <= e["ood"] <= 1.0 for e in rl["evals"] + sft["evals"])
        # verl's SFT trainer ran (recipes/toy_addition/sft.yaml): its NLL on the demonstrations went down, and
        # the RL runs trained (the smoke tests of both recipes ride on this grid)
        sft_m = cmp.read_metrics(str(tmp_path / "runs" / "addition" / f"sft_seed{seed}" / "metrics.jsonl"))
        losses = [m["train/loss"] for _, m in sorted(sft_m.items()) if "train/loss" in m]
        assert len(losses) == sft["steps"] and all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
        rl_m = cmp.read_metrics(str(tmp_path / "runs" / "addition" / f"grpo_seed{seed}" / "metrics.jsonl"))
        for step in range(1, rl["steps"] + 1):
            assert math.isfinite(rl_m[step]["actor/pg_loss"]) and rl_m[step].get("batch/off_policy_rows", 0) == 0
    table = open(tmp_path / "table.md").read()
    assert "| grpo |" in table and "| sft |" in table and "Paired by seed against **grpo**" in table
    assert f"runs made on commit(s) {out['runs']['addition']['grpo']['0']['commit']}" in table
    assert (tmp_path / "curves.png").stat().st_size > 0
    # resumable: the finished grid is read back, nothing is launched again
    again = subprocess.run([sys.executable, "-m", "scripts.experiments.compare", *args], cwd=cmp.REPO_ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "run.sh" not in again.stdout, again.stdout[-2000:]


@pytest.mark.parametrize("task", sorted(cmp.TASKS))
@pytest.mark.parametrize("method", ["luffy", "grpo", "guide_on_failure", "prefix_rl", "pass_rate_control"])
def test_rl_runs_compose_and_validate(method, task):
    """What the harness passes run.sh for every RL launch method on every task composes and passes mix_src's checks."""
    from mix_src.config.mix_config import validate_mix_config
    from mix_src.extend import load_plugins

    m = cmp.load_method(method)
    cfg = _compose_toy("on_policy_grpo", [*cmp.TASKS[task].overrides, *cmp.rl_args(m), "mix.flops_budget=1e12"])
    load_plugins(list(cfg.mix.plugins))
    mix = validate_mix_config(cfg)
    assert mix.flops_budget == 1e12
    if task == "sort":
        assert cfg.reward.custom_reward_function.path == "pkg://scripts.experiments.toy_tasks.sort" and cfg.data.max_response_length == 24


def test_a_run_that_lost_its_rendezvous_port_is_started_again_and_other_failures_raise(tmp_path):
    """The tiny grid's --jobs 2 lost a run to EADDRINUSE (a port taken between its choice and its bind, on a fresh
    clone of 4b04fae): such a run failed before training and is started once more; any other failure raises."""
    marker = tmp_path / "tried"
    clash = ["bash", "-c", f"if [ -e {marker} ]; then echo ok; else touch {marker}; "
             "echo 'DistNetworkError: address already in use, name: EADDRINUSE'; exit 1; fi"]
    assert cmp.launch(clash, {}, str(tmp_path), []) >= 0
    assert (tmp_path / "run.log").read_text() == "ok\n" and "EADDRINUSE" in (tmp_path / "run.attempt1.log").read_text()
    with pytest.raises(RuntimeError, match="rc=3"):
        cmp.launch(["bash", "-c", "echo other; exit 3"], {}, str(tmp_path), [])
    marker.unlink()
    with pytest.raises(RuntimeError, match="EADDRINUSE"):  # only once more
        cmp.launch(clash[:2] + [clash[2].replace("then echo ok", "then echo EADDRINUSE; exit 1")], {}, str(tmp_path), [])
