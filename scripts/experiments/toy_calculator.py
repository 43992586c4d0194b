"""Assets, base model, evaluator and the comparison driver of the toy tool-use task (:mod:`scripts.experiments.toy_tasks.calculator`).

    OUT/tokenizer/        character tokenizer (printable ASCII, one token a character) with ChatML and four
                          multi-character word tokens for the hermes tool call (``<tool_call>``, ``</tool_call>``,
                          the JSON head up to the expression and ``"}}``): an expert episode is 42-45 tokens,
                          not ~115 (verl's HermesToolParser parses the decoded text, so it is unchanged)
    OUT/{train,heldout,ood}.parquet   ToolEnv.rows (mix_src/rollout/environments.py), response budget 64 tokens
    OUT/base_seed{S}/     the base: a tiny Qwen2 (toy_addition's shape) pre-trained on attempts to answer
                          WITHOUT the tool (prompt ``a*b`` -> the product, written directly): it never saw a
                          tool call, and a 2-layer model does not learn 3x2-digit products in that budget
    OUT/base_seed{S}/eval.json   its measured base property: greedy held-out / OOD accuracy and tool-call
                          rate, and the sampled (temperature 1, the rollout's) success and tool-call rates on
                          the training prompts, k samples each

The evaluator (:func:`run_episodes`) plays verl's tool-agent episode with HF ``generate``: a turn ends at EOS;
a turn with a hermes tool call gets the calculator's result laid out by verl's Continuous-Token builder
(as the agent loop does) and the model answers; at most ``MAX_TURNS`` assistant turns and ``RESPONSE``
response tokens; the environment's ``score`` grades the decoded response.

Usage::

    python -m scripts.experiments.toy_calculator prepare [--out outputs/toy_calculator]
    python -m scripts.experiments.toy_calculator eval MODEL_DIR [--out ...]
    python -m scripts.experiments.toy_calculator compare --seeds 0 1 2 --steps 20 [--runs DIR] [--wrap CMD]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import string
import subprocess
import sys
import time

from scripts import make_tiny_assets as tiny_assets
from scripts.experiments import toy_addition as ta

REPO_ROOT = ta.REPO_ROOT
DEFAULT_OUT = os.path.join(REPO_ROOT, "outputs", "toy_calculator")
HEAD = '{"name": "calculator", "arguments": {"expression": "'
WORDS = ["<tool_call>", "</tool_call>", HEAD, '"}}']
CHARS = list(string.printable)
MODEL_KW = dict(ta.MODEL_KW)
PRETRAIN = dict(steps=300, batch_size=64, lr=1e-3, warmup=30, weight_decay=0.0)
RESPONSE = 64  # recipes/toy_calculator/config.yaml data.max_response_length
MAX_TURNS = 3  # multi_turn.max_assistant_turns
N_TRAIN, N_EVAL = 512, 64
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def build_tokenizer(out_dir: str):
    return tiny_assets.build_tokenizer(out_dir, chars=CHARS, words=WORDS, model_max_length=256)


def _env():
    import scripts.experiments.toy_tasks.calculator  # noqa: F401  (registers the environment)
    from mix_src.rollout.environments import get_environment

    return get_environment("toy_calculator")


def _prompt_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---------------------------------------------------------------------------------------------- base
def pretrain_base(model_dir: str, tok, seed: int, log=print, **overrides) -> dict:
    """Tiny Qwen2 trained on ``a*b`` -> ``str(a*b)`` + EOS (response tokens only): answers without the tool."""
    import torch

    hp = {**PRETRAIN, **overrides}
    model, opt, sched = ta.new_base(tok, seed, hp, model_kw=MODEL_KW)
    rng = random.Random(seed + 1000)
    t0 = time.time()
    for step in range(hp["steps"]):
        seqs, plens = [], []
        for _ in range(hp["batch_size"]):
            a, b = rng.randint(100, 999), rng.randint(10, 99)
            p = _prompt_ids(tok, f"{a}*{b}")
            seqs.append(p + tok.encode(str(a * b), add_special_tokens=False) + [tok.eos_token_id])
            plens.append(len(p))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        labels = ids.clone()
        for i, (s, pl) in enumerate(zip(seqs, plens)):
            labels[i, :pl] = -100
            labels[i, len(s):] = -100
        attn = (labels != -100) | (torch.arange(width)[None, :] < torch.tensor(plens)[:, None])
        loss = ta.pretrain_step(model, opt, sched, ids, labels, attention_mask=attn.long())
        if step % 100 == 0 or step == hp["steps"] - 1:
            log(f"pretrain step {step:4d} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    return ta.save_base(model, model_dir, hp, t0, loss)


# ---------------------------------------------------------------------------------------------- evaluator
def run_episodes(model, tok, items: list[dict], *, samples: int = 1, do_sample: bool = False, seed: int = 0,
                 batch_size: int = 256) -> list[dict]:
    """Play one tool episode per (item, sample) with HF generate; returns [{"item", "response", "score", ...}]."""
    import torch
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from scripts.experiments.toy_tasks.calculator import calculator

    env = _env()
    builder = create_continuous_token_builder(tok, hf_model_type="qwen2")
    torch.manual_seed(seed)
    eps = []
    for it in items:
        for _ in range(samples):
            msgs = [{"role": "user", "content": it["question"]}]
            ids = list(builder.build_initial_tokens(msgs))
            eps.append({"item": it, "msgs": msgs, "ids": ids, "start": len(ids), "turns": 0, "done": False})
    eos = tok.eos_token_id
    for _turn in range(MAX_TURNS):
        live = [e for e in eps if not e["done"]]
        if not live:
            break
        for i in range(0, len(live), batch_size):
            chunk = live[i : i + batch_size]
            width = max(len(e["ids"]) for e in chunk)
            room = max(1, min(RESPONSE - (len(e["ids"]) - e["start"]) for e in chunk))
            x = torch.tensor([[tok.pad_token_id] * (width - len(e["ids"])) + e["ids"] for e in chunk])
            mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(e["ids"]) for e in chunk])[:, None]).long()
            kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if do_sample else dict(do_sample=False)
            with torch.no_grad():
                out = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=room, pad_token_id=tok.pad_token_id,
                                     eos_token_id=eos, **kw)
            for e, row in zip(chunk, out[:, width:].tolist()):
                gen = row[: row.index(eos) + 1] if eos in row else row
                gen = gen[: RESPONSE - (len(e["ids"]) - e["start"])]
                e["ids"] = list(builder.merge_assistant_tokens(e["ids"], gen).token_ids)
                e["turns"] += 1
                text = tok.decode(gen, skip_special_tokens=True)
                e["msgs"] = e["msgs"] + [{"role": "assistant", "content": text}]
                calls = TOOL_CALL.findall(text)
                if not calls or not gen or gen[-1] != eos or len(e["ids"]) - e["start"] >= RESPONSE:
                    e["done"] = True
                    continue
                try:
                    result = calculator(json.loads(calls[0])["arguments"]["expression"])
                except (ValueError, KeyError, TypeError):
                    result = "error: bad tool call"
                new = e["msgs"] + [{"role": "tool", "content": result}]
                merged = list(builder.merge_context_tokens(e["msgs"], new, e["ids"]).token_ids)
                if len(merged) - e["start"] >= RESPONSE:  # as verl: a result that does not fit ends the episode
                    e["done"] = True
                    continue
                e["ids"], e["msgs"] = merged, new
    res = []
    for e in eps:
        text = tok.decode(e["ids"][e["start"]:], skip_special_tokens=True)
        res.append({"question": e["item"]["question"], "answer": str(e["item"]["answer"]), "response": text,
                    "response_tokens": len(e["ids"]) - e["start"],
                    **env.score(e["item"], text)})
    return res


def _items(parquet: str) -> list[dict]:
    import pandas as pd

    return [json.loads(x["item"]) for x in pd.read_parquet(parquet)["extra_info"]]


def _load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def evaluate(model_dir: str, tokenizer_dir: str, data_dir: str, k: int = 0) -> dict:
    """Greedy held-out / OOD accuracy and tool-call rate; with ``k``: sampled (T=1) rates on the train prompts."""
    tok = ta.load_tokenizer(tokenizer_dir)
    model = _load(model_dir)
    out = {}
    for split in ("heldout", "ood"):
        r = run_episodes(model, tok, _items(os.path.join(data_dir, f"{split}.parquet")))
        out[split] = {"n": len(r), "acc": sum(x["acc"] for x in r) / len(r),
                      "tool_call_rate": sum(x["tool_calls"] > 0 for x in r) / len(r),
                      # the calculator returned the product: the call was well formed with the right expression
                      "correct_call_rate": sum(f"tool\n{x['answer']}\n" in x["response"] for x in r) / len(r),
                      "example": r[0]["response"]}
    if k:
        items = _items(os.path.join(data_dir, "train.parquet"))
        r = run_episodes(model, tok, items, samples=k, do_sample=True, seed=0)
        out["train_sampled"] = {"n_prompts": len(items), "samples_per_prompt": k, "temperature": 1.0,
                                "success_rate": sum(x["acc"] for x in r) / len(r),
                                "tool_call_rate": sum(x["tool_calls"] > 0 for x in r) / len(r),
                                "successes": int(sum(x["acc"] for x in r)), "episodes": len(r)}
    return out


# ---------------------------------------------------------------------------------------------- prepare
def prepare(out_dir: str = DEFAULT_OUT, seed: int = 0, force: bool = False, log=print, k: int = 8) -> dict:
    import pandas as pd

    out_dir = os.path.abspath(out_dir)
    paths = {"tokenizer": os.path.join(out_dir, "tokenizer"), "model": os.path.join(out_dir, f"base_seed{seed}"),
             **{s: os.path.join(out_dir, f"{s}.parquet") for s in ("train", "heldout", "ood")}}
    manifest = os.path.join(paths["model"], "eval.json")
    fp = {"version": 1, "words": WORDS, "model": MODEL_KW, "pretrain": PRETRAIN, "seed": seed, "k": k, "response": RESPONSE}
    if not force and os.path.exists(manifest) and all(os.path.exists(p) for p in paths.values()):
        info = json.load(open(manifest))
        if info.get("fingerprint") == fp:
            return {**paths, "base_eval": info["eval"]}
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(paths["tokenizer"])
    env = _env()
    stats = {}
    for split, n in (("train", N_TRAIN), ("heldout", N_EVAL), ("ood", N_EVAL)):
        rows, stats[split] = env.rows(split, n, 0, tokenizer=tok, max_response_length=RESPONSE)
        pd.DataFrame(rows).to_parquet(paths[split], index=False)
    info = pretrain_base(paths["model"], tok, seed, log=log)
    ev = evaluate(paths["model"], paths["tokenizer"], out_dir, k=k)
    with open(manifest, "w") as f:
        json.dump({"fingerprint": fp, "data": stats, "pretrain": info, "eval": ev}, f, indent=1)
    return {**paths, "base_eval": ev}


def describe_base(ev: dict) -> str:
    s = ev["train_sampled"]
    return (f"base: greedy held-out acc {100 * ev['heldout']['acc']:.1f}% (tool-call rate {100 * ev['heldout']['tool_call_rate']:.1f}%), "
            f"OOD acc {100 * ev['ood']['acc']:.1f}% (tool calls {100 * ev['ood']['tool_call_rate']:.1f}%); sampled at T=1 on "
            f"{s['n_prompts']} train prompts x {s['samples_per_prompt']}: success {s['successes']}/{s['episodes']} "
            f"({100 * s['success_rate']:.2f}%), tool-call rate {100 * s['tool_call_rate']:.2f}%")


# ---------------------------------------------------------------------------------------------- SFT data
def write_sft_messages(train_parquet: str, out_parquet: str, seed: int = 0) -> int:
    """verl SFT data: prompt + the expert episode's messages (assistant tool call, tool result, assistant answer)."""
    import pandas as pd

    df = pd.read_parquet(train_parquet).sample(frac=1.0, random_state=seed).reset_index(drop=True)
    msgs = [list(p) + json.loads(t) for p, t in zip(df["prompt"], df["target"])]
    pd.DataFrame({"messages": msgs}).to_parquet(out_parquet, index=False)
    return len(msgs)


# ---------------------------------------------------------------------------------------------- compare
METHODS = {
    "guided": [],  # recipes/toy_calculator/config.yaml as it is
    "grpo": ["mix.n_prefix=0", "algorithm.filter_groups.enable=false"],  # no expert; every group would be filtered
}
RUN_SH = os.path.join(REPO_ROOT, "recipes", "toy_calculator", "run.sh")


TIMED = 'SECONDS=0; "$@"; rc=$?; echo "[timed] $SECONDS s" >&2; exit $rc'  # the run's own wall time, inside the lock


def _launch(cmd: list[str], env: dict, log: str, wrap: list[str]) -> float:
    """Run ``wrap + cmd``; returns the command's own wall seconds (without a wrapper's wait for a lock)."""
    full = wrap + ["bash", "-c", TIMED, "_", *cmd]
    print(f"[toy_calculator] {' '.join(wrap + cmd)}  (log {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(full, cwd=REPO_ROOT, env={**os.environ, "PYTHON": sys.executable, **env}, stdout=f,
                             stderr=subprocess.STDOUT)
    text = open(log, errors="replace").read()
    if rc != 0:
        raise RuntimeError(f"run failed (rc={rc}); log {log}:\n" + "\n".join(text.splitlines()[-40:]))
    return float(re.findall(r"\[timed\] (\d+) s", text)[-1])


def run_one(method: str, seed: int, steps: int, assets: dict, rdir: str, wrap: list[str]) -> dict:
    """One run (RL through recipes/toy_calculator/run.sh, SFT through verl's sft_trainer), then the evaluator."""
    import shutil

    if os.path.isdir(rdir):
        shutil.rmtree(rdir)
    os.makedirs(rdir)
    ckpt = os.path.join(rdir, "checkpoints")
    if method == "sft":
        data = os.path.join(rdir, "sft_messages.parquet")
        write_sft_messages(assets["train"], data, seed)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=1",
               "-m", "verl.trainer.sft_trainer", "--config-path", os.path.join(REPO_ROOT, "recipes", "toy_addition"),
               "--config-name", "sft", f"model.path={assets['model']}", f"model.tokenizer_path={assets['tokenizer']}",
               f"data.train_files={data}", f"trainer.default_local_dir={ckpt}", f"trainer.total_training_steps={steps}",
               f"trainer.save_freq={steps}", f"trainer.seed={seed}", "data.train_batch_size=8",
               "data.micro_batch_size_per_gpu=8", "data.max_length=96", "trainer.logger=[console]",
               f"hydra.run.dir={rdir}/hydra"]  # fmt: skip
        env = {"VERL_PLATFORM": "cpu", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
               "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    else:
        cmd = ["bash", RUN_SH, *METHODS[method], f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}",
               "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]",
               f"data.seed={seed}", f"mix.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",
               f"trainer.experiment_name=toy_calculator_{method}_seed{seed}"]
        env = {"OUTPUT_DIR": rdir, "ASSETS_DIR": os.path.dirname(assets["train"]), "LOGGER": "[console,file]"}
    wall = _launch(cmd, env, os.path.join(rdir, "run.log"), wrap)
    hf = os.path.join(ckpt, f"global_step_{steps}", "huggingface")
    if method != "sft":
        hf = os.path.join(ckpt, f"global_step_{steps}", "actor", "huggingface")
    ev = evaluate(hf, assets["tokenizer"], os.path.dirname(assets["train"]))
    metrics = {}
    mpath = os.path.join(rdir, "metrics.jsonl")
    if os.path.exists(mpath):
        for line in open(mpath):
            if line.strip():
                rec = json.loads(line)
                metrics.setdefault(rec["step"], {}).update(rec["data"])
    curve = {s: {k: m[k] for k in ("batch/on_solved", "critic/score/mean", "actor/off_policy_prob") if k in m}
             for s, m in sorted(metrics.items())}
    rec = {"method": method, "seed": seed, "steps": steps, "wall_s": round(wall, 1), "eval": ev, "train_curve": curve}
    json.dump(rec, open(os.path.join(rdir, "done.json"), "w"), indent=1)
    return rec


def table(results: list[dict], methods: list[str], base: dict) -> str:
    from scripts.experiments.compare import t_interval

    pct = lambda x: "n/a" if x != x else f"{100 * x:.1f}"  # noqa: E731
    lines = [describe_base(base), "",
             "| method | held-out acc [95% t CI] | OOD acc [95% t CI] | held-out: any tool call / correct call | n seeds | per-seed held-out / OOD | wall s (mean) |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for m in methods:
        runs = sorted((r for r in results if r["method"] == m), key=lambda r: r["seed"])
        if not runs:
            continue
        h = t_interval([r["eval"]["heldout"]["acc"] for r in runs])
        o = t_interval([r["eval"]["ood"]["acc"] for r in runs])
        tc = sum(r["eval"]["heldout"]["tool_call_rate"] for r in runs) / len(runs)
        cc = sum(r["eval"]["heldout"].get("correct_call_rate", float("nan")) for r in runs) / len(runs)
        per = ", ".join(f"s{r['seed']}: {pct(r['eval']['heldout']['acc'])}/{pct(r['eval']['ood']['acc'])}" for r in runs)
        lines.append(f"| {m} | {pct(h['mean'])} [{pct(h['lo'])}, {pct(h['hi'])}] | {pct(o['mean'])} [{pct(o['lo'])}, "
                     f"{pct(o['hi'])}] | {pct(tc)} / {pct(cc)} | {h['n']} | {per} | {sum(r['wall_s'] for r in runs) / len(runs):.0f} |")
    return "\n".join(lines)


def compare(methods: list[str], seeds: list[int], steps: int, runs_dir: str, wrap: list[str], assets_dir: str,
            table_only: bool = False) -> str:
    """Run the missing (method, seed) runs of the grid (``table_only``: none), then write table.md / results.json."""
    assets = prepare(assets_dir)
    print("[toy_calculator] " + describe_base(assets["base_eval"]), flush=True)
    results = []
    for seed in seeds:  # seed-major: a partial grid already compares the methods
        for m in methods:
            rdir = os.path.join(runs_dir, f"{m}_seed{seed}")
            done = os.path.join(rdir, "done.json")
            if os.path.exists(done) and json.load(open(done)).get("steps") == steps:
                rec = json.load(open(done))
                if table_only and "correct_call_rate" not in rec["eval"]["heldout"]:  # evaluated by an older driver
                    sub = "global_step_{}" + ("/huggingface" if m == "sft" else "/actor/huggingface")
                    rec["eval"] = evaluate(os.path.join(rdir, "checkpoints", sub.format(steps)), assets["tokenizer"], assets_dir)
                    json.dump(rec, open(done, "w"), indent=1)
                results.append(rec)
                continue
            if table_only:
                print(f"[toy_calculator] {m} seed {seed}: not run", flush=True)
                continue
            try:
                rec = run_one(m, seed, steps, assets, rdir, wrap)
            except RuntimeError as e:  # a failed run is reported, the grid goes on
                print(f"[toy_calculator] {m} seed {seed} FAILED: {e}", flush=True)
                continue
            print(f"[toy_calculator] {m} seed {seed}: {rec['wall_s']:.0f} s, held-out {rec['eval']['heldout']['acc']:.3f}, "
                  f"OOD {rec['eval']['ood']['acc']:.3f}", flush=True)
            results.append(rec)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    md = (f"toy_calculator, {steps} steps per run (RL: 8 prompts x 8 episodes per step; SFT: 8 expert episodes per step), "
          f"seeds {seeds}, greedy evaluation of the last checkpoint on {N_EVAL} held-out / {N_EVAL} OOD prompts; commit {commit}\n\n"
          + table(results, methods, assets["base_eval"]))
    with open(os.path.join(runs_dir, "table.md"), "w") as f:
        f.write(md + "\n")
    json.dump(results, open(os.path.join(runs_dir, "results.json"), "w"), indent=1)
    print(md, flush=True)
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--out", default=DEFAULT_OUT)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--force", action="store_true")
    pe = sub.add_parser("eval")
    pe.add_argument("model")
    pe.add_argument("--out", default=DEFAULT_OUT)
    pc = sub.add_parser("compare")
    pc.add_argument("--methods", nargs="+", default=["guided", "grpo", "sft"])
    pc.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    pc.add_argument("--steps", type=int, default=20)
    pc.add_argument("--out", default=DEFAULT_OUT)
    pc.add_argument("--runs", default=None, help="default: OUT/runs")
    pc.add_argument("--wrap", default="", help="command prefix for each run, e.g. 'flock /tmp/my.lock'")
    pc.add_argument("--table-only", action="store_true", help="no new runs: the table of the finished ones")
    a = p.parse_args(argv)
    if a.cmd == "prepare":
        res = prepare(a.out, seed=a.seed, force=a.force)
        print(describe_base(res["base_eval"]))
        print(json.dumps(res, indent=1))
    elif a.cmd == "eval":
        print(json.dumps(evaluate(a.model, os.path.join(a.out, "tokenizer"), a.out), indent=1))
    else:
        runs = os.path.abspath(a.runs or os.path.join(a.out, "runs"))
        os.makedirs(runs, exist_ok=True)
        compare(a.methods, a.seeds, a.steps, runs, shlex.split(a.wrap), os.path.abspath(a.out), a.table_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
