"""Evaluation benchmarks from local files -> one validation parquet, ``data_source`` = benchmark name.

Benchmarks (``--input NAME=PATH``, any subset, each once)::

    aime24 aime25 amc math500 minerva olympiad_bench     math: ground truth = the final answer
    arc_c gpqa_diamond                                   multiple choice: ground truth = a letter

Accepted row formats (auto-detected per file; override columns with ``--field NAME.problem=COL`` and
``--field NAME.answer=COL``):

* math: a problem column (``problem`` / ``question`` / ``Question``) and an answer column (``answer`` /
  ``final_answer`` (a list is joined with ", ") / ``expected_answer``), or only a ``solution`` whose last
  ``\\boxed{}`` is the answer (MATH-style files);
* ARC: ``question``, ``choices`` = {``text``: [...], ``label``: [...]}, ``answerKey`` (numeric labels
  1-5 become A-E);
* GPQA: ``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``; the four options are shuffled with
  a seeded RNG per row (``--seed``), so the letter of the correct one is reproducible;
* generic multiple choice: ``question``, ``choices``/``options`` (list of str), ``answer`` (a letter or a
  0-based index);
* rows already in our schema (``prompt`` + ``reward_model``, e.g. LUFFY's ``valid.*.parquet``) are kept
  as they are; a multiple-choice ground truth there may be a letter or a number label (1-26, graded as
  that number or the letter at that position); rows with another one, or without a usable prompt, are
  dropped and counted.

Prompts match training (``scripts/data/prepare_openr1.py``): LUFFY's system prompt + the problem
(``--no-system-prompt``: one user message with a ``\\boxed{}`` instruction). ``extra_info`` holds
``split``, ``index`` (row in the output), ``benchmark_index`` (row in the benchmark file), ``repeat`` and
``answer_type`` (read by the reward). ``--repeat 8`` or ``--repeat aime24=32`` repeats rows for avg@k.

Usage::

    python -m scripts.data.prepare_eval --output data/valid.parquet \\
        --input aime24=raw/aime24.jsonl --input amc=raw/amc.parquet --input math500=raw/math500.jsonl \\
        --input gpqa_diamond=raw/gpqa_diamond.csv.parquet --repeat aime24=32 --repeat amc=32
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

from mix_src.rewards.answers import gold_choice, last_boxed
from scripts.data.prepare_openr1 import (SYSTEM_PROMPT, USER_INSTRUCTION, answer_text, load_table, make_prompt,
                                         resolve_system_prompt)

MATH = ("aime24", "aime25", "amc", "math500", "minerva", "olympiad_bench")
MULTIPLE_CHOICE = ("arc_c", "gpqa_diamond")
BENCHMARKS = MATH + MULTIPLE_CHOICE
# where recipes/common.sh looks for the validation set (VAL_FILES)
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "data", "valid.parquet")
LETTERS = "ABCDEFGHIJ"
MC_INSTRUCTION = "Answer with the letter of the correct option in \\boxed{}, e.g. \\boxed{A}."

PROBLEM_KEYS = ("problem", "question", "Question")
ANSWER_KEYS = ("answer", "final_answer", "expected_answer", "Answer")


def _first_present(row_keys, keys):
    return next((k for k in keys if k in row_keys), None)


_answer_text = answer_text  # one rule for training and evaluation answers (prepare_openr1.answer_text)


def _mc_prompt(question: str, options: list[str]) -> str:
    lines = [question.strip(), ""] + [f"{LETTERS[i]}. {str(o).strip()}" for i, o in enumerate(options)]
    return "\n".join(lines + ["", MC_INSTRUCTION])


class Converter:
    """Turns one benchmark file into rows; counts what it drops."""

    def __init__(self, name: str, path: str, fields: dict[str, str], seed: int, system_prompt: str | None,
                 kind: str = "math"):
        self.name, self.path, self.fields, self.seed, self.system_prompt = name, path, fields, seed, system_prompt
        self.kind = kind  # "math" or "multiple_choice" (answer_kind)
        self.drops: dict[str, int] = {}

    def drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def rows(self, df) -> list[tuple[int, dict]]:
        cols = set(df.columns)
        where = f"{self.name}={self.path}"
        if {"prompt", "reward_model"} <= cols:  # already in our schema
            made = [(i, self.passthrough(r)) for i, r in enumerate(df.to_dict("records"))]
            return [(i, m) for i, m in made if m is not None]
        problem_key = self.fields.get("problem") or _first_present(cols, PROBLEM_KEYS)
        if problem_key is None or problem_key not in cols:
            raise SystemExit(f"error: {where}: no problem column (looked for {self.fields.get('problem') or list(PROBLEM_KEYS)}); "
                             f"columns are {sorted(cols)}. Pass --field {self.name}.problem=COLUMN")
        out = []
        for i, r in enumerate(df.to_dict("records")):
            problem = r.get(problem_key)
            if not isinstance(problem, str) or not problem.strip():
                self.drop(f"empty {problem_key}")
                continue
            made = self.multiple_choice(r, problem, cols, where) if self.name in MULTIPLE_CHOICE \
                else self.math(r, problem, cols, where)
            if made is not None:
                out.append((i, made))
        return out

    def passthrough(self, r: dict) -> dict | None:
        prompt = r.get("prompt")
        if prompt is None or isinstance(prompt, str) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                                 for m in list(prompt)):
            self.drop("prompt is not a list of {role, content} messages")
            return None
        reward_model = r.get("reward_model")
        gt = _answer_text(reward_model.get("ground_truth")) if isinstance(reward_model, dict) else None
        if gt and self.kind == "multiple_choice":
            if gold_choice(gt) is None:
                self.drop("ground truth is not an option label (a letter, or a number 1-26)")
                return None
        return {"prompt": list(prompt), "ground_truth": gt, "extra": r.get("extra_info")}

    def math(self, r, problem, cols, where) -> dict | None:
        key = self.fields.get("answer") or _first_present(cols, ANSWER_KEYS)
        if key is not None and key not in cols:
            raise SystemExit(f"error: {where}: no column {key!r}; columns are {sorted(cols)}")
        if key is not None:
            answer = _answer_text(r.get(key))
        elif "solution" in cols:
            boxed = last_boxed(str(r.get("solution") or ""))
            answer = _answer_text(boxed)
            key = "solution"
        else:
            raise SystemExit(f"error: {where}: no answer column (looked for {list(ANSWER_KEYS)} or a 'solution' with "
                             f"\\boxed{{}}); columns are {sorted(cols)}. Pass --field {self.name}.answer=COLUMN")
        if answer is None:
            self.drop(f"no answer in {key}")
            return None
        return {"prompt": make_prompt(problem.strip(), self.system_prompt), "ground_truth": answer}

    def multiple_choice(self, r, question, cols, where) -> dict | None:
        if "Correct Answer" in cols:  # GPQA
            wrong = [r.get(f"Incorrect Answer {k}") for k in (1, 2, 3)]
            options = [r.get("Correct Answer"), *wrong]
            if any(not isinstance(o, str) or not o.strip() for o in options):
                self.drop("missing option text")
                return None
            order = list(range(4))
            random.Random(f"{self.seed}:{self.name}:{question}").shuffle(order)
            options = [options[k] for k in order]
            letter = LETTERS[order.index(0)]
        elif "choices" in cols and isinstance(r.get("choices"), dict):  # ARC
            texts, labels = list(r["choices"].get("text", [])), [str(x) for x in r["choices"].get("label", [])]
            key = str(r.get(self.fields.get("answer") or "answerKey", "")).strip()
            if not texts or len(texts) != len(labels) or key not in labels:
                self.drop("answerKey not among the choice labels")
                return None
            options, letter = texts, LETTERS[labels.index(key)]
        else:  # generic: a list of options and a letter or index
            opt_key = _first_present(cols, ("choices", "options"))
            ans_key = self.fields.get("answer") or _first_present(cols, ("answer", "answerKey", "label"))
            if opt_key is None or ans_key is None:
                raise SystemExit(f"error: {where}: multiple-choice rows need GPQA columns (Correct Answer, Incorrect "
                                 "Answer 1..3), ARC columns (choices{text,label}, answerKey) or choices/options + "
                                 f"answer; columns are {sorted(cols)}")
            raw = r.get(opt_key)
            options = [] if raw is None else [str(o) for o in raw]
            ans = r.get(ans_key)
            if isinstance(ans, (int, float)) and not isinstance(ans, bool) and 0 <= int(ans) < len(options):
                letter = LETTERS[int(ans)]
            elif isinstance(ans, str) and ans.strip().upper() in LETTERS[:len(options)]:
                letter = ans.strip().upper()
            else:
                self.drop(f"{ans_key} is neither a letter nor an index of {opt_key}")
                return None
        if len(options) > len(LETTERS):
            self.drop(f"more than {len(LETTERS)} options")
            return None
        content = _mc_prompt(question, options)
        prompt = [{"role": "user", "content": content}] if self.system_prompt is None else \
            [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": content}]
        return {"prompt": prompt, "ground_truth": letter}


def _parse_pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        if "=" not in v:
            raise SystemExit(f"error: {flag} {v!r}: expected NAME=VALUE")
        k, val = v.split("=", 1)
        if k in out:
            raise SystemExit(f"error: {flag} {k} given twice")
        out[k.strip()] = val.strip()
    return out


def answer_kind(name: str) -> str:
    """``multiple_choice`` for our multiple-choice benchmarks and for a kept data_source the reward reads as one
    (``gpqa``, ``arc``, ``mmlu``..., mix_src/rewards/math_verify_reward.py answer_type_for), else ``math``."""
    from mix_src.rewards.math_verify_reward import answer_type_for, make_config

    if name in BENCHMARKS:
        return "multiple_choice" if name in MULTIPLE_CHOICE else "math"
    return "multiple_choice" if answer_type_for(name, None, make_config()) == "multiple_choice" else "math"


def refuse_relabel(name: str, path: str, df) -> None:
    """``NAME=PATH`` would write NAME over every row; a file whose rows already name their benchmark (LUFFY's
    valid.parquet holds five) is refused, naming them."""
    if "data_source" not in df.columns or not {"prompt", "reward_model"} <= set(df.columns):
        return
    counts = df["data_source"].astype(str).value_counts().to_dict()
    if set(counts) - {name}:
        raise SystemExit(f"error: --input {name}={path}: its rows already name their benchmark in data_source "
                         f"({', '.join(f'{k}: {v}' for k, v in counts.items())}); writing {name!r} over them would "
                         f"mislabel them. Pass --input {path} (no NAME=) to keep each row's data_source")


def as_is_groups(paths: list[str], split: str) -> dict[str, tuple[str, Any]]:
    """Rows of files already in our schema (``--input PATH``, e.g. LUFFY's data/valid.parquet), grouped by their
    own ``data_source``: ``{data_source: (path, rows)}``."""
    groups: dict[str, tuple[str, Any]] = {}
    for path in paths:
        df = load_table(path, split)
        missing = [c for c in ("data_source", "prompt", "reward_model") if c not in df.columns]
        if missing:
            raise SystemExit(f"error: --input {path}: kept as is needs the columns data_source, prompt and "
                             f"reward_model; it has no {missing} (its columns: {list(df.columns)}). Give it a "
                             f"benchmark name instead: --input NAME={path}")
        for ds, rows in df.groupby(df["data_source"].astype(str), sort=False):
            if ds in groups:
                raise SystemExit(f"error: data_source {ds!r} appears in {groups[ds][0]} and in {path}")
            groups[ds] = (path, rows.reset_index(drop=True))
    return groups


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--input", action="append", default=[], metavar="NAME=PATH|PATH",
                   help=f"benchmark file; NAME in {', '.join(BENCHMARKS)}; a bare PATH is a file already in our "
                        "schema (e.g. LUFFY's data/valid.parquet) whose rows keep their data_source")
    p.add_argument("--output", default=DEFAULT_OUTPUT,
                   help=f"output .parquet path (default {os.path.relpath(DEFAULT_OUTPUT)}, the recipes' default)")
    p.add_argument("--repeat", action="append", default=[], metavar="K|NAME=K",
                   help="repeat rows K times for avg@k (all benchmarks, or one)")
    p.add_argument("--field", action="append", default=[], metavar="NAME.problem=COL|NAME.answer=COL")
    p.add_argument("--split", default="test", help="split to read from DatasetDicts / HF names (test)")
    p.add_argument("--seed", type=int, default=0, help="seed of the GPQA option shuffle")
    p.add_argument("--limit", type=int, default=0, help="first N rows of each benchmark (0 = all)")
    p.add_argument("--no-system-prompt", action="store_true")
    p.add_argument("--system-prompt-file", default=None)
    a = p.parse_args(argv)

    as_is = [v for v in a.input if "=" not in v]  # files in our schema whose rows keep their data_source
    inputs = _parse_pairs([v for v in a.input if "=" in v], "--input")
    if not inputs and not as_is:
        p.error(f"give at least one --input NAME=PATH (NAME in {', '.join(BENCHMARKS)}) or --input PATH")
    unknown = sorted(set(inputs) - set(BENCHMARKS))
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; the names are {', '.join(BENCHMARKS)}")
    tables = {name: load_table(path, a.split) for name, path in inputs.items()}
    for name, df in tables.items():
        refuse_relabel(name, inputs[name], df)
    groups = as_is_groups(as_is, a.split)  # {data_source: (path, rows)}
    clash = sorted(set(groups) & set(inputs))
    if clash:
        p.error(f"benchmark(s) {clash} given both as NAME=PATH and as data_source values of an --input PATH file")
    inputs.update({ds: path for ds, (path, _) in groups.items()})
    tables.update({ds: df for ds, (_, df) in groups.items()})
    default_repeat, repeats = 1, {}
    for v in a.repeat:
        try:
            if "=" in v:
                repeats.update({k: int(x) for k, x in _parse_pairs([v], "--repeat").items()})
            else:
                default_repeat = int(v)
        except ValueError:
            p.error(f"--repeat {v!r}: expected K or NAME=K with an integer K")
    bad = {k: v for k, v in repeats.items() if k not in inputs or v < 1}
    if bad or default_repeat < 1:
        p.error(f"--repeat: counts must be >= 1 and names must be among the inputs; got {bad or default_repeat}")
    fields: dict[str, dict[str, str]] = {}
    for k, v in _parse_pairs(a.field, "--field").items():
        name, _, what = k.partition(".")
        if name not in inputs or what not in ("problem", "answer"):
            p.error(f"--field {k}: expected NAME.problem or NAME.answer with NAME among the inputs")
        fields.setdefault(name, {})[what] = v
    system_prompt = resolve_system_prompt(a, p)

    rows, summary = [], {}
    print(f"{'benchmark':15s} {'read':>6s} {'kept':>6s} {'repeat':>6s} {'rows':>7s}  file")
    for name in [b for b in BENCHMARKS if b in inputs] + [g for g in groups if g not in BENCHMARKS]:
        df = tables[name]
        if a.limit:
            df = df.iloc[: a.limit]
        kind = answer_kind(name)
        conv = Converter(name, inputs[name], fields.get(name, {}), a.seed, system_prompt, kind)
        made = conv.rows(df)
        k = repeats.get(name, default_repeat)
        for bench_index, m in made:
            if not m["ground_truth"]:
                conv.drop("empty ground truth")
                continue
            for rep in range(k):
                extra = dict(m.get("extra") or {})
                extra.update({"split": "test", "index": len(rows), "benchmark_index": bench_index, "repeat": rep,
                              "answer_type": kind})
                rows.append({"data_source": name, "prompt": m["prompt"], "ability": "math" if kind == "math" else kind,
                             "reward_model": {"style": "rule", "ground_truth": m["ground_truth"]},
                             "extra_info": extra})
        kept = len(made) - conv.drops.get("empty ground truth", 0)
        print(f"{name:15s} {len(df):6d} {kept:6d} {k:6d} {kept * k:7d}  {inputs[name]}")
        for reason, n in conv.drops.items():
            print(f"  {name}: dropped {n} rows: {reason}")
        if kept == 0:
            raise SystemExit(f"error: {name}: no usable rows in {inputs[name]}; see the drop counts above")
        summary[name] = {"read": len(df), "kept": kept, "repeat": k, "rows": kept * k, "dropped": dict(conv.drops)}

    import pandas as pd

    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    pd.DataFrame(rows).to_parquet(a.output, index=False)
    print(f"wrote {len(rows)} rows ({len(summary)} benchmarks) to {a.output}")
    return {"rows": len(rows), "benchmarks": summary, "output": a.output}


if __name__ == "__main__":
    main()
