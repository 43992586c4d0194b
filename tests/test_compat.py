"""Every run-time patch of another library is declared with the versions it was read against and checked
(mix_src/compat.py; issue #38: "every patch has a checked version range")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mix_src import compat

REPO = Path(__file__).resolve().parents[1]


def test_every_declared_patch_names_a_site_that_checks_it():
    for patch in compat.PATCHES.values():
        assert patch.written_for, patch.name
        path, function = patch.site.split(" ", 1)
        source = (REPO / path).read_text()
        assert function.split(".")[-1] in source, (patch.name, patch.site)
        assert re.search(rf"(checked|patch=)\(?\"{re.escape(patch.name)}\"", source), (
            f"{patch.site} applies {patch.name} without compat.checked/swapped")


def test_every_patch_site_in_the_main_path_is_declared():
    """The assignments into verl's modules/objects in the main path are all behind a declared patch: every
    ``swapped(...)``/``checked(...)`` names a declared patch, and no bare ``trainer_base.x = ...`` is left."""
    for path in ("mix_src/trainer/v1.py", "mix_src/rollout/agent_loop_worker.py", "mix_src/trainer/adv_estimators.py"):
        source = (REPO / path).read_text()
        for name in re.findall(r"(?:checked\(|patch=)\"([\w.]+)\"", source):
            assert name in compat.PATCHES, (path, name)
        assert not re.search(r"^\s*(trainer_base|trainer_separate_async)\.\w+ = ", source, re.M), path


def test_a_different_verl_is_refused_before_ray_naming_the_patches(monkeypatch):
    from mix_src.config import preflight
    from mix_src.config.mix_config import MixConfigError

    monkeypatch.setattr(compat, "installed_version", lambda dist: "0.10.0" if dist == "verl" else None)
    monkeypatch.setattr(compat, "_CHECKED", set())
    with pytest.raises(MixConfigError, match=r"mix_src patch v1\.create_rl_dataset was written for verl 0\.9\.1, "
                                             r"but verl 0\.10\.0 is installed"):
        preflight.run(None)  # the version check comes first: the config is not read


def test_swapped_restores_the_original_on_error():
    class Owner:
        attr = "verl's"

    with pytest.raises(ZeroDivisionError):
        with compat.swapped(Owner, "attr", "ours", patch="v1.reduce_metrics") as original:
            assert original == "verl's" and Owner.attr == "ours"
            1 / 0
    assert Owner.attr == "verl's"


def test_installed_versions_match():
    assert {p.name for p in compat.check_all()} == set(compat.PATCHES)
