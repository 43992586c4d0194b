"""Evaluate a checkpoint on a validation parquet (e.g. from scripts/data/prepare_eval.py).

Generates with vLLM when it is installed and a GPU is present, otherwise with HF transformers (fine for
tiny models on a CPU); grades every sample with the training reward (mix_src.rewards, math-verify in
worker processes with a hard timeout); prints a per-``data_source`` table and the **unweighted** average
over sources (as LUFFY reports it); writes everything to a JSON file.

    python -m scripts.eval.evaluate --model ckpt/ --data data/valid.parquet --output results.json \\
        [--n 1] [--temperature 0.6] [--top-p 1.0] [--max-new-tokens 8192] [--backend auto|vllm|hf]

Differences from LUFFY's ``eval_scripts/generate_vllm.py``: the system prompt is kept (pass
``--drop-system-prompt`` for LUFFY's behaviour); the response counts as starting inside ``<think>`` only
when the templated prompt ends with ``<think>`` (LUFFY always prepends it); with ``--think auto`` a
missing ``</think>`` is a format error only when the prompts ask for think tags.
A row whose ground truth cannot be graded (empty, or not an option label on a multiple-choice row) or a
sample the grader cannot decide scores as wrong and is counted in the ``ungradable`` column; the
evaluation goes on. Repeated rows (``prepare_eval.py --repeat``) and ``--n`` both average into avg@k.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable



# ------------------------------------------------------------------------------------------- prompts
def load_rows(path: str, max_rows: int = 0) -> list[dict]:
    import pandas as pd

    if not os.path.exists(path):
        raise SystemExit(f"error: --data {path} does not exist")
    df = pd.read_parquet(path)
    missing = [c for c in ("prompt", "reward_model", "data_source") if c not in df.columns]
    if missing:
        raise SystemExit(f"error: {path} has no column(s) {missing}; its columns are {list(df.columns)}. "
                         "Make it with scripts/data/prepare_eval.py")
    if max_rows:
        df = df.iloc[:max_rows]
    rows = df.to_dict("records")
    for r in rows:  # a row whose ground truth cannot be graded is still evaluated: it scores wrong, counted
        r["prompt"] = [dict(m) for m in r["prompt"]]
        r["reward_model"] = dict(r["reward_model"]) if isinstance(r.get("reward_model"), dict) else {}
        r["extra_info"] = dict(r["extra_info"]) if isinstance(r.get("extra_info"), dict) else {}
    return rows


def build_prompts(tokenizer, rows: list[dict], drop_system_prompt: bool) -> list[str]:
    prompts = []
    for r in rows:
        messages = [m for m in r["prompt"] if not (drop_system_prompt and m["role"] == "system")]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return prompts


# ---------------------------------------------------------------------------------------- generation
GenerateFn = Callable[[list[str]], list[list[tuple[str, int]]]]  # prompts -> per prompt: n x (text, tokens)


def pick_backend(requested: str) -> tuple[str, str]:
    import importlib.util

    if requested != "auto":
        return requested, "requested"
    has_vllm = importlib.util.find_spec("vllm") is not None
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_vllm and has_gpu:
        return "vllm", "vllm installed and a GPU present"
    return "hf", ("no GPU" if not has_gpu else "vllm not installed") + ": HF transformers generate"


def hf_generator(model_path: str, tokenizer, *, n: int, temperature: float, top_p: float, max_new_tokens: int,
                 batch_size: int, seed: int, dtype: str) -> GenerateFn:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
                   "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id
    stop_ids = {eos, tokenizer.pad_token_id} - {None}

    def generate(prompts: list[str]) -> list[list[tuple[str, int]]]:
        torch.manual_seed(seed)
        out: list[list[tuple[str, int]]] = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, num_return_sequences=n,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
            if temperature > 0:
                kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=None)
            else:
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            with torch.no_grad():
                seqs = model.generate(**enc, **kw)
            new = seqs[:, enc["input_ids"].shape[1]:].tolist()
            for i in range(len(chunk)):
                samples = []
                for ids in new[i * n:(i + 1) * n]:
                    cut = next((k for k, t in enumerate(ids) if t in stop_ids), len(ids))
                    samples.append((tokenizer.decode(ids[:cut], skip_special_tokens=True), min(cut + 1, len(ids))))
                out.append(samples)
        return out

    return generate


def vllm_generator(model_path: str, tokenizer, *, n: int, temperature: float, top_p: float, max_new_tokens: int,
                   seed: int, tensor_parallel_size: int, tokenizer_path: str) -> GenerateFn:  # pragma: no cover (GPU)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, tokenizer=tokenizer_path, seed=seed, tensor_parallel_size=tensor_parallel_size)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                            max_tokens=max_new_tokens, seed=seed, skip_special_tokens=True)

    def generate(prompts: list[str]) -> list[list[tuple[str, int]]]:
        inputs = [{"prompt_token_ids": tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts]
        outs = llm.generate(inputs, params)
        return [[(o.text, len(o.token_ids)) for o in out.outputs] for out in outs]

    return generate


# ------------------------------------------------------------------------------------------- scoring
def think_settings(prompts: list[str], rows: list[dict], mode: str) -> tuple[list[bool], bool]:
    """Per row: does the response start inside <think>? And is a think block required?"""
    starts = [p.rstrip().endswith("<think>") for p in prompts]
    if mode == "required":
        return starts, True
    if mode == "optional":
        return starts, False
    asks = any(starts) or any("</think>" in m["content"] for r in rows for m in r["prompt"])
    return starts, asks


def score_samples(rows: list[dict], samples: list[list[tuple[str, int]]], starts_in_think: list[bool],
                  require_think: bool, timeout_s: float = 5.0) -> list[dict]:
    """Grade every sample with the training reward; returns one record per sample."""
    from mix_src.rewards import compute_score_batch

    flat = [(i, j, text, ntok) for i, s in enumerate(samples) for j, (text, ntok) in enumerate(s)]
    records: list[dict] = [{} for _ in flat]
    for flag in (True, False):  # the batch API takes one option set per call
        idx = [k for k, (i, *_rest) in enumerate(flat) if starts_in_think[i] == flag]
        if not idx:
            continue
        results = compute_score_batch(
            [rows[flat[k][0]]["data_source"] for k in idx], [flat[k][2] for k in idx],
            [rows[flat[k][0]]["reward_model"].get("ground_truth") for k in idx],
            [rows[flat[k][0]]["extra_info"] for k in idx],
            starts_in_think=flag, require_think=require_think, timeout_s=timeout_s)
        for k, res in zip(idx, results):
            i, j, text, ntok = flat[k]
            records[k] = {"row": i, "sample": j, "data_source": rows[i]["data_source"],
                          "ground_truth": str(rows[i]["reward_model"].get("ground_truth")), "response": text,
                          "response_tokens": ntok, **res}
    return records


def summarize(records: list[dict]) -> dict:
    per: dict[str, dict] = {}
    for r in records:
        s = per.setdefault(r["data_source"], {"n": 0, "acc": 0.0, "format_ok": 0.0, "score": 0.0, "tokens": 0,
                                               "ungradable": 0})
        s["n"] += 1
        s["ungradable"] += int(bool(r.get("ungradable", False)))
        s["acc"] += float(r["acc"])
        s["format_ok"] += float(r["format_ok"])
        s["score"] += float(r["score"])
        s["tokens"] += r["response_tokens"]
    table = {src: {"n": s["n"], "acc": s["acc"] / s["n"], "format_ok": s["format_ok"] / s["n"],
                   "mean_score": s["score"] / s["n"], "mean_response_tokens": s["tokens"] / s["n"],
                   "ungradable": s["ungradable"]}
             for src, s in sorted(per.items())}
    average = sum(t["acc"] for t in table.values()) / len(table) if table else float("nan")
    return {"per_source": table, "average_acc": average}


def print_table(summary: dict) -> None:
    print(f"{'data_source':24s} {'n':>6s} {'acc':>7s} {'format_ok':>9s} {'tokens':>8s} {'ungradable':>10s}")
    for src, t in summary["per_source"].items():
        print(f"{src:24s} {t['n']:6d} {t['acc']:7.3f} {t['format_ok']:9.3f} {t['mean_response_tokens']:8.1f} "
              f"{t['ungradable']:10d}")
    print(f"{'average (unweighted)':24s} {'':6s} {summary['average_acc']:7.3f}   "
          f"over {len(summary['per_source'])} data sources")


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", required=True, help="local model folder (HF format)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    p.add_argument("--data", required=True, help="validation parquet (prompt, reward_model, data_source)")
    p.add_argument("--output", required=True, help="JSON result file")
    p.add_argument("--samples-output", default=None, help="also write every sample to this .jsonl")
    p.add_argument("--backend", choices=("auto", "vllm", "hf"), default="auto")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (LUFFY: 0.6)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per HF generate call")
    p.add_argument("--max-rows", type=int, default=0, help="only the first N rows (0 = all)")
    p.add_argument("--drop-system-prompt", action="store_true", help="LUFFY's eval drops the system message")
    p.add_argument("--think", choices=("auto", "required", "optional"), default="auto",
                   help="is a missing </think> a format error? auto: when the prompts ask for think tags")
    p.add_argument("--timeout", type=float, default=5.0, help="grading deadline per sample, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help="HF backend")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM backend")
    a = p.parse_args(argv)
    for name in ("n", "max_new_tokens", "batch_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.temperature < 0 or not 0 < a.top_p <= 1:
        p.error(f"need --temperature >= 0 and 0 < --top-p <= 1, got {a.temperature} and {a.top_p}")
    if a.n > 1 and a.temperature == 0:
        p.error("--n > 1 with --temperature 0 gives n identical greedy samples; set a temperature")
    if not os.path.isdir(a.model):
        raise SystemExit(f"error: --model {a.model} is not a folder (a local HF checkpoint is needed)")
    tok_path = a.tokenizer or a.model

    from transformers import AutoTokenizer

    from mix_src.rewards import grading_stats, warmup

    t_start = time.time()
    rows = load_rows(a.data, a.max_rows)
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    prompts = build_prompts(tokenizer, rows, a.drop_system_prompt)
    starts, require_think = think_settings(prompts, rows, a.think)
    warmup(timeout_s=a.timeout)  # grading processes start while the model loads
    backend, why = pick_backend(a.backend)
    print(f"{len(rows)} prompts x {a.n} samples from {a.data}; backend {backend} ({why}); "
          f"think block {'required' if require_think else 'optional'}")
    kw = dict(n=a.n, temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens, seed=a.seed)
    if backend == "vllm":
        generate = vllm_generator(a.model, tokenizer, tensor_parallel_size=a.tensor_parallel_size,
                                  tokenizer_path=tok_path, **kw)
    else:
        generate = hf_generator(a.model, tokenizer, batch_size=a.batch_size, dtype=a.dtype, **kw)
    t_gen = time.time()
    samples = generate(prompts)
    t_gen = time.time() - t_gen
    stats0 = dict(grading_stats())
    t_score = time.time()
    records = score_samples(rows, samples, starts, require_think, a.timeout)
    t_score = time.time() - t_score
    grading = {k: v - stats0.get(k, 0) for k, v in grading_stats().items()}
    summary = summarize(records)
    print_table(summary)
    if grading.get("timeout") or grading.get("crashed"):
        print(f"grading: {grading.get('timeout', 0)} timeouts, {grading.get('crashed', 0)} crashed workers "
              "(scored as wrong)")
    n_bad = sum(t["ungradable"] for t in summary["per_source"].values())
    if n_bad:
        print(f"grading: {n_bad} samples could not be graded (scored as wrong; the reasons are logged above, and "
              "the 'ungradable' column counts them per data_source)")

    result = {
        "model": os.path.abspath(a.model), "tokenizer": os.path.abspath(tok_path), "data": os.path.abspath(a.data),
        "backend": backend, "n_rows": len(rows), "n_samples": len(records),
        "sampling": {"n": a.n, "temperature": a.temperature, "top_p": a.top_p, "max_new_tokens": a.max_new_tokens,
                     "seed": a.seed},
        "drop_system_prompt": a.drop_system_prompt, "require_think": require_think,
        "per_source": summary["per_source"], "average_acc": summary["average_acc"],
        "grading": {"timeout_s": a.timeout, **grading,
                    "ungradable": sum(t["ungradable"] for t in summary["per_source"].values())},
        "seconds": {"generate": round(t_gen, 3), "score": round(t_score, 3), "total": round(time.time() - t_start, 3)},
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    with open(a.output, "w") as f:
        json.dump(result, f, indent=1)
    if a.samples_output:
        with open(a.samples_output, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    print(f"wrote {a.output}" + (f" and {a.samples_output}" if a.samples_output else ""))
    return result


if __name__ == "__main__":
    main()
