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
    assert "legacy_batch" in reach and "v1_batch" in reach and "tiny_assets" not in reach


def test_a_batch_trains_plain_runs_first_then_groups_the_runs_with_ray_level_settings(monkeypatch, tmp_path):
    """Plugins, the rollout's name and ray_kwargs reach a run's Ray processes only through ray.init: tests/mix_modes_run.py
    restarts Ray when they change, so the batch trains the runs without them first and the others grouped by them
    (one restart per group); a name is one run only."""
    import pytest

    import e2e

    monkeypatch.setattr(e2e, "BATCHES", {})
    e2e.batch_run("b", "plugin", lambda assets, d: ["mix.plugins=[p.py]"], ["test_b.py::test_b"])
    plain = e2e.batch_run("b", "plain", lambda assets, d: ["mix.n_prefix=1"], ["test_a.py::test_a"])
    e2e.batch_run("b", "other", lambda assets, d: ["+ray_kwargs.x=1"], ["test_b.py::test_b"])
    e2e.batch_run("b", "plugin2", lambda assets, d: ["mix.n_prefix=2", "mix.plugins=[p.py]"], ["test_b.py::test_b"])
    assert e2e.batch_run("b", "plain", e2e.BATCHES["b"]["plain"][0], ["test_c.py::test_c"]) == plain
    assert e2e.BATCHES["b"]["plain"][1] == ("test_a.py::test_a", "test_c.py::test_c")  # one run, two readers
    with pytest.raises(ValueError, match="registered twice"):
        e2e.batch_run("b", "plain", lambda assets, d: [], ["test_d.py::test_d"])
    assert list(e2e.batch_overrides("b", {"test_c.py::test_c"}, {}, tmp_path)) == ["plain"]  # the selected tests' runs
    assert list(e2e.batch_overrides("b", {"test_b.py::test_b", "test_a.py::test_a"}, {}, tmp_path)) == [
        "plain", "other", "plugin", "plugin2"]  # fmt: skip


def test_a_test_reading_a_batch_gets_the_batchs_time_on_top_of_its_own(monkeypatch):
    """The batch trains in the setup of the first test that reads it, inside that test's pytest-timeout budget:
    such a test gets pytest.ini's 900 s plus the batch's runs' time. Under `make test`'s two pytest workers the
    batch's tests carry its group in their node id (what the scheduler of --dist loadgroup reads: one worker trains
    the batch, once), and the Ray tests come first."""
    import pytest
    from _pytest.nodeid import NodeId

    import e2e

    class Item:  # what pytest_collection_modifyitems reads of a collected test
        function = None

        def __init__(self, nodeid, fixturenames):
            self._id, self.fixturenames, self.markers = NodeId.parse(nodeid), fixturenames, []

        nodeid = property(lambda self: str(self._id))  # as _pytest/nodes.py Node.nodeid in pytest 9.2

        def add_marker(self, marker):
            self.markers.append(marker)

        def get_closest_marker(self, name):
            return next((m for m in self.markers if m.name == name), None)

    monkeypatch.setattr(e2e, "BATCHES", {"legacy": {"a": None, "b": None}})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    config = type("Config", (), {"getvalue": lambda self, name: name == "loadgroup"})()  # -n 2 --dist loadgroup
    plain, item = Item("tests/test_x.py::test_plain", ("tmp_path",)), Item("tests/test_x.py::test_b", ("legacy_batch",))
    items = [plain, item]
    conftest.pytest_collection_modifyitems(config, items)
    assert [(m.name, m.args, m.kwargs) for m in item.markers] == [("timeout", (900 + 2 * 480,), {}),
                                                                  ("xdist_group", ("legacy_batch",), {})]
    assert item.nodeid == "tests/test_x.py::test_b@legacy_batch" and plain.nodeid == "tests/test_x.py::test_plain"
    item.add_marker(pytest.mark.ray)
    conftest.pytest_collection_modifyitems(config, items)
    assert items == [item, plain] and item.nodeid.count("@") == 1  # Ray first; grouped once


def test_a_batch_refuses_a_run_of_the_other_base(monkeypatch, tmp_path):
    """The V1 batch trains only ``trainer.use_v1=true`` runs and the legacy batch none: each batch's fixture and
    timeout are sized for its base, and a test reading ``v1_batch`` checks a V1 run."""
    import pytest

    import e2e

    monkeypatch.setattr(e2e, "BATCHES", {})
    e2e.batch_run("v1", "v1_run", lambda assets, d: ["trainer.use_v1=false", "trainer.use_v1=true"], ["a.py::test_a"])
    e2e.batch_run("v1", "legacy_run", lambda assets, d: ["mix.n_prefix=1"], ["b.py::test_b"])
    e2e.batch_run("legacy", "v1_run", lambda assets, d: ["trainer.use_v1=true"], ["c.py::test_c"])
    assert list(e2e.batch_overrides("v1", {"a.py::test_a"}, {}, tmp_path)) == ["v1_run"]  # the last setting counts
    with pytest.raises(ValueError, match=r"batch 'v1', run 'legacy_run': .*trainer.use_v1=true"):
        e2e.batch_overrides("v1", {"b.py::test_b"}, {}, tmp_path)
    with pytest.raises(ValueError, match=r"batch 'legacy', run 'v1_run': .*trainer.use_v1=true"):
        e2e.batch_overrides("legacy", {"c.py::test_c"}, {}, tmp_path)


def test_make_test_leaves_out_the_opt_in_tier_and_test_extra_runs_it():
    """CI runs `make test` (.ci/run): the `extra` tier is out of it and `make test-extra` runs exactly that tier."""
    make = (TESTS.parent / "Makefile").read_text()
    assert '\ntest: install\n\t$(PY) -m pytest -m "not extra" $(XDIST) $(PYTEST_ARGS)\n' in make
    # two pytest workers by default; --dist loadgroup keeps each batch fixture's tests (conftest's xdist_group) on one
    assert "\nTEST_WORKERS ?= 2\n" in make and "-n $(TEST_WORKERS) --dist loadgroup" in make
    assert '\ntest-extra: install\n\t$(PY) -m pytest -m extra $(PYTEST_ARGS)\n' in make
    assert "extra:" in (TESTS.parent / "pytest.ini").read_text()  # registered, so --strict-markers would accept it


def test_a_batch_restarts_ray_only_when_the_next_runs_ray_environment_differs(monkeypatch):
    """tests/mix_modes_run.py: verl's run_ppo rehearsed up to its ray.init gives a run's Ray-level environment (the
    exports of mix_src/config/preflight.py export_plugins land in it); the cluster is shut down before a run only when
    that differs from the one it was started with, so a plugin run gets its own cluster and plain runs share one.
    No Ray is started (ray.init is never reached, ray.shutdown is recorded). 2.9 s at load 11-18 in a session that
    imported verl's trainer already (the fast tier's config-stage tests do), on the shared 2-core machine."""
    import copy
    import os

    import ray
    from omegaconf import open_dict
    from verl.trainer.main_ppo import run_ppo

    import mix_modes_run
    from composed import compose_mix

    composed = compose_mix(["+backend=cpu"])

    def exported(**env):  # a composed run after export_plugins: its environment and runtime env
        config = copy.deepcopy(composed)
        with open_dict(config):
            config.ray_kwargs.ray_init.setdefault("runtime_env", {})["env_vars"] = env
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return mix_modes_run.ray_environment(config, run_ppo)

    before = dict(os.environ)
    plain = exported(VERL_USE_EXTERNAL_MODULES="mix_src.plugins")
    assert dict(os.environ) == {**before, "VERL_USE_EXTERNAL_MODULES": "mix_src.plugins"}  # run_ppo's own exports undone
    assert plain["ray_init"]["runtime_env"]["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == "mix_src.plugins"
    assert exported(VERL_USE_EXTERNAL_MODULES="mix_src.plugins") == plain
    plugin = exported(VERL_USE_EXTERNAL_MODULES="mix_src.plugins", MIX_PLUGINS="/abs/p.py")
    assert plugin != plain and plugin["environ"]["MIX_PLUGINS"] == "/abs/p.py"

    shutdowns = []
    cluster = mix_modes_run.Cluster()
    monkeypatch.setattr(ray, "is_initialized", lambda: cluster.environment is not None)  # up after the first run
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    assert [cluster.prepare(env) for env in (plain, plain, plugin, plugin, plain)] == [False, False, True, False, True]
    assert len(shutdowns) == cluster.restarts == 2
