"""Time the data check before Ray (mix_src/config/data_check.py) on a synthetic file shaped like LUFFY's training set.

    python -m scripts.data.time_data_check [--rows 46000] [--tokenizer DIR] [--out DIR]

Writes ``--rows`` rows with the schema of ``Elliott/Openr1-Math-46k-8192`` (tests/test_data_prep.py
``luffy_train_rows``: LUFFY's system prompt + a problem of ~300 characters, a ~12,000-character target) and times
(1) opening the file and sorting its rows (what every run pays), (2) the prompt-length check (paid unless
``data.truncation=left`` without ``data.filter_overlong_prompts``), under ``--tokenizer`` (default: the tiny CPU
tokenizer, built into ``--out``). Prints the seconds of each.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from scripts.data.prepare_openr1 import SYSTEM_PROMPT


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "let the sum of all integers x such that be find prove triangle circle area".split()
    rows = []
    for i in range(n):
        problem = " ".join(rng.choice(words) for _ in range(60))  # ~300 characters, like an OpenR1-Math problem
        target = "<think>\n" + " ".join(rng.choice(words) for _ in range(2400)) + f"\n</think>\n\n\\boxed{{{i}}}"
        rows.append({"data_source": "", "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                                   {"role": "user", "content": problem}],
                     "target": [{"role": "assistant", "content": target}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(i)},
                     "extra_info": {"split": "default", "index": i}})
    return rows


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=46000)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the tiny CPU tokenizer)")
    p.add_argument("--out", default="/tmp/mix_src_data_check_bench")
    a = p.parse_args(argv)

    import pandas as pd
    from omegaconf import OmegaConf

    from mix_src.config.data_check import check_file, check_prompt_lengths

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"luffy_shaped_{a.rows}.parquet")
    if not os.path.exists(path):
        pd.DataFrame(synthetic_rows(a.rows)).to_parquet(path)
    tokenizer = a.tokenizer
    if tokenizer is None:
        from scripts.make_tiny_assets import build_tokenizer

        tokenizer = os.path.join(a.out, "tokenizer")
        build_tokenizer(tokenizer)
    config = OmegaConf.create({"data": {"max_prompt_length": 1 << 20, "filter_overlong_prompts": False,
                                        "truncation": "error", "apply_chat_template_kwargs": {}},
                               "actor_rollout_ref": {"model": {"path": tokenizer}}})
    t0 = time.perf_counter()
    report = check_file(path, "data.train_files", "prompt", "target")
    t1 = time.perf_counter()
    check_prompt_lengths(config, "data.train_files", report)
    t2 = time.perf_counter()
    out = {"rows": report.rows, "file_mb": os.path.getsize(path) / 2**20, "open_and_rows_s": t1 - t0,
           "prompt_lengths_s": t2 - t1}
    print(f"{report.rows} rows ({out['file_mb']:.0f} MiB): file opened and rows checked in {out['open_and_rows_s']:.1f} s; "
          f"prompt lengths under {tokenizer} in {out['prompt_lengths_s']:.1f} s")
    return out


if __name__ == "__main__":
    main()
