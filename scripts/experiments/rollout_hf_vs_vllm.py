"""CPU backend rollout choice: the toy-addition LUFFY step with rollout ``hf`` vs ``vllm``, side by side.

    python scripts/experiments/rollout_hf_vs_vllm.py [--steps 4] [--assets outputs/toy_addition]

Runs ``bash recipes/toy_addition/run.sh luffy 0`` (32 prompts x n 8 per step, python -m mix_src.main_mix_ppo
on the CPU backend) once per rollout, one after the other, each as its own process tree (tests/e2e.py's
``run_command``: peak RSS summed over the tree, Ray and the rollout server included). Prints, per rollout:
median generation time (``timing_s/gen``) and step time (``timing_s/step``) over the steps after the first,
job start-up (wall time minus the steps and the final validation: Ray, workers, rollout engine), peak RSS; then the ratios vllm / hf.
Needs a source checkout and the toy assets (run.sh builds them on first use, a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from e2e import cpu_env, read_metrics, run_command  # noqa: E402


def run_one(rollout: str, steps: int, assets: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = cpu_env({"ASSETS_DIR": str(assets), "OUTPUT_DIR": str(out), "STEPS": str(steps), "EVAL_EVERY": "1000",
                   "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"), "LOGGER": "[console,file]"})  # fmt: skip
    cmd = ["bash", str(REPO / "recipes/toy_addition/run.sh"), "luffy", "0",
           f"actor_rollout_ref.rollout.name={rollout}", "trainer.val_before_train=false", "trainer.save_freq=-1"]  # fmt: skip
    rc, wall, rss, timed_out, _ = run_command(cmd, env, out / "run.log", timeout=1800, cwd=out)
    if rc != 0 or timed_out:
        raise SystemExit(f"{rollout}: exit {rc} (timed out: {timed_out}); see {out / 'run.log'}")
    metrics = [m for m in read_metrics(out / "metrics.jsonl") if "timing_s/step" in m]
    step = [m["timing_s/step"] for m in metrics]
    gen = [m["timing_s/gen"] for m in metrics]
    testing = sum(m.get("timing_s/testing", 0.0) for m in metrics)  # verl's final validation pass
    return {"rollout": rollout, "steps": len(step), "gen_s": statistics.median(gen[1:]),
            "step_s": statistics.median(step[1:]), "startup_s": wall - sum(step) - testing, "wall_s": wall,
            "peak_rss_mib": rss, "step_times": [round(s, 2) for s in step], "gen_times": [round(g, 2) for g in gen]}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--assets", default=str(REPO / "outputs/toy_addition"))
    ap.add_argument("--out", default=str(REPO / "outputs/rollout_hf_vs_vllm"))
    a = ap.parse_args(argv)
    rows = [run_one(r, a.steps, Path(a.assets), Path(a.out) / r) for r in ("hf", "vllm")]
    print(f"toy-addition LUFFY step, 32 prompts x n 8, {a.steps} steps (medians exclude step 1), {os.cpu_count()} CPUs")
    print(f"{'rollout':8s} {'gen s':>7s} {'step s':>7s} {'start-up s':>10s} {'peak RSS MiB':>12s}")
    for r in rows:
        print(f"{r['rollout']:8s} {r['gen_s']:7.2f} {r['step_s']:7.2f} {r['startup_s']:10.1f} {r['peak_rss_mib']:12.0f}")
    hf, vl = rows
    print(f"ratios vllm / hf: gen {vl['gen_s'] / hf['gen_s']:.2f}, step {vl['step_s'] / hf['step_s']:.2f}, "
          f"start-up {vl['startup_s'] / hf['startup_s']:.2f}, peak RSS {vl['peak_rss_mib'] / hf['peak_rss_mib']:.2f}")
    (Path(a.out) / "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
