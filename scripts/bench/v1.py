"""The two trainer bases on the cpu_tiny recipe: ``python -m scripts.bench v1 [--steps N]``.

Runs ``recipes/cpu_tiny`` (LUFFY: 4 prompts x n 4, one whole demonstration per prompt, responses <= 32 tokens)
three times in one invocation, on the same assets: the legacy ``MIXRayPPOTrainer`` (``trainer.use_v1=false``),
then verl's V1 trainer in ``sync`` and in ``colocate_async`` mode (``trainer.use_v1=true``). Prints each run's
median ``timing_s/step`` (first step excluded: warm-up), samples per second of step time (batch x n / step)
and the ratios V1 sync / legacy (step time) and colocate_async / sync (samples/s).
Needs a source checkout (it reuses tests/e2e.py and scripts/make_tiny_assets.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from scripts.bench.step import REPO, _helpers


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench v1")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    e2e, assets_mod = _helpers()
    batch, n = 4, 4  # recipes/cpu_tiny/config.yaml

    with tempfile.TemporaryDirectory(prefix="mix_bench_v1_") as tmp:
        tmp = Path(tmp)
        assets = assets_mod.build(str(tmp / "assets"), seed=0)
        common = [
            "--config-path", str(REPO / "recipes" / "cpu_tiny"), "--config-name", "config",
            f"data.train_files={assets['train']}", f"data.val_files={assets['val']}",
            f"actor_rollout_ref.model.path={assets['model']}",
            f"actor_rollout_ref.model.tokenizer_path={assets['tokenizer']}",
            f"trainer.total_training_steps={args.steps}", "trainer.logger=[console,file]", "trainer.save_freq=-1",
        ]  # fmt: skip
        runs = {
            "legacy": ["trainer.use_v1=false"],
            "V1 sync": ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"],
            "V1 colocate_async": ["trainer.use_v1=true", "trainer.v1.trainer_mode=colocate_async"],
        }
        rows = {}
        for label, extra in runs.items():
            print(f"running {label} ({args.steps} steps) ...", flush=True)
            workdir = tmp / label.replace(" ", "_")
            result = e2e.run_verl("mix_src.main_mix_ppo", common + extra, workdir, timeout=900, name="bench")
            steps = result.series("timing_s/step")
            if len(steps) < 2:
                raise SystemExit(f"{label}: only {len(steps)} steps logged; see {result.log_path}")
            median = statistics.median(steps[1:])
            rows[label] = (median, batch * n / median, result.wall_s, steps)

    print(f"\ncpu_tiny: {batch} prompts x n={n}, {args.steps} steps")
    print(f"{'run':18s} {'median step s':>14s} {'samples/s':>10s} {'wall s':>8s}  step times")
    for label, (median, sps, wall, steps) in rows.items():
        print(f"{label:18s} {median:14.3f} {sps:10.2f} {wall:8.1f}  {[round(s, 2) for s in steps]}")
    print(f"\nstep-time ratio V1 sync / legacy = {rows['V1 sync'][0] / rows['legacy'][0]:.3f}")
    print(f"throughput ratio colocate_async / sync = {rows['V1 colocate_async'][1] / rows['V1 sync'][1]:.3f}")
