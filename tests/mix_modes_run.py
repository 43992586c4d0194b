"""Several MIX training runs in ONE process: ``python tests/mix_modes_run.py RUNS.json``.

RUNS.json: ``{"name": [hydra overrides...], ...}``. Each run is composed from ``mix_src/config/mix_ppo.yaml`` with
its overrides (``trainer.experiment_name`` is set to its name, so verl's file logger writes
``$VERL_FILE_LOGGER_ROOT/<trainer.project_name>/<name>.jsonl``) and trained by ``run_mix_ppo``: the first run's
``run_ppo`` starts Ray, the next ones find it initialised and reuse it (verl/trainer/main_ppo.py ``run_ppo``:
``if not ray.is_initialized()``). Each run's TaskRunner and its workers end with the run, but the placement
groups its resource pools made live as long as the driver (Ray scopes a non-detached placement group to its job):
:func:`release_cluster` removes them and waits until the cluster's resources are free again. A failing run is
reported and the next one still runs; the exit status is the number of failed runs. Used by
tests/e2e.py ``run_batch`` (the legacy and V1 batches), tests/test_onpolicy_losses_e2e.py (every mode, opt-in) and
by hand (recipes/guided_gspo/README.md).

The Ray-level environment of a run (what reaches its Ray processes only through ``ray.init``: ``mix.plugins`` as
``MIX_PLUGINS``, the rollout's name as ``MIX_CPU_ROLLOUT``, both from mix_src/config/preflight.py
``export_plugins``; ``ray_kwargs``; the driver's environment, which a local cluster inherits) is
:func:`ray_environment`. Before each run the driver's environment is reset to the one this process started with (a
run's exports do not leak into the next), and :class:`Cluster` shuts Ray down when the run's Ray-level environment
differs from the one the cluster was started with, so that run's own ``ray.init`` starts a cluster with its
environment: runs with plugins share this process (its imports, the config stage's warm-up) but not the cluster.
What a later run still shares with an earlier one is this driver process: the plugins the earlier runs imported
here stay imported (mix_src.extend ``load_plugins`` imports a spec once per process; its registry entries stay
registered, under their own names).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from typing import Callable, Optional


def release_cluster(timeout: float = 120.0) -> None:
    """Remove the placement groups a finished run left and wait until every resource of the cluster is free."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    if not ray.is_initialized():
        return
    for pg_id, info in placement_group_table().items():
        if info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the node's CPU / GPU (a removed group's "*_group_*" keys go away with it)
        total, free = ray.cluster_resources(), ray.available_resources()
        if all(free.get(k, 0.0) >= total[k] - 1e-6 for k in ("CPU", "GPU") if k in total):
            return
        time.sleep(1.0)
    raise RuntimeError(f"Ray resources still held {timeout:.0f}s after the run: free {ray.available_resources()} "
                       f"of {total}")


class _Rehearsed(Exception):
    """Raised in place of ``ray.init`` by :func:`ray_environment`: verl's run_ppo got as far as starting Ray."""


def ray_environment(config, run_ppo: Callable) -> dict:
    """What ``run_ppo(config, ...)`` would start Ray with: the kwargs of its ``ray.init`` (verl/trainer/main_ppo.py
    ``run_ppo``: verl's default runtime env merged with ``ray_kwargs.ray_init``, after the environment variables it
    sets from the config) and the driver's environment at that moment (a local cluster's processes inherit it).
    Found by running verl's own ``run_ppo`` on a copy of the config up to its ``ray.init``, with Ray reported as not
    initialised; the driver's environment is restored afterwards. Returns {"ray_init": kwargs, "environ": dict}."""
    import ray

    seen: dict = {}

    def record(**kwargs):
        seen.update(ray_init=kwargs, environ=dict(os.environ))
        raise _Rehearsed

    saved_env, saved = dict(os.environ), (ray.is_initialized, ray.init)
    ray.is_initialized, ray.init = (lambda: False), record
    try:
        run_ppo(copy.deepcopy(config), None)
    except _Rehearsed:
        pass
    finally:
        ray.is_initialized, ray.init = saved
        os.environ.clear()
        os.environ.update(saved_env)
    if not seen:
        raise RuntimeError("verl's run_ppo returned without calling ray.init; tests/mix_modes_run.py cannot tell "
                           "which Ray environment the run needs")  # fmt: skip
    return seen


class Cluster:
    """The batch's Ray cluster: kept while runs need the same Ray-level environment, shut down before a run that
    needs another (that run's own ``ray.init`` then starts it again with its environment)."""

    def __init__(self) -> None:
        self.environment: Optional[dict] = None  # the Ray-level environment of the cluster that is up
        self.restarts = 0

    def prepare(self, wanted: dict) -> bool:
        """Before a run whose Ray-level environment is ``wanted``: shut Ray down when it is up with another one.
        Returns whether it did."""
        import ray

        restart = ray.is_initialized() and wanted != self.environment
        if restart:
            ray.shutdown()
            self.restarts += 1
        self.environment = wanted
        return restart


def _run_ppo_in(cluster: Cluster, run_ppo: Callable) -> Callable:
    """verl's ``run_ppo`` with the cluster prepared for the run's Ray-level environment first."""

    def run_ppo_in_cluster(config, task_runner_class):
        if cluster.prepare(ray_environment(config, run_ppo)):
            print(f"MIX_MODES_RUN Ray restarted for {config.trainer.experiment_name}: its Ray-level environment "
                  "differs from the previous run's", flush=True)  # fmt: skip
        return run_ppo(config, task_runner_class)

    return run_ppo_in_cluster


def main(path: str) -> int:
    from hydra import compose, initialize_config_module
    from verl.trainer import main_ppo

    from mix_src.main_mix_ppo import run_mix_ppo

    runs = json.loads(open(path).read())
    try:  # vLLM sets environment variables when first imported (vllm/env_override.py), inside the batch's first run
        import vllm.env_override  # noqa: F401  # that does; imported here they are every run's, not the first's alone,
    except ImportError:  # so the reset below does not make the second run's Ray-level environment differ (a restart)
        pass
    pristine = dict(os.environ)
    cluster = Cluster()
    main_ppo.run_ppo = _run_ppo_in(cluster, main_ppo.run_ppo)  # run_mix_ppo imports it from there at each call
    failed = 0
    for name, overrides in runs.items():
        start = time.monotonic()
        os.environ.clear()  # the previous run's exports (MIX_PLUGINS, ...) are not this run's
        os.environ.update(pristine)
        try:
            with initialize_config_module(config_module="mix_src.config", version_base=None):
                config = compose(config_name="mix_ppo", overrides=[*overrides, f"trainer.experiment_name={name}"])
            run_mix_ppo(config)
            print(f"MIX_MODES_RUN {name} ok {time.monotonic() - start:.1f}s", flush=True)
        except Exception:  # report and go on: one mode's failure must not hide the others'
            failed += 1
            traceback.print_exc()
            print(f"MIX_MODES_RUN {name} FAILED {time.monotonic() - start:.1f}s", flush=True)
        release_cluster()
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
