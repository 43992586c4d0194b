"""Plot a run's learning curves from verl's ``file`` logger into one PNG.

verl's ``FileLogger`` (``trainer.logger=[console,file]``, path from ``VERL_FILE_LOGGER_PATH``) writes one
JSON object per ``log`` call: ``{"step": <int>, "data": {"<metric>": <value>, ...}}``. Several lines may
share a step (e.g. validation metrics logged separately); they are merged.

Panels (a panel whose keys were never logged says so; missing keys are also listed at the bottom and
printed to stderr):

    reward         critic/score/mean                       mean sequence score of the step's batch
    solved         batch/on_solved, batch/off_solved       fraction solved: on-policy vs demonstration rows
    token prob     actor/off_policy_prob, actor/on_policy_prob   mean pi(token) on target / generated tokens
    entropy        actor/entropy
    prefix ratio   batch/avg_prefix_ratio                  mean prefix ratio over the batch's rows
    length         response_length/mean

Usage::

    python scripts/plot_metrics.py outputs/cpu_tiny/metrics.jsonl [--out curves.png] [--title T]
        [--extra KEY ...]           # one more panel per key

Exit status: 0 when the PNG was written, 1 when the file is missing or holds no metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Iterable, Sequence

# (panel title, metric keys drawn in it)
PANELS: list[tuple[str, list[str]]] = [
    ("reward (score mean)", ["critic/score/mean"]),
    ("solved fraction", ["batch/on_solved", "batch/off_solved"]),
    ("token probability", ["actor/off_policy_prob", "actor/on_policy_prob"]),
    ("entropy", ["actor/entropy"]),
    ("prefix ratio", ["batch/avg_prefix_ratio"]),
    ("response length", ["response_length/mean"]),
]


def read_metrics(path: str) -> list[dict]:
    """One dict per step (sorted by step, ``"step"`` included) from a FileLogger JSONL file.

    Lines that are not valid JSON objects with ``step`` and ``data`` (e.g. a line cut short by a killed
    run) are skipped."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                step, data = int(rec["step"]), rec["data"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(data, dict):
                by_step.setdefault(step, {"step": step}).update(data)
    return [by_step[s] for s in sorted(by_step)]


def _number(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def series(records: Iterable[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``; steps without a finite numeric value are left out."""
    steps, values = [], []
    for rec in records:
        v = _number(rec.get(key))
        if v is not None:
            steps.append(rec["step"])
            values.append(v)
    return steps, values


def plot(
    records: Sequence[dict], out: str, title: str = "", panels: Sequence[tuple[str, list[str]]] = PANELS
) -> tuple[list[str], list[str]]:
    """Write the PNG; return (plotted keys, missing keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows + 0.6), squeeze=False)
    plotted, missing = [], []
    for ax, (panel_title, keys) in zip(axes.flat, panels):
        drawn = 0
        for key in keys:
            steps, values = series(records, key)
            if not steps:
                missing.append(key)
                continue
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.5, label=key)
            plotted.append(key)
            drawn += 1
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged:\n" + "\n".join(keys), ha="center", va="center", fontsize=8,
                    color="gray", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    steps = [r["step"] for r in records]
    head = title or os.path.basename(out)
    fig.suptitle(f"{head}  ({len(steps)} logged steps: {min(steps)}..{max(steps)})" if steps else head, fontsize=11)
    if missing:
        fig.text(0.01, 0.005, "not in the log: " + ", ".join(missing), fontsize=7, color="gray", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return plotted, missing


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Plot learning curves from verl's file-logger JSONL into a PNG.")
    p.add_argument("metrics", help="JSONL written by verl's file logger (VERL_FILE_LOGGER_PATH)")
    p.add_argument("--out", "-o", default=None, help="PNG path (default: learning_curves.png next to the metrics)")
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY", help="extra metric keys, one panel each")
    a = p.parse_args(argv)

    if not os.path.exists(a.metrics):
        print(f"plot_metrics: {a.metrics} does not exist (was the run started with trainer.logger=[console,file]?)",
              file=sys.stderr)
        return 1
    records = read_metrics(a.metrics)
    if not records:
        print(f"plot_metrics: no metrics in {a.metrics}", file=sys.stderr)
        return 1
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.metrics)), "learning_curves.png")
    panels = [*PANELS, *[(k, [k]) for k in a.extra]]
    plotted, missing = plot(records, out, a.title, panels)
    for key in missing:
        print(f"plot_metrics: note: '{key}' is not in the log; its curve is left out", file=sys.stderr)
    print(f"plot_metrics: wrote {out} ({len(records)} steps; {len(plotted)} curves: {', '.join(plotted) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
