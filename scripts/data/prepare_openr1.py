"""OpenR1-Math-style rows -> our training parquet (LUFFY's training data, github.com/ElliottYan/LUFFY).

Input rows need ``problem``, ``answer`` and ``generations`` (list of str); when the columns
``correctness_math_verify`` and ``is_reasoning_complete`` (lists of bool, one per generation) exist, only
generations marked correct **and** complete are candidates. The target is the first candidate that is
non-empty and, with ``--tokenizer``, at most ``--max-target-tokens`` tokens long (LUFFY's v6 filter); every such
candidate (distinct, in order) is kept in ``target_lst``. Rows without one are dropped and **counted by reason**.

Output columns (see data/README.md)::

    data_source   str            --data-source (default "openr1_math")
    prompt        list[message]  [system, user]: LUFFY's system prompt + the raw problem
                                 (--no-system-prompt: one user message with a "\\boxed{}" instruction)
    target        list[message]  [{"role": "assistant", "content": <the chosen generation>}]
    target_lst    list[str]      every candidate within the length cap, distinct, in order (target first):
                                 the demonstrations mix.data.use_target_lst=true draws from (LUFFY's column name)
    ability       str            "math"
    reward_model  {style, ground_truth}  {"rule", answer}
    extra_info    {split, index, source_index}  index = row in the output, source_index = row in the input

Usage (offline, local files)::

    python -m scripts.data.prepare_openr1 --input openr1.parquet --output data/openr1.parquet \\
        --tokenizer /models/Qwen2.5-Math-7B --max-target-tokens 8192

``--input`` is a parquet / jsonl / json file, a folder of them, a ``datasets.save_to_disk`` folder, or
(when online) a Hugging Face dataset name such as ``open-r1/OpenR1-Math-220k``.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
from typing import Any

# LUFFY's system prompt (luffy/scripts/data/prepare_openr1_data_spec_sys.py:80, the system message of its released
# data/valid.parquet), verbatim: its "\n" are newlines (a plain Python string there), not backslash + n.
SYSTEM_PROMPT = (
    "Your task is to follow a systematic, thorough reasoning process before providing the final solution. "
    "This involves analyzing, summarizing, exploring, reassessing, and refining your thought process through "
    "multiple iterations. Structure your response into two sections: Thought and Solution. In the Thought "
    "section, present your reasoning using the format: \"<think>\n {thoughts} </think>\n\". Each thought "
    "should include detailed analysis, brainstorming, verification, and refinement of ideas. After "
    "\"</think>\n,\" in the Solution section, provide the final, logical, and accurate answer, clearly derived "
    "from the exploration in the Thought section. If applicable, include the answer in \\boxed{} for "
    "closed-form results like multiple choices or mathematical solutions."
)
# LUFFY's older single-message prompt (prepare_openr1_data.py), used with --no-system-prompt.
USER_INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."

REQUIRED = ("problem", "answer", "generations")
PREPARED = ("prompt", "reward_model")  # rows already in the training schema (LUFFY's released set): checked, not converted
# where recipes/common.sh looks for the training set (TRAIN_FILES)
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "data", "openr1.parquet")
FLAG_COLUMNS = ("correctness_math_verify", "is_reasoning_complete")


def resolve_system_prompt(a: argparse.Namespace, p: argparse.ArgumentParser) -> str | None:
    """The system prompt chosen by ``--system-prompt-file`` / ``--no-system-prompt`` (default: LUFFY's)."""
    if a.no_system_prompt and a.system_prompt_file:
        p.error("--no-system-prompt and --system-prompt-file contradict each other; pass one")
    if a.system_prompt_file:
        with open(a.system_prompt_file, encoding="utf-8") as f:
            return f.read().strip()
    return None if a.no_system_prompt else SYSTEM_PROMPT


# ----------------------------------------------------------------------------------------- loading
def load_table(source: str, split: str = "train"):
    """A pandas DataFrame from a local parquet/jsonl/json file, a folder of them, a ``save_to_disk``
    folder, or a Hugging Face dataset name (needs network access)."""
    import pandas as pd

    if os.path.isdir(source):
        if os.path.exists(os.path.join(source, "dataset_info.json")) or \
                os.path.exists(os.path.join(source, "dataset_dict.json")):
            import datasets

            ds = datasets.load_from_disk(source)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise SystemExit(f"error: {source} is a saved DatasetDict without split {split!r}; "
                                     f"its splits are {sorted(ds)}; pass --split")
                ds = ds[split]
            return _arrow_to_pandas(ds.with_format("arrow")[:])
        files = sorted(f for ext in ("parquet", "jsonl", "json")
                       for f in glob.glob(os.path.join(source, "**", f"*.{ext}"), recursive=True))
        files = [f for f in files if os.path.basename(f) not in ("dataset_info.json", "state.json")]
        if split and any(split in os.path.basename(f) for f in files):
            files = [f for f in files if split in os.path.basename(f)]
        if not files:
            raise SystemExit(f"error: folder {source} holds no .parquet/.jsonl/.json files and is not a "
                             "datasets.save_to_disk folder")
        subdirs = sorted({os.path.relpath(os.path.dirname(f), source) for f in files})
        print(f"reading {len(files)} files from {source} (subfolders: {', '.join(subdirs)}); point --input at one "
              "subfolder if these are different configurations of the dataset")
        return pd.concat([load_table(f, split) for f in files], ignore_index=True)
    if os.path.isfile(source):
        lower = source.lower()
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                return _arrow_to_pandas(pq.read_table(source))
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a broken file
                raise SystemExit(f"error: {source} is not a readable parquet file ({type(exc).__name__}: "
                                 f"{str(exc)[:200]})") from exc
        if lower.endswith((".jsonl", ".json")):
            return read_json_rows(source)
        raise SystemExit(f"error: {source}: unsupported file type; use .parquet, .jsonl or .json")
    looks_like_path = source.startswith(("/", ".", "~")) or source.count("/") > 1 or \
        source.lower().endswith((".parquet", ".jsonl", ".json"))
    if looks_like_path:
        raise SystemExit(f"error: input {source} does not exist")
    try:
        import datasets

        ds = datasets.load_dataset(source, split=split)
    except Exception as exc:  # offline, or no such dataset
        raise SystemExit(f"error: {source!r} is not a local file or folder, and loading it from the Hugging Face "
                         f"Hub failed ({type(exc).__name__}: {str(exc)[:200]}). Download it first and pass the "
                         "local path.") from exc
    return _arrow_to_pandas(ds.with_format("arrow")[:])


def _arrow_to_pandas(table):
    """An arrow table as pandas without changing a value: an integer column with nulls stays integers (pandas
    would make it float64, so 12 became '12.0'), big integers stay exact."""
    return table.to_pandas(integer_object_nulls=True)


def read_json_rows(path: str):
    """A JSON array or one JSON object per line, values as written (no dtype inference: '0012' and
    12345678901234567890 stay as they are); a malformed line is named by file and line number."""
    import pandas as pd

    from mix_src.config.data_check import JsonLinesError, json_records

    try:
        records = json_records(path)
    except JsonLinesError as exc:
        if exc.line is None:
            raise SystemExit(f"error: {path}: not valid JSON ({exc.error.msg} at line {exc.error.lineno})") from exc
        raise SystemExit(f"error: {path}: line {exc.line} is not valid JSON ({exc.error.msg}); fix or delete "
                         "that line") from exc
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise SystemExit(f"error: {path}: row {bad} is not a JSON object")
    columns = list(dict.fromkeys(k for r in records for k in r))
    return pd.DataFrame({c: pd.Series([r.get(c) for r in records], dtype=object) for c in columns})


def answer_text(value) -> str | None:
    """A final answer as exact text, or None when it is missing, empty, NaN or inf (those rows are dropped and
    counted). Lists are joined with ", ", integer-valued floats lose their ".0" (142.0 -> "142"), ints are written
    exactly, surrounding $ are removed."""
    from mix_src.rewards.answers import ground_truth_problem

    if hasattr(value, "item") and not isinstance(value, str) and getattr(value, "ndim", 1) == 0:
        value = value.item()  # numpy scalars
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        value = str(int(value)) if value.is_integer() else repr(value)
    elif isinstance(value, int):
        value = str(value)
    if not isinstance(value, str) and hasattr(value, "__len__"):
        parts = [answer_text(v) for v in list(value)]
        parts = [p for p in parts if p]
        return ", ".join(parts) if parts else None
    text = str(value).strip()
    if text.startswith("$") and text.endswith("$") and len(text) > 1:
        text = text.strip("$").strip()
    return text if text and ground_truth_problem(text) is None else None


def require_columns(df, columns, where: str, hint: str = "") -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise SystemExit(f"error: {where} has no column(s) {missing}; its columns are {list(df.columns)}. {hint}".rstrip())


def make_prompt(problem: str, system_prompt: str | None) -> list[dict]:
    if system_prompt is None:
        return [{"role": "user", "content": problem + USER_INSTRUCTION}]
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": problem}]


def _as_list(value) -> list | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    try:
        return list(value)
    except TypeError:
        return None


# ------------------------------------------------------------------------------------------ filtering
class _Lengths:
    """Token counts under a tokenizer (``add_special_tokens=False``, like LUFFY), cached per text."""

    def __init__(self, tokenizer_path: str | None):
        self.tok = None
        if tokenizer_path:
            from transformers import AutoTokenizer

            if not os.path.exists(tokenizer_path):
                raise SystemExit(f"error: --tokenizer {tokenizer_path} does not exist (a local folder is needed)")
            self.tok = AutoTokenizer.from_pretrained(tokenizer_path)

    def many(self, texts: list[str]) -> list[int]:
        if self.tok is None:
            return [0] * len(texts)
        out = []
        for i in range(0, len(texts), 256):
            enc = self.tok(texts[i:i + 256], add_special_tokens=False)["input_ids"]
            out.extend(len(x) for x in enc)
        return out


def prepare(df, *, max_target_tokens: int | None, tokenizer: str | None, system_prompt: str | None,
            data_source: str, split: str, where: str) -> tuple[list[dict], dict[str, int]]:
    """Build output rows and the drop counts (``{reason: n}``) from an input DataFrame."""
    require_columns(df, REQUIRED, where, "Expected OpenR1-Math-style rows (problem, answer, generations).")
    flags = [c for c in FLAG_COLUMNS if c in df.columns]
    drops = {"empty problem": 0, "empty, NaN or inf answer": 0, "no generations": 0,
             f"flag lists ({', '.join(flags)}) not as long as generations": 0,
             "no generation marked correct and complete": 0,
             f"every candidate longer than {max_target_tokens} tokens": 0}
    lengths = _Lengths(tokenizer if max_target_tokens else None)

    candidates: list[tuple[int, list[str]]] = []  # (input row, candidate generations in order)
    for i, row in enumerate(df.to_dict("records")):
        problem, answer = row.get("problem"), answer_text(row.get("answer"))
        if not isinstance(problem, str) or not problem.strip():
            drops["empty problem"] += 1
            continue
        if answer is None:
            drops["empty, NaN or inf answer"] += 1
            continue
        gens = _as_list(row.get("generations"))
        if not gens:
            drops["no generations"] += 1
            continue
        flag_lists = [_as_list(row.get(c)) for c in flags]
        if any(fl is None or len(fl) != len(gens) for fl in flag_lists):
            drops[f"flag lists ({', '.join(flags)}) not as long as generations"] += 1
            continue
        ok = [isinstance(g, str) and g.strip() != "" and all(bool(fl[j]) for fl in flag_lists)
              for j, g in enumerate(gens)]
        cands = [g for g, k in zip(gens, ok) if k]
        if not cands:
            drops["no generation marked correct and complete"] += 1
            continue
        candidates.append((i, cands))

    # length filter: every candidate tokenised; a row keeps the distinct ones within the cap, in order
    texts = [t for _, cands in candidates for t in cands]
    lens = iter(lengths.many(texts) if max_target_tokens else [0] * len(texts))
    chosen: dict[int, list[str]] = {}
    for i, cands in candidates:
        fit = [t for t in cands if next(lens) <= max_target_tokens] if max_target_tokens else list(cands)
        if fit:
            chosen[i] = list(dict.fromkeys(fit))
        else:
            drops[f"every candidate longer than {max_target_tokens} tokens"] += 1

    records = df.to_dict("records")
    rows = []
    for i in sorted(chosen):
        r = records[i]
        rows.append({
            "data_source": data_source,
            "prompt": make_prompt(r["problem"], system_prompt),
            "target": [{"role": "assistant", "content": chosen[i][0]}],
            "target_lst": chosen[i],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer_text(r["answer"])},
            "extra_info": {"split": split, "index": len(rows), "source_index": i},
        })
    return rows, {k: v for k, v in drops.items() if v}


def check_prepared(df, *, max_target_tokens: int | None, tokenizer: str | None,
                   where: str) -> tuple[list[int], dict[str, int], int]:
    """Rows already in the training schema (LUFFY's ``Elliott/Openr1-Math-46k-8192``): nothing to convert; each row
    is checked with the training data check's own rule (mix_src/config/data_check.py ``row_problem``) and, with
    ``--tokenizer``, its target length. Returns (kept row indices, drops by reason, kept rows without a target)."""
    from mix_src.config.data_check import normalize_target, row_problem

    drops: dict[str, int] = {}
    kept, texts = [], []
    for i, (prompt, rm) in enumerate(zip(df["prompt"], df["reward_model"])):
        why = row_problem(prompt, rm)
        if why is not None:
            drops[why] = drops.get(why, 0) + 1
            continue
        kept.append(i)
        texts.append(normalize_target(df["target"].iloc[i]) if "target" in df.columns else None)
    no_target = sum(t is None for t in texts)
    if max_target_tokens:
        has = [j for j, t in enumerate(texts) if t is not None]
        lens = _Lengths(tokenizer).many([texts[j] for j in has])
        too_long = {has[j] for j, n in zip(range(len(has)), lens) if n > max_target_tokens}
        if too_long:
            drops[f"target longer than {max_target_tokens} tokens"] = len(too_long)
            kept = [i for j, i in enumerate(kept) if j not in too_long]
    return kept, drops, no_target


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--input", required=True, help="parquet/jsonl/json file, folder, save_to_disk folder or HF name")
    p.add_argument("--output", default=DEFAULT_OUTPUT,
                   help=f"output .parquet path (default {os.path.relpath(DEFAULT_OUTPUT)}, the recipes' default)")
    p.add_argument("--split", default="train", help="split to read from a DatasetDict / HF dataset (train)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder for the target length filter")
    p.add_argument("--max-target-tokens", type=int, default=8192,
                   help="drop targets longer than this under --tokenizer (default 8192; 0 = no limit)")
    p.add_argument("--no-system-prompt", action="store_true",
                   help="one user message (problem + boxed instruction) instead of [system, user]")
    p.add_argument("--system-prompt-file", default=None, help="use this file's text as the system prompt")
    p.add_argument("--data-source", default="openr1_math", help="value of the data_source column")
    p.add_argument("--limit", type=int, default=0, help="only the first N input rows (0 = all)")
    a = p.parse_args(argv)

    if a.max_target_tokens < 0:
        p.error(f"--max-target-tokens must be >= 0, got {a.max_target_tokens}")
    if a.max_target_tokens and not a.tokenizer:
        print(f"note: no --tokenizer given, so targets are not filtered by length (--max-target-tokens "
              f"{a.max_target_tokens} is ignored)")
    system_prompt = resolve_system_prompt(a, p)

    df = load_table(a.input, a.split)
    n_read = len(df)
    if a.limit:
        df = df.iloc[: a.limit]
    print(f"read {n_read} rows from {a.input}" + (f"; using the first {len(df)}" if a.limit else ""))
    if all(c in df.columns for c in PREPARED) and "generations" not in df.columns:
        return _write_prepared(df, a)
    rows, drops = prepare(df, max_target_tokens=a.max_target_tokens if a.tokenizer else None, tokenizer=a.tokenizer,
                          system_prompt=system_prompt, data_source=a.data_source, split=a.split, where=a.input)
    for reason, n in drops.items():
        print(f"dropped {n} rows: {reason}")
    if not rows:
        raise SystemExit(f"error: no rows left out of {len(df)} from {a.input}; see the drop counts above")
    import pandas as pd

    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    pd.DataFrame(rows).to_parquet(a.output, index=False)
    print(f"wrote {len(rows)} rows to {a.output} (dropped {len(df) - len(rows)} of {len(df)})")
    summary = {"read": len(df), "written": len(rows), "dropped": drops, "output": a.output}
    return summary


def _write_prepared(df, a: argparse.Namespace) -> dict[str, Any]:
    """LUFFY's released set (or any file in the training schema): no conversion, the rows checked and the usable
    ones written unchanged."""
    print(f"no conversion needed: {a.input} is already in the training schema (columns {list(df.columns)}; LUFFY's "
          "Elliott/Openr1-Math-46k-8192 is); checking its rows")
    kept, drops, no_target = check_prepared(df, max_target_tokens=a.max_target_tokens if a.tokenizer else None,
                                            tokenizer=a.tokenizer, where=a.input)
    for reason, n in drops.items():
        print(f"dropped {n} rows: {reason}")
    if no_target:
        print(f"kept {no_target} rows without a usable target (trained on-policy only)")
    if not kept:
        raise SystemExit(f"error: no rows left out of {len(df)} from {a.input}; see the drop counts above")
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    df.iloc[kept].reset_index(drop=True).to_parquet(a.output, index=False)
    print(f"wrote {len(kept)} rows to {a.output} (dropped {len(df) - len(kept)} of {len(df)}; rows unchanged)")
    return {"read": len(df), "written": len(kept), "dropped": drops, "no_target": no_target, "output": a.output,
            "converted": False}


if __name__ == "__main__":
    main()
