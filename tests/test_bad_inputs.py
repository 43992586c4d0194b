"""Every bad input of scripts/probe_bad_inputs.py that ends before Ray, run in-process (no Ray, no subprocess):
each one meant to be refused is refused before Ray with its key/file/value named; each one documented to train
passes the pre-Ray stage; data prep and the reward keep values exact. The cases that train are trained by the
probe's --ray run (mix_src/config/README.md's table) and, on both trainer bases, by tests/test_no_target_e2e.py.

The tiny setup is composed once per module (the probe's ``Composer``: Hydra's own override code on a copy), which
:func:`test_composer_gives_what_hydra_composes` checks against Hydra's compose of all the cases' overrides."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from scripts.probe_bad_inputs import CASES, Case, Composer, ComposerMisuse, compose_config, pre_ray, tiny_overrides


@pytest.fixture(scope="module")
def composer(tiny_assets) -> Composer:
    return Composer(tiny_overrides(tiny_assets))


def test_the_probe_covers_the_issue():
    """Issue #41 asks for at least 40 inputs over data prep, trainer keys, data contents and the reward."""
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)
    assert {c.group for c in CASES} == {"trainer keys", "data contents", "data prep", "reward"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_ends_before_ray(case: Case, tiny_assets, composer, tmp_path):
    outcome = pre_ray(case, tmp_path, tiny_assets, composer)
    if case.call is not None:
        want = ("refused",) if case.ok is None else ("exact", "graded ungradable")
    else:
        want = ("passes pre-Ray",) if case.expect == "trains" else ("refused before Ray",)
    assert outcome["verdict"] in want, outcome
    if outcome["verdict"].startswith("refused"):
        assert outcome["line"], "a refusal says what is wrong"


def test_composer_gives_what_hydra_composes(tiny_assets, composer, tmp_path):
    """All the cases' overrides in one command line (the last of each key): the composer's config is Hydra's."""
    fill = {"dir": str(tmp_path), "train": tiny_assets["train"], "val": tiny_assets["val"]}
    last = {}
    for case in CASES:
        for o in case.overrides:
            last[o.split("=", 1)[0].lstrip("+~")] = o.format(**fill)
    overrides = [*composer.base, *last.values()]
    assert len(last) > 25 and any(o.startswith("+") for o in last.values())
    assert OmegaConf.to_container(composer(overrides)) == OmegaConf.to_container(compose_config(overrides))
    with pytest.raises(ComposerMisuse, match="config group"):
        composer([*composer.base, "+backend=cpu"])
    with pytest.raises(ComposerMisuse, match="do not start with its base"):
        composer(["data.train_batch_size=8"])
