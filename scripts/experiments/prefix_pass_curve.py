"""The pass-rate curve p(ratio) of a toy task's model conditioned on a prefix of the expert trace (issue #56's evidence):
what PrefixRL (arXiv 2601.18795) and pass-rate control (arXiv 2605.05112) act on. For each ratio r the model continues
the first ``h = floor(r * |y + EOS|)`` tokens of the row's expert trace ``y`` (mix_src's prefix rule,
mix_src/algo/prefix.py), sampling at temperature 1 (the rollout's sampler settings); the answer (prefix +
continuation) is scored with the task's reward. The prefix is context: a prefix that already holds the hard token
makes the continuation easy, one that stops before it leaves the problem as hard as unprefixed.

    python -m scripts.experiments.prefix_pass_curve --task addition --assets outputs/evidence56/assets/addition \\
        [--ratios 0 0.1 0.2 0.3 0.5 0.7 0.9] [--samples 8] [--rows 200] [--split train] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os

from mix_src.algo.prefix import build_prefix
from scripts.experiments import toy_addition as ta
from scripts.experiments.toy_sort import _prompt_ids


def curve(model_dir: str, tokenizer_dir: str, parquet: str, compute_score, ratios, samples: int, rows: int,
          max_new_tokens: int, seed: int = 0) -> dict:
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    tok = ta.load_tokenizer(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    df = pd.read_parquet(parquet).head(rows)
    out = {}
    for r in ratios:
        torch.manual_seed(seed)
        solved = per_row = 0
        rates = []
        for _, row in df.iterrows():
            target = tok(row["target"][0]["content"], add_special_tokens=False)["input_ids"]
            prefix = build_prefix(target, r, tok.eos_token_id)[: len(target)]  # a continuation is left (ratio 1: EOS)
            h = len(prefix)
            ids = torch.tensor([_prompt_ids(tok, row["prompt"][0]["content"]) + prefix])
            with torch.no_grad():
                gen = model.generate(input_ids=ids.repeat(samples, 1), attention_mask=torch.ones_like(ids).repeat(samples, 1),
                                     do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=max(1, max_new_tokens - h), pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, ids.shape[1] - h:], skip_special_tokens=True)
            ok = [compute_score(row["data_source"], t, row["reward_model"]["ground_truth"])["acc"] for t in texts]
            solved += sum(ok)
            per_row += 1
            rates.append(sum(ok) / samples)
        out[f"{r:g}"] = {"pass_rate": solved / (per_row * samples),
                         "groups_in_band_0.25_0.75": sum(0.25 <= x <= 0.75 for x in rates) / len(rates),
                         "groups_mixed": sum(0 < x < 1 for x in rates) / len(rates)}
        print(f"[prefix_pass_curve] ratio {r:g}: pass rate {100 * out[f'{r:g}']['pass_rate']:.1f}%, groups in "
              f"[0.25, 0.75] {100 * out[f'{r:g}']['groups_in_band_0.25_0.75']:.1f}%, mixed "
              f"{100 * out[f'{r:g}']['groups_mixed']:.1f}%", flush=True)
    return out


def main(argv=None) -> int:
    from scripts.experiments.compare import TASKS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--assets", required=True, help="the task's assets folder (compare.py's OUT/assets/<task>)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--split", default="train", choices=["train", "heldout"])
    p.add_argument("--model", default=None, help="default: the assets' base_seed0")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    task = TASKS[a.task]
    res = curve(a.model or os.path.join(a.assets, "base_seed0"), os.path.join(a.assets, "tokenizer"),
                os.path.join(a.assets, f"{a.split}.parquet"), task.compute_score, a.ratios, a.samples, a.rows,
                task.max_response_length)
    if a.out:
        json.dump({"args": vars(a), "curve": res}, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
