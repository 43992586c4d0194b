"""Reward benchmark: grade N generated responses one call at a time (``compute_score``, as a single verl
reward thread would) and with the batch API (``compute_score_batch``, parallel workers); print the
throughput ratio and the worst single-item latency.

    python -m scripts.bench rewards [--n 2000] [--timeout 2.0] [--pathological 0.005] [--workers 0] [--seed 0]

The responses mix correct answers (exact and equivalent forms), wrong answers, multiple choice, plain
numbers, malformed responses and a small share of pathological ones (deeply nested LaTeX, power towers,
a 10,000-character nested expression) that only the per-item deadline stops. Each mode starts from a
fresh pool (forked from a warmed zygote), so neither benefits from the other's caches.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from mix_src.rewards import math_verify_reward as mvr
from mix_src.rewards.pool import close_all

FILLER = ("Let me think. We consider the cases carefully, compute the sum and check the boundary values; "
          "by symmetry the expression simplifies. Now verify with a small example: $2+3=5$. ")


def _think(rng: random.Random) -> str:
    return "<think>\n" + FILLER * rng.randint(5, 30) + "\n</think>\n\n"


def make_items(n: int, seed: int = 0, pathological_frac: float = 0.005) -> list[dict]:
    """``n`` (data_source, response, ground_truth, category) rows, deterministic for ``seed``."""
    rng = random.Random(seed)
    items = []
    n_patho = max(1, round(n * pathological_frac)) if pathological_frac > 0 else 0
    for i in range(n):
        if i < n_patho:
            cat = "pathological"
        else:
            cat = rng.choices(["correct_exact", "correct_equiv", "wrong", "multiple_choice", "numeric", "malformed"],
                              weights=[20, 25, 30, 8, 7, 10])[0]
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        think = _think(rng)
        ds, gt = "math", str(a)
        if cat == "correct_exact":
            kind = rng.randrange(3)
            if kind == 0:
                resp = f"{think}The answer is $\\boxed{{{a}}}$."
            elif kind == 1:
                gt = f"\\frac{{{a}}}{{{b}}}"
                resp = f"{think}So we get \\boxed{{\\dfrac{{{a}}}{{{b}}}}}."
            else:
                gt = f"{a}\\sqrt{{{b}}}"
                resp = f"{think}Hence \\boxed{{{a} \\sqrt{{{b}}}}}"
        elif cat == "correct_equiv":
            kind = rng.randrange(5)
            if kind == 0:
                gt, resp = f"\\frac{{{a}}}{{4}}", f"{think}The value is \\boxed{{{a / 4}}}."
            elif kind == 1:
                gt, resp = f"({a},{a + b}]", f"{think}Therefore $x \\in ({a}, {a + b}]$."
            elif kind == 2:
                gt, resp = f"\\{{{a},{b}\\}}", f"{think}The solutions are \\boxed{{\\{{{b}, {a}\\}}}}."
            elif kind == 3:
                gt, resp = f"x^2+{2 * a}x+{a * a}", f"{think}We get \\boxed{{(x+{a})^2}}"
            else:
                gt, resp = f"{2 * a}\\sqrt{{3}}", f"{think}So the length is \\boxed{{\\sqrt{{{12 * a * a}}}}}."
        elif cat == "wrong":
            kind = rng.randrange(3)
            if kind == 0:
                resp = f"{think}The answer is \\boxed{{{a + 1}}}."
            elif kind == 1:
                gt, resp = f"\\frac{{{a}}}{{{b + 1}}}", f"{think}\\boxed{{\\frac{{{b + 1}}}{{{a}}}}}"
            else:
                gt, resp = f"({a},{a + b}]", f"{think}so $x \\in [{a}, {a + b}]$"
        elif cat == "multiple_choice":
            ds, gt = rng.choice(["arc_c", "gpqa_diamond"]), rng.choice("ABCD")
            pick = gt if rng.random() < 0.5 else rng.choice("ABCD")
            resp = f"{think}" + rng.choice([f"The answer is ({pick}).", f"\\boxed{{{pick}}}", f"Answer: {pick}"])
        elif cat == "numeric":
            ds, gt = "gsm8k", f"{a * 1000 + b}"
            resp = f"{think}In total she has {a:,},{b:03d} apples." if rng.random() < 0.5 else \
                f"{think}So the total is {a * 1000 + b + 1}."
        elif cat == "malformed":
            kind = rng.randrange(4)
            if kind == 0:
                resp = think.replace("</think>", "") + f"\\boxed{{{a}}}"  # no </think>: format error
            elif kind == 1:
                resp = f"{think}The answer is \\boxed{{{a}"  # unbalanced
            elif kind == 2:
                resp = think  # nothing after </think>
            else:
                resp = f"{think}\\frac{{\\sqrt{{}}}}{{}} ^^ }}{{ \\left( \\right] {a} $$ $"
        else:  # pathological
            kind = i % 4
            if kind == 0:
                resp = f"{think}\\boxed{{" + "\\frac{1}{" * 40 + "2" + "}" * 40 + "}"
            elif kind == 1:
                resp = f"{think}\\boxed{{9^{{9^{{9^{{9}}}}}}}}"
            elif kind == 2:
                resp = f"{think}\\boxed{{" + "\\left(" * 1600 + "1" + "\\right)" * 1600 + "}"  # 20k chars
            else:
                resp = f"{think}\\boxed{{(10^{{10}})!}}"
        items.append({"data_source": ds, "response": resp, "ground_truth": gt, "category": cat})
    rng.shuffle(items)
    return items


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.bench rewards", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="number of responses (default 2000)")
    p.add_argument("--timeout", type=float, default=2.0, help="per-item deadline in seconds (default 2.0; the reward default is 5)")
    p.add_argument("--workers", type=int, default=0, help="grading processes for the batch API (0 = #CPUs, max 8)")
    p.add_argument("--pathological", type=float, default=0.005, help="share of pathological responses (0.005)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    items = make_items(a.n, a.seed, a.pathological)
    ds = [x["data_source"] for x in items]
    resp = [x["response"] for x in items]
    gts = [x["ground_truth"] for x in items]
    opts = {"timeout_s": a.timeout, "num_workers": a.workers}
    cfg = mvr.make_config(**opts)
    cats: dict[str, int] = {}
    for x in items:
        cats[x["category"]] = cats.get(x["category"], 0) + 1
    print(f"{a.n} responses: " + ", ".join(f"{k} {v}" for k, v in sorted(cats.items())))
    print(f"per-item timeout {a.timeout:.1f}s, batch workers {cfg.workers}, usable CPUs {_cpus()}, mean response "
          f"{sum(map(len, resp)) / len(resp):.0f} chars, load average at start {_load()}")

    # 1) one call at a time (what one verl reward thread does)
    close_all()
    mvr.warmup(**opts)
    stats0 = dict(mvr.grading_stats())
    worst, worst_cat = 0.0, ""
    t0 = time.perf_counter()
    seq = []
    for x in items:
        t = time.perf_counter()
        seq.append(mvr.compute_score(x["data_source"], x["response"], x["ground_truth"], **opts))
        dt = time.perf_counter() - t
        if dt > worst:
            worst, worst_cat = dt, x["category"]
    t_seq = time.perf_counter() - t0
    st = mvr.grading_stats()
    seq_timeouts = st.get("timeout", 0) - stats0.get("timeout", 0)
    seq_cpu = st.get("worker_cpu_s", 0.0) - stats0.get("worker_cpu_s", 0.0)
    n_jobs = sum(isinstance(mvr._prepare(d, r, g, None, cfg), mvr._Pending) for d, r, g in zip(ds, resp, gts))

    # 2) the batch API, from a fresh pool
    close_all()
    mvr.warmup(**opts)
    stats0 = dict(mvr.grading_stats())
    t0 = time.perf_counter()
    bat = mvr.compute_score_batch(ds, resp, gts, **opts)
    t_bat = time.perf_counter() - t0
    st = mvr.grading_stats()
    bat_timeouts = st.get("timeout", 0) - stats0.get("timeout", 0)
    bat_cpu = st.get("worker_cpu_s", 0.0) - stats0.get("worker_cpu_s", 0.0)
    close_all()

    same = sum(s == b for s, b in zip(seq, bat))
    acc = sum(r["acc"] for r in bat) / len(bat)
    fmt = sum(r["format_ok"] for r in bat) / len(bat)
    print(f"sent to workers: {n_jobs} of {a.n} (the rest decided in-process: exact matches, letters, numbers, "
          f"format errors)")
    print(f"sequential compute_score : {t_seq:7.2f} s  {a.n / t_seq:8.1f} items/s  timeouts {seq_timeouts}")
    print(f"batch compute_score_batch: {t_bat:7.2f} s  {a.n / t_bat:8.1f} items/s  timeouts {bat_timeouts}")
    print(f"throughput ratio batch/sequential: {t_seq / t_bat:.2f}x (target >= 1.8x on 2 cores)")
    print(f"worker CPU on completed items: sequential {seq_cpu:.1f} s, batch {bat_cpu:.1f} s; each timeout holds a "
          f"worker for {a.timeout:.1f} s of wall time")
    print(f"worst single-item latency: {worst:.3f} s ({worst_cat}); bound = timeout {a.timeout:.1f} s + worker restart")
    print(f"identical results sequential vs batch: {same}/{a.n}; acc {acc:.3f}, format_ok {fmt:.3f}")
    print(f"load average at end {_load()} (other processes on these CPUs lower the ratio)")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
