"""mix_src.rewards: scores, formats, LaTeX equivalences, multiple choice, numbers, the hard timeout, the
thread-safety verl needs, verl's own loader and naive reward manager, and the grading pool itself."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mix_src.rewards import compute_score, compute_score_batch, grading_stats, make_config
from mix_src.rewards import answers
from mix_src.rewards.pool import GradingPool

T = "<think>\nLet me work it out.\n</think>\n\n"  # a well-formed thinking part
V1 = {"correct_score": 1.0, "wrong_score": -0.5, "format_error_score": -1.0}  # LUFFY's reward v1


def score(response, gt, data_source="math", extra_info=None, **kw):
    return compute_score(data_source, response, gt, extra_info, **kw)


# ------------------------------------------------------------------------------ correct / wrong / format
def test_correct_wrong_and_configurable_scores():
    assert score(T + "The answer is \\boxed{42}.", "42") == {"score": 1.0, "acc": True, "format_ok": True, "ungradable": False}
    assert score(T + "The answer is \\boxed{41}.", "42") == {"score": 0.0, "acc": False, "format_ok": True, "ungradable": False}
    assert score(T + "\\boxed{42}", "42", **V1)["score"] == 1.0
    assert score(T + "\\boxed{41}", "42", **V1) == {"score": -0.5, "acc": False, "format_ok": True, "ungradable": False}
    assert score(T + "I do not know.", "42", **V1) == {"score": -0.5, "acc": False, "format_ok": True, "ungradable": False}
    # an answer inside the thinking part does not count; the text after the LAST </think> is graded
    assert score("<think>\\boxed{42}</think> so \\boxed{7}", "42")["acc"] is False
    assert score("<think>a</think> draft \\boxed{7} </think> final \\boxed{42}", "42")["acc"] is True


def test_format_errors():
    no_close = "<think>\nthinking... \\boxed{42}"
    assert score(no_close, "42", **V1) == {"score": -1.0, "acc": False, "format_ok": False, "ungradable": False}
    assert score(no_close, "42") == {"score": 0.0, "acc": False, "format_ok": False, "ungradable": False}
    # default starts_in_think=True: the prompt ended with <think>, so only </think> is needed (LUFFY v3)
    assert score("reasoning </think> \\boxed{42}", "42")["acc"] is True
    # starts_in_think=False: a <think> must come before </think>
    assert score("reasoning </think> \\boxed{42}", "42", starts_in_think=False)["format_ok"] is False
    assert score("<think>r</think> \\boxed{42}", "42", starts_in_think=False)["acc"] is True
    assert score("</think> x <think> \\boxed{42}", "42", starts_in_think=False)["format_ok"] is False
    # require_think=False grades the whole response (LUFFY v4), format_ok still reports the tags
    assert score("plain \\boxed{42}", "42", require_think=False) == {"score": 1.0, "acc": True, "format_ok": False, "ungradable": False}
    # require_boxed (LUFFY v1): an answer without \boxed{} is a format error
    assert score(T + "The answer is 42.", "42", require_boxed=True, **V1)["score"] == -1.0
    assert score(T + "The answer is 42.", "42")["acc"] is True  # math-verify finds the bare number


# ------------------------------------------------------------------------------------ LaTeX equivalence
@pytest.mark.parametrize(
    "answer, gt, expected",
    [
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", True),
        ("\\boxed{1/2}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{1}{3}}", "0.5", False),
        ("$\\boxed{2\\sqrt{3}}$", "\\sqrt{12}", True),
        ("\\boxed{\\boxed{7}}", "7", True),
        ("\\fbox{7}", "7", True),
        ("The final answer is $\\frac{3}{4}$.", "0.75", True),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
        ("\\boxed{\\{3, 2, 1\\}}", "\\{1,2,3\\}", True),
        ("\\boxed{\\{1, 2\\}}", "\\{1,2,3\\}", False),
        ("$x \\in (1, 2]$", "(1,2]", True),
        ("\\boxed{(1,2]}", "(1,2]", True),
        ("\\boxed{[1,2]}", "(1,2]", False),
        ("\\boxed{(-\\infty, 3) \\cup (5, \\infty)}", "(-\\infty,3)\\cup(5,\\infty)", True),
        ("\\boxed{007}", "7", True),  # two integers: decided in-process
        ("\\boxed{1000001}", "1000000", False),
    ],
)
def test_latex_equivalences(answer, gt, expected):
    result = score(T + answer, gt)
    assert result["acc"] is expected, (answer, gt, result)
    assert result["score"] == (1.0 if expected else 0.0)


def test_ground_truth_forms_and_errors():
    assert score(T + "\\boxed{5}", "\\boxed{5}")["acc"] is True  # a boxed ground truth
    assert score(T + "\\boxed{5}", "$5$")["acc"] is True
    assert score(T + "\\boxed{5}", 5)["acc"] is True  # numbers from parquet
    assert score(T + "\\boxed{5}", ["5"])["acc"] is True  # a one-element list


# --------------------------------------------------------------------------- multiple choice / numeric
@pytest.mark.parametrize(
    "answer, expected",
    [("\\boxed{B}", "B"), ("\\boxed{(B)}", "B"), ("\\boxed{\\text{B}}", "B"), ("\\boxed{B. 42 m}", "B"),
     ("The answer is (C).", "C"), ("Answer: D", "D"), ("Final answer: option A", "A"), ("(A)", "A"),
     ("B", "B"), ("\\boxed{Bob}", None), ("the answer is a cat", None), ("I cannot tell.", None)],
)
def test_extract_choice(answer, expected):
    assert answers.extract_choice(answer) == expected


def test_multiple_choice_routing():
    for ds in ("arc_c", "allenai/ai2_arc", "ARC-Challenge", "gpqa_diamond", "Idavidrein/gpqa", "mmlu_pro"):
        assert score(T + "The answer is (C).", "C", ds)["acc"] is True, ds
        assert score(T + "\\boxed{A}", "C", ds)["acc"] is False, ds
    assert score(T + "\\boxed{B}", "(B)", "gpqa")["acc"] is True  # ground truth "(B)" is fine too
    # "archimedes" is not "arc": math grading, where B is a symbol that must equal the gold symbol
    assert score(T + "\\boxed{3}", "3", "archimedes_math")["acc"] is True
    # extra_info.answer_type overrides the data source, and the answer_type option does too
    assert score(T + "\\boxed{C}", "C", "my_quiz", {"answer_type": "multiple_choice"})["acc"] is True
    assert score(T + "Answer: C", "C", "my_quiz", answer_type="multiple_choice")["acc"] is True


def test_numeric_answers():
    assert score(T + "So she has 1,234 apples.", "1234", "gsm8k")["acc"] is True
    assert score(T + "So she has 1,235 apples.", "1234", "gsm8k")["acc"] is False
    assert score(T + "The total is \\boxed{72}.", "72", "openai/gsm8k")["acc"] is True
    assert score(T + "It costs $3.50.", "3.5", "gsm8k")["acc"] is True
    assert score(T + "\\boxed{\\frac{7}{2}}", "3.5", "gsm8k")["acc"] is True  # not plain: math-verify
    assert score(T + "no number here", "3", "gsm8k")["acc"] is False
    assert score(T + "\\boxed{12}", "12", "x", {"answer_type": "numeric"})["acc"] is True
    assert answers.parse_number("1,2") is None and answers.parse_number("1e400") is None
    assert answers.numbers_equal(2.0**60, 2.0**60 + 1) is True  # beyond exact floats: tolerance
    assert answers.numbers_equal(1234567.0, 1234568.0) is False  # integers compare exactly


# ------------------------------------------------------------------------------ timeouts and robustness
PATHOLOGICAL = {
    "nested_latex_10k": "\\boxed{" + "\\left(" * 800 + "x" + "\\right)" * 800 + "}",
    "frac_chain": "\\boxed{" + "\\frac{1}{" * 40 + "2" + "}" * 40 + "}",
    "power_tower": "\\boxed{9^{9^{9^{9}}}}",
}


def test_pathological_inputs_score_zero_within_the_timeout():
    assert len(PATHOLOGICAL["nested_latex_10k"]) > 10_000
    timeout = 1.0
    compute_score("math", T + "\\boxed{\\frac{1}{2}}", "0.5", timeout_s=timeout)  # pool started outside the clock
    before = grading_stats().get("timeout", 0)
    for name, answer in PATHOLOGICAL.items():
        t0 = time.perf_counter()
        result = compute_score("math", T + answer, "1", timeout_s=timeout, **V1)
        elapsed = time.perf_counter() - t0
        # wrong (not a format error), and counted as ungradable: the grader could not decide in time
        assert result == {"score": -0.5, "acc": False, "format_ok": True, "ungradable": True}, name
        assert elapsed < timeout + 1.5, f"{name} took {elapsed:.2f}s with timeout_s={timeout}"
    assert grading_stats()["timeout"] - before == len(PATHOLOGICAL)  # really stopped by the deadline
    # the killed workers were replaced: normal grading goes on
    assert compute_score("math", T + "\\boxed{0.25}", "\\frac14", timeout_s=timeout)["acc"] is True


def test_cheap_paths_stay_cheap_on_huge_inputs():
    huge = "<think>" + "{" * 50_000 + "\\boxed{" * 5_000 + "}" * 20_000  # no </think>
    t0 = time.perf_counter()
    assert compute_score("math", huge, "1")["format_ok"] is False
    assert compute_score("gpqa", T + "answer " * 20_000 + "\\boxed{" * 1000, "A")["acc"] is False
    assert compute_score("gsm8k", T + "1," * 50_000, "1")["acc"] is False
    assert time.perf_counter() - t0 < 2.0


def test_thread_safe_under_verl_style_executor():
    """verl runs the reward in run_in_executor threads, where math-verify's SIGALRM timeouts raise."""
    cases = [(T + "\\boxed{0.5}", "\\frac{1}{2}", True), (T + "\\boxed{\\frac{2}{3}}", "0.5", False),
             (T + "$x \\in [0, 1)$", "[0,1)", True), (T + "\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True)] * 4
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda c: compute_score("math", c[0], c[1]), cases))
    assert [r["acc"] for r in results] == [c[2] for c in cases]


def test_batch_matches_sequential_and_checks_lengths():
    from scripts.bench.rewards import make_items

    items = make_items(40, seed=3, pathological_frac=0.0)
    items.append({"data_source": "math", "response": "no think block \\boxed{1}", "ground_truth": "1"})
    args = ([x["data_source"] for x in items], [x["response"] for x in items], [x["ground_truth"] for x in items])
    batch = compute_score_batch(*args, **V1)
    seq = [compute_score(d, r, g, **V1) for d, r, g in zip(*args)]
    assert batch == seq
    assert {r["score"] for r in batch} == {1.0, -0.5, -1.0}
    with pytest.raises(ValueError, match="lengths differ"):
        compute_score_batch(["math"], ["a", "b"], ["1"])


def test_options_are_validated():
    with pytest.raises(TypeError, match=r"unknown reward_kwargs \['wrong_scor'\]"):
        score(T + "\\boxed{1}", "1", wrong_scor=-1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        make_config(timeout_s=0)
    with pytest.raises(TypeError, match="require_think must be true or false"):
        make_config(require_think="yes")
    with pytest.raises(ValueError, match="answer_type must be one of"):
        make_config(answer_type="mc")
    # verl's own call-time extras are not options and are ignored
    assert score(T + "\\boxed{1}", "1", reward_router_address=None)["acc"] is True


# ------------------------------------------------------------------------------------------ verl wiring
def test_verl_loader_and_naive_reward_manager(tmp_path):
    """The exact path verl 0.9.1 takes: get_custom_reward_fn (pkg:// path + reward_kwargs) and the naive
    reward manager, which decodes, calls us in an executor thread and copies our keys to reward_extra_info."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from conftest import load_make_tiny_assets

    tokenizer = load_make_tiny_assets().build_tokenizer(str(tmp_path / "tok"))
    cfg = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": "pkg://mix_src.rewards.math_verify_reward", "name": "compute_score",
        "reward_kwargs": {"wrong_score": -0.5, "format_error_score": -1.0}}}})
    fn = get_custom_reward_fn(cfg)

    def item(response: str, gt: str) -> DataProto:
        ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        resp = torch.tensor([ids + [tokenizer.pad_token_id] * 3])
        prompt = torch.tensor([[tokenizer.pad_token_id, 5, 6]])
        mask = torch.cat([torch.tensor([[0, 1, 1]]), torch.tensor([[1] * len(ids) + [0] * 3])], dim=1)
        return DataProto.from_dict(
            tensors={"prompts": prompt, "responses": resp, "attention_mask": mask},
            non_tensors={"data_source": np.array(["math"], dtype=object),
                         "reward_model": np.array([{"style": "rule", "ground_truth": gt}], dtype=object),
                         "extra_info": np.array([{"split": "test", "index": 0}], dtype=object)})

    async def run():
        manager = NaiveRewardManager(OmegaConf.create({}), tokenizer, fn)
        return [await manager.run_single(item(r, g)) for r, g in
                [("<think>1+1</think> \\boxed{0.5}", "\\frac{1}{2}"), ("<think>x</think> \\boxed{3}", "2"),
                 ("no think \\boxed{2}", "2")]]

    out = asyncio.run(run())
    assert [o["reward_score"] for o in out] == [1.0, -0.5, -1.0]
    assert [o["reward_extra_info"]["acc"] for o in out] == [True, False, False]
    assert [o["reward_extra_info"]["format_ok"] for o in out] == [True, True, False]


# ------------------------------------------------------------------------------------- the pool itself
def test_pool_kills_overrunning_and_dead_workers():
    pool = GradingPool(max_workers=2)  # no preload: a bare python zygote
    try:
        t0 = time.perf_counter()
        out = pool.run(time.sleep, (30,), timeout_s=0.3)
        assert out.status == "timeout" and time.perf_counter() - t0 < 2.0
        assert pool.run(os._exit, (3,), timeout_s=5).status == "crashed"
        err = pool.run(int, ("x",), timeout_s=5)
        assert err.status == "error" and "ValueError" in err.error
        assert pool.run(divmod, (7, 2), timeout_s=5).value == (3, 1)
        outs = pool.map([(pow, (2, i)) for i in range(20)] + [(time.sleep, (30,))], timeout_s=0.5)
        assert [o.value for o in outs[:20]] == [2**i for i in range(20)] and outs[20].status == "timeout"
        assert pool.stats["timeout"] == 2 and pool.stats["crashed"] == 1 and pool._n_workers <= 2
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(abs, (1,))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_pool_processes_die_with_their_caller():
    """A caller killed with SIGKILL (no atexit) leaves no zygote and no busy worker behind."""
    import subprocess
    import sys

    code = ("import threading, time, os\n"
            "from mix_src.rewards.pool import GradingPool\n"
            "p = GradingPool(1)\n"
            "threading.Thread(target=p.run, args=(time.sleep, (300,), 300), daemon=True).start()\n"
            "t = time.time() + 30\n"  # the zygote and its worker start (slower on a loaded machine)
            "while not (p._zygote and p._live) and time.time() < t: time.sleep(0.05)\n"
            "print(p._zygote.pid, *p._live, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.time() + 5
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), f"still running: {[p for p in pids if _alive(p)]}"


def test_pool_reports_a_zygote_that_cannot_start():
    pool = GradingPool(max_workers=1, preload="no_such_module_for_mix_src:x", start_timeout_s=30)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            pool.run(abs, (1,))
    finally:
        pool.close()


def test_bench_smoke(capsys):
    from scripts.bench import rewards as bench

    bench.main(["--n", "30", "--pathological", "0", "--timeout", "10"])
    out = capsys.readouterr().out
    assert "throughput ratio batch/sequential:" in out and "worst single-item latency:" in out
    assert "identical results sequential vs batch: 30/30" in out


# ------------------------------------------------------------- real multiple-choice labels, bad rows
# ARC-Challenge as published (allenai/ai2_arc) labels most questions' options A-D and some 1-4 (the answer
# key is then "1".."4"); these rows keep both kinds, as a validation file made from it does.
ARC_MIXED = [
    ("letter", "B", "\\boxed{B}", True), ("letter", "B", "The answer is (B).", True),
    ("letter", "B", "\\boxed{C}", False), ("letter", "B", "\\boxed{2}", False),  # a number is not a letter's label
    ("digit", "4", "\\boxed{4}", True), ("digit", "4", "\\boxed{D}", True), ("digit", "4", "\\boxed{(4)}", True),
    ("digit", "4", "The answer is 4.", True), ("digit", "4", "Answer: D", True), ("digit", "4", "4", True),
    ("digit", "4", "\\boxed{3}", False), ("digit", "4", "\\boxed{C}", False), ("digit", "1", "\\boxed{A}", True),
    ("digit", "3", "The answer is 3.5", False), ("digit", "3", "no choice made", False),
]


@pytest.mark.parametrize("label_kind, gt, answer, expected", ARC_MIXED)
def test_multiple_choice_letter_and_digit_labels(label_kind, gt, answer, expected):
    result = score(T + answer, gt, "arc_c")
    assert result["acc"] is expected and result["ungradable"] is False, (label_kind, gt, answer, result)


def test_multiple_choice_set_mixing_labels_grades_in_batch():
    """A whole validation batch with letter and digit answer keys: graded, nothing raised, nothing ungradable."""
    rows = ARC_MIXED * 3
    out = compute_score_batch(["arc_c"] * len(rows), [T + r[2] for r in rows], [r[1] for r in rows],
                              [{"answer_type": "multiple_choice"}] * len(rows))
    assert [o["acc"] for o in out] == [r[3] for r in rows]
    assert not any(o["ungradable"] for o in out)


MC = {"answer_type": "multiple_choice"}


def test_bad_rows_score_wrong_are_counted_and_never_raise(caplog):
    from mix_src.rewards import ungradable_counts
    from mix_src.rewards import math_verify_reward as mvr

    bad = [  # (data_source, response, ground truth, extra_info, why)
        ("bad_mc", T + "\\boxed{C}", "42", MC, "an MC ground truth that is no option label"),
        ("bad_mc", T + "\\boxed{C}", "Paris", MC, "an MC ground truth that is a word"),
        ("bad_gt", T + "\\boxed{5}", "  ", None, "an empty ground truth"),
        ("bad_gt", T + "\\boxed{5}", None, None, "a missing ground truth"),
        ("bad_gt", T + "\\boxed{5}", float("nan"), None, "a NaN ground truth from parquet"),
        ("bad_gt", T + "\\boxed{5}", {"a": 1}, None, "a ground truth of the wrong type"),
        ("bad_gt", T + "\\boxed{nan}", "nan", None, "the text 'nan' (a lost answer that str() wrote)"),
        ("bad_gt", T + "\\boxed{inf}", " -Infinity ", None, "the text of an infinite float"),
        ("bad_gt", T + "\\boxed{inf}", float("inf"), None, "an infinite float"),
        ("bad_resp", None, "5", None, "a response that is not a string"),
        ("bad_kind", T + "\\boxed{C}", "C", {"answer_type": "letters"}, "an unknown answer_type"),
        ("bad_math", T + "\\boxed{x+1}", "\\\\", None, "a ground truth math-verify cannot parse"),
    ]
    before = ungradable_counts()
    assert compute_score("bad_mc", T + "\\boxed{C}", "C", MC)["ungradable"] is False
    with caplog.at_level("WARNING", logger=mvr.__name__):
        for ds, resp, gt, extra, why in bad:
            out = compute_score(ds, resp, gt, extra, **V1)
            assert out["score"] == -0.5 and out["acc"] is False and out["ungradable"] is True, why
        batch = compute_score_batch([b[0] for b in bad], [b[1] for b in bad], [b[2] for b in bad], [b[3] for b in bad])
    assert all(o["ungradable"] and o["score"] == 0.0 for o in batch)
    after = ungradable_counts()
    for ds in ("bad_mc", "bad_gt", "bad_resp", "bad_kind", "bad_math"):
        n = sum(1 for b in bad if b[0] == ds)
        assert after.get(ds, 0) - before.get(ds, 0) == 2 * n, ds
    # one line per (data_source, kind of reason), naming both; the repeats within a minute are not logged
    lines = [r.getMessage() for r in caplog.records if "ungradable row" in r.getMessage()]
    assert any("'bad_mc'" in m and "option label" in m for m in lines)
    assert any("'bad_resp'" in m and "solution_str must be a str" in m for m in lines)
    assert any("'bad_math'" in m and "cannot parse the ground truth" in m for m in lines)
    assert len(lines) == 5, lines  # bad_mc, bad_gt, bad_resp, bad_kind, bad_math: one kind of reason each


def test_ungradable_log_is_rate_limited(caplog, monkeypatch):
    from mix_src.rewards import math_verify_reward as mvr

    clock = [1000.0]
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    with caplog.at_level("WARNING", logger=mvr.__name__):
        for _ in range(50):
            score(T + "\\boxed{A}", "zz top", "rate_limited_mc", MC)
        clock[0] += mvr._LOG_EVERY_S + 1
        score(T + "\\boxed{A}", "zz top", "rate_limited_mc", MC)
    lines = [r.getMessage() for r in caplog.records if "'rate_limited_mc'" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "49 more such rows since the last message" in lines[1]


def test_naive_reward_manager_passes_ungradable_to_extra_info(tmp_path):
    """verl's reward loop copies every key of our result into reward_extra_info: `ungradable` reaches the
    batch (the trainer's reward/ungradable) and validation metrics, and a bad row does not raise there."""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    from conftest import load_make_tiny_assets

    tokenizer = load_make_tiny_assets().build_tokenizer(str(tmp_path / "tok"))

    def item(response: str, gt, ds: str) -> DataProto:
        ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        mask = torch.tensor([[0, 1, 1] + [1] * len(ids)])
        return DataProto.from_dict(
            tensors={"prompts": torch.tensor([[tokenizer.pad_token_id, 5, 6]]), "responses": torch.tensor([ids]),
                     "attention_mask": mask},
            non_tensors={"data_source": np.array([ds], dtype=object),
                         "reward_model": np.array([{"style": "rule", "ground_truth": gt}], dtype=object),
                         "extra_info": np.array([{"answer_type": "multiple_choice"}], dtype=object)})

    async def run():
        manager = NaiveRewardManager(OmegaConf.create({}), tokenizer, compute_score)
        return [await manager.run_single(item(r, g, d)) for r, g, d in
                [("<think>x</think> \\boxed{4}", "4", "arc_c"), ("<think>x</think> \\boxed{B}", "B", "arc_c"),
                 ("<think>x</think> \\boxed{B}", "E5", "arc_c")]]

    out = asyncio.run(run())
    assert [o["reward_score"] for o in out] == [1.0, 1.0, 0.0]
    assert [o["reward_extra_info"]["ungradable"] for o in out] == [False, False, True]
