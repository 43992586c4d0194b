"""Feed the project bad inputs as a new user would, and say how each one ends: ``python -m scripts.probe_bad_inputs``.

Each case is one mistake on the README's tiny CPU setup (scripts/make_tiny_assets.py, the CPU backend): a trainer
key, a data file's contents, a data-prep input, a reward input. The verdicts:

* **refused before Ray**: :func:`mix_src.config.preflight.run` (or Hydra's composition, or the data-prep command)
  raised, naming the key/file/value; the seconds are from the start of the composition to the error;
* **passes pre-Ray**: the pre-Ray stage accepted it, as the docs say it should (``--ray`` then trains it);
* **trains as documented**: ``--ray``: ``python -m mix_src.main_mix_ppo`` with it trained 1 step and exited 0;
* **exact / graded ungradable**: a data-prep or reward case whose output keeps the value exactly;
* **LATE CRASH**: ``--ray``: the run failed inside Ray (the error's line is the driver's ``[mix_src] FAILED`` line);
* **NOT REFUSED** / **SILENT**: an input the docs refuse passed the pre-Ray stage / trained and exited 0, or a
  data-prep/reward case changed a value.

Options: ``--ray`` (the cases that pass pre-Ray are also trained, one subprocess each: about a minute each on 2
cores; run under ``flock /tmp/ray.lock``), ``--write`` (the table goes into mix_src/config/README.md between its
probe markers), ``--only SUBSTRING``. ``tests/test_bad_inputs.py`` runs the pre-Ray cases in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
README = REPO / "mix_src" / "config" / "README.md"
BEGIN, END = "<!-- probe_bad_inputs:begin -->", "<!-- probe_bad_inputs:end -->"

A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
LUFFY = ("mix.n_prefix=1",)  # one demonstration per group: the cases about targets need targets read


@dataclasses.dataclass
class Case:
    """One bad input. ``overrides``: Hydra overrides on the tiny setup ({dir} = a fresh folder, {train}/{val} = the
    tiny files); ``files``: builds files in {dir} first; ``call``: a data-prep/reward case, returns what to judge
    with ``ok`` (True: the value was kept exactly / graded ungradable). ``expect``: 'refused' or 'trains'."""

    name: str
    group: str
    expect: str = "refused"
    overrides: tuple[str, ...] = ()
    files: Optional[Callable[[Path, dict], None]] = None
    call: Optional[Callable[[Path, dict], Any]] = None
    ok: Optional[Callable[[Any], bool]] = None


# ---- data files -----------------------------------------------------------------------------------------------------
def _rows(assets: dict, n: Optional[int] = None) -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(assets["train"]).to_pylist()
    return rows if n is None else rows[:n]


def _write(path: Path, rows: list[dict]) -> None:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)


def _edit(fn: Callable[[dict], dict], n: Optional[int] = None, name: str = "train.parquet"):
    def files(d: Path, assets: dict) -> None:
        _write(d / name, [fn(dict(r)) for r in _rows(assets, n)])
    return files


def _raw(content: bytes, name: str = "train.parquet"):
    def files(d: Path, assets: dict) -> None:
        (d / name).write_bytes(content)
    return files


def _mkdir(d: Path, assets: dict) -> None:
    (d / "train.parquet").mkdir()


def _drop(col: str) -> Callable[[dict], dict]:
    return lambda r: {k: v for k, v in r.items() if k != col}


def _set(**kw) -> Callable[[dict], dict]:
    return lambda r: {**r, **kw}


def _nan_truth(r: dict) -> dict:
    i = int((r.get("extra_info") or {}).get("index", 0))
    return {**r, "reward_model": {**r["reward_model"], "ground_truth": "nan" if i % 2 else r["reward_model"]["ground_truth"]}}


TRAIN = "data.train_files={dir}/train.parquet"
VAL = "data.val_files={dir}/train.parquet"


# ---- data prep and reward -------------------------------------------------------------------------------------------
def _openr1(rows: list[dict], *extra: str):
    def call(d: Path, assets: dict):
        import pandas as pd

        from scripts.data import prepare_openr1

        pd.DataFrame(rows).to_parquet(d / "in.parquet")
        prepare_openr1.main(["--input", str(d / "in.parquet"), "--output", str(d / "out.parquet"), *extra])
        return pd.read_parquet(d / "out.parquet")
    return call


def _openr1_row(problem: str, answer: Any) -> dict:
    """An OpenR1-Math row (the columns LUFFY's prepare_train.py reads): one correct, complete generation."""
    return {"problem": problem, "answer": answer, "generations": [f"<think>\nx\n</think>\n\n\\boxed{{{answer}}}"],
            "correctness_math_verify": [True], "is_reasoning_complete": [True]}


def _openr1_jsonl(d: Path, assets: dict):
    from scripts.data import prepare_openr1

    (d / "in.jsonl").write_text('{"problem": "p", "answer": "1", "generations": ["x \\\\boxed{1}"]}\n{"problem": broken\n')
    return prepare_openr1.main(["--input", str(d / "in.jsonl"), "--output", str(d / "out.parquet")])


def _eval(rows: list[dict], name: Optional[str]):
    def call(d: Path, assets: dict):
        import pandas as pd

        from scripts.data import prepare_eval

        pd.DataFrame(rows).to_parquet(d / "in.parquet")
        spec = f"{name}={d / 'in.parquet'}" if name else str(d / "in.parquet")
        prepare_eval.main(["--output", str(d / "out.parquet"), "--input", spec])
        return pd.read_parquet(d / "out.parquet")
    return call


def _valid_rows() -> list[dict]:
    """Rows shaped like LUFFY's data/valid.parquet: data_source names each row's benchmark."""
    out = []
    for i, ds in enumerate(["aime24", "amc", "math500"]):
        out.append({"data_source": ds, "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}})
    return out


def _score(response: str, truth: str):
    def call(d: Path, assets: dict):
        from mix_src.rewards.math_verify_reward import compute_score

        return compute_score("math", response, truth)
    return call


def _truths(df) -> list[str]:
    return [str(rm["ground_truth"]) for rm in df["reward_model"]]


def _score_of(result) -> float:
    return float(result["score"] if isinstance(result, dict) else result)


CASES: list[Case] = [
    # ---- trainer keys: verl's batch arithmetic and training length (mix_src/config/batch_check.py) ----
    Case(f"{A}ppo_mini_batch_size=3", "trainer keys", overrides=(f"{A}ppo_mini_batch_size=3",)),
    Case(f"{R}n=0", "trainer keys", overrides=(f"{R}n=0",)),
    Case(f"{A}ppo_micro_batch_size_per_gpu=0", "trainer keys", overrides=(f"{A}ppo_micro_batch_size_per_gpu=0",)),
    Case(f"{A}ppo_micro_batch_size_per_gpu=3", "trainer keys", overrides=(f"{A}ppo_micro_batch_size_per_gpu=3",)),
    Case(f"{R}log_prob_micro_batch_size_per_gpu=0", "trainer keys", overrides=(f"{R}log_prob_micro_batch_size_per_gpu=0",)),
    Case("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0", "trainer keys",
         overrides=("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0", f"{A}use_kl_loss=true")),
    Case(f"{A}optim.lr=-1e-4", "trainer keys", overrides=(f"{A}optim.lr=-1e-4",)),
    Case(f"{A}optim.lr=0", "trainer keys", overrides=(f"{A}optim.lr=0",)),
    Case("trainer.total_epochs=0", "trainer keys", overrides=("trainer.total_epochs=0",)),
    Case("trainer.total_training_steps=0", "trainer keys", overrides=("trainer.total_training_steps=0",)),
    Case("data.train_batch_size=64 (32 training rows)", "trainer keys",
         overrides=("data.train_batch_size=64", f"{A}ppo_mini_batch_size=64")),
    Case("data.train_batch_size=0", "trainer keys", overrides=("data.train_batch_size=0",)),
    Case(f"{A}ppo_mini_batch_size=8 (> train_batch_size 4)", "trainer keys", overrides=(f"{A}ppo_mini_batch_size=8",)),
    Case("mix.data.max_target_length=8192 (data.max_response_length=16)", "trainer keys",
         overrides=(*LUFFY, "mix.data.max_target_length=8192")),
    Case("mix.n_prefix=5 (rollout.n=2)", "trainer keys", overrides=("mix.n_prefix=5",)),
    Case("+mix.no_such_key=1", "trainer keys", overrides=("+mix.no_such_key=1",)),
    Case("mix.prefix_strategy=bogus", "trainer keys", overrides=("mix.prefix_strategy=bogus",)),
    Case("mix.loss.off_policy_reshape=bogus", "trainer keys", overrides=("mix.loss.off_policy_reshape=bogus",)),
    Case("algorithm.adv_estimator=bogus", "trainer keys", overrides=("algorithm.adv_estimator=bogus",)),
    Case("mix.data.sample_target_ratio=1.5", "trainer keys", overrides=("mix.data.sample_target_ratio=1.5",)),
    Case("data.train_files=missing.parquet", "trainer keys", overrides=("data.train_files={dir}/missing.parquet",)),
    Case("actor_rollout_ref.model.path=/no/such/model", "trainer keys", overrides=("actor_rollout_ref.model.path=/no/such/model",)),
    Case("trainer.default_local_dir under a file (cannot be written)", "trainer keys",
         overrides=("trainer.default_local_dir={dir}/afile/ckpt", "trainer.save_freq=1"),
         files=_raw(b"x", "afile")),
    Case("mix.data.sample_target_ratio=0.0 (on-policy only)", "trainer keys", expect="trains",
         overrides=(*LUFFY, "mix.data.sample_target_ratio=0.0")),
    Case("data.max_response_length=8 with ~12-token targets (every row's target over the cap)", "trainer keys",
         overrides=(*LUFFY, "data.max_response_length=8")),
    Case("data.max_prompt_length=8 (~25-token prompts; data.truncation's default)", "trainer keys",
         overrides=("data.max_prompt_length=8",)),
    Case("data.max_prompt_length=8, data.truncation=error (~25-token prompts)", "trainer keys",
         overrides=("data.max_prompt_length=8", "data.truncation=error")),
    Case("data.max_prompt_length=8, data.filter_overlong_prompts=true", "trainer keys",
         overrides=("data.max_prompt_length=8", "data.filter_overlong_prompts=true")),
    # ---- data contents (mix_src/config/data_check.py) ----
    Case("train file: empty (0 bytes)", "data contents", overrides=(TRAIN,), files=_raw(b"")),
    Case("train file: text named .parquet", "data contents", overrides=(TRAIN,), files=_raw(b"problem,answer\nq,1\n")),
    Case("train file: a directory", "data contents", overrides=(TRAIN,), files=_mkdir),
    Case("train file: fake parquet (PAR1 + junk)", "data contents", overrides=(TRAIN,), files=_raw(b"PAR1" + b"\0" * 64 + b"PAR1")),
    Case("train file: no prompt column", "data contents", overrides=(TRAIN,), files=_edit(_drop("prompt"))),
    Case("train file: prompt is a string", "data contents", overrides=(TRAIN,), files=_edit(lambda r: {**r, "prompt": "q?"})),
    Case("train file: prompt is an empty list", "data contents", overrides=(TRAIN,), files=_edit(_set(prompt=[]))),
    Case("train file: no reward_model column", "data contents", overrides=(TRAIN,), files=_edit(_drop("reward_model"))),
    Case("train file: 2 rows (train_batch_size 4)", "data contents", overrides=(TRAIN,), files=_edit(lambda r: r, n=2)),
    Case("train file: every target null", "data contents", expect="trains", overrides=(TRAIN, *LUFFY),
         files=_edit(_set(target=None))),
    Case("train file: targets are integers", "data contents", overrides=(TRAIN, *LUFFY), files=_edit(_set(target=12))),
    Case("train file: half the ground truths 'nan'", "data contents", expect="trains", overrides=(TRAIN,),
         files=_edit(_nan_truth)),
    Case("val file: no prompt column", "data contents", overrides=(VAL.replace("train.parquet", "val.parquet"),),
         files=_edit(_drop("prompt"), name="val.parquet")),
    # ---- data prep (scripts/data) ----
    Case("prepare_openr1: answer NaN", "data prep",
         call=_openr1([_openr1_row("p", float("nan")), _openr1_row("q", "2")]),
         ok=lambda df: "nan" not in _truths(df) and len(df) == 1),
    Case("prepare_openr1: answer 12 (integer)", "data prep",
         call=_openr1([_openr1_row("p", 12)]),
         ok=lambda df: _truths(df) == ["12"]),
    Case("prepare_openr1: a broken JSONL line", "data prep", call=_openr1_jsonl),
    Case("prepare_openr1: no problem/generations columns", "data prep",
         call=_openr1([{"question": "p", "answer": "1"}])),
    Case("prepare_eval: answer 12345678901234567890", "data prep",
         call=_eval([{"problem": "p", "answer": 12345678901234567890}], "aime24"),
         ok=lambda df: _truths(df) == ["12345678901234567890"]),
    Case("prepare_eval --input aime24=<LUFFY-style valid.parquet>", "data prep", call=_eval(_valid_rows(), "aime24")),
    Case("prepare_eval --input <LUFFY-style valid.parquet> (kept as is)", "data prep", call=_eval(_valid_rows(), None),
         ok=lambda df: sorted(set(df["data_source"])) == ["aime24", "amc", "math500"]),
    # ---- reward (mix_src/rewards) ----
    Case("reward: \\boxed{nan} against ground truth 'nan'", "reward", call=_score("x \\boxed{nan}", "nan"),
         ok=lambda r: _score_of(r) <= 0),
    Case("reward: \\boxed{inf} against ground truth 'inf'", "reward", call=_score("x \\boxed{inf}", "inf"),
         ok=lambda r: _score_of(r) <= 0),
]


# ---- running ----------------------------------------------------------------------------------------------------------
def tiny_overrides(assets: dict) -> list[str]:
    """The README's tiny CPU run (tests/e2e.py's sizes): 4 prompts x 2 samples, 16-token responses, 1 step."""
    return [
        "+backend=cpu", f"data.train_files={assets['train']}", f"data.val_files={assets['val']}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=16",
        f"actor_rollout_ref.model.path={assets['model']}", f"++actor_rollout_ref.model.tokenizer_path={assets['tokenizer']}",
        f"{R}n=2", f"{A}ppo_mini_batch_size=4", f"{A}ppo_micro_batch_size_per_gpu=8",
        f"{R}log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "reward.custom_reward_function.path=pkg://mix_src.rewards.math_verify_reward",
        "reward.custom_reward_function.name=compute_score",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console]",
    ]


def case_overrides(case: Case, d: Path, assets: dict) -> list[str]:
    if case.files is not None:
        case.files(d, assets)
    fill = {"dir": str(d), "train": assets["train"], "val": assets["val"]}
    return [*tiny_overrides(assets), *(o.format(**fill) for o in case.overrides)]


def compose_config(overrides: list[str]):
    """``mix_ppo`` composed by Hydra with ``overrides``, as ``python -m mix_src.main_mix_ppo`` composes it."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="mix_src.config", version_base=None):
        return compose(config_name="mix_ppo", overrides=overrides)


class ComposerMisuse(ValueError):
    """A :class:`Composer` given a command line it does not compose (not a case's refusal)."""


class Composer:
    """:func:`compose_config` for many command lines that start with the same ``base``, composing ``base`` once: each
    call copies the composed base and applies the rest with Hydra's own override code
    (``ConfigLoaderImpl._apply_overrides_to_config``, hydra/_internal/config_loader_impl.py 336-401 in hydra-core
    1.3.8: what ``compose`` runs on the overrides after loading the defaults, line 276). Reading and merging the
    YAML files is most of a composition (about 1 s of a case's 1.3 s on the 2-core CPU machine), so
    ``tests/test_bad_inputs.py`` and ``tests/test_batch_check.py`` compose this way; ``tests/test_bad_inputs.py``
    checks that it gives what Hydra's compose gives for all the cases' overrides at once. Past ``base``: value overrides only
    (``key=v``, ``+key=v``, ``++key=v``, ``~key``); one that selects a config group (``+backend=cpu``) is refused."""

    def __init__(self, base: list[str]):
        from importlib import resources

        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.base, self.config, self.parser = list(base), compose_config(list(base)), OverridesParser.create()
        self.groups = {p.name for p in resources.files("mix_src.config").iterdir()
                       if p.is_dir() and not p.name.startswith("_")}  # config groups: mix_src/config's folders

    def __call__(self, overrides: list[str]):
        import copy

        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        if list(overrides[:len(self.base)]) != self.base:
            raise ComposerMisuse(f"Composer: the overrides do not start with its base {self.base}")
        parsed = self.parser.parse_overrides(list(overrides[len(self.base):]))
        groups = [o.input_line for o in parsed if o.key_or_group.split(".")[0] in self.groups]
        if groups:
            raise ComposerMisuse(f"Composer: {groups} select a config group; compose them with compose_config")
        config = copy.deepcopy(self.config)
        ConfigLoaderImpl._apply_overrides_to_config(parsed, config)
        return config


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def pre_ray(case: Case, d: Path, assets: dict, composer: Optional[Composer] = None) -> dict:
    """Compose and run the pre-Ray stage in this process (a config case), or call the data-prep/reward function.
    ``composer``: a :class:`Composer` whose base is :func:`tiny_overrides` (the tests' faster composition); None:
    Hydra composes the whole command line, as the entry point does (the probe's timings)."""
    t0 = time.perf_counter()
    if case.call is not None:
        try:
            result = case.call(d, assets)
        except (Exception, SystemExit) as e:  # noqa: BLE001  (a refusal is what is measured)
            return {"verdict": "refused", "seconds": time.perf_counter() - t0, "line": first_line(e)}
        good = case.ok is not None and case.ok(result)
        verdict = ("exact" if case.group == "data prep" else "graded ungradable") if good else "SILENT"
        return {"verdict": verdict, "seconds": time.perf_counter() - t0, "line": _describe(result)}
    from mix_src.config import preflight

    overrides = case_overrides(case, d, assets)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the stage's summary lines (rows dropped and counted)
            cfg = (composer or compose_config)(overrides)
            preflight.run(cfg)
    except ComposerMisuse:
        raise
    except Exception as e:  # noqa: BLE001
        return {"verdict": "refused before Ray", "seconds": time.perf_counter() - t0,
                "line": f"{type(e).__name__}: {first_line(e)}", "overrides": overrides}
    verdict = "passes pre-Ray" if case.expect == "trains" else "NOT REFUSED"
    drops = [ln.strip() for ln in printed.getvalue().splitlines() if "dropped" in ln and "none dropped" not in ln]
    return {"verdict": verdict, "seconds": time.perf_counter() - t0, "line": drops[0] if drops else "",
            "overrides": overrides}


def _describe(result) -> str:
    if hasattr(result, "columns"):
        return f"{len(result)} rows; ground truths {_truths(result)[:3]}" + (
            f"; data_source {sorted(set(result['data_source']))}" if "data_source" in result.columns else "")
    return f"score {_score_of(result)}" if isinstance(result, (dict, int, float)) else str(result)[:120]


def with_ray(outcome: dict) -> dict:
    """Train the case for 1 step through the entry point (a subprocess); the driver's last line names a failure."""
    t0 = time.perf_counter()
    env = dict(os.environ, VERL_PLATFORM=os.environ.get("VERL_PLATFORM", "cpu"))
    proc = subprocess.run([sys.executable, "-m", "mix_src.main_mix_ppo", *outcome["overrides"]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + "\n" + proc.stderr).strip().splitlines()  # no colour codes
    failed = [ln for ln in out if ln.startswith("[mix_src] FAILED")]
    counts = [ln.strip() for ln in out if "dropped" in ln and "none dropped" not in ln]
    if proc.returncode == 0:
        verdict = "trains as documented" if outcome["verdict"] == "passes pre-Ray" else "SILENT"
        return {**outcome, "verdict": verdict, "seconds": seconds, "line": counts[0][:160] if counts else "exit 0"}
    return {**outcome, "verdict": "LATE CRASH", "seconds": seconds,
            "line": (failed[-1] if failed else (out[-1] if out else f"exit {proc.returncode}"))[:200]}


def probe(cases: list[Case], assets: dict, ray: bool = False) -> list[dict]:
    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            outcome = pre_ray(case, Path(tmp), assets)
            if ray and outcome["verdict"] in ("passes pre-Ray", "NOT REFUSED"):
                outcome = with_ray(outcome)
        outcome.pop("overrides", None)
        rows.append({"input": case.name, "group": case.group, **outcome})
        print(f"{outcome['verdict']:>22s} {outcome['seconds']:6.1f} s  {case.name}: {outcome['line'][:140]}", flush=True)
    return rows


def table(rows: list[dict], how: str) -> str:
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = [how, "", "| # | group | input | verdict | seconds | the error's first line (or what happened) |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['group']} | `{esc(r['input'])}` | {r['verdict']} | {r['seconds']:.1f} | {esc(r['line'][:220])} |")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    lines += ["", "Verdicts: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())) + "."]
    return "\n".join(lines)


def write_readme(text: str) -> None:
    doc = README.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    README.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def build_assets(out: str) -> dict:
    from scripts import make_tiny_assets

    return make_tiny_assets.build(out, seed=0)


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ray", action="store_true", help="also train (1 step) each case that passes the pre-Ray stage")
    p.add_argument("--write", action="store_true", help=f"write the table into {README.relative_to(REPO)}")
    p.add_argument("--only", default=None, help="only the cases whose input contains this")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    cases = [c for c in CASES if a.only is None or a.only in c.name]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = probe(cases, build_assets(tmp), ray=a.ray)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    how = (f"`python -m scripts.probe_bad_inputs{' --ray' if a.ray else ''} --write` on commit {commit} (plus the working "
           f"tree's uncommitted edits, if any), this repository's 2-core CPU machine, {len(rows)} cases in "
           f"{time.perf_counter() - t0:.0f} s; seconds are from composing the config to the error (pre-Ray cases, "
           "in-process) or the whole 1-step run (`--ray` cases, one process each, Ray start-up included).")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.write:
        write_readme(table(rows, how))
    bad = [r for r in rows if r["verdict"] in ("LATE CRASH", "SILENT", "NOT REFUSED")]
    print(f"{len(rows)} cases, {len(bad)} late or silent")
    return rows


if __name__ == "__main__":
    main()
