"""Step-time overhead of the MIX trainer: ``python -m mix_src.bench step [--steps N] [--n N] [--batch B]``.

Runs the CPU tiny config twice in one invocation, side by side on the same assets and sizes: verl's stock
``python -m verl.trainer.main_ppo`` (GRPO, legacy trainer) and ``python -m mix_src.main_mix_ppo`` with
``mix.n_prefix=0`` (same GRPO maths through our trainer, agent loop and loss). Prints the median
``timing_s/step`` of each (first step excluded: warm-up) and the ratio MIX / stock (target <= 1.10).
Needs a source checkout (it reuses tests/e2e.py and scripts/make_tiny_assets.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _helpers():
    sys.path.insert(0, str(REPO / "tests"))
    import conftest  # noqa: F401  (tests/ on sys.path)
    import e2e

    return e2e, conftest.load_make_tiny_assets()


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m mix_src.bench step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=32)
    args = ap.parse_args(argv)
    e2e, assets_mod = _helpers()

    with tempfile.TemporaryDirectory(prefix="mix_bench_step_") as tmp:
        tmp = Path(tmp)
        assets = assets_mod.build(str(tmp / "assets"), seed=0)
        common = e2e.tiny_overrides(
            assets, steps=args.steps, batch_size=args.batch, n=args.n, response_length=args.response_length
        ) + ["algorithm.adv_estimator=grpo", "trainer.use_v1=false"]
        runs = {
            "stock verl GRPO": ("verl.trainer.main_ppo", e2e.STOCK_VERL_CPU + common),
            "MIX n_prefix=0": ("mix_src.main_mix_ppo", e2e.MIX_CPU + common + ["mix.n_prefix=0"]),
        }
        rows = {}
        for label, (module, overrides) in runs.items():
            print(f"running {label} ({args.steps} steps) ...", flush=True)
            result = e2e.run_verl(module, overrides, tmp / label.split()[0], timeout=900, name="bench")
            steps = result.series("timing_s/step")
            if len(steps) < 2:
                raise SystemExit(f"{label}: only {len(steps)} steps logged; see {result.log_path}")
            rows[label] = (statistics.median(steps[1:]), steps, result.wall_s, result.peak_rss_mb)

    print(f"\nCPU tiny config: batch {args.batch} prompts x n={args.n}, response <= {args.response_length} tokens")
    print(f"{'run':18s} {'median step s':>14s} {'wall s':>8s} {'peak RSS MB':>12s}  step times")
    for label, (median, steps, wall, rss) in rows.items():
        print(f"{label:18s} {median:14.3f} {wall:8.1f} {rss:12.0f}  {[round(s, 2) for s in steps]}")
    base, mix = rows["stock verl GRPO"][0], rows["MIX n_prefix=0"][0]
    print(f"\nstep-time ratio MIX / stock = {mix / base:.3f}  (target <= 1.10)")
