"""The test tiers (tests/conftest.py): what `make test-fast` leaves out is named correctly. Under 1 s, no Ray."""

from __future__ import annotations

import ast
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def test_every_slow_entry_names_a_test_function():
    """A renamed or deleted test would leave its SLOW entry matching nothing, and the test back in the fast tier."""
    for entry, why in conftest.SLOW.items():
        file, name = entry.split("::")
        tree = ast.parse((TESTS / file).read_text())
        tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
        assert name in tests, f"tests/conftest.py SLOW[{entry!r}]: no test {name} in tests/{file}"
        assert why, entry


def test_a_shared_ray_fixture_of_conftest_marks_its_tests_ray():
    """A test that only requests conftest's shared e2e job (its body starts nothing) is still in the `ray` tier."""
    reach = conftest._ray_functions(conftest.__file__)
    assert "legacy_batch" in reach and "tiny_assets" not in reach


def test_a_batch_refuses_what_must_reach_a_runs_own_ray_processes(monkeypatch, tmp_path):
    """Later runs of a batch share the first run's Ray job: plugins, the rollout's name and ray_kwargs would not
    reach their workers, so such a run is refused (before anything starts), and a name is one run only."""
    import pytest

    import e2e

    monkeypatch.setattr(e2e, "BATCHES", {})
    plain = e2e.batch_run("b", "plain", lambda assets, d: ["mix.n_prefix=1"], ["test_a.py::test_a"])
    e2e.batch_run("b", "plugin", lambda assets, d: ["mix.plugins=[p.py]"], ["test_b.py::test_b"])
    assert e2e.batch_run("b", "plain", e2e.BATCHES["b"]["plain"][0], ["test_c.py::test_c"]) == plain
    assert e2e.BATCHES["b"]["plain"][1] == ("test_a.py::test_a", "test_c.py::test_c")  # one run, two readers
    with pytest.raises(ValueError, match="registered twice"):
        e2e.batch_run("b", "plain", lambda assets, d: [], ["test_d.py::test_d"])
    assert list(e2e.batch_overrides("b", {"test_c.py::test_c"}, {}, tmp_path)) == ["plain"]  # the selected tests' runs
    with pytest.raises(ValueError, match=r"run 'plugin': \['mix.plugins=\[p.py\]'\] must reach"):
        e2e.batch_overrides("b", {"test_b.py::test_b"}, {}, tmp_path)


def test_a_test_reading_a_batch_gets_the_batchs_time_on_top_of_its_own(monkeypatch):
    """The batch trains in the setup of the first test that reads it, inside that test's pytest-timeout budget:
    such a test gets pytest.ini's 900 s plus the batch's runs' time."""
    import e2e

    class Item:  # what pytest_collection_modifyitems reads of a collected test
        function, fixturenames = None, ("tmp_path", "legacy_batch")

        def __init__(self):
            self.markers = []

        def add_marker(self, marker):
            self.markers.append(marker)

    monkeypatch.setattr(e2e, "BATCHES", {"legacy": {"a": None, "b": None}})
    item = Item()
    conftest.pytest_collection_modifyitems(None, [item])
    assert [(m.name, m.args) for m in item.markers] == [("timeout", (900 + 2 * 480,))]
