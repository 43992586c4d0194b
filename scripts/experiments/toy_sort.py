"""Assets for the digit-sorting toy task (:mod:`scripts.experiments.toy_tasks.sort`), built like the toy-addition ones
(:mod:`scripts.experiments.toy_addition`: same character tokenizer, same tiny Qwen2, same pre-training
loop shape), deterministic and cached:

    OUT/tokenizer/          the toy-addition character tokenizer
    OUT/train.parquet       4096 'pair' strings (one digit twice), verl's schema + ``target``
    OUT/heldout.parquet     200 other 'pair' strings (validation, data_source toy_sort)
    OUT/ood.parquet         200 'triple' strings (data_source toy_sort_ood)
    OUT/base_seed{S}/       the base: pre-trained on expert traces of all-distinct strings (every count 1)
    OUT/base_seed{S}/eval.json  greedy pass rate on held-out / OOD / distinct strings, and the sampled
                            (temperature 1) success rate p on held-out, 8 samples per problem

Usage::

    python -m scripts.experiments.toy_sort prepare [--out outputs/toy_sort] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from scripts.experiments.toy_tasks import sort as task
from scripts.experiments import toy_addition as ta

REPO_ROOT = ta.REPO_ROOT
DEFAULT_OUT = os.path.join(REPO_ROOT, "outputs", "toy_sort")
PRETRAIN = dict(ta.PRETRAIN, steps=600)
MAX_NEW_TOKENS = 24  # a distinct-digit trace is 20 characters + EOS


def _prompt_ids(tokenizer, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def pretrain_base(model_dir: str, tokenizer, seed: int, log=print, **overrides) -> dict:
    """A tiny Qwen2 (toy-addition's shape) trained on all-distinct strings' traces, response tokens only."""
    import torch

    hp = {**PRETRAIN, **overrides}
    model, opt, sched = ta.new_base(tokenizer, seed, hp, model_kw=ta.MODEL_KW)
    rng = random.Random(seed + 1000)
    t0 = time.time()
    for step in range(hp["steps"]):
        seqs, plens = [], []
        for s in task.sample(hp["batch_size"], rng, "distinct"):
            p = _prompt_ids(tokenizer, s)
            seqs.append(p + tokenizer.encode(task.expert_trace(s), add_special_tokens=False) + [tokenizer.eos_token_id])
            plens.append(len(p))
        assert len(set(map(len, seqs))) == 1, "distinct strings: equal lengths, no padding"
        ids = torch.tensor(seqs)
        labels = ids.clone()
        labels[:, : plens[0]] = -100
        loss = ta.pretrain_step(model, opt, sched, ids, labels)
        if step % 100 == 0 or step == hp["steps"] - 1:
            log(f"pretrain step {step:5d} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    return ta.save_base(model, model_dir, hp, t0, loss)


def evaluate_rows(model, tokenizer, parquet: str, compute_score, max_new_tokens: int, samples: int = 0,
                  batch_size: int = 200, seed: int = 0) -> dict:
    """Any toy task: greedy pass rate on a verl RL parquet (prompt messages, reward_model.ground_truth)
    scored with ``compute_score``; with ``samples > 0`` also the sampled (temperature 1, top-p 1) success rate
    ``p`` over ``samples`` draws per problem."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    if isinstance(tokenizer, str):
        tokenizer = ta.load_tokenizer(tokenizer)
    df = pd.read_parquet(parquet)
    prompts = [_prompt_ids(tokenizer, p[0]["content"]) for p in df["prompt"]]
    truths = [rm["ground_truth"] for rm in df["reward_model"]]
    sources = list(df["data_source"])

    def run(do_sample: bool, reps: int) -> list[float]:
        scores = []
        torch.manual_seed(seed)
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in chunk])
            mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(c) for c in chunk])[:, None]).long()
            kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if do_sample else dict(do_sample=False)
            with torch.no_grad():
                gen = model.generate(input_ids=ids.repeat_interleave(reps, 0), attention_mask=mask.repeat_interleave(reps, 0),
                                     max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, **kw)
            texts = tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
            for j, text in enumerate(texts):
                k = i + j // reps
                scores.append(compute_score(sources[k], text, truths[k])["acc"])
        return scores

    greedy = run(False, 1)
    out = {"n": len(prompts), "acc": sum(greedy) / len(greedy)}
    if samples:
        sampled = run(True, samples)
        out["sampled_p"] = sum(sampled) / len(sampled)
        out["samples_per_problem"] = samples
        out["correct_per_problem"] = [int(sum(sampled[i * samples:(i + 1) * samples])) for i in range(len(prompts))]
    return out


def prepare(out_dir: str = DEFAULT_OUT, seed: int = 0, force: bool = False, log=print, pretrain_steps: int | None = None) -> dict:
    """Build (or reuse) tokenizer, parquets and base model ``base_seed{seed}``; the split is always seed 0."""
    import pandas as pd

    out_dir = os.path.abspath(out_dir)
    paths = {k: os.path.join(out_dir, v) for k, v in (("tokenizer", "tokenizer"), ("train", "train.parquet"),
             ("heldout", "heldout.parquet"), ("ood", "ood.parquet"), ("model", f"base_seed{seed}"))}
    manifest = os.path.join(paths["model"], "eval.json")
    fp = {"version": 1, "task": "toy_sort", "seed": seed, "chars": "".join(ta.CHARS), "model": ta.MODEL_KW,
          "pretrain": {**PRETRAIN, "steps": pretrain_steps or PRETRAIN["steps"]}}
    if not force and os.path.exists(manifest) and all(os.path.exists(p) for p in paths.values()):
        with open(manifest) as f:
            info = json.load(f)
        if info.get("fingerprint") == fp:
            return {**paths, "base_eval": info["eval"]}
    os.makedirs(out_dir, exist_ok=True)
    ta.build_tokenizer(paths["tokenizer"])
    tokenizer = ta.load_tokenizer(paths["tokenizer"])
    sp = task.splits(seed=0)
    for name, split, source in (("train", "train", task.DATA_SOURCE), ("heldout", "test", task.DATA_SOURCE),
                                ("ood", "test", task.OOD_SOURCE)):
        rows = [task.make_row(s, split, i, data_source=source) for i, s in enumerate(sp[name])]
        pd.DataFrame(rows).to_parquet(paths[name], index=False)
    info = pretrain_base(paths["model"], tokenizer, seed, log=log, steps=fp["pretrain"]["steps"])
    distinct = os.path.join(out_dir, "distinct.parquet")
    pd.DataFrame([task.make_row(s, "test", i) for i, s in enumerate(task.sample(200, random.Random(12345), "distinct"))]
                 ).to_parquet(distinct, index=False)
    ev = {"heldout": evaluate_rows(paths["model"], tokenizer, paths["heldout"], task.compute_score, MAX_NEW_TOKENS, samples=8),
          "ood": evaluate_rows(paths["model"], tokenizer, paths["ood"], task.compute_score, MAX_NEW_TOKENS),
          "distinct": evaluate_rows(paths["model"], tokenizer, distinct, task.compute_score, MAX_NEW_TOKENS)}
    with open(manifest, "w") as f:
        json.dump({"fingerprint": fp, "pretrain": info, "eval": ev}, f, indent=1)
    return {**paths, "base_eval": ev}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--out", default=DEFAULT_OUT)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    print(json.dumps(prepare(a.out, seed=a.seed, force=a.force), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
