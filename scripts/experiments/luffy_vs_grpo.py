"""LUFFY vs on-policy GRPO vs SFT on the toy addition task, on CPU, through the real trainers.

For each method (luffy, on_policy_grpo, sft) and seed, runs ``bash recipes/toy_addition/run.sh METHOD SEED``
with the same step budget (or reuses a finished run with the same budget; a finished shorter RL run in the same
folder is continued from its last checkpoint), then collects the held-out greedy
accuracy (200 carry problems) every ``--eval-every`` steps:

* luffy / on_policy_grpo: the trainer's own validation (``val-core/toy_addition/acc/mean@1`` in the run's
  metrics.jsonl; ``val_kwargs.do_sample=false``), step 0 = before training. The last step is also saved in
  HF format and re-checked with the independent evaluator (``toy_addition.evaluate``, HF ``generate``).
* sft: verl's SFT trainer has no generation validation, so its HF checkpoints (one per evaluation step) are
  scored with ``toy_addition.evaluate``; step 0 = the base model.

Prints a table (step -> accuracy per method and seed), writes ``OUT/results.json``, ``OUT/table.md`` and
``OUT/curves.png``. Wall time per run is measured around ``run.sh`` (Ray/torchrun start-up included).

Usage::

    python -m scripts.experiments.luffy_vs_grpo [--steps 100] [--eval-every 20] [--seeds 0 1]
        [--methods luffy on_policy_grpo sft] [--out outputs/toy_addition/luffy_vs_grpo] [--rerun] [--no-run]

    # diagnostic figure: longer trainer runs (run.sh output dirs) next to luffy_replica.py curves
    python -m scripts.experiments.luffy_vs_grpo --diagnostic OUT.png --long-runs DIR... --replicas JSON...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
from scripts.experiments import toy_addition as ta

METHODS = ["luffy", "on_policy_grpo", "sft", "sft_rl"]
LABELS = {"luffy": "LUFFY (1 expert + 7 on-policy)", "on_policy_grpo": "on-policy GRPO (8 on-policy)",
          "sft": "SFT (verl SFT trainer)", "sft_rl": "SFT, then on-policy GRPO (half the steps each)"}
COLORS = {"luffy": "tab:blue", "on_policy_grpo": "tab:red", "sft": "tab:green", "sft_rl": "tab:purple"}
VAL_KEY_SUFFIX = "/acc/mean@1"  # val-core/<data_source>/acc/mean@1
OOD_KEY = f"val-core/{ta.OOD_SOURCE}{VAL_KEY_SUFFIX}"


def read_metrics(path: str) -> dict[int, dict]:
    """verl file-logger JSONL -> {step: merged metrics}. A continued run's earlier parts
    (``metrics.until_stepN.jsonl`` next to ``metrics.jsonl``, written by run.sh on resume) are read first."""
    import glob

    stem = path[: -len(".jsonl")] if path.endswith(".jsonl") else path
    parts = sorted(glob.glob(glob.escape(stem) + ".until_step*.jsonl"),
                   key=lambda p: int(p[len(stem) + len(".until_step"): -len(".jsonl")]))
    by_step: dict[int, dict] = {}
    for part in [*parts, path]:
        if not os.path.exists(part):
            continue
        with open(part) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    by_step.setdefault(int(rec["step"]), {}).update(rec["data"])
    return by_step


def val_curve(metrics: dict[int, dict], source: str = ta.task.DATA_SOURCE) -> dict[int, float]:
    """step -> greedy accuracy on the validation rows of ``source`` from the trainer's validation metrics."""
    key = f"val-core/{source}{VAL_KEY_SUFFIX}"
    return {step: float(m[key]) for step, m in metrics.items() if key in m}


def run_dir(out: str, method: str, seed: int) -> str:
    return os.path.join(out, f"{method}_seed{seed}")


def sft_checkpoint(out: str, seed: int, step: int) -> str:
    """HF folder of the SFT run's checkpoint at ``step`` (verl's SFT trainer layout)."""
    return os.path.join(run_dir(out, "sft", seed), "checkpoints", f"global_step_{step}", "huggingface")


def launch(method: str, seed: int, rdir: str, steps: int, eval_every: int, assets: str, variant: str = "addition3",
           model_path: str | None = None) -> float:
    """Run ``recipes/toy_addition/run.sh`` once; returns its wall time in seconds. Raises on failure.
    ``sft_rl`` runs ``on_policy_grpo`` from ``model_path`` (an SFT checkpoint)."""
    os.makedirs(rdir, exist_ok=True)
    # a finished shorter RL run in rdir is continued (run.sh resumes from its last checkpoint): wall times add up.
    # Its done.json stays until this run succeeds (a failed continuation leaves the shorter run's record).
    done_path = os.path.join(rdir, "done.json")
    prev = {}
    if method != "sft" and os.path.exists(os.path.join(rdir, "checkpoints", "latest_checkpointed_iteration.txt")) \
            and os.path.exists(done_path):
        with open(done_path) as f:
            prev = json.load(f)
    env = {**os.environ, "STEPS": str(steps), "EVAL_EVERY": str(eval_every), "OUTPUT_DIR": rdir, "ASSETS_DIR": assets,
           "VARIANT": variant}
    if model_path:
        env["MODEL_PATH"] = model_path
    recipe = "on_policy_grpo" if method == "sft_rl" else method
    cmd = ["bash", os.path.join(REPO_ROOT, "recipes", "toy_addition", "run.sh"), recipe, str(seed)]
    log = os.path.join(rdir, f"run_from_step{prev['steps']}.log" if prev else "run.log")
    print(f"[luffy_vs_grpo] {method} seed {seed}: {' '.join(cmd)} (log {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if rc != 0:
        tail = open(log, errors="replace").read().splitlines()[-40:]
        raise RuntimeError(f"{method} seed {seed} failed (rc={rc}); log {log}:\n" + "\n".join(tail))
    done = {"steps": steps, "eval_every": eval_every, "wall_s": round(wall + prev.get("wall_s", 0.0), 1)}
    if prev:
        done["continued"] = {"from_step": prev["steps"], "earlier_wall_s": prev.get("wall_s"), "wall_s": round(wall, 1)}
    with open(done_path, "w") as f:
        json.dump(done, f)
    return wall


def finished(rdir: str, steps: int, eval_every: int) -> bool:
    p = os.path.join(rdir, "done.json")
    if not os.path.exists(p):
        return False
    with open(p) as f:
        d = json.load(f)
    return d.get("steps") == steps and d.get("eval_every") == eval_every


def hf_eval(model_dir: str, tokenizer, problems, cache: dict, tag: str = "") -> float:
    key = model_dir + tag
    if key not in cache:
        cache[key] = ta.evaluate(model_dir, tokenizer, problems)["acc"]
    return cache[key]


def collect(method: str, rdir: str, steps: int, eval_every: int, base_acc: float, tokenizer, problems,
            ood_problems=None, base_ood: float | None = None, offset: int = 0) -> dict:
    """Accuracy curves (held-out, and OOD when the variant has it) and wall time of one finished run.
    ``offset``: the run's step 0 is this step of the method's budget (sft_rl's RL half)."""
    with open(os.path.join(rdir, "done.json")) as f:
        done = json.load(f)
    cache_path = os.path.join(rdir, "hf_eval.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    ckpts = os.path.join(rdir, "checkpoints")
    res = {"wall_s": done["wall_s"]}
    if method == "sft":
        curve, ood = {0: base_acc}, {0: base_ood}
        for step in range(eval_every, steps + 1, eval_every):
            hf = os.path.join(ckpts, f"global_step_{step}", "huggingface")
            curve[step] = hf_eval(hf, tokenizer, problems, cache)
            if ood_problems:
                ood[step] = hf_eval(hf, tokenizer, ood_problems, cache, tag="#ood")
        res["curve"] = curve
        if ood_problems:
            res["ood_curve"] = ood
        res["final_hf_eval"] = curve[steps]
    else:
        metrics = read_metrics(os.path.join(rdir, "metrics.jsonl"))
        res["curve"] = {offset + s: v for s, v in val_curve(metrics).items()}
        if ood_problems:
            res["ood_curve"] = {offset + s: v for s, v in val_curve(metrics, ta.OOD_SOURCE).items()}
        hf = os.path.join(ckpts, f"global_step_{steps}", "actor", "huggingface")
        res["final_hf_eval"] = hf_eval(hf, tokenizer, problems, cache) if os.path.isdir(hf) else None
        last = metrics.get(max(metrics)) if metrics else {}
        res["train_last"] = {k: last.get(k) for k in ("critic/score/mean", "batch/on_solved", "batch/off_solved",
                                                      "actor/off_policy_prob", "actor/on_policy_prob", "actor/entropy")}
        res["train_score"] = {s: m["critic/score/mean"] for s, m in metrics.items() if "critic/score/mean" in m}
        res["on_solved"] = {s: m["batch/on_solved"] for s, m in metrics.items() if "batch/on_solved" in m}
    with open(cache_path, "w") as f:
        json.dump(cache, f, indent=1)
    return res


def table(results: dict, methods, seeds) -> str:
    cols = [(m, s) for m in methods for s in seeds]
    steps = sorted({st for (m, s) in cols for st in results[m][s]["curve"]})
    head = "| step | " + " | ".join(f"{m} s{s}" for m, s in cols) + " |"
    lines = [head, "|" + "---:|" * (len(cols) + 1)]
    for st in steps:
        cells = []
        for m, s in cols:
            v = results[m][s]["curve"].get(st)
            cells.append("" if v is None else f"{100 * v:.1f}")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    lines.append("| wall s | " + " | ".join(f"{results[m][s]['wall_s']:.0f}" for m, s in cols) + " |")
    return "\n".join(lines)


def plot(results: dict, methods, seeds, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    for m in methods:
        for i, s in enumerate(seeds):
            c = results[m][s]["curve"]
            xs = sorted(c)
            ax.plot(xs, [100 * c[x] for x in xs], color=COLORS.get(m), marker="o", ms=3,
                    ls="-" if i == 0 else "--", label=f"{LABELS.get(m, m)}, seed {s}")
    ax.set_xlabel("training step (32 prompts per step)")
    ax.set_ylabel("held-out greedy accuracy (%), 200 carry problems")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), handlelength=3.5)  # outside: no curve hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_diagnostic(long_runs, replicas, path: str) -> None:
    """Trainer runs (solid) and plain-torch replica runs (dotted) of any length on one set of axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for d in long_runs:
        c = val_curve(read_metrics(os.path.join(d, "metrics.jsonl")))
        name = os.path.basename(os.path.normpath(d))
        method = next((m for m in METHODS if name.startswith(m)), "luffy")
        xs = sorted(c)
        ax.plot(xs, [100 * c[x] for x in xs], color=COLORS[method], marker="o", ms=3, label=f"trainer: {name}")
        print(f"trainer {name}: " + ", ".join(f"{x}:{100 * c[x]:.1f}" for x in xs))
    for j in replicas:
        r = json.load(open(j))
        c = {int(k): v for k, v in r["curve"].items()}
        xs = sorted(c)
        ax.plot(xs, [100 * c[x] for x in xs], color=COLORS[r["method"]], ls=":", marker=".",
                label=f"replica: {r['method']} lr {r['lr']:g} seed {r['seed']}")
        print(f"replica {r['method']} seed {r['seed']}: " + ", ".join(f"{x}:{100 * c[x]:.1f}" for x in xs))
    ax.set_xlabel("training step (32 prompts x 8 per step)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.set_title("toy addition: real trainer vs plain-torch replica (same maths), longer budgets", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(results: dict, methods, seeds, steps: int, has_ood: bool) -> str:
    """Final accuracy per method: mean and each seed, held-out (in distribution) and OOD."""
    def cell(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "n/a"
        mean = sum(vals) / len(vals)
        return f"**{100 * mean:.1f}** ({' / '.join(f'{100 * v:.1f}' for v in vals)})"

    head = "| method | held-out, in distribution: mean (" + " / ".join(f"s{s}" for s in seeds) + ") |"
    head += " out of distribution: mean (each seed) |" if has_ood else ""
    lines = [head, "|---|---:|" + ("---:|" if has_ood else "")]
    for m in methods:
        row = f"| {LABELS[m]} | {cell([results[m][s]['curve'].get(steps) for s in seeds])} |"
        if has_ood:
            row += f" {cell([results[m][s].get('ood_curve', {}).get(steps) for s in seeds])} |"
        lines.append(row)
    return "\n".join(lines)


def plot_summary(results: dict, methods, seeds, path: str, title: str, has_ood: bool) -> None:
    """Held-out (and OOD) accuracy vs step: the seed mean of each method bold, each seed thin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("curve", "held-out, in distribution")] + ([("ood_curve", "out of distribution")] if has_ood else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for m in methods:
            curves = [results[m][s].get(key, {}) for s in seeds]
            xs = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            for c in curves:
                cx = sorted(c)
                ax.plot(cx, [100 * c[x] for x in cx], color=COLORS[m], lw=0.7, alpha=0.45)
            ax.plot(xs, [100 * sum(c[x] for c in curves) / len(curves) for x in xs], color=COLORS[m], lw=2.2,
                    marker="o", ms=3, label=LABELS[m])
        ax.set_xlabel("training step (32 prompts per step)")
        ax.set_ylabel(f"greedy accuracy (%), {name}")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--methods", nargs="+", default=METHODS[:3], choices=METHODS)
    p.add_argument("--variant", default="addition3", choices=sorted(ta.VARIANTS))
    p.add_argument("--assets", default=None, help="default: outputs/toy_addition (addition3), outputs/demo/assets (demo)")
    p.add_argument("--out", default=os.path.join(ta.DEFAULT_OUT, "luffy_vs_grpo"))
    p.add_argument("--rerun", action="store_true", help="run again from scratch even when a finished run exists")
    p.add_argument("--no-run", action="store_true", help="only read finished runs")
    p.add_argument("--diagnostic", metavar="PNG", help="only plot --long-runs and --replicas into PNG")
    p.add_argument("--long-runs", nargs="*", default=[])
    p.add_argument("--replicas", nargs="*", default=[])
    a = p.parse_args(argv)
    if a.diagnostic:
        plot_diagnostic(a.long_runs, a.replicas, a.diagnostic)
        return 0
    if a.steps % a.eval_every:
        p.error("--steps must be a multiple of --eval-every")
    half = a.steps // 2
    if "sft_rl" in a.methods and (a.steps % 2 or half % a.eval_every):
        p.error("sft_rl: --steps/2 must be a multiple of --eval-every (the SFT checkpoint it starts from)")
    if a.assets is None:
        a.assets = ta.DEFAULT_OUT if a.variant == "addition3" else os.path.join(REPO_ROOT, "outputs", "demo", "assets")

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # hf_eval loads checkpoints: no "Loading weights" bars
    prep = ta.prepare(a.assets, seed=0, variant=a.variant)
    base_acc = prep["base_eval"]["heldout_carry"]["acc"]
    base_ood = prep["base_eval"].get("ood", {}).get("acc")
    print(f"[luffy_vs_grpo] base model: held-out pass rate {100 * base_acc:.1f}% (greedy, n=200); "
          f"carry-free {100 * prep['base_eval']['carry_free']['acc']:.1f}%"
          + ("" if base_ood is None else f"; OOD {100 * base_ood:.1f}%"), flush=True)
    tokenizer = ta.load_tokenizer(prep["tokenizer"])
    problems = ta.read_problems(prep["heldout"])
    ood_problems = ta.read_problems(prep["ood"]) if "ood" in prep else None

    # sft_rl starts from the SFT run's checkpoint at half the budget: SFT runs first
    order = sorted(a.methods, key=lambda m: (m == "sft_rl", METHODS.index(m)))
    if "sft_rl" in order and "sft" not in order:
        order.insert(0, "sft")
    results: dict = {m: {} for m in order}
    for seed in a.seeds:  # seed-major: a partial experiment already compares the methods
        for m in order:
            rdir = run_dir(a.out, m, seed)
            steps = half if m == "sft_rl" else a.steps
            if a.rerun or not finished(rdir, steps, a.eval_every):
                if a.no_run:
                    raise SystemExit(f"no finished run in {rdir} with steps={steps} (drop --no-run)")
                if a.rerun and os.path.isdir(rdir):
                    shutil.rmtree(rdir)  # from scratch, not continued
                model_path = sft_checkpoint(a.out, seed, half) if m == "sft_rl" else None
                wall = launch(m, seed, rdir, steps, a.eval_every, a.assets, a.variant, model_path)
                print(f"[luffy_vs_grpo] {m} seed {seed}: {wall:.0f} s", flush=True)
            results[m][seed] = collect(m, rdir, steps, a.eval_every, base_acc, tokenizer, problems, ood_problems,
                                       base_ood, offset=half if m == "sft_rl" else 0)
            if m == "sft_rl":  # the SFT half of the curve: the SFT run's first half
                for key in ("curve", "ood_curve"):
                    if key in results["sft"][seed]:
                        sft_part = {st: v for st, v in results["sft"][seed][key].items() if st < half}
                        results[m][seed][key] = {**sft_part, **results[m][seed].get(key, {})}
                results[m][seed]["wall_s"] += results["sft"][seed]["wall_s"] / 2  # its share of the SFT run
    methods = [m for m in METHODS if m in a.methods]

    md = table(results, methods, a.seeds)
    summary = summary_table(results, methods, a.seeds, a.steps, ood_problems is not None)
    print(md + "\n\n" + summary)
    for m in methods:
        print(f"final {m}: independent HF re-check of the last step: "
              + ", ".join("n/a" if results[m][s].get("final_hf_eval") is None else
                          f"{100 * results[m][s]['final_hf_eval']:.1f}%" for s in a.seeds))
    os.makedirs(a.out, exist_ok=True)
    png = os.path.join(a.out, "curves.png")
    title = f"toy addition ({a.variant}), {a.steps} steps x 32 prompts, n=8, CPU (base: {100 * base_acc:.0f}%)"
    if len(a.seeds) >= 3 or ood_problems is not None:
        plot_summary(results, methods, a.seeds, png, title, ood_problems is not None)
    else:
        plot(results, methods, a.seeds, png, title)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(md + "\n\n" + summary + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"variant": a.variant, "steps": a.steps, "eval_every": a.eval_every, "seeds": a.seeds,
                   "base_acc": base_acc, "base_ood": base_ood, "results": results}, f, indent=1, default=str)
    print(f"[luffy_vs_grpo] wrote {png}, table.md, results.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
