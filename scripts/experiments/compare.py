"""A comparison harness: methods x seeds x toy tasks at matched training compute, with confidence intervals.

    python -m scripts.experiments.compare --methods luffy grpo sft sft_rl guide_on_failure --seeds 0 1 2 3 4 \\
        --tasks addition sort --budget 1e12 [--evals 6] [--last-k 2] [--baseline sft_rl] [--out DIR] [--jobs N] [--wrap CMD]

**Runs.** Every run goes through the real entry points: RL methods through ``recipes/toy_addition/run.sh``
(``python -m mix_src.main_mix_ppo`` with the toy task's ``on_policy_grpo`` config = the task's base settings),
SFT through the same script's ``sft`` path (verl's own ``verl.trainer.sft_trainer`` under torchrun). ``--jobs N``
runs N at a time (threads over the runs' subprocesses; SFT->RL after the SFT runs it starts from). A finished run has ``done.json`` in
its folder and is not re-run while the grid's budget and evaluations and the run's Hydra overrides stay the same
(:func:`reusable`); an unfinished folder is deleted and the run starts again. ``--wrap CMD`` (or env
``COMPARE_RUN_WRAPPER``) prefixes each run's command, e.g. ``--wrap "flock /tmp/my.lock"`` takes a lock per run.

**Methods plug in by name.** A method ``X`` is runnable when ``recipes/X/compare.yaml`` exists with
``plugins: [mix.plugins paths relative to the repository root]`` and ``overrides: [Hydra key=value strings
applied on top of the toy task's base settings]``, optional ``kind: rl`` (default). Built-in kinds: ``sft``
(the name ``sft``) and ``sft_rl`` (a compare.yaml with ``kind: sft_rl``, ``rl_method: <an rl method>`` and
``sft_fraction``). Short names: :data:`ALIASES`. ``self_source: {k: K}`` (kind rl): the run trains on its own
model's verified samples, their sampling FLOPs charged to it (:mod:`scripts.experiments.compare_guidance`).

**Matched compute, enforced.** ``--budget`` is training FLOPs (``--count full``: 6N + attention + LM head, or
``6n``; formulas in :mod:`mix_src.algo.flops`), counted by each run from its own tokens. RL runs get
``mix.flops_budget``: the trainer stops at the first step whose cumulative FLOPs reach it (it overshoots by
less than one step, reported). verl's SFT trainer cannot be given a hook, but an SFT step's FLOPs are fixed here
(32 sequences of one length), so the budget becomes ``ceil(budget / step FLOPs)`` steps before launch, checked
after the run against the token count verl logs (``train/global_tokens``). SFT->RL: the first
``sft_fraction`` of the budget is SFT (the SFT run's checkpoint nearest to that step; the share is reported),
the rest RL from that checkpoint with ``mix.flops_budget = budget - SFT FLOPs``.

**Evaluation.** Held-out (in distribution) and OOD greedy accuracy at about ``--evals`` points per run: RL runs
validate in the trainer every ``test_freq`` steps (``val-core/<source>/acc/mean@1``) and at the budget step; SFT
checkpoints are scored with an HF ``generate`` evaluator. Validation is not counted as training compute.

**Statistics.** Per run: the mean of its last ``--last-k`` evaluations (the last one is at the budget). Per
method: the mean over seeds and a 95% interval — Student-t with n stated when n < 5, a percentile bootstrap
(10,000 resamples) over seeds when n >= 5. Paired comparison against ``--baseline``: per-seed differences,
their mean and t-interval. Evaluation noise: the binomial standard error sqrt(p(1-p)/n_problems) at the method's
mean, printed next to the seed standard deviation. A second table compares at equal optimizer steps.

Outputs in ``--out``: ``results.json`` (every run: curves, FLOPs, wall time), ``table.md``, ``curves.png``
(accuracy vs FLOPs, seed mean with the 95% t band; curves are interpolated onto a FLOPs grid for the plot only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import yaml

from scripts.experiments.toy_tasks import addition as addition_task
from scripts.experiments.toy_tasks import sort as sort_task
from mix_src.algo.flops import ModelShape, forward_flops, sft_step_flops
from scripts.experiments import compare_guidance as cg
from scripts.experiments import toy_addition as ta
from scripts.experiments import toy_sort as ts

REPO_ROOT = ta.REPO_ROOT
RUN_SH = os.path.join(REPO_ROOT, "recipes", "toy_addition", "run.sh")
ALIASES = {"luffy": "luffy_zero", "grpo": "on_policy_grpo", "sft_rl": "sft_then_rl"}
RL_STEP_CAP = 100000  # trainer.total_training_steps: the FLOPs budget stops a run long before
SFT_BATCH = 32  # recipes/toy_addition/sft.yaml data.train_batch_size
VAL_SUFFIX = "/acc/mean@1"


# ---------------------------------------------------------------------------------------------- tasks
@dataclass
class Task:
    name: str
    prepare: Callable[..., dict]  # (assets dir, pretrain_steps) -> {tokenizer, train, heldout, ood, model, base_eval}
    data_source: str
    ood_source: str
    compute_score: Callable
    max_new_tokens: int
    max_response_length: int
    env: dict = field(default_factory=dict)  # run.sh environment
    overrides: list = field(default_factory=list)  # Hydra overrides of the RL runs (on the toy base config)


def _prepare_addition(out: str, pretrain_steps: int | None = None) -> dict:
    return ta.prepare(out, seed=0, variant="demo", log=lambda *a: None, pretrain_steps=pretrain_steps)


def _prepare_sort(out: str, pretrain_steps: int | None = None) -> dict:
    return ts.prepare(out, seed=0, log=lambda *a: None, pretrain_steps=pretrain_steps)


# addition: the demo variant (2-digit, units-column carries; OOD = unseen digit pairs). The harness builds every
# task's assets itself, so run.sh never does (SKIP_PREPARE=1).
TASKS = {
    "addition": Task("addition", _prepare_addition, addition_task.DATA_SOURCE, ta.OOD_SOURCE, addition_task.compute_score,
                     ta.MAX_NEW_TOKENS, 16, env={"VARIANT": "demo", "SKIP_PREPARE": "1"}),
    "sort": Task("sort", _prepare_sort, sort_task.DATA_SOURCE, sort_task.OOD_SOURCE, sort_task.compute_score,
                 ts.MAX_NEW_TOKENS, 24, env={"SKIP_PREPARE": "1"},
                 overrides=["+task=sort"]),  # recipes/toy_addition/task/sort.yaml: reward, response length, RL lr
}


# ---------------------------------------------------------------------------------------------- methods
@dataclass
class Method:
    name: str  # as given (an alias or a recipe folder)
    kind: str  # rl | sft | sft_rl
    plugins: list = field(default_factory=list)
    overrides: list = field(default_factory=list)
    rl_method: str = ""  # sft_rl: the RL method of the second phase
    sft_fraction: float = 0.5
    self_source: dict | None = None  # {k, temperature}: scripts/experiments/compare_guidance.py


def load_method(name: str, recipes_dir: str = os.path.join(REPO_ROOT, "recipes")) -> Method:
    """``recipes/<name>/compare.yaml`` (after :data:`ALIASES`), or the built-in ``sft``."""
    if name == "sft":
        return Method("sft", "sft")
    folder = ALIASES.get(name, name)
    path = os.path.join(recipes_dir, folder, "compare.yaml")
    if not os.path.exists(path):
        known = sorted(d for d in os.listdir(recipes_dir) if os.path.exists(os.path.join(recipes_dir, d, "compare.yaml")))
        raise SystemExit(f"method {name!r}: no {path}; runnable methods: sft, {', '.join(known)} "
                         f"(aliases {ALIASES}). A method is runnable when recipes/<name>/compare.yaml exists.")
    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    unknown = set(spec) - {"kind", "plugins", "overrides", "rl_method", "sft_fraction", "self_source"}
    if unknown:
        raise SystemExit(f"{path}: unknown keys {sorted(unknown)} (known: kind, plugins, overrides, rl_method, "
                         "sft_fraction, self_source)")
    kind = spec.get("kind", "rl")
    if kind not in ("rl", "sft", "sft_rl"):
        raise SystemExit(f"{path}: kind={kind!r}; use rl, sft or sft_rl")
    for key in ("plugins", "overrides"):
        if not isinstance(spec.get(key, []), list) or not all(isinstance(x, str) for x in spec.get(key, [])):
            raise SystemExit(f"{path}: {key} must be a list of strings")
    plugins = [os.path.join(REPO_ROOT, p) for p in spec.get("plugins", [])]
    for p in plugins:
        if not os.path.exists(p):
            raise SystemExit(f"{path}: plugin {p} does not exist")
    m = Method(name, kind, plugins, list(spec.get("overrides", [])), spec.get("rl_method", ""),
               float(spec.get("sft_fraction", 0.5)), cg.check_self_source(spec.get("self_source"), path))
    if m.self_source and kind != "rl":
        raise SystemExit(f"{path}: self_source is for kind rl, not {kind}")
    if kind == "sft_rl":
        if not m.rl_method or load_method(m.rl_method, recipes_dir).kind != "rl":
            raise SystemExit(f"{path}: kind sft_rl needs rl_method: <a method of kind rl>")
        if not 0.0 < m.sft_fraction < 1.0:
            raise SystemExit(f"{path}: sft_fraction={m.sft_fraction} must be in (0, 1)")
    return m


def run_overrides(task: Task, method: Method, rl_overrides=()) -> list[str]:
    """The Hydra overrides a run's RL part is launched with (SFT: none), recorded in its ``done.json``."""
    if method.kind == "sft":
        return []
    rl = load_method(method.rl_method) if method.kind == "sft_rl" else method
    sourced = [] if not rl.self_source else [  # a record of the train file (run_rl passes it as TRAIN_FILES)
        f"data.train_files=<self-sourced, k={rl.self_source['k']}, temperature={rl.self_source['temperature']:g}, "
        f"rows={rl.self_source.get('rows') or 'all'}>"]
    return [*task.overrides, *rl_args(rl), *rl_overrides, *sourced]


def reusable(rec: dict, a, overrides: list[str]) -> bool:
    """A finished run is reused when its budget, count, evaluations and RL overrides are this grid's (a run
    recorded before the overrides were, e.g. the sort runs at addition's lr before #40, is run again)."""
    return (rec.get("budget"), rec.get("count"), rec.get("evals_asked"), rec.get("overrides")) == (
        a.budget, a.count, a.evals, overrides)


def rl_args(method: Method) -> list[str]:
    """The Hydra overrides a kind-rl method adds to the toy base config."""
    out = list(method.overrides)
    if method.plugins:
        out.insert(0, "mix.plugins=[" + ",".join(method.plugins) + "]")
    return out


# ---------------------------------------------------------------------------------------------- compute
def model_shape(model_dir: str) -> ModelShape:
    with open(os.path.join(model_dir, "config.json")) as f:
        return ModelShape.from_hf_config(json.load(f))


def sft_sequence_lengths(train_parquet: str, tokenizer_dir: str) -> list[int]:
    """Tokens of each SFT example (chat template of prompt + assistant target), as the SFT trainer trains on."""
    import pandas as pd

    tok = ta.load_tokenizer(tokenizer_dir)
    df = pd.read_parquet(train_parquet)
    out = []
    for p, t in zip(df["prompt"], df["target"]):
        ids = tok.apply_chat_template(list(p) + [{"role": "assistant", "content": t[0]["content"]}], tokenize=True)
        out.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def rl_step_upper_bound(shape: ModelShape, prompt_len: int, max_response: int, batch: int = 32, n: int = 8,
                        count: str = "full") -> float:
    """FLOPs of an RL step whose rows are all full length (rollout + old log-probs + 1 training pass): an upper
    bound, used only to place the evaluations."""
    return 5 * batch * n * forward_flops(shape, [prompt_len + max_response], count)


# ---------------------------------------------------------------------------------------------- runs
def _wrapper(arg: str | None) -> list[str]:
    w = arg if arg is not None else os.environ.get("COMPARE_RUN_WRAPPER", "")
    return shlex.split(w) if w else []


PORT_CLASH = "EADDRINUSE"  # torch.distributed's rendezvous lost a free port to another run started beside it


def launch(cmd: list[str], env: dict, rdir: str, wrap: list[str], attempts: int = 2) -> float:
    """Run ``cmd`` (its output in ``rdir/run.log``); returns its wall time. A run that failed because its
    torch.distributed rendezvous port was taken meanwhile by another run of the grid (``--jobs`` > 1, or a test
    beside it) is started again, up to ``attempts`` times in all: it failed before training (the first attempt's log
    is kept as ``run.attempt1.log``). Any other failure raises with the log's tail."""
    log = os.path.join(rdir, "run.log")
    print(f"[compare] {' '.join(wrap + cmd)}  (log {log})", flush=True)
    for attempt in range(1, attempts + 1):
        t0 = time.time()
        with open(log, "w") as f:
            full = {"PYTHON": sys.executable, **os.environ, **env}  # run.sh's interpreter: this one unless PYTHON is set
            rc = subprocess.call(wrap + cmd, cwd=REPO_ROOT, env=full, stdout=f, stderr=subprocess.STDOUT)
        total = time.time() - t0
        if rc == 0:
            break
        text = open(log, errors="replace").read()
        if PORT_CLASH in text and attempt < attempts:
            os.replace(log, os.path.join(rdir, f"run.attempt{attempt}.log"))
            print(f"[compare] {rdir}: a rendezvous port was taken by another process ({PORT_CLASH}); starting again",
                  flush=True)
            continue
        raise RuntimeError(f"run failed (rc={rc}); log {log}:\n" + "\n".join(text.splitlines()[-40:]))
    own = os.path.join(rdir, "wall_seconds.txt")  # run.sh's own wall time: without a wrapper's wait (a lock)
    return float(open(own).read()) if os.path.exists(own) else total


def git_commit() -> str:
    """HEAD's short hash, with ``+dirty`` when tracked files differ from it (the runs then used that tree)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_jobs(fn: Callable, jobs: list, n: int) -> None:
    """``fn(job)`` for every job, ``n`` at a time (threads: each job waits on its own subprocess). Every job
    runs even when one fails (the runs are independent; finished ones are kept and a rerun reuses them); the
    first failure is raised at the end."""
    if n == 1:
        for job in jobs:
            fn(job)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def read_metrics(path: str) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    by_step.setdefault(int(rec["step"]), {}).update(rec["data"])
    return by_step


def _fresh(rdir: str) -> None:
    if os.path.isdir(rdir):
        shutil.rmtree(rdir)  # an unfinished run: start again
    os.makedirs(rdir)


def run_rl(task: Task, assets: dict, method: Method, seed: int, budget: float, count: str, test_freq: int, rdir: str,
           wrap: list[str], model_path: str | None = None, flops_offset: dict | None = None, extra: tuple = (),
           train_file: str | None = None) -> dict:
    """One RL run to ``budget`` FLOPs; returns its record (curves over FLOPs and steps)."""
    _fresh(rdir)
    env = {**task.env, "STEPS": str(RL_STEP_CAP), "EVAL_EVERY": str(test_freq), "OUTPUT_DIR": rdir,
           "ASSETS_DIR": os.path.dirname(assets["train"]), "MODEL_PATH": model_path or assets["model"],
           "TRAIN_FILES": train_file or assets["train"], "VAL_FILES": f"[{assets['heldout']},{assets['ood']}]",
           "LOGGER": "[console,file]"}
    cmd = ["bash", RUN_SH, "on_policy_grpo", str(seed), *task.overrides, *rl_args(method), *extra,  # the grid's last
           f"mix.flops_budget={budget:.6e}", f"mix.flops_count={count}", "trainer.save_freq=-1"]
    wall = launch(cmd, env, rdir, wrap)
    metrics = read_metrics(os.path.join(rdir, "metrics.jsonl"))
    off = flops_offset or {"6n": 0.0, "full": 0.0}
    last = max(s for s, m in metrics.items() if "flops/total_full" in m)
    evals = []
    for step in sorted(metrics):
        m = metrics[step]
        key = f"val-core/{task.data_source}{VAL_SUFFIX}"
        if key not in m:
            continue
        fl = {c: off[c] + (m.get(f"flops/total_{c}", 0.0) if step > 0 else 0.0) for c in ("6n", "full")}
        evals.append({"step": step, "optimizer_steps": step * _opt_steps_per_rl_step(extra), "flops": fl,
                      "heldout": float(m[key]), "ood": float(m.get(f"val-core/{task.ood_source}{VAL_SUFFIX}", float("nan")))})
    lm = metrics[last]
    return {"kind": "rl", "wall_s": round(wall, 1), "steps": last, "evals": evals,
            "flops": {c: off[c] + lm[f"flops/total_{c}"] for c in ("6n", "full")},
            "last_step_flops": {c: lm[f"flops/step_{c}"] for c in ("6n", "full")},
            "informative": cg.informative(metrics)}


def _opt_steps_per_rl_step(overrides=()) -> int:
    """Optimizer steps per RL step: data.train_batch_size / ppo_mini_batch_size x ppo_epochs (toy base.yaml:
    32 / 16 x 1 = 2), with the harness's own overrides applied."""
    kv = dict(o.split("=", 1) for o in overrides if "=" in o)
    batch = int(kv.get("data.train_batch_size", 32))
    mini = int(kv.get("actor_rollout_ref.actor.ppo_mini_batch_size", 16))
    return batch // mini * int(kv.get("actor_rollout_ref.actor.ppo_epochs", 1))


def run_sft(task: Task, assets: dict, seed: int, steps: int, save_freq: int, step_flops: dict, rdir: str,
            wrap: list[str], tokens_per_step: int) -> dict:
    """One verl SFT run of ``steps`` steps; its checkpoints (every ``save_freq``) are scored held-out and OOD."""
    _fresh(rdir)
    env = {**task.env, "STEPS": str(steps), "EVAL_EVERY": str(save_freq), "OUTPUT_DIR": rdir,
           "ASSETS_DIR": os.path.dirname(assets["train"]), "MODEL_PATH": assets["model"], "TRAIN_FILES": assets["train"],
           "LOGGER": "[console,file]"}
    wall = launch(["bash", RUN_SH, "sft", str(seed)], env, rdir, wrap)
    metrics = read_metrics(os.path.join(rdir, "metrics.jsonl"))
    logged = [m["train/global_tokens"] for m in metrics.values() if "train/global_tokens" in m]
    tok = ta.load_tokenizer(assets["tokenizer"])
    base = base_eval(task, assets)
    evals = [{"step": 0, "optimizer_steps": 0, "flops": {"6n": 0.0, "full": 0.0}, "heldout": base["heldout"], "ood": base["ood"]}]
    for step in sorted(set(range(save_freq, steps + 1, save_freq)) | {steps}):
        hf = os.path.join(rdir, "checkpoints", f"global_step_{step}", "huggingface")
        evals.append({"step": step, "optimizer_steps": step, "flops": {c: step * step_flops[c] for c in step_flops},
                      "heldout": ts.evaluate_rows(hf, tok, assets["heldout"], task.compute_score, task.max_new_tokens)["acc"],
                      "ood": ts.evaluate_rows(hf, tok, assets["ood"], task.compute_score, task.max_new_tokens)["acc"]})
    return {"kind": "sft", "wall_s": round(wall, 1), "steps": steps, "evals": evals,
            "flops": {c: steps * step_flops[c] for c in step_flops}, "last_step_flops": dict(step_flops),
            "tokens_per_step": {"counted": tokens_per_step,
                                "logged_by_verl": sorted(set(int(x) for x in logged))}}


def base_eval(task: Task, assets: dict) -> dict:
    """Greedy held-out / OOD accuracy and the sampled success rate p of the base (cached next to the base)."""
    path = os.path.join(assets["model"], "compare_base_eval.json")
    if os.path.exists(path) and "pass_at_k" in json.load(open(path)):
        return json.load(open(path))
    tok = ta.load_tokenizer(assets["tokenizer"])
    h = ts.evaluate_rows(assets["model"], tok, assets["heldout"], task.compute_score, task.max_new_tokens, samples=8)
    o = ts.evaluate_rows(assets["model"], tok, assets["ood"], task.compute_score, task.max_new_tokens)
    from scripts.data.self_sample import pass_at_k

    res = {"heldout": h["acc"], "ood": o["acc"], "sampled_p": h["sampled_p"], "n_heldout": h["n"], "n_ood": o["n"],
           "pass_at_k": {str(k): v for k, v in pass_at_k(h["correct_per_problem"], 8, [1, 2, 4, 8]).items()}}
    json.dump(res, open(path, "w"))
    return res


# ---------------------------------------------------------------------------------------------- statistics
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    """Two-sided 95% Student-t quantile (table; between entries the next smaller df, i.e. conservative)."""
    if df <= 0:
        return float("nan")
    if df > 30:
        return 1.96
    return _T975[max(k for k in _T975 if k <= df)]


def interval(values: list[float], n_boot: int = 10000, seed: int = 0) -> dict:
    """Mean and 95% interval over seeds: t-interval when n < 5, percentile bootstrap when n >= 5."""
    v = [x for x in values if x == x]
    n = len(v)
    if n == 0:
        return {"n": 0, "mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "method": "none", "sd": float("nan")}
    mean = sum(v) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1)) if n > 1 else float("nan")
    if n >= 5:
        rng = random.Random(seed)
        means = sorted(sum(rng.choice(v) for _ in range(n)) / n for _ in range(n_boot))
        return {"n": n, "mean": mean, "sd": sd, "lo": means[int(0.025 * n_boot)], "hi": means[int(0.975 * n_boot) - 1],
                "method": "bootstrap"}
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half, "method": "t"}


def t_interval(values: list[float]) -> dict:
    v = [x for x in values if x == x]
    n = len(v)
    mean = sum(v) / n if n else float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1)) if n > 1 else float("nan")
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def smoothed(run: dict, split: str, k: int) -> float:
    """Mean of the run's last ``k`` evaluations (``split``: heldout / ood)."""
    vals = [e[split] for e in run["evals"]][-k:]
    return sum(vals) / len(vals)


def at_optimizer_steps(run: dict, split: str, opt: int) -> tuple[float, int]:
    """The run's evaluation at the largest optimizer-step count <= ``opt``."""
    ev = [e for e in run["evals"] if e["optimizer_steps"] <= opt]
    return ev[-1][split], ev[-1]["optimizer_steps"]


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def _pass_at_k_text(base: dict) -> str:
    """The base's held-out pass@k (base_eval), as printed and tabled."""
    return ", ".join(f"pass@{k} {100 * v:.2f}%" for k, v in base.get("pass_at_k", {}).items())


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}"


def summarize(results: dict, tasks: list[str], methods: list[str], seeds: list[int], k: int, baseline: str,
              base: dict) -> tuple[str, dict]:
    """The markdown tables and the statistics behind them."""
    lines, stats = [], {}
    for tname in tasks:
        stats[tname] = {}
        n_eval = {"heldout": base[tname]["n_heldout"], "ood": base[tname]["n_ood"]}
        lines += [f"### task `{tname}` — equal FLOPs (mean of each run's last {k} evaluations)", "",
                  f"Base model: greedy held-out {_pct(base[tname]['heldout'])}%, OOD {_pct(base[tname]['ood'])}%, "
                  f"sampled success rate p = {_pct(base[tname]['sampled_p'])}% (8 samples x {n_eval['heldout']} problems), "
                  + _pass_at_k_text(base[tname]) + ".", "",
                  "| method | held-out: mean [95% CI] | OOD: mean [95% CI] | n | seed sd (held-out / OOD) | eval SE (held-out / OOD) | FLOPs (full, mean) | wall s (mean) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for m in methods:
            runs = [results[tname][m][s] for s in seeds if s in results[tname].get(m, {})]
            if not runs:
                continue
            row = {}
            for split in ("heldout", "ood"):
                row[split] = interval([smoothed(r, split, k) for r in runs])
                row[split]["eval_se"] = binomial_se(row[split]["mean"], n_eval[split])
            stats[tname][m] = row
            h, o = row["heldout"], row["ood"]
            ci = lambda s: f"{_pct(s['mean'])} [{_pct(s['lo'])}, {_pct(s['hi'])}]"  # noqa: E731
            lines.append(f"| {m} | {ci(h)} | {ci(o)} | {h['n']} ({h['method']}) | {_pct(h['sd'])} / {_pct(o['sd'])} | "
                         f"{_pct(h['eval_se'])} / {_pct(o['eval_se'])} | "
                         f"{sum(r['flops']['full'] for r in runs) / len(runs):.3g} | {sum(r['wall_s'] for r in runs) / len(runs):.0f} |")
        if baseline in methods:
            lines += ["", f"Paired by seed against **{baseline}** (difference of the smoothed accuracy, points; t-interval):", "",
                      "| method | held-out diff [95% CI] | OOD diff [95% CI] | n pairs |", "|---|---:|---:|---:|"]
            for m in methods:
                if m == baseline:
                    continue
                pair = [s for s in seeds if s in results[tname].get(m, {}) and s in results[tname].get(baseline, {})]
                if not pair:
                    continue
                d = {split: t_interval([smoothed(results[tname][m][s], split, k) - smoothed(results[tname][baseline][s], split, k)
                                        for s in pair]) for split in ("heldout", "ood")}
                stats[tname][m]["paired_vs_" + baseline] = d
                ci = lambda s: f"{100 * s['mean']:+.1f} [{100 * s['lo']:+.1f}, {100 * s['hi']:+.1f}]"  # noqa: E731
                lines.append(f"| {m} | {ci(d['heldout'])} | {ci(d['ood'])} | {len(pair)} |")
        # equal optimizer steps: the largest count every run reached with an evaluation
        all_runs = [r for m in methods for r in results[tname].get(m, {}).values()]
        if all_runs:
            opt = min(r["evals"][-1]["optimizer_steps"] for r in all_runs)
            lines += ["", f"Equal optimizer steps (each run's evaluation at the largest count <= {opt}, the most every run reached; "
                      "an RL step = 2 optimizer steps, an SFT step = 1):", "",
                      "| method | held-out mean [95% t CI] | OOD mean [95% t CI] | n |", "|---|---:|---:|---:|"]
            for m in methods:
                runs = [results[tname][m][s] for s in seeds if s in results[tname].get(m, {})]
                if not runs:
                    continue
                h = t_interval([at_optimizer_steps(r, "heldout", opt)[0] for r in runs])
                o = t_interval([at_optimizer_steps(r, "ood", opt)[0] for r in runs])
                lines.append(f"| {m} | {_pct(h['mean'])} [{_pct(h['lo'])}, {_pct(h['hi'])}] | "
                             f"{_pct(o['mean'])} [{_pct(o['lo'])}, {_pct(o['hi'])}] | {h['n']} |")
        lines.append("")
    return "\n".join(lines), stats


def plot(results: dict, tasks: list[str], methods: list[str], seeds: list[int], budget: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(tasks), 2, figsize=(10.5, 3.6 * len(tasks)), squeeze=False)
    grid = np.linspace(0, budget, 41)
    for row, tname in zip(axes, tasks):
        for ax, split in zip(row, ("heldout", "ood")):
            for i, m in enumerate(methods):
                runs = [results[tname][m][s] for s in seeds if s in results[tname].get(m, {})]
                if not runs:
                    continue
                ys = np.array([np.interp(grid, [e["flops"]["full"] for e in r["evals"]], [e[split] for e in r["evals"]])
                               for r in runs]) * 100
                mean = ys.mean(0)
                color = f"C{i}"
                ax.plot(grid, mean, color=color, lw=2, label=f"{m} (n={len(runs)})")
                if len(runs) > 1:
                    half = t975(len(runs) - 1) * ys.std(0, ddof=1) / np.sqrt(len(runs))
                    ax.fill_between(grid, mean - half, mean + half, color=color, alpha=0.15)
            ax.set_title(f"{tname}: {'held-out (in distribution)' if split == 'heldout' else 'out of distribution'}", fontsize=9)
            ax.set_xlabel("training FLOPs (full count)")
            ax.set_ylabel("greedy accuracy (%)")
            ax.set_ylim(-3, 103)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["luffy", "grpo", "sft", "sft_rl", "guide_on_failure"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--tasks", nargs="+", default=["addition", "sort"], choices=sorted(TASKS))
    p.add_argument("--budget", type=float, required=True, help="training FLOPs per run (see --count)")
    p.add_argument("--count", default="full", choices=["full", "6n"], help="the FLOPs count the budget uses")
    p.add_argument("--evals", type=int, default=6, help="evaluations per run (about; RL: at least), evenly in FLOPs")
    p.add_argument("--last-k", type=int, default=2, help="per-run score: mean of the last k evaluations")
    p.add_argument("--baseline", default="sft_rl", help="the paired comparison's baseline method")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "outputs", "compare"))
    p.add_argument("--assets", default=None, help="default: OUT/assets/<task>")
    p.add_argument("--wrap", default=None, help="command prefix for each run (default: env COMPARE_RUN_WRAPPER)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (each its own Ray cluster or torchrun); scripts/experiments/README.md: measured speed-up here")
    p.add_argument("--rl-overrides", nargs="*", default=[],
                   help="Hydra overrides added to every RL run, after the method's own (tests: smaller batches; ablations)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="base pre-training steps (tests: a barely trained base)")
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error("--jobs must be >= 1")
    if a.evals < 2:
        p.error("--evals must be >= 2 (SFT->RL starts from an SFT checkpoint before the last)")
    a.out = os.path.abspath(a.out)  # run.sh and the trainer's processes get absolute paths
    a.assets = os.path.abspath(a.assets) if a.assets else None
    wrap = _wrapper(a.wrap)
    methods = {m: load_method(m) for m in a.methods}  # refuses an unknown method before anything runs
    t_start = time.time()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.makedirs(a.out, exist_ok=True)
    results: dict = {t: {} for t in a.tasks}
    base, plans = {}, {}
    for tname in a.tasks:
        task = TASKS[tname]
        assets = task.prepare(os.path.join(a.assets, tname) if a.assets else os.path.join(a.out, "assets", tname),
                              a.pretrain_steps)
        base[tname] = base_eval(task, assets)
        print(f"[compare] {tname}: base greedy held-out {_pct(base[tname]['heldout'])}%, OOD {_pct(base[tname]['ood'])}%, "
              f"sampled success rate p = {_pct(base[tname]['sampled_p'])}%, held-out pass@k (8 samples): "
              + _pass_at_k_text(base[tname]), flush=True)
        shape = model_shape(assets["model"])
        lens = sft_sequence_lengths(assets["train"], assets["tokenizer"])
        mean_len = sum(lens) / len(lens)
        if len(set(lens)) != 1:
            print(f"[compare] {tname}: SFT sequences have {len(set(lens))} lengths; step FLOPs use the mean ({mean_len:.1f})")
        step_fl = {c: sft_step_flops(shape, [mean_len] * SFT_BATCH, c) for c in ("6n", "full")}
        sft_steps = math.ceil(a.budget / step_fl[a.count])  # the first step count reaching the budget
        save_freq = max(1, math.ceil(sft_steps / a.evals))  # verl's SFT trainer also saves the last step
        prompt_len = len(ta.prompt_ids(ta.load_tokenizer(assets["tokenizer"]), 10, 10))
        test_freq = max(1, int(a.budget / rl_step_upper_bound(shape, prompt_len, task.max_response_length,
                                                                  count=a.count) / a.evals))
        plans[tname] = {"shape": shape.describe(), "sft_step_flops": step_fl, "sft_steps": sft_steps, "sft_save_freq": save_freq,
                        "sft_tokens_per_step": int(round(mean_len * SFT_BATCH)), "rl_test_freq": test_freq}
        # seed-major (a partial grid already compares the methods); SFT->RL after the SFT runs it starts from
        for phase in (False, True):
            todo = []
            for seed in a.seeds:
                for mname in [m for m in methods if (methods[m].kind == "sft_rl") == phase]:
                    rdir = os.path.join(a.out, "runs", tname, f"{mname}_seed{seed}")
                    done = os.path.join(rdir, "done.json")
                    if os.path.exists(done):
                        rec = json.load(open(done))
                        if reusable(rec, a, run_overrides(task, methods[mname], a.rl_overrides)):
                            results[tname].setdefault(mname, {})[seed] = rec
                            continue
                    todo.append((mname, seed, rdir, done))

            def one(job, task=task, assets=assets, tname=tname, sft_steps=sft_steps, save_freq=save_freq,
                    step_fl=step_fl, test_freq=test_freq):
                mname, seed, rdir, done = job
                m = methods[mname]
                launched_on = git_commit()  # the tree run.sh starts from (a grid can outlive several commits)
                if m.kind == "rl" and m.self_source:  # sample, keep the verified, charge the sampling
                    rec = cg.run_self_sourced(run_rl, launch, task, assets, m, seed, a, test_freq, rdir, wrap)
                elif m.kind == "rl":
                    rec = run_rl(task, assets, m, seed, a.budget, a.count, test_freq, rdir, wrap, extra=tuple(a.rl_overrides))
                elif m.kind == "sft":
                    rec = run_sft(task, assets, seed, sft_steps, save_freq, step_fl, rdir, wrap, plans[tname]["sft_tokens_per_step"])
                else:
                    rec = run_sft_rl(task, assets, m, seed, a, sft_steps, save_freq, step_fl, rdir, wrap, test_freq,
                                     plans[tname]["sft_tokens_per_step"])
                rec.update({"budget": a.budget, "count": a.count, "evals_asked": a.evals, "method": mname, "seed": seed,
                            "task": tname, "jobs": a.jobs, "commit": launched_on,
                            "overrides": run_overrides(task, m, a.rl_overrides)})
                with open(done, "w") as f:
                    json.dump(rec, f, indent=1)
                results[tname].setdefault(mname, {})[seed] = rec
                print(f"[compare] {tname} {mname} seed {seed}: {rec['wall_s']:.0f} s, {rec['flops']['full']:.4g} FLOPs, "
                      f"held-out {_pct(rec['evals'][-1]['heldout'])}%, OOD {_pct(rec['evals'][-1]['ood'])}%", flush=True)

            run_jobs(one, todo, a.jobs)
    names = list(a.methods)
    md, stats = summarize(results, a.tasks, names, a.seeds, a.last_k, a.baseline, base)
    md += "\n" + cg.guidance_table(results, a.tasks, names, a.seeds, a.budget, a.count)
    commit = git_commit()
    run_commits = sorted({r.get("commit", "unrecorded") for t in results.values() for m in t.values() for r in m.values()})
    wall = time.time() - t_start
    head = (f"Budget {a.budget:.3g} training FLOPs per run ({a.count} count, mix_src/algo/flops.py), seeds {a.seeds}, "
            f"~{a.evals} evaluations per run, score = mean of the last {a.last_k}; runs made on commit(s) "
            f"{', '.join(run_commits)}, this table on {commit}; "
            f"this invocation's wall time {wall:.0f} s (finished runs reused are not re-timed).\n")
    print(head + "\n" + md)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(head + "\n" + md)
    plot(results, a.tasks, names, a.seeds, a.budget, os.path.join(a.out, "curves.png"),
         f"accuracy vs training FLOPs, budget {a.budget:.2g} ({a.count}); mean over seeds, 95% t band; commit {commit}")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"args": vars(a), "commit": commit, "wall_s": round(wall, 1), "base": base, "plans": plans,
                   "stats": stats, "runs": results}, f, indent=1, default=str)
    print(f"[compare] wrote {a.out}/table.md, curves.png, results.json", flush=True)
    return 0


def run_sft_rl(task: Task, assets: dict, m: Method, seed: int, a, sft_steps: int, save_freq: int, step_fl: dict,
               rdir: str, wrap: list[str], test_freq: int, tokens_per_step: int) -> dict:
    """SFT for ``m.sft_fraction`` of the budget (the seed's SFT run's checkpoint nearest to it; the
    SFT run is made here when the grid has none), then ``m.rl_method`` from it for the rest of the budget."""
    sft_dir = os.path.join(a.out, "runs", task.name, f"sft_seed{seed}")
    done = os.path.join(sft_dir, "done.json")
    sft = json.load(open(done)) if os.path.exists(done) else None
    if sft is None or sft.get("budget") != a.budget or sft.get("evals_asked") != a.evals:
        sft = run_sft(task, assets, seed, sft_steps, save_freq, step_fl, sft_dir, wrap, tokens_per_step)
        sft.update({"budget": a.budget, "count": a.count, "evals_asked": a.evals, "method": "sft", "seed": seed, "task": task.name})
        json.dump(sft, open(done, "w"), indent=1)
    points = sorted(set(range(save_freq, sft_steps + 1, save_freq)) | {sft_steps})  # the SFT run's checkpoints
    split_step = min(points[:-1] or points, key=lambda st: abs(st - m.sft_fraction * sft_steps))
    sft_flops = {c: split_step * step_fl[c] for c in step_fl}
    ckpt = os.path.join(sft_dir, "checkpoints", f"global_step_{split_step}", "huggingface")
    rl = run_rl(task, assets, load_method(m.rl_method), seed, a.budget - sft_flops[a.count], a.count,
                max(1, test_freq // 2), rdir, wrap, model_path=ckpt, flops_offset=sft_flops, extra=tuple(a.rl_overrides))
    sft_evals = [e for e in sft["evals"] if e["step"] <= split_step]
    rl_evals = [dict(e, optimizer_steps=e["optimizer_steps"] + split_step) for e in rl["evals"] if e["step"] > 0]
    return {"kind": "sft_rl", "wall_s": round(rl["wall_s"] + sft["wall_s"] * split_step / sft["steps"], 1),
            "steps": {"sft": split_step, "rl": rl["steps"]}, "evals": sft_evals + rl_evals, "flops": rl["flops"],
            "last_step_flops": rl["last_step_flops"],
            "split": {"sft_fraction_asked": m.sft_fraction, "sft_flops": sft_flops,
                      "sft_share": sft_flops[a.count] / rl["flops"][a.count], "rl_method": m.rl_method}}


if __name__ == "__main__":
    sys.exit(main())
