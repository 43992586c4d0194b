"""scripts/experiments/prefix_pass_curve.py (issue #56's evidence: the pass rate of a model continuing a prefix of
the expert trace): the prefix is mix_src's ``floor(ratio * |y + EOS|)`` tokens and is part of the scored answer, so a
reward that asks for the trace's first tokens is met by every sample once the prefix holds them, and by none (of a
random tiny model) without it."""

from __future__ import annotations

import pandas as pd

from scripts.experiments import prefix_pass_curve as ppc
from scripts.experiments import toy_addition as ta


def test_the_prefix_is_mix_srcs_and_is_part_of_the_scored_answer(tiny_assets):
    df = pd.read_parquet(tiny_assets["train"]).head(4)
    tok = ta.load_tokenizer(tiny_assets["tokenizer"])
    head = {}  # ground truth -> the text of the trace's first floor(0.9 * |y + EOS|) tokens
    for _, row in df.iterrows():
        ids = tok(row["target"][0]["content"], add_special_tokens=False)["input_ids"]
        head[str(row["reward_model"]["ground_truth"])] = tok.decode(ids[: int(0.9 * (len(ids) + 1))])

    def starts_with_the_head(data_source, text, ground_truth, extra_info=None):
        return {"acc": float(text.startswith(head[str(ground_truth)]))}

    out = ppc.curve(tiny_assets["model"], tiny_assets["tokenizer"], tiny_assets["train"], starts_with_the_head,
                    [0.0, 0.9], samples=2, rows=4, max_new_tokens=8)
    assert out["0.9"] == {"pass_rate": 1.0, "groups_in_band_0.25_0.75": 0.0, "groups_mixed": 0.0}
    assert out["0"]["pass_rate"] == 0.0
