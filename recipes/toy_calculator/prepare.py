"""Data prep of the toy_calculator environment: train / heldout / ood parquets in verl's schema with the
expert episode as a JSON ``target``; episodes longer than ``--max-response-length`` response tokens (as the
agent loop lays them out with ``--tokenizer``) are dropped and counted.

    python recipes/toy_calculator/prepare.py --tokenizer TOK_DIR --out OUT [--n-train 512] [--seed 0]
        [--max-response-length 128]

Prints one JSON line per split: {"split", "path", "rows", "dropped_too_long", "no_expert"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def prepare(tokenizer_path: str, out: str, *, n_train: int = 512, n_eval: int = 64, seed: int = 0,
            max_response_length: int = 128) -> dict:  # fmt: skip
    import pandas as pd
    from transformers import AutoTokenizer

    import scripts.experiments.toy_tasks.calculator  # noqa: F401  (registers the environment)
    from mix_src.rollout.environments import get_environment

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    env = get_environment("toy_calculator")
    os.makedirs(out, exist_ok=True)
    report = {}
    for split, n in (("train", n_train), ("heldout", n_eval), ("ood", n_eval)):
        rows, stats = env.rows(split, n, seed, tokenizer=tok, max_response_length=max_response_length)
        path = os.path.join(os.path.abspath(out), f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(path)
        report[split] = {"split": split, "path": path, **stats}
        print(json.dumps(report[split]))
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=512)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-response-length", type=int, default=128)
    a = p.parse_args(argv)
    prepare(a.tokenizer, a.out, n_train=a.n_train, n_eval=a.n_eval, seed=a.seed,
            max_response_length=a.max_response_length)  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
