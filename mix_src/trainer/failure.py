"""One line that says what failed when a Ray worker fails, printed last by the driver.

A failure inside Ray reaches the driver as ``ray.exceptions.RayTaskError`` wrapping the worker's exception
(nested once per Ray hop; ray/exceptions.py ``RayTaskError.cause``), or as ``RayActorError`` when a process died.
:func:`failure_line` walks to the innermost cause and names it:

    [mix_src] FAILED in WorkerDict.actor_rollout_update_actor (pid 1234): ZeroDivisionError: division by zero

:func:`report_failure` is the entry point's guard: it prints the traceback, then that line last, and exits 1.
"""

from __future__ import annotations

import contextlib
import re
import sys
import traceback
from typing import Iterator


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _task_name(error: BaseException) -> str:
    """``Class.method (pid N)`` of a RayTaskError, from its message's innermost ``ray::Class.method() (pid=N, ...)``
    line (Ray's dual class that ``ray.get`` raises keeps only ``cause``)."""
    found = re.findall(r"ray::([\w.]+)\(\)\W*\(pid=(\d+)", re.sub(r"\x1b\[[0-9;]*m", "", str(error)))
    if found:
        return f"{found[-1][0]} (pid {found[-1][1]})"
    fields = vars(error)
    return f"{fields['function_name']} (pid {fields.get('pid')})" if "function_name" in fields else "a Ray task"


def failure_line(exc: BaseException) -> str:
    """``[mix_src] FAILED in <worker>: <ExcType>: <first line>`` for an exception raised through Ray."""
    from ray.exceptions import RayActorError, RayTaskError

    cause, task = exc, None  # the worker's own exception under Ray's wrappers (one per hop); the innermost wrapper
    while isinstance(cause, RayTaskError) and cause.cause is not None and cause.cause is not cause:
        task, cause = cause, cause.cause
    if task is not None:
        worker = _task_name(task)  # the task that raised it: its function (Class.method) and process
    elif isinstance(cause, RayActorError):
        match = re.search(r"class_name:\s*(\S+)", str(cause))
        worker = f"actor {match.group(1)}" if match else "a Ray actor"
        message = [line.strip() for line in str(cause).splitlines() if line.strip()]
        return f"[mix_src] FAILED in {worker}: {type(cause).__name__}: {message[-1] if message else ''}"
    else:
        worker = "the driver"
    if isinstance(cause, RayTaskError):  # a wrapper without a cause (an unserialisable exception)
        return f"[mix_src] FAILED in {worker}: {_first_line(cause.traceback_str)}"
    name = re.sub(r"^RayTaskError\((\w+)\)$", r"\1", getattr(cause, "__class__", type(cause)).__name__)
    return f"[mix_src] FAILED in {worker}: {name}: {_first_line(cause) or '(no message)'}"


@contextlib.contextmanager
def report_failure() -> Iterator[None]:
    """Run the training; if a Ray task or actor fails, print the traceback, then :func:`failure_line` last,
    and exit with status 1 (Hydra would otherwise print its own traceback after the line)."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        yield
    except (RayTaskError, RayActorError) as exc:
        sys.stdout.flush()
        traceback.print_exc()
        print(failure_line(exc), file=sys.stderr, flush=True)
        raise SystemExit(1) from exc
