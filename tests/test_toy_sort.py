"""The digit-sorting task as its RL runs see it (issue #40: why RL lowered accuracy on sort). The reward, the
length caps and the sampling settings were checked and are kept here as tests; the cause was the learning
rate, now a per-task setting (recipes/toy_addition/task/sort.yaml). No Ray; 42-50 s on the shared 2-core
machine under load, most of it the first Hydra compose (verl's imports)."""

import os
import random

import pytest

import composed
from scripts.experiments.toy_tasks import sort as task
from scripts.experiments import compare as cmp
from scripts.experiments import toy_addition as ta
from scripts.experiments import toy_sort as ts


def _compose(task_name: str):
    return composed.compose("on_policy_grpo", cmp.TASKS[task_name].overrides,
                            config_dir=os.path.join(cmp.REPO_ROOT, "recipes", "toy_addition"))


@pytest.fixture(scope="module")
def sort_cfg():
    """What run.sh composes for every sort RL run of the harness (before the method's own overrides)."""
    return _compose("sort")


def _strings():
    sp = task.splits(seed=0)
    return sp["train"][:500] + sp["heldout"] + sp["ood"] + task.sample(200, random.Random(1), "distinct")


def _score(text: str, s: str) -> float:
    return task.compute_score(task.DATA_SOURCE, text, "".join(sorted(s)))["score"]


def test_reward_scores_every_correct_sort_1_and_wrong_answers_0():
    """Every expert trace scores 1 (also as the decoded response can come: leading space, trailing newline);
    an answer one digit short (the base's failure), one digit too long, unsorted or spaced scores 0."""
    for s in _strings():
        trace, ans = task.expert_trace(s), "".join(sorted(s))
        res = task.compute_score(task.DATA_SOURCE, trace, ans)
        assert (res["score"], res["acc"], res["format_ok"]) == (1.0, 1.0, 1.0), (s, trace)
        assert _score(" " + trace, s) == _score(trace + "\n", s) == 1.0
        head = trace.partition(">")[0]
        for wrong in (ans[:-1], ans + ans[-1], ans[::-1] if ans != ans[::-1] else ans[:-1], ans[:2] + " " + ans[2:]):
            assert _score(f"{head}>{wrong}", s) == 0.0, (s, wrong)
    # the base's answer on a repeated digit: every present digit once
    assert _score("12 31 41 51>1345", "31415") == 0.0


def test_traces_fit_the_response_and_target_caps(sort_cfg, tmp_path):
    """Correct answers are never cut: trace + EOS fits data.max_response_length of the sort runs, the target
    (the trace) fits mix.data.max_target_length's default, and the HF evaluator's max_new_tokens."""
    from mix_src.config.mix_config import DataConfig

    width = int(sort_cfg.data.max_response_length)
    assert width == cmp.TASKS["sort"].max_response_length
    ta.build_tokenizer(str(tmp_path / "tok"))
    tok = ta.load_tokenizer(str(tmp_path / "tok"))
    longest = max(len(tok.encode(task.expert_trace(s), add_special_tokens=False)) for s in _strings())
    assert longest == 20  # an all-distinct trace (the base's); 'pair' 17, 'triple' 14
    assert longest + 1 <= width and longest + 1 <= ts.MAX_NEW_TOKENS
    assert DataConfig().target_limit(width) >= longest


def test_sort_runs_sample_at_temperature_1_and_validate_greedily(sort_cfg):
    rollout = sort_cfg.actor_rollout_ref.rollout
    assert (rollout.temperature, rollout.top_p, rollout.top_k, rollout.do_sample) == (1.0, 1, -1, True)
    assert (rollout.val_kwargs.do_sample, rollout.val_kwargs.n) == (False, 1)  # = the HF evaluator's greedy pass@1


def test_sort_rl_runs_use_the_sort_learning_rate(sort_cfg):
    """The cause of #40: addition's lr 5e-4 wrecked the sort policies in the first RL step; sort's RL runs
    (every method, and the RL phase of SFT->RL) get 1e-4 from recipes/toy_addition/task/sort.yaml."""
    assert float(sort_cfg.actor_rollout_ref.actor.optim.lr) == pytest.approx(1e-4)
    assert float(_compose("addition").actor_rollout_ref.actor.optim.lr) == pytest.approx(5e-4)
    assert sort_cfg.reward.custom_reward_function.path == "pkg://scripts.experiments.toy_tasks.sort"


def test_a_sort_run_made_at_the_old_learning_rate_is_not_reused():
    """`make evidence` reuses finished runs: one recorded before the sort setting (no overrides in its
    done.json, or the old ones) is run again; one with this grid's overrides is reused."""
    from types import SimpleNamespace

    grid = SimpleNamespace(budget=4e11, count="full", evals=4)
    grpo = cmp.load_method("grpo")
    now = cmp.run_overrides(cmp.TASKS["sort"], grpo)
    assert now == ["+task=sort"]
    old = {"budget": 4e11, "count": "full", "evals_asked": 4}
    assert not cmp.reusable(old, grid, now)
    assert not cmp.reusable({**old, "overrides": ["reward.custom_reward_function.path=pkg://scripts.experiments.toy_tasks.sort",
                                                  "data.max_response_length=24"]}, grid, now)
    assert cmp.reusable({**old, "overrides": now}, grid, now)
    assert cmp.run_overrides(cmp.TASKS["sort"], cmp.load_method("sft_rl")) == now  # its RL phase is grpo's
    assert cmp.run_overrides(cmp.TASKS["sort"], cmp.load_method("sft")) == []
