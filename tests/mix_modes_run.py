"""Several MIX training runs in ONE process and ONE Ray cluster: ``python tests/mix_modes_run.py RUNS.json``.

RUNS.json: ``{"name": [hydra overrides...], ...}``. Each run is composed from ``mix_src/config/mix_ppo.yaml`` with
its overrides (``trainer.experiment_name`` is set to its name, so verl's file logger writes
``$VERL_FILE_LOGGER_ROOT/<trainer.project_name>/<name>.jsonl``) and trained by ``run_mix_ppo``: the first run's
``run_ppo`` starts Ray, the next ones find it initialised and reuse it (verl/trainer/main_ppo.py ``run_ppo``:
``if not ray.is_initialized()``). Each run's TaskRunner and its workers end with the run, but the placement
groups its resource pools made live as long as the driver (Ray scopes a non-detached placement group to its job):
:func:`release_cluster` removes them and waits until the cluster's resources are free again. A failing run is
reported and the next one still runs; the exit status is the number of failed runs. Used by
tests/test_onpolicy_losses_e2e.py (CI modes) and by hand for every mode (recipes/guided_gspo/README.md).
"""

from __future__ import annotations

import json
import sys
import time
import traceback


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


def main(path: str) -> int:
    from hydra import compose, initialize_config_module

    from mix_src.main_mix_ppo import run_mix_ppo

    runs = json.loads(open(path).read())
    failed = 0
    for name, overrides in runs.items():
        start = time.monotonic()
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
