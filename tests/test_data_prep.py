"""scripts/data/prepare_openr1.py and prepare_eval.py on tiny local files written here (offline)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import REPO_ROOT, load_make_tiny_assets

from scripts.data import prepare_eval as prep_eval
from scripts.data import prepare_openr1 as openr1

T = lambda body: f"<think>\n{body}\n</think>\n\n\\boxed{{1}}"  # noqa: E731
LONG = T("x" * 200)  # > 40 tokens under the char-level tiny tokenizer


def openr1_rows() -> list[dict]:
    return [
        # 0: first generation correct and complete -> target
        {"problem": "p0", "answer": "1", "generations": [T("a0"), T("b0")],
         "correctness_math_verify": [True, True], "is_reasoning_complete": [True, True]},
        # 1: first incomplete, second correct and complete -> second
        {"problem": "p1", "answer": "2", "generations": [T("a1"), T("b1")],
         "correctness_math_verify": [True, True], "is_reasoning_complete": [False, True]},
        # 2: nothing correct -> dropped
        {"problem": "p2", "answer": "3", "generations": [T("a2")],
         "correctness_math_verify": [False], "is_reasoning_complete": [True]},
        # 3: empty answer -> dropped
        {"problem": "p3", "answer": " ", "generations": [T("a3")],
         "correctness_math_verify": [True], "is_reasoning_complete": [True]},
        # 4: the only candidate is too long -> dropped
        {"problem": "p4", "answer": "5", "generations": [LONG],
         "correctness_math_verify": [True], "is_reasoning_complete": [True]},
        # 5: first candidate too long, second fits -> second
        {"problem": "p5", "answer": "6", "generations": [LONG, T("b5")],
         "correctness_math_verify": [True, True], "is_reasoning_complete": [True, True]},
        # 6: flag list shorter than generations -> dropped
        {"problem": "p6", "answer": "7", "generations": [T("a6"), T("b6")],
         "correctness_math_verify": [True], "is_reasoning_complete": [True, True]},
        # 7: no generations -> dropped
        {"problem": "p7", "answer": "8", "generations": [],
         "correctness_math_verify": [], "is_reasoning_complete": []},
    ]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer")
    load_make_tiny_assets().build_tokenizer(path)
    return path


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ------------------------------------------------------------------------------------------ prepare_openr1
def test_prepare_openr1_schema_targets_and_drop_counts(tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "openr1.jsonl"
    _write_jsonl(src, openr1_rows())
    out = tmp_path / "train.parquet"
    summary = openr1.main(["--input", str(src), "--output", str(out), "--tokenizer", tokenizer_dir,
                           "--max-target-tokens", "40"])
    printed = capsys.readouterr().out
    print(printed)

    assert summary["read"] == 8 and summary["written"] == 3
    assert summary["dropped"] == {
        "empty, NaN or inf answer": 1, "no generations": 1,
        "flag lists (correctness_math_verify, is_reasoning_complete) not as long as generations": 1,
        "no generation marked correct and complete": 1, "every candidate longer than 40 tokens": 1}
    for reason, n in summary["dropped"].items():
        assert f"dropped {n} rows: {reason}" in printed
    assert "wrote 3 rows" in printed and "dropped 5 of 8" in printed

    df = pd.read_parquet(out)
    assert list(df.columns) == ["data_source", "prompt", "target", "target_lst", "ability", "reward_model", "extra_info"]
    assert df["data_source"].tolist() == ["openr1_math"] * 3 and df["ability"].tolist() == ["math"] * 3
    # every verified generation within the cap, target first (issue #55): row 5 loses its too-long first one
    assert [list(t) for t in df["target_lst"]] == [[T("a0"), T("b0")], [T("b1")], [T("b5")]]
    row = df.iloc[1]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][0]["content"] == openr1.SYSTEM_PROMPT and row["prompt"][1]["content"] == "p1"
    assert [dict(t) for t in row["target"]] == [{"role": "assistant", "content": T("b1")}]
    assert dict(row["reward_model"]) == {"style": "rule", "ground_truth": "2"}
    assert [t[0]["content"] for t in df["target"]] == [T("a0"), T("b1"), T("b5")]
    assert [dict(e) for e in df["extra_info"]] == [
        {"split": "train", "index": 0, "source_index": 0}, {"split": "train", "index": 1, "source_index": 1},
        {"split": "train", "index": 2, "source_index": 5}]
    assert "\\boxed{}" in openr1.SYSTEM_PROMPT and "<think>\n {thoughts} </think>\n" in openr1.SYSTEM_PROMPT


def test_prepare_openr1_input_formats_and_options(tmp_path, capsys):
    import datasets

    rows = openr1_rows()
    pd.DataFrame(rows).to_parquet(tmp_path / "in.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "snapshot" / "data").mkdir(parents=True)  # a hub snapshot: shards in a folder
    pd.DataFrame(rows[:3]).to_parquet(tmp_path / "snapshot" / "data" / "train-00000-of-00002.parquet")
    pd.DataFrame(rows[3:]).to_parquet(tmp_path / "snapshot" / "data" / "train-00001-of-00002.parquet")
    results = []
    for i, src in enumerate([tmp_path / "in.parquet", tmp_path / "saved", tmp_path / "snapshot"]):
        out = tmp_path / f"o{i}.parquet"
        s = openr1.main(["--input", str(src), "--output", str(out), "--no-system-prompt", "--data-source", "x"])
        results.append(pd.read_parquet(out))
        assert s["written"] == 4  # no tokenizer: row 4 (long) is kept
    printed = capsys.readouterr().out
    assert "targets are not filtered by length" in printed and "reading 2 files from" in printed
    assert results[0].to_json() == results[1].to_json() == results[2].to_json()
    prompt = results[0].iloc[0]["prompt"]
    assert len(prompt) == 1 and prompt[0]["role"] == "user"
    assert prompt[0]["content"] == "p0" + openr1.USER_INSTRUCTION and results[0].iloc[0]["data_source"] == "x"

    # without the flag columns every non-empty generation is a candidate
    pd.DataFrame([{"problem": "q", "answer": "1", "generations": ["", T("z")]}]).to_parquet(tmp_path / "noflags.parquet")
    openr1.main(["--input", str(tmp_path / "noflags.parquet"), "--output", str(tmp_path / "o.parquet")])
    assert pd.read_parquet(tmp_path / "o.parquet").iloc[0]["target"][0]["content"] == T("z")


def test_prepare_openr1_errors_name_the_problem(tmp_path):
    pd.DataFrame([{"question": "q", "answer": "1"}]).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(SystemExit, match=r"bad.parquet has no column\(s\) \['problem', 'generations'\]"):
        openr1.main(["--input", str(tmp_path / "bad.parquet"), "--output", str(tmp_path / "o.parquet")])
    with pytest.raises(SystemExit, match="does not exist"):
        openr1.main(["--input", str(tmp_path / "missing.parquet"), "--output", str(tmp_path / "o.parquet")])
    _write_jsonl(tmp_path / "none.jsonl", openr1_rows()[2:4])
    with pytest.raises(SystemExit, match="no rows left out of 2"):
        openr1.main(["--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o.parquet")])


# ------------------------------------------------------------------------------------------- prepare_eval
def _eval_files(d) -> dict[str, str]:
    f = {}
    _write_jsonl(d / "aime24.jsonl", [{"problem": "A1", "answer": 204}, {"problem": "A2", "answer": "33"}])
    with open(d / "aime25.json", "w") as fh:
        json.dump([{"question": "B1", "answer": "7"}], fh)
    pd.DataFrame([{"problem": "C1", "answer": 142.0}, {"problem": "C2", "answer": 2.5}]).to_parquet(d / "amc.parquet")
    _write_jsonl(d / "math500.jsonl", [{"problem": "D1", "solution": "so \\boxed{\\frac{1}{2}}."},
                                       {"problem": "D2", "solution": "no box"}])
    pd.DataFrame([{"problem": "E1", "solution": "...", "answer": "$3$"}]).to_parquet(d / "minerva.parquet")
    _write_jsonl(d / "olympiad.jsonl", [{"question": "F1", "final_answer": ["$\\frac{1}{2}$"]},
                                        {"question": "F2", "final_answer": ["1", "2"]}])
    pd.DataFrame([
        {"question": "G1", "choices": {"text": ["x", "y", "z", "w"], "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
        {"question": "G2", "choices": {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}, "answerKey": "2"},
        {"question": "G3", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "E"},
    ]).to_parquet(d / "arc.parquet")
    pd.DataFrame([{"Question": f"H{i}", "Correct Answer": f"right{i}", "Incorrect Answer 1": "w1",
                   "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(6)]).to_parquet(d / "gpqa.parquet")
    for name, fn in [("aime24", "aime24.jsonl"), ("aime25", "aime25.json"), ("amc", "amc.parquet"),
                     ("math500", "math500.jsonl"), ("minerva", "minerva.parquet"), ("olympiad_bench", "olympiad.jsonl"),
                     ("arc_c", "arc.parquet"), ("gpqa_diamond", "gpqa.parquet")]:
        f[name] = str(d / fn)
    return f


def test_prepare_eval_all_benchmarks(tmp_path, capsys):
    files = _eval_files(tmp_path)
    out = tmp_path / "valid.parquet"
    argv = ["--output", str(out), "--repeat", "aime24=4", "--repeat", "2"] + \
        [x for name, path in files.items() for x in ("--input", f"{name}={path}")]
    summary = prep_eval.main(argv)
    printed = capsys.readouterr().out
    print(printed)
    df = pd.read_parquet(out)

    counts = df["data_source"].value_counts().to_dict()
    assert counts == {"aime24": 8, "aime25": 2, "amc": 4, "math500": 2, "minerva": 2, "olympiad_bench": 4,
                      "arc_c": 4, "gpqa_diamond": 12}
    assert summary["rows"] == len(df) == 38
    assert summary["benchmarks"]["math500"]["dropped"] == {"no answer in solution": 1}
    assert summary["benchmarks"]["arc_c"]["dropped"] == {"answerKey not among the choice labels": 1}
    assert "math500: dropped 1 rows: no answer in solution" in printed
    assert "arc_c: dropped 1 rows: answerKey not among the choice labels" in printed

    gt = lambda src: [rm["ground_truth"] for rm in df[df.data_source == src]["reward_model"]]  # noqa: E731
    assert gt("aime24") == ["204"] * 4 + ["33"] * 4
    assert gt("amc") == ["142", "142", "2.5", "2.5"]
    assert gt("math500") == ["\\frac{1}{2}"] * 2 and gt("minerva") == ["3"] * 2
    assert gt("olympiad_bench") == ["\\frac{1}{2}"] * 2 + ["1, 2"] * 2
    assert gt("arc_c") == ["C", "C", "B", "B"]
    assert set(gt("gpqa_diamond")) <= set("ABCD") and len(set(gt("gpqa_diamond"))) > 1  # shuffled

    gpqa = df[df.data_source == "gpqa_diamond"].iloc[0]
    user = gpqa["prompt"][-1]["content"]
    letter = gpqa["reward_model"]["ground_truth"]
    assert f"{letter}. right0" in user and prep_eval.MC_INSTRUCTION in user
    assert gpqa["prompt"][0]["content"] == prep_eval.SYSTEM_PROMPT
    extra = [dict(e) for e in df["extra_info"]]
    assert [e["index"] for e in extra] == list(range(len(df)))
    assert [e["repeat"] for e in extra[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {e["answer_type"] for e in extra} == {"math", "multiple_choice"}

    # same seed -> same option order
    prep_eval.main(argv[:1] + [str(tmp_path / "again.parquet")] + argv[2:])
    assert pd.read_parquet(tmp_path / "again.parquet")["prompt"].to_json() == df["prompt"].to_json()

    # the reward routes these rows correctly
    from mix_src.rewards import compute_score

    resp = f"<think>ok</think> The answer is \\boxed{{{letter}}}"
    assert compute_score("gpqa_diamond", resp, letter, dict(gpqa["extra_info"]))["acc"] is True
    wrong = "A" if letter != "A" else "B"
    assert compute_score("gpqa_diamond", resp.replace(letter + "}", wrong + "}"), letter,
                         dict(gpqa["extra_info"]))["acc"] is False


def test_prepare_eval_passthrough_fields_and_errors(tmp_path):
    # LUFFY-style rows already in our schema are kept
    pd.DataFrame([{"data_source": "aime24", "prompt": [{"role": "user", "content": "Q"}], "ability": "math",
                   "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"split": "test", "index": 9}}]
                 ).to_parquet(tmp_path / "luffy.parquet")
    pd.DataFrame([{"Problem": "P", "Final": "9"}]).to_parquet(tmp_path / "odd.parquet")
    out = tmp_path / "v.parquet"
    prep_eval.main(["--output", str(out), "--input", f"aime24={tmp_path / 'luffy.parquet'}",
                    "--input", f"amc={tmp_path / 'odd.parquet'}", "--field", "amc.problem=Problem",
                    "--field", "amc.answer=Final", "--no-system-prompt"])
    df = pd.read_parquet(out)
    assert df["data_source"].tolist() == ["aime24", "amc"]
    assert df.iloc[0]["prompt"][0]["content"] == "Q" and df.iloc[0]["reward_model"]["ground_truth"] == "5"
    assert df.iloc[1]["prompt"][0]["content"] == "P" + prep_eval.USER_INSTRUCTION
    assert df.iloc[1]["reward_model"]["ground_truth"] == "9"

    with pytest.raises(SystemExit, match=r"no problem column .* Pass --field amc.problem=COLUMN"):
        prep_eval.main(["--output", str(out), "--input", f"amc={tmp_path / 'odd.parquet'}"])
    with pytest.raises(SystemExit):  # argparse error: unknown benchmark name
        prep_eval.main(["--output", str(out), "--input", f"aime={tmp_path / 'odd.parquet'}"])


def test_prepare_eval_passthrough_mixed_labels_and_malformed_rows(tmp_path, capsys):
    """Rows already in our schema (e.g. converted ARC files): letter and number answer keys are kept (the
    reward grades both); rows with another multiple-choice ground truth or an unusable prompt are dropped
    and counted by reason."""
    msg = [{"role": "user", "content": "Which?\n1. a\n2. b\n3. c\n4. d"}]
    rows = [{"data_source": "arc_c", "prompt": msg, "reward_model": {"style": "rule", "ground_truth": gt},
             "extra_info": {"split": "test"}} for gt in ("B", "4", "(C)", "E5", "Paris", "")]
    rows.append({"data_source": "arc_c", "prompt": "not messages", "reward_model": {"ground_truth": "A"},
                 "extra_info": {}})
    _write_jsonl(tmp_path / "arc.jsonl", rows)
    summary = prep_eval.main(["--output", str(tmp_path / "v.parquet"), "--input", f"arc_c={tmp_path / 'arc.jsonl'}"])
    printed = capsys.readouterr().out
    df = pd.read_parquet(tmp_path / "v.parquet")
    assert [rm["ground_truth"] for rm in df["reward_model"]] == ["B", "4", "(C)"]
    assert summary["benchmarks"]["arc_c"]["dropped"] == {
        "ground truth is not an option label (a letter, or a number 1-26)": 2, "empty ground truth": 1,
        "prompt is not a list of {role, content} messages": 1}
    assert "arc_c: dropped 2 rows: ground truth is not an option label" in printed

    from mix_src.rewards import compute_score

    graded = [compute_score("arc_c", f"<think>x</think> \\boxed{{{ans}}}", rm["ground_truth"], dict(e))
              for ans, rm, e in zip(("B", "D", "C"), df["reward_model"], df["extra_info"])]
    assert [g["acc"] for g in graded] == [True, True, True]


# ----------------------------------------------------------------------------- exact values (issue #41 item 4)
def test_answers_kept_exact_nan_and_empty_dropped_bad_line_named(tmp_path, capsys):
    gens = {"generations": [T("a")], "correctness_math_verify": [True], "is_reasoning_complete": [True]}
    rows = [{"problem": "p0", "answer": 12, **gens}, {"problem": "p1", "answer": None, **gens},
            {"problem": "p2", "answer": "0012", **gens}, {"problem": "p3", "answer": 12345678901234567890, **gens},
            {"problem": "p4", "answer": "", **gens}, {"problem": "p5", "answer": "nan", **gens}]
    # parquet: an int column with a null was float64 through pandas (12 -> '12.0', None -> 'nan')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{**r, "answer": r["answer"] if r["answer"] in (12, None) else None}
                                         for r in rows[:2]]), tmp_path / "ints.parquet")
    s = openr1.main(["--input", str(tmp_path / "ints.parquet"), "--output", str(tmp_path / "o.parquet")])
    assert [rm["ground_truth"] for rm in pd.read_parquet(tmp_path / "o.parquet")["reward_model"]] == ["12"]
    assert s["dropped"] == {"empty, NaN or inf answer": 1}
    # JSONL: values as written, no dtype inference
    _write_jsonl(tmp_path / "r.jsonl", rows)
    s = openr1.main(["--input", str(tmp_path / "r.jsonl"), "--output", str(tmp_path / "o.parquet")])
    assert [rm["ground_truth"] for rm in pd.read_parquet(tmp_path / "o.parquet")["reward_model"]] == \
        ["12", "0012", "12345678901234567890"]
    assert s["dropped"] == {"empty, NaN or inf answer": 3}
    assert "dropped 3 rows: empty, NaN or inf answer" in capsys.readouterr().out
    # a malformed line is named by file and line
    with open(tmp_path / "r.jsonl", "a") as f:
        f.write('{"problem": "p6", "answer": \n')
    with pytest.raises(SystemExit, match=r"r\.jsonl: line 7 is not valid JSON"):
        openr1.main(["--input", str(tmp_path / "r.jsonl"), "--output", str(tmp_path / "o.parquet")])
    # prepare_eval reads the same way: the big integer stays exact
    _write_jsonl(tmp_path / "aime.jsonl", [{"problem": "A", "answer": 12345678901234567890}, {"problem": "B", "answer": None}])
    out = prep_eval.main(["--output", str(tmp_path / "v.parquet"), "--input", f"aime24={tmp_path / 'aime.jsonl'}"])
    assert pd.read_parquet(tmp_path / "v.parquet").iloc[0]["reward_model"]["ground_truth"] == "12345678901234567890"
    assert out["benchmarks"]["aime24"]["dropped"] == {"no answer in answer": 1}


# ------------------------------------------------------------------------- LUFFY's released data (issue #36 item 1)
LUFFY_SYSTEM = openr1.SYSTEM_PROMPT  # LUFFY's prepare_openr1_data_v6.py make_openr1_map_fn `instruction`, verbatim


def luffy_train_rows(n: int = 6) -> list[dict]:
    """Rows with the schema of LUFFY's released training set, Elliott/Openr1-Math-46k-8192. LUFFY's
    data/prepare_train.py only dumps that dataset (load_dataset(...); pd.DataFrame(rows).to_parquet), so the types
    come from the script that made it, luffy/scripts/data/prepare_openr1_data_v6.py make_openr1_map_fn('train')."""
    return [{
        "data_source": "",  # str: the literal "data_source": "" in make_openr1_map_fn
        # list of {role, content} str structs: [system = `instruction` (LUFFY's system prompt), user = example['problem']]
        "prompt": [{"role": "system", "content": LUFFY_SYSTEM}, {"role": "user", "content": f"What is {i}+{i}?"}],
        # list of one {role: "assistant", content: str}: generations[0] of OpenR1-Math-220k (after filter_function
        # kept the correct and complete ones and filter_target_length those <= 8192 tokens)
        "target": [{"role": "assistant", "content": f"<think>\n{i}+{i}={2 * i}\n</think>\n\n\\boxed{{{2 * i}}}"}],
        "ability": "math",  # str: the literal "math"
        # {style: str, ground_truth: str}: "rule" and example['answer'], a string column in OpenR1-Math-220k
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "default", "index": i},  # {split: str 'default', index: int idx}
    } for i in range(n)]


def test_luffy_released_training_set_passes_unchanged(tmp_path, capsys):
    import datasets

    rows = luffy_train_rows()
    rows[3]["reward_model"] = {"style": "rule", "ground_truth": "nan"}  # ungradable: dropped, counted
    rows[4]["target"] = None  # no target: kept, trained on-policy only
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))  # the arrow folder `datasets` saves
    pd.DataFrame(rows).to_parquet(tmp_path / "openr1.parquet")  # what LUFFY's data/prepare_train.py writes
    for src in (tmp_path / "saved", tmp_path / "openr1.parquet"):
        out = tmp_path / "out.parquet"
        s = openr1.main(["--input", str(src), "--output", str(out)])
        printed = capsys.readouterr().out
        assert "no conversion needed" in printed and "dropped 1 rows: reward_model.ground_truth is 'nan'" in printed
        assert "kept 1 rows without a usable target" in printed and "wrote 5 rows" in printed
        assert s["converted"] is False and s["written"] == 5 and s["no_target"] == 1
        df = pd.read_parquet(out)
        assert list(df.columns) == list(rows[0])
        assert [e["index"] for e in df["extra_info"]] == [0, 1, 2, 4, 5]
        assert df.iloc[0]["prompt"][0]["content"] == LUFFY_SYSTEM and df.iloc[0]["target"][0]["content"].startswith("<think>")


def test_luffy_released_training_set_target_length_filter(tmp_path, tokenizer_dir, capsys):
    rows = luffy_train_rows(4)
    rows[1]["target"] = [{"role": "assistant", "content": LONG}]
    pd.DataFrame(rows).to_parquet(tmp_path / "openr1.parquet")
    s = openr1.main(["--input", str(tmp_path / "openr1.parquet"), "--output", str(tmp_path / "o.parquet"),
                     "--tokenizer", tokenizer_dir, "--max-target-tokens", "40"])
    assert s["dropped"] == {"target longer than 40 tokens": 1} and s["written"] == 3


def luffy_valid_rows() -> list[dict]:
    """Rows shaped like LUFFY's data/valid.parquet (2,019 rows; its arrow schema: data_source str, prompt
    list<struct<content: str, role: str>>, ability str, reward_model struct<ground_truth: str, style: str>,
    extra_info struct<index: int64, split: str>) with its five data_source values and their row counts
    (olympiad_bench 675, math 500, amc 332, minerva 272, aime 240), here 2 rows each."""
    return [{"data_source": ds, "prompt": [{"content": LUFFY_SYSTEM, "role": "system"},
                                           {"content": f"{ds} problem {i}", "role": "user"}],
             "ability": "math", "reward_model": {"ground_truth": f"{i + 1}", "style": "rule"},
             "extra_info": {"index": i, "split": "default"}}
            for ds in ("aime", "amc", "math", "minerva", "olympiad_bench") for i in range(2)]


def test_luffy_valid_parquet_keeps_its_five_benchmarks(tmp_path, capsys):
    pd.DataFrame(luffy_valid_rows()).to_parquet(tmp_path / "valid.parquet")
    out = tmp_path / "v.parquet"
    s = prep_eval.main(["--output", str(out), "--input", str(tmp_path / "valid.parquet")])
    df = pd.read_parquet(out)
    assert df["data_source"].value_counts().to_dict() == {ds: 2 for ds in ("aime", "amc", "math", "minerva",
                                                                            "olympiad_bench")}
    assert s["rows"] == 10 and df.iloc[0]["prompt"][0]["content"] == LUFFY_SYSTEM
    assert {e["answer_type"] for e in df["extra_info"]} == {"math"}
    # NAME=PATH would write one benchmark name over all five: refused, naming them
    with pytest.raises(SystemExit, match=r"--input aime24=.*valid.parquet: its rows already name their benchmark in "
                                         r"data_source \(aime: 2, amc: 2, .*Pass --input .*valid.parquet \(no NAME=\)"):
        prep_eval.main(["--output", str(out), "--input", f"aime24={tmp_path / 'valid.parquet'}"])
