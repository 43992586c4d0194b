"""Every bad input of scripts/probe_bad_inputs.py that ends before Ray, run in-process (no Ray, no subprocess):
each one meant to be refused is refused before Ray with its key/file/value named; each one documented to train
passes the pre-Ray stage; data prep and the reward keep values exact. The cases that train are trained by the
probe's --ray run (mix_src/config/README.md's table)."""

import pytest

from scripts.probe_bad_inputs import CASES, Case, pre_ray


def test_the_probe_covers_the_issue():
    """Issue #41 asks for at least 40 inputs over data prep, trainer keys, data contents and the reward."""
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)
    assert {c.group for c in CASES} == {"trainer keys", "data contents", "data prep", "reward"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_ends_before_ray(case: Case, tiny_assets, tmp_path):
    outcome = pre_ray(case, tmp_path, tiny_assets)
    if case.call is not None:
        want = ("refused",) if case.ok is None else ("exact", "graded ungradable")
    else:
        want = ("passes pre-Ray",) if case.expect == "trains" else ("refused before Ray",)
    assert outcome["verdict"] in want, outcome
    if outcome["verdict"].startswith("refused"):
        assert outcome["line"], "a refusal says what is wrong"
