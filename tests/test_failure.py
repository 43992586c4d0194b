"""A Ray worker's failure is named in the driver's last line (mix_src/trainer/failure.py), not lost in Ray's log."""

import subprocess
import sys
import textwrap

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from mix_src.trainer.failure import failure_line, report_failure


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


def test_a_filter_groups_error_on_the_v1_base_is_named(capsys):
    """verl's V1 sync replay buffer waits in the TaskRunner's process, where mix_src's generation budget raises
    FilterGroupsExhausted (mix_src/trainer/v1.py ``_wait_for_next_poll``): ray.get raises Ray's dual class of it,
    whose ``__getattr__`` sends every missing attribute (``function_name``) to the cause, so the line must come from
    the message, not the attribute (an AttributeError naming ``function_name`` then hid the error)."""
    from mix_src.trainer.legacy import FilterGroupsExhausted

    message = ("filter groups: after 10 generation batches of 1 prompts (algorithm.filter_groups.max_num_gen_batches=10) "
               "only 3 of data.train_batch_size=4 prompt groups had a non-zero std of 'seq_reward'")
    error = RayTaskError("MixTaskRunnerV1.run", "Traceback ...", FilterGroupsExhausted(message),
                         proctitle="ray::MixTaskRunnerV1.run", pid=15318, ip="127.0.0.1",
                         actor_repr="<mix_src.trainer.v1.MixTaskRunnerV1 object at 0x7f3ea613aa50>").as_instanceof_cause()
    assert isinstance(error, FilterGroupsExhausted)  # what run_ppo's ray.get raises on the driver
    with pytest.raises(AttributeError, match="function_name"):
        error.function_name  # noqa: B018  (Ray's dual class: the cause has no such attribute)
    line = f"[mix_src] FAILED in MixTaskRunnerV1.run (pid 15318): FilterGroupsExhausted: {message}"
    assert failure_line(error) == line
    with pytest.raises(SystemExit) as exit_info, report_failure():
        raise error
    assert exit_info.value.code == 1 and capsys.readouterr().err.strip().splitlines()[-1] == line


def test_a_dead_actor_is_named():
    line = failure_line(ActorDiedError())
    assert line.startswith("[mix_src] FAILED in a Ray actor: ActorDiedError: The actor died unexpectedly")


SCRIPT = textwrap.dedent('''
    import ray
    from mix_src.trainer.failure import report_failure

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
