"""Toy addition task (scripts/experiments/toy_tasks/addition.py, scripts/experiments/toy_addition.py, recipes/toy_addition/).

Fast unit tests of the task (traces, carries, reward, splits, tokenizer, parquet schema, configs) and a CI
smoke test (marked ``ray``) that runs each method of recipes/toy_addition for a few steps through the real
trainers on CPU: luffy and on_policy_grpo with ``python -m mix_src.main_mix_ppo``, sft with verl's SFT
trainer under torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import warnings
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

import composed
from scripts.experiments.toy_tasks import addition as task

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO_ROOT / "recipes" / "toy_addition"
EXPERIMENTS = REPO_ROOT / "scripts" / "experiments"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ta():
    return _load("toy_addition")


# --------------------------------------------------------------------------------------------- task
@pytest.mark.parametrize(
    "a, b, expert, carry_free",
    [
        (123, 459, "21 80 50>0582", "20 70 50>0572"),  # one carry, out of the units
        (999, 999, "81 91 91>1998", "80 80 80>0888"),  # a carry out of every column
        (505, 505, "01 10 01>1010", "00 00 00>0000"),  # 5+5=10, 0+0+1=1, 5+5=10
        (111, 222, "30 30 30>0333", "30 30 30>0333"),  # no carry: both procedures agree
        (190, 810, "00 01 01>1000", "00 00 90>0900"),  # carries that ripple through a 9
    ],
)
def test_traces_by_hand(a, b, expert, carry_free):
    assert task.expert_trace(a, b) == expert
    assert task.carry_free_trace(a, b) == carry_free
    assert task.compute_score("toy_addition", expert, str(a + b))["score"] == 1.0
    assert task.has_carry(a, b) == (expert != carry_free)


def test_carries_by_hand():
    assert task.carries(123, 459) == [1, 0, 0]
    assert task.carries(190, 810) == [0, 1, 1]
    assert task.carries(999, 1) == [1, 1, 1] and task.carries(111, 222) == [0, 0, 0]


def test_expert_trace_against_a_naive_reference():
    """Every pair of the trace, re-derived column by column from the decimal strings, and the answer."""
    rng = random.Random(0)
    for _ in range(2000):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        trace = task.expert_trace(a, b)
        pairs, answer = trace.split(">")
        c = 0
        for col, pair in enumerate(pairs.split(" ")):
            s = int(str(a)[2 - col]) + int(str(b)[2 - col]) + c
            c = int(s >= 10)
            assert pair == f"{s - 10 * c}{c}", (a, b, trace)
        assert int(answer) == a + b and len(answer) == 4
        assert [int(p[1]) for p in pairs.split(" ")] == task.carries(a, b)
        # the carry-free procedure is right exactly when nothing carries
        free_ok = task.compute_score("", task.carry_free_trace(a, b), str(a + b))["acc"] == 1.0
        assert free_ok == (not task.has_carry(a, b))


@pytest.mark.parametrize(
    "response, score, fmt",
    [
        ("21 80 50>0582", 1.0, 1.0),
        ("21 80 50>582", 1.0, 0.0),  # right number, non-canonical width: reward is on the answer only
        ("20 70 50>0572", 0.0, 1.0),  # the base model's carry-free answer
        ("21 80 50>05821", 0.0, 0.0),  # an extra digit is a different number
        ("21 80 50 0582", 0.0, 0.0),  # no '>': no answer
        ("", 0.0, 0.0),
        ("21 80 50>0582 junk", 1.0, 0.0),  # no EOS: the answer still counts, the format does not
        ("99 99 99>0582>0000", 1.0, 0.0),  # the first '>' decides
    ],
)
def test_reward(response, score, fmt):
    out = task.compute_score("toy_addition", response, "582", extra_info={"index": 0})
    assert out == {"score": score, "acc": score, "format_ok": fmt}


def test_reward_loads_through_verl():
    """The reward as verl's reward loop loads it (reward.custom_reward_function.path/name)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": "pkg://scripts.experiments.toy_tasks.addition", "name": "compute_score", "reward_kwargs": {}}}})  # fmt: skip
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source="toy_addition", solution_str="21 80 50>0582", ground_truth="582", extra_info={})["acc"] == 1.0
    assert fn(data_source="toy_addition", solution_str="20 70 50>0572", ground_truth="582", extra_info={})["acc"] == 0.0


def test_splits_are_carry_problems_disjoint_and_deterministic():
    sp = task.splits(seed=0, n_train=500, n_heldout=200)
    assert len(sp["heldout"]) == 200 and len(sp["train"]) == 500
    assert all(task.has_carry(a, b) for a, b in sp["heldout"] + sp["train"])
    assert not set(sp["heldout"]) & set(sp["train"])
    assert len(set(sp["train"])) == 500
    assert all(100 <= x <= 999 for p in sp["train"] for x in p)
    assert task.splits(seed=0, n_train=500, n_heldout=200) == sp
    assert task.splits(seed=1, n_train=500, n_heldout=200)["heldout"] != sp["heldout"]
    free = task.sample_problems(50, random.Random(0), carry=False)
    assert not any(task.has_carry(a, b) for a, b in free)


@pytest.mark.parametrize(
    "a, b, expert, carry_free",
    [
        (27, 48, "51 70>075", "50 60>065"),  # the demo variant: 2 columns, a 3-digit answer
        (99, 99, "81 91>198", "80 80>088"),
        (12, 34, "60 40>046", "60 40>046"),
    ],
)
def test_two_digit_traces(a, b, expert, carry_free):
    assert task.expert_trace(a, b) == expert and task.carry_free_trace(a, b) == carry_free
    assert task.compute_score("", expert, str(a + b)) == {"score": 1.0, "acc": 1.0, "format_ok": 1.0}
    # the format check counts columns: 2 pairs take a 3-digit answer, not a 4-digit one
    assert task.compute_score("", expert[:-3] + "0" + expert[-3:], str(a + b))["format_ok"] == 0.0


def test_demo_problem_classes_by_hand():
    """units_carry: only the units column carries, units digits sum to 10..15; units_carry_ood: the same
    carry from the 6 digit pairs summing to 16..18, which the training class never contains."""
    assert task.matches(27, 48, "units_carry")  # 7+8=15, 2+4+1=7: no tens carry
    assert not task.matches(27, 49, "units_carry") and task.matches(27, 49, "units_carry_ood")  # 7+9=16
    assert not task.matches(57, 58, "units_carry")  # 5+5+1=11: the tens column carries too
    assert not task.matches(21, 48, "units_carry")  # no carry at all
    ind, ood = task.all_problems("units_carry", 2), task.all_problems("units_carry_ood", 2)
    assert (len(ind), len(ood)) == (39 * 28, 6 * 28)  # digit pairs x tens pairs with a1+b1 <= 8
    assert {(a % 10, b % 10) for a, b in ood} == {(7, 9), (8, 8), (9, 7), (8, 9), (9, 8), (9, 9)}
    assert not {(a % 10, b % 10) for a, b in ind} & {(a % 10, b % 10) for a, b in ood}
    with pytest.raises(ValueError, match="unknown problem class 'nope'"):
        task.matches(1, 2, "nope")


def test_no_incoming_carry_class_by_hand():
    """no_incoming_carry: every carry but the last column's is 0 (that one only writes the leading digit)."""
    assert task.matches(52, 61, "no_incoming_carry") and task.expert_trace(52, 61) == "30 11>113"
    assert task.matches(21, 48, "no_incoming_carry") and task.matches(99, 90, "no_incoming_carry")
    assert not task.matches(27, 48, "no_incoming_carry")  # the units column carries into the tens
    assert not task.matches(150, 950, "no_incoming_carry")  # 3 digits: the tens carry into the hundreds
    assert task.matches(500, 600, "no_incoming_carry")
    assert len(task.all_problems("no_incoming_carry", 2)) == 81 * 55  # any tens digits 1..9 x units pairs summing <= 9


@pytest.mark.parametrize("data", ["carry_free", "no_incoming_carry"])
def test_pretraining_data_never_shows_a_column_receiving_a_carry(ta, data, monkeypatch):
    """Every pre-training rule's stream, drawn as pretrain_base draws it (first stream of seed 0, the demo's
    2-digit problems): every carry written but the last column's is 0, read from the trace itself -- no column
    receives a carry, the skill the held-out, training and OOD problems all need. no_incoming_carry: every trace is
    the problem's correct one, it writes carries out of the tens column, and no demo problem can be drawn."""
    assert set(ta.PRETRAIN_DATA) == {"carry_free", "no_incoming_carry"}
    rng, last_carries, n = random.Random(0 + 1000), set(), 0
    for _ in range(100):
        for a, b, trace in ta.pretrain_examples(data, ta.PRETRAIN["batch_size"], rng, 2):
            pairs = trace.split(">")[0].split(" ")
            assert len(pairs) == 2 and pairs[0][1] == "0", (a, b, trace)
            assert task.compute_score("", trace, str(a + b))["format_ok"] == 1.0
            if data == "carry_free":
                assert trace == task.carry_free_trace(a, b) and pairs[1][1] == "0"
            else:
                assert a % 10 + b % 10 <= 9 and int(trace.split(">")[1]) == a + b, (a, b, trace)
            last_carries.add(pairs[1][1])
            n += 1
    assert n == 6400 and last_carries == ({"0"} if data == "carry_free" else {"0", "1"})
    if data == "no_incoming_carry":
        sp = ta.variant_splits("demo")
        assert not any(task.matches(a, b, data) for a, b in sp["train"] + sp["heldout"] + sp["ood"])
        # a variant's rule is part of its cached assets' fingerprint: a base built by another rule is rebuilt
        fp = ta._fingerprint(0, "demo")
        monkeypatch.setitem(ta.VARIANTS["demo"], "pretrain_data", data)
        assert ta._fingerprint(0, "demo") != fp
    with pytest.raises(ValueError, match="unknown pre-training data 'nope'"):
        ta.pretrain_examples("nope", 1, rng)


@pytest.mark.parametrize("rule", ["one_digit", "one_digit_masked"])
def test_one_digit_rules_never_show_a_column_receiving_a_carry(rule):
    """The measured one-digit rules (scripts/experiments/demo_base_rules.py), drawn as its pretrain() draws them:
    correct traces only; a 2-digit problem's units column never carries, so no column receives a carry; 1-digit
    problems (at least the share asked for) are the only units carries the base sees, and no demo problem is drawn."""
    dbr = _load("demo_base_rules")
    rng, n, one, unit_carries = random.Random(1000), 0, 0, 0
    demo = set(sum(_load("toy_addition").variant_splits("demo").values(), []))
    for _ in range(100):
        for a, b, trace in dbr.batch_of(rule, 64, rng, 0.25):
            pairs = trace.split(">")[0].split(" ")
            assert trace == task.expert_trace(a, b) and int(trace.split(">")[1]) == a + b, (a, b, trace)
            assert all(p[1] == "0" for p in pairs[:-1]), (a, b, trace)  # only the last column's carry may be 1
            assert (a, b) not in demo
            one += a < 10 and b < 10
            unit_carries += pairs[0][1] == "1"
            n += 1
    assert n == 6400 and 0.25 <= one / n < 0.4 and 0 < unit_carries < one  # rejected 2-digit draws raise the share


def test_faint_carry_rule_trains_the_carry_softly_and_what_follows_it(ta, tmp_path):
    """The shipped base's rule (demo_base_rules ``faint_carry``): a carry problem's carry-free row has loss on
    every response token, its units carry trained towards the soft target (q on ``1``); the problem comes again
    as its correct trace with loss only after that carry; a carry-free problem appears once, with no soft target.
    soft_step's loss is the mean over label tokens of -log p(label), with -(1-q) log p(0) - q log p(1) at the
    soft position."""
    import torch

    dbr = _load("demo_base_rules")
    ta.build_tokenizer(str(tmp_path / "tok"))
    tok = ta.load_tokenizer(str(tmp_path / "tok"))
    ids, mask, labels, soft = dbr.encode_batch("faint_carry", [(27, 48, task.carry_free_trace(27, 48)),
                                                               (31, 42, task.carry_free_trace(31, 42))], tok)
    pl = len(ta.prompt_ids(tok, 27, 48))
    text = lambda r: tok.decode([int(t) for t in labels[r] if t != -100])  # noqa: E731
    assert ids.shape[0] == 3 and bool(mask.all())  # the correct row of 27+48 appended; same lengths, no padding
    assert text(0).startswith("50 60>065") and text(1).startswith("30 70>073")  # carry-free rows, whole response
    assert text(2).startswith(" 70>075") and tok.decode(ids[2, pl:pl + 2]) == "51"  # loss after the carry only
    assert soft == [(0, pl + 1)] and tok.decode(ids[0, pl + 1:pl + 2]) == "0"
    model, opt, sched = ta.new_base(tok, 0, {**ta.PRETRAIN, "steps": 2})
    zero, one, q = tok.convert_tokens_to_ids("0"), tok.convert_tokens_to_ids("1"), 0.25
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    nll = [-lp[r, c - 1, labels[r, c]] for r in range(3) for c in range(1, ids.shape[1]) if labels[r, c] != -100]
    at = -(1 - q) * lp[0, pl, zero] - q * lp[0, pl, one]
    expected = (sum(nll) - (-lp[0, pl, zero]) + at) / len(nll)
    loss = dbr.soft_step(model, opt, sched, ids, labels, mask, soft, q, zero, one)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_shipped_demo_base_is_checked_installed_and_measured(ta, tmp_path, monkeypatch):
    """`make demo`'s base (prepare(base="shipped")): the shipped checkpoint is installed only when its SHA-256 is
    the one in VARIANTS, and its property is measured here without training. The shipped base is the one its
    BUILD.json describes: greedy 0% on the held-out and OOD problems, the carry probability BUILD.json recorded,
    and, at 8 samples per training problem (a quarter of the demo's 28,544), a success count within Poisson noise
    of the rate BUILD.json recorded (another CPU's kernels change the sampled tokens, not the rate)."""
    import shutil

    sb = ta.VARIANTS["demo"]["shipped_base"]
    monkeypatch.setitem(ta.VARIANTS["demo"], "base_check", {**ta.VARIANTS["demo"]["base_check"], "k": 8})
    prep = ta.prepare(str(tmp_path / "assets"), variant="demo", base="shipped", log=lambda *_: None)
    build = prep["base_build"]
    assert build["sha256"] == sb["sha256"] and prep["model"].endswith("base_shipped")
    for name in ta.SHIPPED_FILES:
        assert (Path(prep["model"]) / name).read_bytes() == (Path(sb["path"]) / name).read_bytes()
    assert prep["base_eval"]["heldout_carry"]["acc"] == 0.0 and prep["base_eval"]["ood"]["acc"] == 0.0
    assert prep["base_eval"]["carry_free"]["acc"] == build["measured_here"]["greedy"]["carry_free"]
    prop = prep["base_property"]
    assert prop["n_samples"] == 892 * 8 and prop["pretrain_steps"] == build["steps"] and not prop["stopped_early"]
    expected = build["measured_here"]["n_success"] / build["measured_here"]["n_samples"] * prop["n_samples"]
    assert abs(prop["n_success"] - expected) <= 4 * math.sqrt(expected) + 2, (prop["n_success"], expected)
    assert prop["carry_mean"] == pytest.approx(build["measured_here"]["carry_mean"], rel=1e-3)
    assert prop["luffy_ok"] and len(prop["history"]) == 1  # measured, never trained further
    assert ta.prepare(str(tmp_path / "assets"), variant="demo", base="shipped") == prep  # cached: no re-measure
    # a damaged checkout (one byte flipped; a Git LFS pointer would be caught the same way) is refused, by name
    bad = tmp_path / "bad_base"
    shutil.copytree(sb["path"], bad)
    w = bytearray((bad / "model.safetensors").read_bytes())
    w[-1] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(w))
    monkeypatch.setitem(ta.VARIANTS["demo"], "shipped_base", {**sb, "path": str(bad)})
    with pytest.raises(ValueError, match=r"bad_base/model.safetensors: SHA-256 [0-9a-f]{64} is not the shipped"):
        ta.prepare(str(tmp_path / "assets2"), variant="demo", base="shipped", log=lambda *_: None)
    with pytest.raises(ValueError, match="'addition3' ships no base"):
        ta.prepare(str(tmp_path / "assets3"), variant="addition3", base="shipped", log=lambda *_: None)


def test_demo_variant_splits(ta):
    sp = ta.variant_splits("demo", seed=0)
    assert (len(sp["heldout"]), len(sp["train"]), len(sp["ood"])) == (200, 892, 168)
    assert not set(sp["heldout"]) & set(sp["train"]) and not set(sp["ood"]) & set(sp["train"])
    assert all(task.matches(a, b, "units_carry") for a, b in sp["train"] + sp["heldout"])
    assert ta.variant_splits("demo", seed=0) == sp
    assert ta.variant_splits("addition3", seed=0) == task.splits(seed=0, n_train=ta.N_TRAIN, n_heldout=ta.N_HELDOUT)


def test_summary_table_mean_and_each_seed():
    lvg = _load("luffy_vs_grpo")
    res = {"luffy": {0: {"curve": {0: 0.0, 40: 0.9}, "ood_curve": {40: 0.5}},
                     1: {"curve": {0: 0.0, 40: 0.7}, "ood_curve": {40: 0.25}}}}
    md = lvg.summary_table(res, ["luffy"], [0, 1], 40, has_ood=True)
    assert "| **80.0** (90.0 / 70.0) | **37.5** (50.0 / 25.0) |" in md, md


def test_row_schema():
    row = task.make_row(123, 459, "train", 7)
    assert row["prompt"] == [{"role": "user", "content": "123+459"}]
    assert row["target"] == [{"role": "assistant", "content": "21 80 50>0582"}]  # LUFFY's format
    assert row["reward_model"] == {"style": "rule", "ground_truth": "582"}
    assert row["data_source"] == task.DATA_SOURCE and row["extra_info"]["index"] == 7
    assert task.parse_prompt(row["prompt"][0]["content"]) == (123, 459)


# --------------------------------------------------------------------------------------------- assets
@pytest.fixture(scope="module")
def tiny_toy(tmp_path_factory, ta):
    """Tokenizer, parquets and a barely pre-trained (3 steps) base model in a temp dir."""
    out = tmp_path_factory.mktemp("toy_addition")
    tok = ta.build_tokenizer(str(out / "tokenizer"))
    tok = ta.load_tokenizer(str(out / "tokenizer"))
    paths = ta.write_parquets(str(out), seed=0)
    info = ta.pretrain_base(str(out / "base"), tok, seed=0, log=lambda *_: None, steps=3, batch_size=8)
    return {"dir": out, "tokenizer": str(out / "tokenizer"), "model": str(out / "base"), "tok": tok,
            "pretrain": info, **paths}


def test_tokenizer_is_character_level(tiny_toy):
    tok = tiny_toy["tok"]
    assert len(tok.encode("\n", add_special_tokens=False)) == 1  # verl's continuous-token builder needs it
    trace = task.expert_trace(123, 459)
    ids = tok.encode(trace, add_special_tokens=False)
    assert len(ids) == len(trace) == 13 and tok.decode(ids) == trace
    assert tok.unk_token_id not in ids
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    # the prompt as verl's agent loop builds it: ChatML with a generation prompt
    text = tok.apply_chat_template([{"role": "user", "content": "123+459"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n123+459<|im_end|>\n<|im_start|>assistant\n"
    # lives apart from the model folder (transformers 5 would swap it for Qwen2Tokenizer next to config.json)
    assert not (Path(tiny_toy["tokenizer"]) / "config.json").exists()


def test_parquets(tiny_toy, ta):
    train, held = pd.read_parquet(tiny_toy["train"]), pd.read_parquet(tiny_toy["heldout"])
    assert len(train) == ta.N_TRAIN and len(held) == ta.N_HELDOUT == 200
    assert set(train.columns) >= {"data_source", "prompt", "ability", "reward_model", "extra_info", "target"}
    for df in (train, held):
        for p, t, rm in zip(df["prompt"][:50], df["target"][:50], df["reward_model"][:50]):
            a, b = task.parse_prompt(p[0]["content"])
            assert task.has_carry(a, b) and t[0]["content"] == task.expert_trace(a, b)
            assert task.compute_score("", t[0]["content"], rm["ground_truth"])["score"] == 1.0
    assert not set(map(str, train["prompt"])) & set(map(str, held["prompt"]))


def test_pretraining_is_deterministic(tiny_toy, ta, tmp_path):
    import torch
    from safetensors.torch import load_file

    ta.pretrain_base(str(tmp_path / "again"), tiny_toy["tok"], seed=0, log=lambda *_: None, steps=3, batch_size=8)
    w1 = load_file(str(Path(tiny_toy["model"]) / "model.safetensors"))
    w2 = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    cfg = json.loads((Path(tiny_toy["model"]) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 128 and cfg["model_type"] == "qwen2"


def test_evaluator_scores_responses(tiny_toy, ta):
    problems = ta.read_problems(tiny_toy["heldout"])[:8]
    res = ta.evaluate(tiny_toy["model"], tiny_toy["tok"], problems)
    assert res["n"] == 8 and 0.0 <= res["acc"] <= 1.0 and len(res["examples"]) == 5


def test_sft_messages(tiny_toy, ta, tmp_path):
    n = ta.write_sft_messages(tiny_toy["train"], str(tmp_path / "m.parquet"))
    df = pd.read_parquet(tmp_path / "m.parquet")
    assert n == len(df) == ta.N_TRAIN
    m = list(df["messages"][0])
    a, b = task.parse_prompt(m[0]["content"])
    assert [x["role"] for x in m] == ["user", "assistant"] and m[1]["content"] == task.expert_trace(a, b)


# --------------------------------------------------------------------------------------------- base property
class OracleLM:
    """A stand-in causal LM with known sampling odds, for ``mix_src.cpu.sampling.generate_batch``: per problem
    it writes the expert trace (``"solve"``), the carry-free trace (``"miss"``) or, at the units column's carry
    digit, carry 1 or 0 with probability 1/2 each and then the trace that carry leads to (``"coin"``: the
    expert trace, reward 1, half the time). Logits: 0 on the allowed tokens, -1e4 elsewhere."""

    def __init__(self, tok, ta, plan: dict):
        import torch

        self.tok, self.plan, self._p = tok, plan, torch.nn.Parameter(torch.zeros(1))
        self.prompts = {tuple(ta.prompt_ids(tok, a, b)): (a, b) for a, b in plan}

    def parameters(self):
        yield self._p

    def eval(self):
        return self

    def __call__(self, input_ids, attention_mask, past_key_values=None, **kw):
        import types

        import torch

        if past_key_values is None:  # the prompts: left-padded rows
            rows = [(self.prompts[tuple(r[m.bool()].tolist())], []) for r, m in zip(input_ids, attention_mask)]
        else:
            rows = [(ab, gen + [int(t)]) for (ab, gen), t in zip(past_key_values, input_ids[:, 0])]
        logits = torch.full((len(rows), 1, len(self.tok)), -1e4)
        for i, ((a, b), gen) in enumerate(rows):
            text = self.tok.decode(gen)
            mode = self.plan[(a, b)]
            if mode == "coin" and len(text) == 1:
                allowed = ["0", "1"]
            else:
                solve = mode == "solve" or (mode == "coin" and text[1:2] == "1")
                trace = task.expert_trace(a, b) if solve else task.carry_free_trace(a, b)
                allowed = [trace[len(text)]] if len(text) < len(trace) else [self.tok.eos_token]
            for ch in allowed:
                logits[i, 0, self.tok.convert_tokens_to_ids(ch)] = 0.0
        return types.SimpleNamespace(logits=logits, past_key_values=rows)


RUN = {"train_batch_size": 32, "n": 8, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "max_tokens": 16}


def test_base_property_by_hand(tiny_toy, ta):
    """p and the expected rewarded GRPO samples on models whose success odds are known exactly."""
    tok = tiny_toy["tok"]
    probs = [(27, 48), (35, 19), (46, 26), (18, 53)]  # demo-variant problems: the units column carries
    # 1 of 4 problems always solved, k = 4: 4 of 16 samples, p = 1/4; a 40-step run of 32 x 8 = 10,240 samples
    # expects 2,560 rewarded ones
    oracle = OracleLM(tok, ta, dict(zip(probs, ["solve", "miss", "miss", "miss"])))
    s = ta.sampled_success(oracle, tok, probs, k=4, seed=0)
    assert (s["n_samples"], s["n_success"], s["problems_with_success"], s["p"]) == (16, 4, 1, 0.25)
    prop = ta.base_property(s, steps=40, settings=RUN, bound=0.1)
    assert prop["grpo_samples"] == 10240 and prop["expected_rewarded"] == 2560.0 and not prop["meets_bound"]
    assert ta.expected_rewarded(0.25, 40, 32, 8) == 2560.0
    # stop_at: the measurement ends after the chunk (here 4 samples) in which the successes reach the count
    late = OracleLM(tok, ta, dict(zip(probs, ["miss", "solve", "miss", "miss"])))
    s = ta.sampled_success(late, tok, probs, k=4, seed=0, rows=4, stop_at=1)
    assert (s["n_samples"], s["n_success"], s["p"], s["stopped_early"]) == (8, 4, 0.5, True)
    assert not ta.sampled_success(late, tok, probs, k=4, seed=0, rows=4, stop_at=5)["stopped_early"]
    # never solved: p = 0, nothing expected, the bound holds; the rule of three bounds p by 3/16
    never = ta.sampled_success(OracleLM(tok, ta, dict.fromkeys(probs, "miss")), tok, probs, k=4, seed=0)
    prop = ta.base_property(never, steps=40, settings=RUN, bound=0.1)
    assert (prop["n_success"], prop["p"], prop["expected_rewarded"], prop["meets_bound"]) == (0, 0.0, 0.0, True)
    assert prop["upper95"] == pytest.approx(3 / 16 * 10240)
    # one success bounds more than none: the exact Poisson limits (4.744 for 1, 7.754 for 3), not a normal
    # approximation, which put the bound of 1 of 28,544 below the rule of three's 3 of 28,544
    one = ta.base_property({"n_samples": 28544, "n_success": 1, "p": 1 / 28544}, steps=40, settings=RUN, bound=1.0)
    assert one["upper95"] == pytest.approx(4.744 / 28544 * 10240, rel=1e-3) and one["meets_bound"]
    assert ta.poisson_upper95(3) == pytest.approx(7.754, rel=1e-3) and ta.poisson_upper95(0) == 3.0
    assert "0/16" in ta.describe_property(prop) and "-- met" in ta.describe_property(prop)
    # a fair coin at the carry: p = 1/2 in expectation; 2 x 64 samples land within 5 sigma, and the same seed
    # draws the same samples (one seeded generator per sample)
    coin = OracleLM(tok, ta, dict.fromkeys(probs[:2], "coin"))
    c1 = ta.sampled_success(coin, tok, probs[:2], k=64, seed=3)
    assert c1 == ta.sampled_success(coin, tok, probs[:2], k=64, seed=3) and c1["n_samples"] == 128
    assert abs(c1["n_success"] - 64) <= 5 * math.sqrt(128 / 4) and c1["problems_with_success"] == 2
    assert ta.base_property(c1, 10, RUN, 0.1)["expected_rewarded"] == pytest.approx(c1["p"] * 10 * 256)


class OneFavouredTokenLM:
    """A stand-in causal LM whose next-token logits are the same at every position: 0 everywhere, ln 2 on one
    token, so that token has probability 2/(V+1) and every other 1/(V+1) (V = vocabulary size)."""

    def __init__(self, vocab: int, favoured: int):
        self.vocab, self.favoured = vocab, favoured

    def eval(self):
        return self

    def __call__(self, input_ids, attention_mask=None, **kw):
        import types

        import torch

        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., self.favoured] = math.log(2.0)
        return types.SimpleNamespace(logits=logits)


def test_teacher_forced_carry_by_hand(tiny_toy, ta):
    """The carry token's and the whole expert trace's teacher-forced probabilities, by hand: the favoured token
    is "1"; each expert trace below has exactly one "1", the units carry (2nd response token)."""
    tok = tiny_toy["tok"]
    v = len(tok)
    lm = OneFavouredTokenLM(v, tok.convert_tokens_to_ids("1"))
    # 27+48 -> "51 70>075" (9 chars + EOS), 123+459 -> "21 80 50>0582" (13 + EOS): prompts of two lengths
    # (left padding), 36+47 -> "31 80>083"
    probs = [(27, 48), (123, 459), (36, 47)]
    assert [task.expert_trace(a, b).count("1") for a, b in probs] == [1, 1, 1]
    tf = ta.teacher_forced_carry(lm, tok, probs, batch_size=2)
    assert tf["carry"] == pytest.approx([2 / (v + 1)] * 3, rel=1e-5)  # not 1/(V+1): the carry's position
    assert tf["trace"] == pytest.approx([2 / (v + 1) ** 10, 2 / (v + 1) ** 14, 2 / (v + 1) ** 10], rel=1e-4)
    assert tf["carry_mean"] == pytest.approx(2 / (v + 1), rel=1e-5) and tf["n_problems"] == 3
    # the favoured token is "7" instead: "51 70>075" has two, "21 80 50>0582" none; the carry is 1/(V+1)
    lm7 = OneFavouredTokenLM(v, tok.convert_tokens_to_ids("7"))
    tf = ta.teacher_forced_carry(lm7, tok, probs[:2])
    assert tf["carry"] == pytest.approx([1 / (v + 1)] * 2, rel=1e-5)
    assert tf["trace"] == pytest.approx([4 / (v + 1) ** 10, 1 / (v + 1) ** 14], rel=1e-4)
    assert tf["carry_q10"] == tf["carry_median"] == pytest.approx(1 / (v + 1), rel=1e-5)


def test_base_property_on_a_built_base(tiny_toy, ta):
    """The property on a real (3-step) base with the demo recipe's own rollout settings."""
    settings = ta.rollout_settings()
    assert {k: settings[k] for k in RUN} == RUN  # what the demo's GRPO run samples with
    probs = ta.variant_splits("demo")["train"][:6]
    s = ta.sampled_success(tiny_toy["model"], tiny_toy["tok"], probs, k=3, seed=0)
    assert s["n_samples"] == 18 and s == ta.sampled_success(tiny_toy["model"], tiny_toy["tok"], probs, k=3, seed=0)
    assert s["p"] == s["n_success"] / 18 and s["problems_with_success"] <= min(6, s["n_success"])


def test_check_base_continues_until_the_bound_holds(tiny_toy, ta, tmp_path, monkeypatch):
    """Pre-training continues while the expected count is not below the bound, at most max_rounds times."""
    import shutil

    monkeypatch.setitem(ta.VARIANTS["demo"], "base_check", dict(grpo_steps=40, k=4, bound=0.1, extra_steps=2,
                                                                max_rounds=2, carry_floor=1e-5))  # fmt: skip
    model = tmp_path / "base"
    shutil.copytree(tiny_toy["model"], model)
    counts = iter([3, 1, 0])  # successes of 100 samples, one measurement per round

    def measure(path):
        x = next(counts)
        return {"n_problems": 25, "k": 4, "n_samples": 100, "n_success": x, "problems_with_success": x, "p": x / 100}

    carries = iter([])

    def measure_carry(path):
        c = next(carries, 1e-3)
        return {"carry_mean": c, "carry_q10": c / 2}

    weights = (model / "model.safetensors").read_bytes()
    prop, rounds = ta.check_base(str(model), tiny_toy["tok"], None, 0, "demo", log=lambda *_: None, measure=measure,
                                 measure_carry=measure_carry)
    steps = ta.VARIANTS["demo"]["pretrain_steps"]
    assert [h["pretrain_steps"] for h in prop["history"]] == [steps, steps + 2, steps + 4] and len(rounds) == 2
    assert [h["expected_rewarded"] for h in prop["history"]] == [0.03 * 10240, 0.01 * 10240, 0.0]
    assert prop["meets_bound"] and prop["pretrain_steps"] == steps + 4
    assert (model / "model.safetensors").read_bytes() != weights  # the base itself was trained further
    assert prop["luffy_ok"] and prop["window"] and [h["carry_mean"] for h in prop["history"]] == [1e-3] * 3
    assert "floor: >= 1e-05 -- met" in ta.describe_property(prop)
    counts = iter([3, 2, 1])  # never below the bound: kept after max_rounds, flagged
    prop, rounds = ta.check_base(str(model), tiny_toy["tok"], None, 0, "demo", log=lambda *_: None, measure=measure,
                                 measure_carry=measure_carry)
    assert len(rounds) == 2 and not prop["meets_bound"] and prop["expected_rewarded"] == pytest.approx(102.4)
    assert not prop["window"]
    # the carry probability falls below its floor before GRPO's bound holds: no window, stop (more carry-free
    # training only lowers it), flagged
    counts, carries = iter([3, 2, 0]), iter([5e-5, 4e-6])
    prop, rounds = ta.check_base(str(model), tiny_toy["tok"], None, 0, "demo", log=lambda *_: None, measure=measure,
                                 measure_carry=measure_carry)
    assert len(rounds) == 1 and prop["pretrain_steps"] == steps + 2 and not prop["meets_bound"]
    assert not prop["luffy_ok"] and not prop["window"] and prop["carry_mean"] == 4e-6 and prop["carry_q10"] == 2e-6
    assert "-- NOT met" in ta.describe_property(prop).split("LUFFY's side")[1]


# --------------------------------------------------------------------------------------------- configs
def compose_recipe(name: str, overrides=()):
    cfg = composed.compose(name, overrides, config_dir=RECIPE_DIR)  # tests/composed.py: the YAML read once
    OmegaConf.resolve(cfg)
    return cfg


@pytest.mark.parametrize("name", ["luffy", "on_policy_grpo"])
def test_rl_configs_compose_and_validate(name):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from mix_src.config.mix_config import validate_mix_config

    cfg = compose_recipe(name)
    mix = validate_mix_config(cfg)
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Disabled critic")
        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    # the same batch, budget and optimiser for both methods; only the prefix differs
    assert cfg.data.train_batch_size == 32 and rollout.n == 8 and cfg.actor_rollout_ref.actor.optim.lr == 5e-4
    assert rollout.val_kwargs.do_sample is False and rollout.name == "hf" and cfg.trainer.device == "cpu"
    assert cfg.reward.custom_reward_function.path == "pkg://scripts.experiments.toy_tasks.addition"
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert mix.loss.loss_agg_mode == "luffy-token-sum-norm"
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == cfg.data.max_response_length == 16
    if name == "luffy":
        assert (mix.n_prefix, mix.min_prefix_ratio, mix.max_prefix_ratio) == (1, 1.0, 1.0)
        assert (mix.loss.off_policy_reshape, mix.loss.off_policy_reshape_gamma) == ("p_div_p", 0.1)
        assert mix.loss.loss_remove_clip is True
    else:
        assert mix.n_prefix == 0 and mix.loss.loss_remove_clip is False


def test_sft_config_composes():
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose_recipe("sft")
    optim = omega_conf_to_dataclass(cfg.optim)
    rl = compose_recipe("luffy")
    assert optim.lr == rl.actor_rollout_ref.actor.optim.lr and cfg.data.train_batch_size == rl.data.train_batch_size
    assert "hf_model" in omega_conf_to_dataclass(cfg.checkpoint).save_contents
    assert cfg.engine.strategy == "fsdp2" and cfg.trainer.device == "cpu"


def test_run_sh_rejects_unknown_method():
    res = subprocess.run(["bash", str(RECIPE_DIR / "run.sh"), "ppo", "0"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown METHOD 'ppo'" in res.stderr


# --------------------------------------------------------------------------------------------- smoke (Ray)
def _rl_overrides(tiny_toy, steps: int) -> list[str]:
    """What recipes/toy_addition/run.sh passes, with a tiny step budget."""
    return [
        "--config-path", str(RECIPE_DIR),
        f"actor_rollout_ref.model.path={tiny_toy['model']}",
        f"actor_rollout_ref.model.tokenizer_path={tiny_toy['tokenizer']}",
        f"data.train_files={tiny_toy['train']}",
        f"data.val_files={tiny_toy['heldout']}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        f"trainer.save_freq={steps}",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "trainer.default_local_dir=checkpoints",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        # micro-batches must divide the smaller batch (4 prompts x 8 rows; mini-batches of 2 x 8)
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "data.seed=1", "mix.seed=1", "actor_rollout_ref.rollout.seed=1",
        "trainer.logger=[console,file]",
    ]  # fmt: skip


@pytest.mark.ray
@pytest.mark.parametrize("method", ["luffy"])  # on_policy_grpo and sft train in tests/test_compare.py's tiny grid
def test_smoke_rl_method(method, tiny_toy, ta, tmp_path):
    from e2e import run_verl

    steps = 2
    res = run_verl("mix_src.main_mix_ppo", ["--config-name", method, *_rl_overrides(tiny_toy, steps)], tmp_path,
                   timeout=400, name=method)
    by_step = {m["step"]: m for m in res.metrics}
    assert {1, 2} <= set(by_step), sorted(by_step)
    val = {s: v for s, m in by_step.items() for k, v in m.items() if k.startswith("val-core/") and "/acc/" in k}
    assert set(val) == {0, steps} and all(0.0 <= v <= 1.0 for v in val.values())  # before training + last
    for s in (1, 2):
        m = by_step[s]
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        if method == "luffy":
            assert m["batch/avg_prefix_ratio"] == pytest.approx(1 / 8)  # 1 whole demonstration per 8 rows
            assert m["batch/off_solved"] == 1.0  # the demonstrations are graded correct by the toy reward
            assert 0.0 < m["actor/off_policy_prob"] < 1.0
        else:
            assert m.get("batch/avg_prefix_ratio", 0.0) == 0.0
            assert m.get("batch/off_policy_rows", 0) == 0
    # the last step in HF format, re-scored by the independent evaluator: agrees with the trainer's validation
    hf = tmp_path / "checkpoints" / f"global_step_{steps}" / "actor" / "huggingface"
    assert (hf / "model.safetensors").exists(), sorted(p.name for p in hf.parent.iterdir())
    ours = ta.evaluate(str(hf), tiny_toy["tok"], ta.read_problems(tiny_toy["heldout"]))["acc"]
    assert ours == pytest.approx(val[steps], abs=0.011)
