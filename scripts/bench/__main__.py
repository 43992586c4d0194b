"""Dispatch ``python -m scripts.bench NAME [args...]`` to ``scripts.bench.NAME.main(args)``."""

import importlib
import sys

BENCHMARKS = {
    "core": "grpo_split vs loop and its floor; mixed token loss vs plain PPO-clip (time, peak memory)",
    "rewards": "math-verify reward: sequential vs batch API throughput, worst-case latency",
    "step": "CPU tiny config: stock verl GRPO vs MIX trainer at n_prefix=0, step-time ratio; --toy: the toy "
    "LUFFY step's stage breakdown vs a plain-torch reference loop",
    "v1": "cpu_tiny recipe: legacy MIX trainer vs V1 sync vs V1 colocate_async, step time and samples/s",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in (*BENCHMARKS, "all"):
        print("usage: python -m scripts.bench {" + ",".join([*BENCHMARKS, "all"]) + "} [args...]")
        for name, what in BENCHMARKS.items():
            print(f"  {name:8s} {what}")
        return 2
    names = list(BENCHMARKS) if argv[0] == "all" else [argv[0]]
    for name in names:
        print(f"=== bench {name} ===", flush=True)
        importlib.import_module(f"scripts.bench.{name}").main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
