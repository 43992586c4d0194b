"""``python -m mix_src.planner``: per-GPU memory terms and GPU-hours of a recipe, before any GPU is rented.

    python -m mix_src.planner --config-path recipes/luffy_zero --config-name config \\
        --model Qwen/Qwen2.5-Math-7B --gpu a100-80gb [hydra overrides ...]

``--model``: a local model directory / ``config.json``, or a preset id (mix_src/planner/presets.py); default
``actor_rollout_ref.model.path``. Exit 2 when the states alone do not fit (what preflight refuses)."""

from __future__ import annotations

import argparse
import os
import sys

from mix_src.planner.check import format_plan, load_model_config, refusal, run_shape
from mix_src.planner.estimate import GPUS, count_params, plan_memory, plan_time

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")  # mix_src/config


def compose(config_path: str, config_name: str, overrides: list[str]):
    """The config exactly as ``python -m mix_src.main_mix_ppo --config-path ... --config-name ...`` composes it."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=os.path.abspath(config_path), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mix_src.planner", description=__doc__.splitlines()[0])
    ap.add_argument("--config-path", default=CONFIG_DIR)
    ap.add_argument("--config-name", default="mix_ppo")
    ap.add_argument("--model", help="model dir, config.json or preset id (default: actor_rollout_ref.model.path)")
    ap.add_argument("--gpu", default="a100-80gb", choices=sorted(GPUS))
    ap.add_argument("--steps", type=int, help="training steps (default: trainer.total_training_steps)")
    ap.add_argument("--mfu", type=float, default=0.3, help="model FLOPs utilisation of the training passes")
    ap.add_argument("--mean-response", type=float,
                    help="mean response tokens per row (default: half of data.max_response_length)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for mix_src.main_mix_ppo")
    args = ap.parse_args(argv)
    cfg = compose(args.config_path, args.config_name, args.overrides)
    model = args.model or cfg.actor_rollout_ref.model.path
    hf, source = load_model_config(model)
    if hf is None:
        print(f"planner: cannot read the model config: {source}; pass --model DIR|config.json|preset", file=sys.stderr)
        return 1
    run = run_shape(cfg, steps=args.steps)
    gpu = GPUS[args.gpu]
    mean = args.mean_response if args.mean_response is not None else run.response_len / 2
    mem = plan_memory(hf, run, gpu)
    time = plan_time(hf, run, gpu, mean_response=mean, mfu=args.mfu, kv_sequences=mem.kv_sequences) if run.steps else None
    n_params = count_params(hf)
    print(f"model config: {source}")
    print(format_plan(mem, time, run, n_params, mfu=args.mfu, mean_response=mean))
    if time is None:
        print("GPU-hours: no step budget (trainer.total_training_steps unset): pass --steps")
    why = refusal(n_params, run, gpu.memory_bytes)
    if why:
        print(f"REFUSED before Ray: {why}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
