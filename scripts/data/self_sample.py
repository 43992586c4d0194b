"""Self-sourced traces, offline (issue #55 item 2; PrefixRL, arXiv 2601.18795, sources its traces by rejection sampling
with the base model): sample ``--k`` responses per prompt of a training parquet from a model, keep those the training
reward verifies, and write them as each row's ``target_lst`` (distinct, in sample order; ``mix.data.use_target_lst``
reads them, ``recipes/prefix_rl`` draws its prefixes from them). Reports the generation FLOPs spent (both counts of
mix_src/algo/flops.py, ``rollout_flops``: ``F(P + R)`` per sample) and the pass rate per prompt.

    python -m scripts.data.self_sample --model ckpt/ --input data/openr1.parquet --output data/self.parquet \\
        [--k 8] [--temperature 1.0] [--max-new-tokens 8192] [--backend auto|vllm|cpu] [--seed 0] \\
        [--reward-path pkg://my.module --reward-name compute_score] [--drop-target]

The reward is the training run's: math-verify's (mix_src/rewards, the default) or the run's custom reward function,
given as verl's ``reward.custom_reward_function.path`` / ``.name`` (a file or ``pkg://module``, loaded by verl's own
``load_extern_object``; it returns a dict with ``acc`` or ``score``, or a number). ``--drop-target`` writes ``target``
as null, so that the model's own verified samples are the only guidance (PrefixRL's self-improvement setting); by
default the input's ``target`` is kept and joins the drawn set.

Backends: ``cpu`` is the CPU backend's own sampler (mix_src/cpu/sampling.py ``generate_batch``: one seeded generator
per sample, seed = ``seed * 1e6 + row * k + j``, so a sample does not depend on its batch-mates); ``vllm`` is
scripts/eval/evaluate.py's vLLM generator (GPU; not run by this repository's tests). ``auto``: vLLM when installed
and a GPU is present.

Output: the input rows with ``target_lst`` replaced by the verified samples (a row with none keeps an empty list:
with ``use_target_lst`` it trains on its ``target`` alone, or on-policy) and a ``self_pass_rate`` column (verified /
k). ``--summary`` (default ``<output>.json``): ``flops`` {6n, full}, prompts, samples, verified, pass rates. These
FLOPs are what a run using the file spent before training; teacher traces from elsewhere are free to it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from scripts.eval.evaluate import build_prompts, score_samples, think_settings


def cpu_generator(model_path: str, tokenizer, *, k: int, temperature: float, top_p: float, max_new_tokens: int,
                  seed: int, batch_size: int):
    """prompts -> per prompt ``k`` x (text, response token ids), by the CPU backend's sampler."""
    import torch
    from transformers import AutoModelForCausalLM

    from mix_src.cpu.sampling import SamplingSpec, generate_batch

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = {t for t in (tokenizer.eos_token_id,) if t is not None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)

    def generate(prompts: list[str]) -> list[list[tuple[str, list[int]]]]:
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        flat = [(i, j) for i in range(len(prompts)) for j in range(k)]
        out: list[list[tuple[str, list[int]]]] = [[] for _ in prompts]
        for start in range(0, len(flat), batch_size):
            chunk = flat[start:start + batch_size]
            specs = [SamplingSpec(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  seed=seed * 1_000_000 + i * k + j) for i, j in chunk]
            for (i, _), (tokens, _) in zip(chunk, generate_batch(model, [ids[i] for i, _ in chunk], specs, eos, pad)):
                out[i].append((tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True), tokens))
        return out

    return generate


def keep_verified(samples: list[list[tuple[str, list[int]]]], records: list[dict], k: int) -> tuple[list, np.ndarray]:
    """Per prompt: the distinct verified texts (``acc > 0``, in sample order) and the pass rate (verified / k, counting
    repeats). ``records``: :func:`scripts.eval.evaluate.score_samples`'s, one per sample."""
    verified = [[] for _ in samples]
    passed = np.zeros(len(samples))
    for r in records:
        if float(r.get("acc", r.get("score", 0.0)) or 0.0) > 0:
            passed[r["row"]] += 1
            if r["response"] not in verified[r["row"]]:
                verified[r["row"]].append(r["response"])
    return verified, passed / k


def custom_scorer(path: str, name: str):
    """records of a custom verl reward function ``name`` in ``path`` (verl's ``load_extern_object``: a file or
    ``pkg://module``), in :func:`scripts.eval.evaluate.score_samples`'s shape (what :func:`keep_verified` reads)."""
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(path, name)

    def score(rows: list[dict], samples: list[list[tuple[str, int]]]) -> list[dict]:
        out = []
        for i, s in enumerate(samples):
            for j, (text, _n) in enumerate(s):
                r = fn(rows[i]["data_source"], text, rows[i]["reward_model"].get("ground_truth"), rows[i]["extra_info"])
                acc = float(r.get("acc", r.get("score", 0.0))) if isinstance(r, dict) else float(r)
                out.append({"row": i, "sample": j, "response": text, "acc": acc})
        return out

    return score


def pass_at_k(correct: np.ndarray, n: int, ks) -> dict[int, float]:
    """The unbiased pass@k estimator (Chen et al. 2021, arXiv 2107.03374, eq. 1) averaged over prompts:
    ``1 - C(n - c, k) / C(n, k)`` per prompt with ``c`` of its ``n`` samples correct; ``ks`` <= n."""
    from math import comb

    return {k: float(np.mean([1.0 - comb(n - int(c), k) / comb(n, k) for c in correct])) for k in ks if k <= n}


def generation_flops(model_path: str, prompt_lens, response_lens) -> dict[str, float]:
    from transformers import AutoConfig

    from mix_src.algo.flops import COUNTS, ModelShape, rollout_flops

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_path).to_dict())
    return {c: float(rollout_flops(shape, prompt_lens, response_lens, response_lens, c)) for c in COUNTS}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", required=True, help="local model folder (HF format)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    p.add_argument("--input", required=True, help="training parquet (prompt, reward_model, data_source)")
    p.add_argument("--output", required=True, help="the parquet to write")
    p.add_argument("--summary", default=None, help="JSON summary (default: <output>.json)")
    p.add_argument("--k", type=int, default=8, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8192)
    p.add_argument("--backend", choices=("auto", "vllm", "cpu"), default="auto")
    p.add_argument("--batch-size", type=int, default=16, help="samples per CPU sampler call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=5.0, help="grading deadline per sample, seconds")
    p.add_argument("--reward-path", default=None,
                   help="the run's custom reward (verl's reward.custom_reward_function.path; default: math-verify)")
    p.add_argument("--reward-name", default="compute_score", help="its function (reward.custom_reward_function.name)")
    p.add_argument("--drop-target", action="store_true",
                   help="write target as null: only the verified samples guide (PrefixRL's self-sourced setting)")
    a = p.parse_args(argv)
    for name in ("k", "max_new_tokens", "batch_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not a.temperature > 0 or not 0 < a.top_p <= 1:
        p.error(f"rejection sampling needs --temperature > 0 and 0 < --top-p <= 1, got {a.temperature}, {a.top_p}")
    if not os.path.isdir(a.model):
        raise SystemExit(f"error: --model {a.model} is not a folder (a local HF checkpoint is needed)")
    import pandas as pd
    from transformers import AutoTokenizer

    df = pd.read_parquet(a.input)
    missing = [c for c in ("prompt", "reward_model", "data_source") if c not in df.columns]
    if missing:
        raise SystemExit(f"error: --input {a.input} has no column(s) {missing}; its columns are {list(df.columns)}")
    rows = [{"prompt": [dict(m) for m in r["prompt"]], "reward_model": dict(r["reward_model"]),
             "data_source": r["data_source"], "extra_info": dict(r["extra_info"]) if r.get("extra_info") is not None
             else None} for r in df.to_dict("records")]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer or a.model)
    prompts = build_prompts(tokenizer, rows, drop_system_prompt=False)
    backend = a.backend
    if backend == "auto":
        import importlib.util

        import torch

        backend = "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "cpu"
    start = time.time()
    if backend == "cpu":
        samples = cpu_generator(a.model, tokenizer, k=a.k, temperature=a.temperature, top_p=a.top_p,
                                max_new_tokens=a.max_new_tokens, seed=a.seed, batch_size=a.batch_size)(prompts)
    else:  # pragma: no cover (GPU)
        from scripts.eval.evaluate import vllm_generator

        gen = vllm_generator(a.model, tokenizer, n=a.k, temperature=a.temperature, top_p=a.top_p,
                             max_new_tokens=a.max_new_tokens, seed=a.seed, tensor_parallel_size=1,
                             tokenizer_path=a.tokenizer or a.model)
        samples = [[(text, [0] * n) for text, n in s] for s in gen(prompts)]
    graded = [[(t, len(ids)) for t, ids in s] for s in samples]
    if a.reward_path:
        records = custom_scorer(a.reward_path, a.reward_name)(rows, graded)
    else:
        starts, require_think = think_settings(prompts, rows, "auto")
        records = score_samples(rows, graded, starts, require_think, a.timeout)
    verified, rates = keep_verified(samples, records, a.k)
    prompt_lens = [len(tokenizer(pr, add_special_tokens=False)["input_ids"]) for pr, s in zip(prompts, samples) for _ in s]
    response_lens = [len(ids) for s in samples for _, ids in s]
    flops = generation_flops(a.model, prompt_lens, response_lens)

    df = df.copy()
    df["target_lst"] = verified
    df["self_pass_rate"] = rates
    if a.drop_target:
        df["target"] = None
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    df.to_parquet(a.output)
    summary = {"input": a.input, "output": a.output, "backend": backend, "k": a.k, "prompts": len(rows),
               "samples": len(response_lens), "verified": int(round(float(rates.sum()) * a.k)),
               "prompts_with_a_trace": int(sum(bool(v) for v in verified)), "pass_rate_mean": float(rates.mean()),
               "pass_rate_per_prompt": [float(r) for r in rates],
               "pass_at_k": pass_at_k(np.rint(rates * a.k), a.k, sorted({1, 2, 4, 8, 16, 32, 64, a.k})),
               "reward": f"{a.reward_path}:{a.reward_name}" if a.reward_path else "math-verify (mix_src.rewards)",
               "target_dropped": a.drop_target, "flops": flops, "seconds": time.time() - start}
    with open(a.summary or os.path.splitext(a.output)[0] + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    print(f"[self_sample] {len(rows)} prompts x {a.k} samples ({backend}): {summary['verified']} verified, "
          f"{summary['prompts_with_a_trace']} prompts with a trace, mean pass rate {summary['pass_rate_mean']:.3f}, "
          f"pass@{a.k} {summary['pass_at_k'][a.k]:.3f}; "
          f"generation FLOPs {flops['full']:.4g} (full), {flops['6n']:.4g} (6n); wrote {a.output}")
    return summary


if __name__ == "__main__":
    main()
