"""The comparison harness's guidance parts (scripts/experiments/compare_guidance.py; issues #55 item 2 and #56 item 3):
a self-sourcing method's traces come from the real data command (scripts.data.self_sample) on the run's own base,
their sampling FLOPs are charged to the run (its RL budget is the grid's minus them, its evaluations and FLOPs start
after them), the file is made once per (task, k, temperature, seed); pass@k of the base is printed; the informative
group shares are read from a run's metrics. No Ray: ``run_rl`` is a recorder here, the trainer's own runs of the
method are tests/test_prefix_rl_e2e.py's (2 steps, both bases)."""

from __future__ import annotations

import argparse
import os

import pandas as pd
import pytest

from scripts.experiments import compare as cmp
from scripts.experiments import compare_guidance as cg


def test_prefix_rl_self_sources_and_bad_self_source_specs_are_refused(tmp_path):
    m = cmp.load_method("prefix_rl")
    assert m.kind == "rl" and m.self_source == {"k": 4, "temperature": 1.0, "rows": 512}
    assert "mix.data.use_target_lst=true" in m.overrides and "mix.loss.prefix_tokens=context" in m.overrides
    # the self-sourced train file is part of what makes a finished run reusable
    assert cmp.run_overrides(cmp.TASKS["addition"], m)[-1] == "data.train_files=<self-sourced, k=4, temperature=1, rows=512>"
    for bad in ("self_source: 4", "self_source: {k: 0}", "self_source: {n: 4}", "self_source: {k: 2, temperature: 0}", "self_source: {k: 2, rows: 0}",
                "{kind: sft_rl, rl_method: grpo, self_source: {k: 2}}"):
        (tmp_path / "m").mkdir(exist_ok=True)
        (tmp_path / "m" / "compare.yaml").write_text(bad)
        with pytest.raises(SystemExit, match="self_source"):
            cmp.load_method("m", recipes_dir=str(tmp_path))


def _task(tmp_path):
    # the tiny assets with the addition task's reward (scores 0 on them: the accounting is what is tested)
    return cmp.Task("tiny", None, "x", "y", cmp.TASKS["addition"].compute_score, 8, 6)


def test_the_sampling_is_charged_to_the_run_and_made_once(tiny_assets, tmp_path):
    calls, launched = [], []

    def recorder(task, assets, method, seed, budget, count, test_freq, rdir, wrap, flops_offset=None, extra=(),
                 train_file=None):
        calls.append({"budget": budget, "offset": flops_offset, "train_file": train_file})
        return {"flops": {c: flops_offset[c] + 1.0 for c in flops_offset}}

    def launch(cmd, env, rdir, wrap):
        launched.append(cmd)
        return cmp.launch(cmd, env, rdir, wrap)

    a = argparse.Namespace(out=str(tmp_path), budget=1e12, count="full", rl_overrides=[])
    m = cmp.Method("prefix_rl", "rl", self_source={"k": 2, "temperature": 1.0, "rows": 8})
    rec = cg.run_self_sourced(recorder, launch, _task(tmp_path), tiny_assets, m, 3, a, 1, str(tmp_path / "run"), [])
    src = rec["self_source"]
    assert calls[0]["offset"] == src["flops"] and src["flops"]["full"] > 0
    assert calls[0]["budget"] == pytest.approx(1e12 - src["flops"]["full"])  # the RL part gets the rest
    assert rec["flops"]["full"] == src["flops"]["full"] + 1.0
    df = pd.read_parquet(calls[0]["train_file"])
    assert df["target"].isna().all() and "target_lst" in df and src["samples"] == 2 * len(df) == 2 * 8
    # rows: a seeded random 8 of the 32 training prompts are sampled and are the run's training file
    full = pd.read_parquet(tiny_assets["train"])
    assert len(full) == 32 and set(df["extra_info"].map(lambda e: e["index"])) <= set(full["extra_info"].map(lambda e: e["index"]))
    assert launched[0][launched[0].index("--seed") + 1] == "3" and "--drop-target" in launched[0]
    assert "pkg://scripts.experiments.toy_tasks.addition" in launched[0]  # the task's own reward
    # made once: a second run of the same (task, k, temperature, seed) reuses the file and its charge
    again = cg.run_self_sourced(recorder, launch, _task(tmp_path), tiny_assets, m, 3, a, 1, str(tmp_path / "run2"), [])
    assert len(launched) == 1 and again["self_source"]["flops"] == src["flops"]
    # a budget the sampling alone spends is refused, naming the way out
    a.budget = src["flops"]["full"] / 2
    with pytest.raises(SystemExit, match="nothing is left to train; lower self_source.k"):
        cg.run_self_sourced(recorder, launch, _task(tmp_path), tiny_assets, m, 3, a, 1, str(tmp_path / "run3"), [])


def test_informative_shares_and_the_guidance_table():
    metrics = {0: {"val-core/x/acc/mean@1": 0.0},
               1: {"batch/solve_none": 0.5, "batch/solve_all": 0.25, "pass_rate_control/informative_before": 0.1,
                   "pass_rate_control/informative_after": 0.3},
               2: {"batch/solve_none": 0.25, "batch/solve_all": 0.25, "pass_rate_control/informative_before": 0.3,
                   "pass_rate_control/informative_after": 0.5}}
    inf = cg.informative(metrics)
    assert inf == pytest.approx({"steps": 2, "mixed": (0.25 + 0.5) / 2, "solve_none": 0.375, "band_before": 0.2,
                                 "band_after": 0.4})
    src = {"k": 4, "temperature": 1.0, "prompts": 10, "prompts_with_a_trace": 3, "pass_at_k": {"1": 0.1, "4": 0.3},
           "flops": {"full": 1e11, "6n": 9e10}}
    results = {"t": {"a": {0: {"informative": inf}}, "b": {0: {"informative": inf, "self_source": src}}}}
    md = cg.guidance_table(results, ["t"], ["a", "b"], [0], 4e11, "full")
    assert "pass@1 10.00%, pass@4 30.00%" in md
    assert "| a | 37.5 | 37.5 | 20.0 / 40.0 | 0 (teacher traces are free) |  |" in md
    assert "| b | 37.5 | 37.5 | 20.0 / 40.0 | 25.0 | 3.0 of 10 |" in md
