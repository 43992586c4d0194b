"""What the comparison harness (scripts/experiments/compare.py) needs for guidance methods (issues #55, #56):

* **Self-sourced traces, charged.** A method whose ``compare.yaml`` has ``self_source: {k: K[, temperature: T][, rows:
  N]}`` trains on the task's training file (``rows``: a random N of its rows, drawn with the run's seed, so that the
  sampling fits the budget: the sort task has 4,096 prompts, a run sees about 256) rewritten by
  ``python -m scripts.data.self_sample`` (the data command users run):
  ``K`` samples a prompt from the run's own starting model (the CPU backend's sampler, seeded with the run's seed), the
  ones the task's reward verifies as each row's ``target_lst``, the expert ``target`` dropped (``--drop-target``: the
  model's own successes are the only guidance, PrefixRL's self-improvement setting, arXiv 2601.18795). The sampling's
  generation FLOPs (``rollout_flops``, both counts) are the run's ``flops_offset``: its RL part gets
  ``mix.flops_budget = budget - offset`` and every evaluation is placed at ``offset + trained FLOPs``, as SFT->RL's
  SFT part is. Teacher traces (``target``) stay free. One file per (task, K, T, seed), reused while its summary
  says the same model and settings.
* **pass@k of the base** on the training prompts, from that sampling (the unbiased estimator,
  :func:`scripts.data.self_sample.pass_at_k`): printed and written to the table.
* **Informative groups per run**: each step's share of prompt groups whose rows are neither all solved nor all failed
  (``1 - batch/solve_none - batch/solve_all``, mix_src/trainer/stages.py ``luffy_metrics``; a group with a
  demonstration row counts when the model's rows fail, since that row is solved) and, for pass-rate control, its
  own band metric (``pass_rate_control/informative_before`` / ``_after``: pass rate in [0.25, 0.75]).
"""

from __future__ import annotations

import json
import math
import os
import sys

SELF_SOURCE_KEYS = {"k", "temperature", "rows"}


def check_self_source(spec, path: str) -> dict | None:
    """``self_source`` of a compare.yaml, validated (None when absent)."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - SELF_SOURCE_KEYS or "k" not in spec:
        raise SystemExit(f"{path}: self_source must be a mapping with k (samples per prompt) and optionally "
                         f"temperature and rows, got {spec!r}")
    k, temp, rows = spec["k"], spec.get("temperature", 1.0), spec.get("rows")
    if not isinstance(k, int) or k < 1 or not isinstance(temp, (int, float)) or not temp > 0 or not (
            rows is None or (isinstance(rows, int) and rows >= 1)):
        raise SystemExit(f"{path}: self_source needs an integer k >= 1, temperature > 0 and rows (optional) an "
                         f"integer >= 1, got {spec!r}")
    return {"k": k, "temperature": float(temp), "rows": rows}


def self_source(task, assets: dict, spec: dict, seed: int, out: str, launch, wrap: list[str]) -> dict:
    """The self-sourced training file of (task, spec, seed), made once by ``scripts.data.self_sample``; returns its
    summary (``output``: the parquet, ``flops``: {6n, full}, ``pass_at_k``, ``prompts_with_a_trace``, ...)."""
    import pandas as pd

    rows = spec.get("rows")
    folder = os.path.join(out, "self_source", task.name,
                          f"k{spec['k']}_t{spec['temperature']:g}" + (f"_rows{rows}" if rows else "") + f"_seed{seed}")
    parquet, summary_path = os.path.join(folder, "self.parquet"), os.path.join(folder, "self.json")
    reward = "pkg://" + task.compute_score.__module__  # the task's training reward (reward.custom_reward_function)
    source = assets["train"]
    if rows and rows < len(pd.read_parquet(assets["train"], columns=["data_source"])):
        source = os.path.join(folder, "rows.parquet")  # the run's training prompts: a seeded random subset
    want = {"k": spec["k"], "input": source, "reward": f"{reward}:compute_score", "target_dropped": True}
    if os.path.exists(summary_path):
        summary = json.load(open(summary_path))
        if {key: summary.get(key) for key in want} == want and summary.get("model") == assets["model"] \
                and summary.get("seed") == seed and summary.get("temperature") == spec["temperature"]:
            return summary
    os.makedirs(folder, exist_ok=True)
    if source != assets["train"]:
        pd.read_parquet(assets["train"]).sample(n=rows, random_state=seed).sort_index().to_parquet(source)
    cmd = [sys.executable, "-m", "scripts.data.self_sample", "--model", assets["model"], "--tokenizer", assets["tokenizer"],
           "--input", source, "--output", parquet, "--k", str(spec["k"]),
           "--temperature", str(spec["temperature"]), "--max-new-tokens", str(task.max_response_length),
           "--backend", "cpu", "--seed", str(seed), "--batch-size", "256", "--reward-path", reward, "--drop-target"]
    wall = launch(cmd, {"OMP_NUM_THREADS": "1"}, folder, wrap)
    summary = json.load(open(summary_path))
    summary.update({"model": assets["model"], "seed": seed, "temperature": spec["temperature"], "wall_s": round(wall, 1)})
    json.dump(summary, open(summary_path, "w"), indent=1)
    return summary


def run_self_sourced(run_rl, launch, task, assets: dict, m, seed: int, a, test_freq: int, rdir: str,
                     wrap: list[str]) -> dict:
    """One run of a self-sourcing method: its file (:func:`self_source`), then ``run_rl`` on it with the sampling
    charged: budget minus the sampling's FLOPs, evaluations placed after them, the record's FLOPs including them."""
    src = self_source(task, assets, m.self_source, seed, a.out, launch, wrap)
    rec = run_rl(task, assets, m, seed, rl_budget(a.budget, src["flops"], a.count, f"{m.name} seed {seed}"), a.count,
                 test_freq, rdir, wrap, flops_offset=src["flops"], extra=tuple(a.rl_overrides), train_file=src["output"])
    rec["self_source"] = {key: src[key] for key in ("k", "temperature", "prompts", "samples", "verified",
                                                     "prompts_with_a_trace", "pass_rate_mean", "pass_at_k", "flops",
                                                     "wall_s")}
    print(f"[compare] {task.name} {m.name} seed {seed}: self-sourced traces for {src['prompts_with_a_trace']} of "
          f"{src['prompts']} prompts (k = {src['k']}, pass@k {src['pass_at_k']}), {src['flops'][a.count]:.3g} "
          f"FLOPs charged", flush=True)
    return rec


def informative(metrics: dict[int, dict]) -> dict:
    """Per-run means over training steps of the informative-group shares (module docstring)."""
    steps = [m for s, m in sorted(metrics.items()) if s > 0 and "batch/solve_none" in m]
    out = {"steps": len(steps)}
    if steps:
        out["mixed"] = sum(1.0 - m["batch/solve_none"] - m["batch/solve_all"] for m in steps) / len(steps)
        out["solve_none"] = sum(m["batch/solve_none"] for m in steps) / len(steps)
    for key in ("informative_before", "informative_after"):
        vals = [m[f"pass_rate_control/{key}"] for m in steps if f"pass_rate_control/{key}" in m]
        if vals:
            out["band_" + key.split("_")[1]] = sum(vals) / len(vals)
    return out


def _mean_ci(values: list[float]) -> str:
    from scripts.experiments.compare import t_interval

    if not values:
        return "n/a"
    s = t_interval(values)
    return f"{100 * s['mean']:.1f}" + ("" if s["n"] < 2 else f" [{100 * s['lo']:.1f}, {100 * s['hi']:.1f}]")


def guidance_table(results: dict, tasks: list[str], methods: list[str], seeds: list[int], budget: float,
                   count: str) -> str:
    """Markdown: per task, pass@k of the base (from a self-sourced run's sampling) and per method the informative
    shares (mean over steps, then over seeds with a t-interval) and the offline sampling's share of the budget."""
    lines = []
    for tname in tasks:
        runs = {m: [results[tname][m][s] for s in seeds if s in results[tname].get(m, {})] for m in methods}
        if not any("informative" in r for rs in runs.values() for r in rs):
            continue
        sourced = [r["self_source"] for rs in runs.values() for r in rs if r.get("self_source")]
        lines += [f"### task `{tname}` — guidance: informative groups and self-sourced traces", ""]
        if sourced:
            ks = sorted(int(k) for k in sourced[0]["pass_at_k"])
            lines += [f"pass@k of the base on the {sourced[0]['prompts']} training prompts (unbiased estimator over "
                      f"k = {sourced[0]['k']} samples a prompt, temperature {sourced[0]['temperature']:g}; mean over "
                      f"the {len(sourced)} self-sourced runs' own draws): "
                      + ", ".join(f"pass@{k} {100 * sum(s['pass_at_k'][str(k)] for s in sourced) / len(sourced):.2f}%"
                                  for k in ks), ""]
        lines += ["| method | mixed groups, % of groups (mean over steps) [95% t CI] | all-failed groups, % | "
                  "pass-rate band [0.25, 0.75] before / after steering, % | offline sampling FLOPs, % of budget | "
                  "prompts with a self-sourced trace |", "|---|---:|---:|---:|---:|---:|"]
        for m in methods:
            rs = [r for r in runs[m] if "informative" in r]
            if not rs:
                continue
            inf = [r["informative"] for r in rs]
            band = ("n/a" if "band_before" not in inf[0] else
                    f"{_mean_ci([i['band_before'] for i in inf])} / {_mean_ci([i['band_after'] for i in inf])}")
            src = [r["self_source"] for r in rs if r.get("self_source")]
            off = ("0 (teacher traces are free)" if not src else
                   f"{100 * sum(s['flops'][count] for s in src) / len(src) / budget:.1f}")
            traces = "" if not src else f"{sum(s['prompts_with_a_trace'] for s in src) / len(src):.1f} of {src[0]['prompts']}"
            lines.append(f"| {m} | {_mean_ci([i['mixed'] for i in inf if 'mixed' in i])} | "
                         f"{_mean_ci([i['solve_none'] for i in inf if 'solve_none' in i])} | {band} | {off} | {traces} |")
        lines.append("")
    return "\n".join(lines)


def rl_budget(budget: float, offset: dict, count: str, where: str) -> float:
    """The RL part's budget after an offline cost; refused when the offline part alone spends the budget."""
    rest = budget - offset[count]
    if not rest > 0 or not math.isfinite(rest):
        raise SystemExit(f"{where}: its offline sampling spent {offset[count]:.3g} FLOPs ({count}) of the budget "
                         f"{budget:.3g}: nothing is left to train; lower self_source.k or raise --budget")
    return rest
