"""scripts/eval/evaluate.py: end to end on the tiny random Qwen2 on CPU (HF backend), plus the scoring and
the unweighted per-source average on hand-made responses."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import REPO_ROOT

from scripts.eval import evaluate


def test_module_import_does_not_load_heavy_backends():
    import subprocess
    import sys

    code = ("import sys; import scripts.eval.evaluate; "
            "print(sorted(k for k in ('vllm', 'torch', 'transformers') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "[]"


def test_evaluate_tiny_model_on_cpu(tiny_assets, tmp_path, capsys):
    out = tmp_path / "result.json"
    samples = tmp_path / "samples.jsonl"
    result = evaluate.main(["--model", tiny_assets["model"], "--tokenizer", tiny_assets["tokenizer"],
                            "--data", tiny_assets["val"], "--output", str(out), "--samples-output", str(samples),
                            "--backend", "hf", "--n", "2", "--temperature", "1.0", "--max-new-tokens", "12",
                            "--batch-size", "4", "--timeout", "10"])
    printed = capsys.readouterr().out
    print(printed)
    n_rows = len(pd.read_parquet(tiny_assets["val"]))

    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["backend"] == "hf" and saved["n_rows"] == n_rows and saved["n_samples"] == 2 * n_rows
    assert set(saved["per_source"]) == {"tiny_arith"}
    src = saved["per_source"]["tiny_arith"]
    assert src["n"] == 2 * n_rows and 0 <= src["acc"] <= 1
    assert saved["average_acc"] == pytest.approx(src["acc"])
    assert saved["require_think"] is False  # the tiny prompts do not ask for think tags
    assert 1 <= src["mean_response_tokens"] <= 12
    assert "tiny_arith" in printed and "average (unweighted)" in printed

    # every saved sample re-grades to the same result with the reward itself
    from mix_src.rewards import compute_score

    recs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(recs) == 2 * n_rows and {r["sample"] for r in recs} == {0, 1}
    for r in recs:
        again = compute_score(r["data_source"], r["response"], r["ground_truth"], require_think=False,
                              starts_in_think=False)
        assert {k: again[k] for k in ("score", "acc", "format_ok")} == {k: r[k] for k in ("score", "acc", "format_ok")}


def test_scoring_and_unweighted_average():
    T = "<think>ok</think> "
    rows = [
        {"data_source": "a", "prompt": [], "reward_model": {"ground_truth": "\\frac{1}{2}"}, "extra_info": {}},
        {"data_source": "a", "prompt": [], "reward_model": {"ground_truth": "3"}, "extra_info": {}},
        {"data_source": "a", "prompt": [], "reward_model": {"ground_truth": "4"}, "extra_info": {}},
        {"data_source": "b", "prompt": [], "reward_model": {"ground_truth": "C"},
         "extra_info": {"answer_type": "multiple_choice"}},
    ]
    samples = [[(T + "\\boxed{0.5}", 5)], [(T + "\\boxed{3}", 3)], [("<think>no close \\boxed{4}", 4)],
               [(T + "The answer is (B).", 6)]]
    recs = evaluate.score_samples(rows, samples, [False] * 4, require_think=True)
    assert [(r["acc"], r["format_ok"]) for r in recs] == [(True, True), (True, True), (False, False), (False, True)]
    summary = evaluate.summarize(recs)
    assert summary["per_source"]["a"]["acc"] == pytest.approx(2 / 3)
    assert summary["per_source"]["b"]["acc"] == 0.0
    assert summary["average_acc"] == pytest.approx(1 / 3)  # unweighted over sources; weighted would be 0.5
    assert summary["per_source"]["a"]["format_ok"] == pytest.approx(2 / 3)
    # think settings: a prompt ending in <think> starts inside it; auto requires the block when asked for
    rows_think = [{"prompt": [{"role": "system", "content": "use <think> ... </think>"}]}]
    assert evaluate.think_settings(["...assistant\n<think>\n"], rows_think, "auto") == ([True], True)
    assert evaluate.think_settings(["...assistant\n"], [{"prompt": [{"role": "user", "content": "2+2"}]}],
                                   "auto") == ([False], False)


def test_clear_errors(tmp_path, tiny_assets):
    pd.DataFrame([{"question": "q"}]).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(SystemExit, match=r"has no column\(s\) \['prompt', 'reward_model', 'data_source'\]"):
        evaluate.main(["--model", tiny_assets["model"], "--data", str(tmp_path / "bad.parquet"),
                       "--output", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="is not a folder"):
        evaluate.main(["--model", str(tmp_path / "nope"), "--data", tiny_assets["val"],
                       "--output", str(tmp_path / "r.json")])


def test_bad_rows_and_digit_labels_do_not_stop_an_evaluation(tmp_path, capsys):
    """A validation file mixing ARC's letter and digit answer keys, plus rows that cannot be graded: every
    row is loaded and scored, bad ones count as wrong and ungradable, the evaluation finishes."""
    T = "<think>ok</think> "
    mc = {"answer_type": "multiple_choice"}
    rows = [{"data_source": "arc_c", "prompt": [{"role": "user", "content": "q"}],
             "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": mc}
            for gt in ("B", "4", "4", "1", "", "E5")]
    path = tmp_path / "valid.parquet"
    pd.DataFrame(rows).to_parquet(path)
    loaded = evaluate.load_rows(str(path))
    assert len(loaded) == 6
    samples = [[(T + "\\boxed{B}", 3)], [(T + "\\boxed{4}", 3)], [(T + "\\boxed{D}", 3)], [(T + "\\boxed{B}", 3)],
               [(T + "\\boxed{A}", 3)], [(T + "\\boxed{A}", 3)]]
    recs = evaluate.score_samples(loaded, samples, [False] * 6, require_think=True)
    assert [r["acc"] for r in recs] == [True, True, True, False, False, False]
    assert [r["ungradable"] for r in recs] == [False, False, False, False, True, True]
    summary = evaluate.summarize(recs)
    assert summary["per_source"]["arc_c"]["ungradable"] == 2
    assert summary["per_source"]["arc_c"]["acc"] == pytest.approx(3 / 6)
    evaluate.print_table(summary)
    assert "ungradable" in capsys.readouterr().out
