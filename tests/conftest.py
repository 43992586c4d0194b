"""Shared pytest fixtures.

``tiny_assets``: built once per test session by ``scripts/make_tiny_assets.py`` (offline, seed 0) and
returned as ``{"tokenizer", "model", "train", "val"}`` -> absolute paths. End-to-end helpers that run
real verl/Ray jobs live in ``tests/e2e.py``.
"""

from __future__ import annotations

import os

import pytest

from kernels import pin_environment

# Before any test module imports torch: the record's CPU kernel settings, where the environment does not set its own
# (tests/kernels.py; the guards compare bit for bit only where the kernels match their record's).
pin_environment()

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_make_tiny_assets():
    """``scripts/make_tiny_assets.py`` (the repository root is on pytest's path, see pytest.ini)."""
    from scripts import make_tiny_assets

    return make_tiny_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict:
    """Tiny tokenizer / random Qwen2 / arithmetic parquets, built once per session (seed 0)."""
    out = tmp_path_factory.mktemp("tiny_assets")
    return load_make_tiny_assets().build(str(out), seed=0)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's intra-op threads (scripts/experiments' toy trainers set 1) leaves the next test in its
    process the count it found: bit-exact records (test_loss_guard) depend on it, and with `make test`'s two pytest
    workers which test follows which changes from run to run."""
    import sys

    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    yield
    if torch is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _train_batch(fixture: str, request, tiny_assets, tmp_path_factory) -> dict:
    """Train the runs of ``BATCH_FIXTURES[fixture]``'s batch that the selected tests read (tests/e2e.py
    ``run_batch``). Returns {run name: RunResult}."""
    from e2e import run_batch

    selected = {f"{item.path.name}::{item.function.__name__}" for item in request.session.items
                if getattr(item, "function", None)}  # fmt: skip
    batch, per_run = BATCH_FIXTURES[fixture]
    return run_batch(batch, selected, tiny_assets, tmp_path_factory.mktemp(fixture), timeout_per_run=per_run)


@pytest.fixture(scope="session")
def legacy_batch(request, tiny_assets, tmp_path_factory) -> dict:
    """The legacy-base runs registered with ``e2e.batch_run("legacy", ...)`` that the selected tests read, trained
    once in one process and one Ray cluster per Ray-level environment (tests/e2e.py ``run_batch``, tests/mix_modes_run.py
    ``Cluster``: runs with plugins get a cluster of their own). Returns {run name: RunResult}."""
    return _train_batch("legacy_batch", request, tiny_assets, tmp_path_factory)


@pytest.fixture(scope="session")
def v1_batch(request, tiny_assets, tmp_path_factory) -> dict:
    """The same for the V1 runs (``trainer.use_v1=true``) registered with ``e2e.batch_run("v1", ...)``. Each V1 run
    makes its own TransferQueue controller and kills it at its end (mix_src/trainer/v1.py ``MixTaskRunnerV1.run``:
    ``tq.init`` ... ``finally: tq.close()``), so no run finds the previous run's queue."""
    return _train_batch("v1_batch", request, tiny_assets, tmp_path_factory)


# ---- test tiers -----------------------------------------------------------------------------------------------
# `make test` (CI) runs every test but the opt-in tier `extra` (marked by hand, each with its reason; `make test-extra`);
# `make test-fast` runs `-m "not ray and not slow"` (SLOW below). A test is marked
# `ray` automatically when it can start a Ray cluster: its body, a fixture it requests (of its module or of this
# file) or a function of its module that it calls (transitively) names one of RAY_ENTRY_POINTS (tests/e2e.py's job
# runners, ray.init). Nothing to remember when adding an e2e test.
RAY_ENTRY_POINTS = frozenset({"run_verl", "run_command", "run_batch", "ray.init"})


def _names_in(node) -> set[str]:
    """The names a function uses: bare names, attribute names, and ``ray.<attr>`` spelled out."""
    import ast

    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
            if isinstance(n.value, ast.Name) and n.value.id == "ray":
                names.add(f"ray.{n.attr}")
    return names


def _ray_functions(path: str) -> frozenset:
    """The module-level functions of the test file ``path`` that can reach a Ray entry point."""
    import ast

    if path not in _RAY_FUNCTIONS:
        tree = ast.parse(open(path).read())
        funcs = {n.name: _names_in(n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        ray, grew = set(RAY_ENTRY_POINTS), True
        while grew:
            new = {name for name, used in funcs.items() if name not in ray and used & ray}
            ray |= new
            grew = bool(new)
        _RAY_FUNCTIONS[path] = frozenset(ray)
    return _RAY_FUNCTIONS[path]


_RAY_FUNCTIONS: dict[str, frozenset] = {}


# `slow`: tests that start no Ray cluster but spawn fresh Python interpreters (each imports torch and verl) or build
# and measure models; `make test` runs them, `make test-fast` leaves them out (`-m "not ray and not slow"`). Each
# entry is "file::test function" (every parametrisation) with its seconds in a `-m "not ray"` run on the shared
# 2-core machine under load (25 min for the 1,058 tests of that tier), the reason it is slow; the two
# test_multirank entries are from `make test-fast` at 6811d4b (load 6.5-8). tests/test_tiers.py checks that every
# entry still names a test.
SLOW = {
    "test_toy_addition.py::test_shipped_demo_base_is_checked_installed_and_measured": "62 s: trains, measures a base",
    "test_luffy_keys.py::test_train_sh_runs_through_the_config_stage": "53 s: runs train.sh's config stage",
    "test_vllm_cpu.py::test_cpu_linear_layers_keep_reloadable_weights": "51 s: a fresh interpreter imports vLLM",
    "test_packaging.py::test_verl_modules_on_our_path_import_in_a_fresh_interpreter": "44 s: fresh interpreters",
    "test_cpu_checkpoint_engine.py::test_cpu_gloo_registers_whichever_module_a_process_imports_first": "2 x 36 s: "
    "fresh interpreters",
    "test_determinism.py::test_rows_do_not_depend_on_their_batch": "38 s + 21 s: generation in fresh processes",
    "test_packaging.py::test_cpu_path_never_imports_gpu_only_packages": "34 s: a fresh interpreter",
    "test_toy_addition.py::test_check_base_continues_until_the_bound_holds": "33 s: trains a base",
    "test_vllm_cpu.py::test_vllm_distribution_alias_lets_verl_import_and_keeps_vllm_on_cpu": "31 s: imports vLLM",
    "test_verl_key_parity.py::test_agent_loop_worker_registers_prefix_guided_through_the_dataset_class": "30 s",
    "test_cpu_backend.py::test_process_group_init_uses_plain_gloo": "23 s + 20 s: process groups in subprocesses",
    "test_cpu_workers.py::test_critic_is_verls_token_classification_model_with_a_cpu_attention": "23 s: verl's engine",
    "test_cpu_workers.py::test_reference_engine_offload_policy_shards_on_cpu": "20 s: verl's engine",
    "test_plugins.py::test_worker_process_loads_plugins_at_import_verl": "19 s: a fresh interpreter",
    "test_recipes.py::test_gpu_recipe_one_gpu_variant": "8 x 9-17 s: each composes and checks a GPU recipe",
    "test_cpu_activation.py::test_plugin_in_a_fresh_process_follows_the_rule": "16 s: a fresh interpreter",
    "test_rewards.py::test_bench_smoke": "16 s: the reward benchmark",
    "test_onpolicy_losses.py::test_preflight_accepts_a_verl_loss_and_refuses_its_knob_conflicts_before_ray": "14 s",
    "test_mix_trainer_v1.py::test_v1_accepts_the_loss_extensions_whose_inputs_it_writes": "14 s",
    "test_verl_key_parity.py::test_lora_layered_summon_needs_a_preloaded_base": "13 s",
    "test_patches.py::test_a_worker_process_with_a_patch_for_another_verl_stops_at_import_verl": "12 s: a fresh "
    "interpreter",
    "test_plugins.py::test_config_stage_loads_a_plugin_by_relative_path_and_exports_it": "11 s: a fresh interpreter",
    "test_multirank.py::test_simulation_equals_gloo_averaging": "24 s: gloo ranks in subprocesses",
    "test_multirank.py::test_luffy_paper_defaults_are_the_official_8_gpu_weights": "12 s",
    # #38 item 6, for test-fast <= 3 min: the slowest of `make test-fast` at dfc224e + others' edits in progress
    # (load 5-18: an evidence run, a Ray test; 585 s wall, 253 s CPU), each a config composed and checked in full,
    # a model built or a subprocess; the pure maths and loss guards (test_loss_guard, test_luffy_parity,
    # test_multirank's official comparisons) stay in the fast tier.
    "test_recipes.py::test_recipe_composes_and_validates": "15 x 3.2-5.6 s: composes and checks each recipe",
    "test_mix_trainer_v1.py::test_recipes_v1_variant": "20 x 2.5-3.1 s: each recipe composed for V1 and checked",
    "test_toy_addition.py::test_rl_configs_compose_and_validate": "2 x 4 s: composes and checks",
    "test_toy_addition.py::test_sft_config_composes": "5.3 s",
    "test_toy_addition.py::test_base_property_on_a_built_base": "4.8 s: builds a base",
    "test_recipes.py::test_plot_metrics_reads_and_plots": "9.0 s: matplotlib",
    "test_recipes.py::test_sft_then_rl_runs_both_stages": "4.9 s",
    "test_resources.py::test_a_disk_too_small_is_refused_naming_the_key": "8.6 s: composes and checks",
    "test_resources.py::test_unknown_model_size_still_probes_the_directory": "5.2 s",
    "test_max_model_len.py::test_prompt_plus_response_beyond_the_context_is_refused_before_ray": "7.6 s",
    "test_evaluate.py::test_evaluate_tiny_model_on_cpu": "6.1 s: generates with the tiny model",
    "test_install_torch.py::test_never_a_cuda_build_and_an_unreachable_index_fails_fast": "5.7 s: pip",
    "test_install_torch.py::test_wheel_at_hand_is_used_without_asking_the_index": "4.7 s: pip",
    "test_install_torch.py::test_no_wheel_at_hand_takes_the_cpu_build_from_the_index": "4.1 s: pip",
    "test_planner.py::test_chunked_entropy_before_after": "5.3 s",
    "test_flops.py::test_budget_refused_with_a_critic_and_bad_values": "4.6 s",
    "test_verl_key_parity.py::test_sglang_refusal_explains_the_conflict": "4.5 s",
    # the next, from a second `make test-fast` after the entries above (load 9; 637 s wall, 220 s CPU)
    "test_compare.py::test_luffy_compare_yaml_is_the_toy_luffy_recipe": "15.2 s: composes the harness's configs",
    "test_chord.py::test_compare_yaml_composes_on_the_toy_task": "9.0 s: composes the harness's configs",
    "test_max_model_len.py::test_driver_resolves_a_null_max_model_len_to_the_model_context": "12.6 s",
    "test_mix_trainer_v1.py::test_v1_accepts_before_ray": "up to 7.3 s a case: each a V1 config through the config stage",
    # #51-#56 (this round)
    "test_gpu_visit.py::test_random_tiny_loads_offline_and_every_id_decodes": "7-18 s: builds the tiny random model "
    "and its 151,936-id tokenizer, decodes every id",
    "test_self_sample.py::test_tiny_assets_on_cpu_write_target_lst_flops_and_pass_rates": "6-10.6 s: samples with "
    "the tiny model",
    "test_self_sample.py::test_a_custom_reward_grades_and_drop_target_leaves_only_the_verified_samples": "2-5 s: samples "
    "with the tiny model",
    "test_compare_guidance.py::test_the_sampling_is_charged_to_the_run_and_made_once": "7.4 s: the data command in a "
    "subprocess with the tiny model",
    # #53 (at load 9-12 on the 2-core machine)
    "test_wheelhouse.py::test_fetch_takes_torch_at_hand_or_from_the_cpu_index": "7.4 s: four pip runs",
    "test_wheelhouse.py::test_pieces_install_with_no_index_over_a_hosts_packages": "4.0 s: pack, a venv, pip",
    "test_wheelhouse.py::test_install_names_what_is_missing": "3.0 s: a venv, pip",
}  # fmt: skip


BATCH_FIXTURES = {"legacy_batch": ("legacy", 480), "v1_batch": ("v1", 480)}  # fixture -> (e2e batch, timeout per run, s)


def _xdist_group(item, name: str) -> None:
    """What pytest-xdist 3.8 does for ``--dist loadgroup`` in its worker (xdist/remote.py,
    ``pytest_collection_modifyitems``: the group as a ``@name`` suffix of the node id, which the controller's scheduler
    reads). xdist sets ``item._nodeid``, which pytest 9.2 no longer reads (``Node.nodeid`` is ``str(item._id)``,
    _pytest/nodes.py), so without this every group was spread over both workers and each trained the batch again."""
    from _pytest.nodeid import NodeId

    if "@" not in item.nodeid:
        item._id = NodeId.parse(f"{item.nodeid}@{name}")


def pytest_collection_modifyitems(config, items):
    from e2e import BATCHES

    worker = bool(os.environ.get("PYTEST_XDIST_WORKER"))  # `make test`'s pytest workers (pytest-xdist)
    grouped = worker and config.getvalue("loadgroup")
    for item in items:
        fn = getattr(item, "function", None)
        for fixture, (batch, per_run) in BATCH_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):  # the batch may train in its setup: pytest.ini's 900 s
                item.add_marker(pytest.mark.timeout(900 + per_run * len(BATCHES.get(batch, {}))))  # + the batch's
                item.add_marker(pytest.mark.xdist_group(fixture))  # one pytest worker trains it (--dist loadgroup)
                if grouped:
                    _xdist_group(item, fixture)
        if fn is not None and f"{item.path.name}::{fn.__name__}" in SLOW:
            item.add_marker(pytest.mark.slow)
        if fn is None or item.get_closest_marker("ray"):
            continue
        reach = _ray_functions(str(item.path)) | _ray_functions(__file__)  # this file's fixtures too
        if {fn.__name__, *getattr(item, "fixturenames", ())} & reach:
            item.add_marker(pytest.mark.ray)
    if worker:  # the Ray tests, a minute or more each, first: the workers' scheduler hands them out first
        items.sort(key=lambda item: not item.get_closest_marker("ray"))
