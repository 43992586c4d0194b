"""scripts/data/self_sample.py (issue #55 item 2): self-sourced traces offline, on the tiny assets on CPU (the CPU
backend's sampler, no Ray): the written file carries ``target_lst`` and ``self_pass_rate``, the summary the FLOPs
(checked against mix_src/algo/flops.py on the samples' own lengths) and the pass rates; the keep rule on its own."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from transformers import AutoConfig, AutoTokenizer

from mix_src.algo.flops import ModelShape, forward_flops
from scripts.data import self_sample


def test_keep_verified_distinct_in_order_and_pass_rate():
    samples = [[("a", [1]), ("b", [2]), ("a", [1])], [("c", [3]), ("d", [4]), ("e", [5])]]
    records = [{"row": 0, "sample": 0, "response": "a", "acc": 1.0}, {"row": 0, "sample": 1, "response": "b", "acc": 0.0},
               {"row": 0, "sample": 2, "response": "a", "acc": 1.0}, {"row": 1, "sample": 0, "response": "c", "acc": 0.0},
               {"row": 1, "sample": 1, "response": "d", "score": 1.0}, {"row": 1, "sample": 2, "response": "e"}]
    verified, rates = self_sample.keep_verified(samples, records, 3)
    assert verified == [["a"], ["d"]] and rates.tolist() == pytest.approx([2 / 3, 1 / 3])


def test_tiny_assets_on_cpu_write_target_lst_flops_and_pass_rates(tiny_assets, tmp_path):
    out = tmp_path / "self.parquet"
    summary = self_sample.main(["--model", tiny_assets["model"], "--tokenizer", tiny_assets["tokenizer"],
                                "--input", tiny_assets["train"], "--output", str(out), "--k", "2",
                                "--max-new-tokens", "8", "--backend", "cpu"])
    df = pd.read_parquet(out)
    assert len(df) == 32 and {"target", "target_lst", "self_pass_rate"} <= set(df.columns)
    assert summary["samples"] == 64 and len(summary["pass_rate_per_prompt"]) == 32
    assert df["self_pass_rate"].tolist() == summary["pass_rate_per_prompt"]
    assert all(len(t) <= 2 for t in df["target_lst"]) and summary["verified"] >= sum(map(len, df["target_lst"]))
    assert json.loads((tmp_path / "self.json").read_text())["flops"] == summary["flops"]
    # FLOPs: F(P + R) per sample, P = the templated prompt's tokens, R <= 8 generated tokens
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_assets["model"]).to_dict())
    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    texts = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False) for p in df["prompt"]]
    lens = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    low, high = (forward_flops(shape, [n + r for n in lens for _ in range(2)], "full") for r in (1, 8))
    assert low <= summary["flops"]["full"] <= high and 0 < summary["flops"]["6n"] < summary["flops"]["full"]


def test_pass_at_k_is_the_unbiased_estimator():
    # c = 0, 1, 4 correct of n = 4: pass@1 = c/n; pass@2 = 1 - C(n-c, 2)/C(n, 2) = 0, 1 - 3/6, 1
    got = self_sample.pass_at_k([0, 1, 4], 4, [1, 2, 4, 8])
    assert got == pytest.approx({1: (0 + 0.25 + 1) / 3, 2: (0 + 0.5 + 1) / 3, 4: (0 + 1 + 1) / 3})  # k > n left out


LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 2 == 0), "acc": float(len(solution_str) % 2 == 0)}
"""


def test_a_custom_reward_grades_and_drop_target_leaves_only_the_verified_samples(tiny_assets, tmp_path):
    """The run's own reward (verl's reward.custom_reward_function path/name) decides what is kept, and with
    --drop-target the expert target is gone: target_lst alone guides (the harness's PrefixRL from self-sourced traces)."""
    reward = tmp_path / "even_length.py"
    reward.write_text(LENGTH_REWARD)
    out = tmp_path / "self.parquet"
    summary = self_sample.main(["--model", tiny_assets["model"], "--tokenizer", tiny_assets["tokenizer"],
                                "--input", tiny_assets["train"], "--output", str(out), "--k", "2",
                                "--max-new-tokens", "6", "--backend", "cpu", "--reward-path", str(reward),
                                "--drop-target"])
    df = pd.read_parquet(out)
    assert df["target"].isna().all() and summary["target_dropped"] and summary["reward"].endswith("even_length.py:compute_score")
    kept = [t for lst in df["target_lst"] for t in lst]
    assert kept and all(len(t) % 2 == 0 for t in kept)  # only what the custom reward verified
    rates = df["self_pass_rate"].to_numpy()
    assert summary["pass_at_k"] == pytest.approx({1: rates.mean(), 2: self_sample.pass_at_k(rates * 2, 2, [2])[2]})
    assert all(bool(len(lst)) == (r > 0) for lst, r in zip(df["target_lst"], rates))
