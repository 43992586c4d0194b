"""A Ray worker's failure is named in the driver's last line (mix_src/failure.py), not lost in Ray's log."""

import subprocess
import sys
import textwrap

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from mix_src.failure import failure_line


def _raised_in(function_name: str, cause: BaseException, pid: int) -> BaseException:
    """What ray.get raises for ``cause`` raised in ``function_name`` (the cause's type, as Ray builds it)."""
    return RayTaskError(function_name, "Traceback ...", cause, proctitle=f"ray::{function_name}", pid=pid,
                        ip="127.0.0.1").as_instanceof_cause()


def test_the_innermost_worker_and_exception_are_named():
    worker = _raised_in("WorkerDict.actor_rollout_update_actor", ZeroDivisionError("division by zero\nmore"), 42)
    runner = _raised_in("MixTaskRunner.run", worker, 7)  # the TaskRunner re-raises the worker's error
    assert failure_line(runner) == ("[mix_src] FAILED in WorkerDict.actor_rollout_update_actor (pid 42): "
                                    "ZeroDivisionError: division by zero")
    assert failure_line(ValueError("x")) == "[mix_src] FAILED in the driver: ValueError: x"


def test_a_dead_actor_is_named():
    line = failure_line(ActorDiedError())
    assert line.startswith("[mix_src] FAILED in a Ray actor: ActorDiedError: The actor died unexpectedly")


SCRIPT = textwrap.dedent('''
    import ray
    from mix_src.failure import report_failure

    @ray.remote(num_cpus=0)
    class Worker:
        def step(self, n):
            return 1 / n

    @ray.remote(num_cpus=0)
    class Runner:
        def run(self):
            return ray.get(Worker.remote().step.remote(0))

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=True)
    with report_failure():
        ray.get(Runner.remote().run.remote())
''')


@pytest.mark.ray
def test_a_real_ray_failure_ends_the_driver_output_with_its_line():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last.startswith("[mix_src] FAILED in Worker.step (pid ") and last.endswith(
        "): ZeroDivisionError: division by zero"), proc.stderr[-3000:]
