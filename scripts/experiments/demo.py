"""`make demo`: LUFFY learns a skill on-policy GRPO cannot, in minutes on 2 CPU cores, through the real trainer.

The task is the toy-addition demo variant (``scripts/experiments/toy_addition.py``, ``VARIANTS["demo"]``):
2-digit additions whose only carry is out of the units column, written as a units-first trace
(``27+48`` -> ``51 70>075``). The base model is shipped (``recipes/toy_addition/demo_base``, pre-trained on
carry-free traces with a faint prior for the correct carry: ``demo_base_rules.py faint_carry``; its SHA-256 is
checked; BUILD.json there says how it was made), so every machine starts from
the same weights; it solves 0% of them greedily. LUFFY puts one expert trace in each group of 8. Before
training the demo prints the property its story rests on, measured on this machine: the base's sampled
success rate p on the 892 training problems
(32 samples each at the rollout temperature, with the rollout's own sampler) and the rewarded samples
on-policy GRPO can expect from it over the run, p x steps x 32 x 8, with its bound (< 1: less than one expected
reward in the whole run); and the teacher-forced probability the base gives the expert's carry token (mean over
the training problems), which LUFFY's shaped term must raise, with its floor (>= 5e-6). It measures and reports
(every sample counted; the base is never trained further) and warns before and after training when either
side is missed. The shipped base meets both (1 of 28,544 sampled successes where it was built); E is the base's,
and GRPO's policy can still move without a reward (its entropy bonus), so GRPO's actual rewarded samples are
printed after training: see recipes/toy_addition/README.md for the search behind the base. Both methods run
``bash recipes/toy_addition/run.sh METHOD 0`` (``python -m mix_src.main_mix_ppo``, CPU backend, Ray) at
the same time, with the same budget; this driver prints one line per training step of each, then the
held-out greedy accuracy of both (200 problems; the trainer's own validation) and writes a PNG.

Usage::

    python -m scripts.experiments.demo [--steps 40] [--eval-every 5] [--seed 0] [--out outputs/demo]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from scripts.experiments import toy_addition as ta
from scripts.experiments.luffy_vs_grpo import plot, read_metrics

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METHODS = ["luffy", "on_policy_grpo"]
SHORT = {"luffy": "LUFFY", "on_policy_grpo": "GRPO "}
ID_KEY = f"val-core/{ta.task.DATA_SOURCE}/acc/mean@1"
OOD_KEY = f"val-core/{ta.OOD_SOURCE}/acc/mean@1"


def step_line(method: str, step: int, steps: int, m: dict) -> str:
    line = (f"[demo] {SHORT[method]} step {step:3d}/{steps}  train reward {m.get('critic/score/mean', float('nan')):.3f}"
            f"  {m.get('timing_s/step', float('nan')):4.1f} s/step")
    if ID_KEY in m:
        line += f"  held-out {100 * m[ID_KEY]:5.1f}%"
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps of each method")
    p.add_argument("--eval-every", type=int, default=5, help="held-out validation every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "outputs", "demo"))
    a = p.parse_args(argv)
    t0 = time.time()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the evaluator loads checkpoints: no "Loading weights" bars here
    assets = os.path.join(a.out, "assets")
    print(f"[demo] building the task in {assets}, installing the shipped base model and measuring its property "
          "(about 1-2 min on 2 cores; cached)", flush=True)
    prep = ta.prepare(assets, seed=0, variant="demo", log=lambda *_: None, base="shipped")
    base = prep["base_eval"]["heldout_carry"]["acc"]
    print(f"[demo] base model: {100 * base:.1f}% of the 200 held-out problems ({time.time() - t0:.0f} s)", flush=True)
    settings = ta.rollout_settings()
    prop = prep["base_property"]
    if a.steps != prop["grpo_steps"]:
        prop = {**ta.base_property(prop, a.steps, settings, prop["bound"]), "pretrain_steps": prop["pretrain_steps"]}
    built = prep["base_build"]
    print(f"[demo] base: the shipped checkpoint ({os.path.relpath(ta.VARIANTS['demo']['shipped_base']['path'], REPO_ROOT)}"
          f", SHA-256 checked; rule {built['rule']}, {built['steps']} pre-training steps, seed {built['seed']}, built on "
          f"{built['machine']} at commit {built['commit'][:12]}); measured on this machine: {ta.describe_property(prop)}",
          flush=True)
    if not prop["meets_bound"]:
        print(f"[demo] WARNING: the base misses the bound: on-policy GRPO can expect {prop['expected_rewarded']:.1f} "
              "rewarded samples and may learn from them, so 'GRPO never sees a reward' need not hold on this "
              "machine; running anyway", flush=True)
    if not prop.get("luffy_ok", True):
        print(f"[demo] WARNING: the base's probability of the expert's carry token ({prop['carry_mean']:.1e}) is "
              f"below its floor ({prop['carry_floor']:g}): LUFFY's shaped term may barely move it in "
              f"{a.steps} steps; running anyway", flush=True)

    procs, logs = {}, {}
    for method in METHODS:
        rdir = os.path.join(a.out, method)
        shutil.rmtree(rdir, ignore_errors=True)  # a fresh run each time (run.sh would resume a finished one)
        os.makedirs(rdir)
        env = {**os.environ, "VARIANT": "demo", "STEPS": str(a.steps), "EVAL_EVERY": str(a.eval_every),
               "ASSETS_DIR": assets, "OUTPUT_DIR": rdir, "LOGGER": "[console,file]", "SKIP_PREPARE": "1",
               "MODEL_PATH": prep["model"]}
        logs[method] = os.path.join(rdir, "run.log")
        with open(logs[method], "w") as f:
            procs[method] = subprocess.Popen(
                ["bash", os.path.join(REPO_ROOT, "recipes", "toy_addition", "run.sh"), method, str(a.seed)],
                cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
            )  # fmt: skip
    print(f"[demo] training LUFFY and on-policy GRPO side by side, {a.steps} steps each (Ray start-up ~1 min); "
          f"logs: {logs['luffy']}, {logs['on_policy_grpo']}", flush=True)

    printed = {m: -1 for m in METHODS}
    metrics: dict = {m: {} for m in METHODS}
    while True:
        running = [m for m in METHODS if procs[m].poll() is None]
        for m in METHODS:
            try:
                metrics[m] = read_metrics(os.path.join(a.out, m, "metrics.jsonl"))
            except ValueError:  # a line being written: read it next time
                continue
            for step in sorted(s for s in metrics[m] if s > printed[m]):
                print(step_line(m, step, a.steps, metrics[m][step]), flush=True)
                printed[m] = step
        if not running:
            break
        time.sleep(1.0)
    failed = [m for m in METHODS if procs[m].returncode != 0]
    if failed:
        for m in failed:
            tail = open(logs[m], errors="replace").read().splitlines()[-30:]
            print(f"[demo] {m} failed (rc {procs[m].returncode}); last lines of {logs[m]}:\n" + "\n".join(tail))
        return 1

    curves = {m: {s: d[ID_KEY] for s, d in metrics[m].items() if ID_KEY in d} for m in METHODS}
    ood = {m: {s: d[OOD_KEY] for s, d in metrics[m].items() if OOD_KEY in d} for m in METHODS}
    png = os.path.join(a.out, "demo.png")
    plot({m: {a.seed: {"curve": curves[m]}} for m in METHODS}, METHODS, [a.seed], png,
         f"toy addition (demo variant), {a.steps} steps, seed {a.seed}, CPU")
    final = {m: curves[m][max(curves[m])] for m in METHODS}
    per_step = settings["train_batch_size"] * settings["n"]  # GRPO: every row is an on-policy sample
    rewarded = sum(round(d["critic/score/mean"] * per_step) for d in metrics["on_policy_grpo"].values()
                   if "critic/score/mean" in d)
    summary = {"steps": a.steps, "seed": a.seed, "wall_s": round(time.time() - t0, 1), "base_acc": base,
               "base_property": prop, "grpo_rewarded_samples": rewarded, "heldout": curves, "ood": ood,
               "final": final}
    with open(os.path.join(a.out, "demo.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"[demo] held-out greedy accuracy after {a.steps} steps: LUFFY {100 * curves['luffy'][0]:.1f}% -> "
          f"{100 * final['luffy']:.1f}%, on-policy GRPO {100 * curves['on_policy_grpo'][0]:.1f}% -> "
          f"{100 * final['on_policy_grpo']:.1f}%", flush=True)
    print(f"[demo] on-policy GRPO's rewarded samples: {rewarded} of {a.steps * per_step} (expected from the base: "
          f"{prop['expected_rewarded']:.2f}, bound < {prop['bound']:g} {'met' if prop['meets_bound'] else 'NOT met'})",
          flush=True)
    print(f"[demo] wrote {png} and demo.json; {time.time() - t0:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
