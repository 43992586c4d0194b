"""A persistent pool of grading processes with a hard per-item deadline (any picklable module-level function): a
zygote that forks the workers, why not ``multiprocessing``, and the clean-up: mix_src/rewards/README.md, "Grading
processes". :meth:`GradingPool.run` is thread-safe.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

_PID = struct.Struct("!q")
_BACKSTOP_EXTRA_S = 5


@dataclass(frozen=True)
class Outcome:
    """Result of one task: ``status`` ``ok`` (``value``), ``error`` (the task raised: ``error`` is ``Type: message``),
    ``timeout`` (killed at the deadline) or ``crashed`` (the worker died, e.g. at its memory limit)."""

    status: str
    value: Any = None
    seconds: float = 0.0  # wall time from sending the task to the answer (or the kill)
    error: str = ""
    cpu_seconds: float = 0.0  # CPU time the worker spent on the task (0 for timeouts and crashes)


@dataclass(frozen=True)
class _Worker:
    pid: int
    conn: Connection

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # the zygote reaps it (SIGCHLD is ignored there)
        with contextlib.suppress(OSError):
            self.conn.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("grading zygote closed its control socket")
        buf += chunk
    return buf


class GradingPool:
    """Up to ``max_workers`` grading processes. ``preload``: ``"module:function"`` run once in the zygote before it
    forks (imports and warm caches shared by every worker); ``memory_limit_mb`` > 0 caps each worker's address
    space (``RLIMIT_AS``): a runaway computation fails with ``MemoryError`` instead of swapping the machine."""

    def __init__(self, max_workers: int, memory_limit_mb: int = 0, preload: str | None = None,
                 start_timeout_s: float = 120.0):
        self.max_workers = int(max_workers)
        self.memory_limit_mb = int(memory_limit_mb)
        self.preload = preload or ""
        self.start_timeout_s = float(start_timeout_s)
        self.owner_pid = os.getpid()
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._live: dict[int, _Worker] = {}
        self._n_workers = 0  # live or being started
        self._closed = False
        self._zygote_lock = threading.Lock()
        self._zygote: subprocess.Popen | None = None
        self._ctrl: socket.socket | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.stats = {"ok": 0, "error": 0, "timeout": 0, "crashed": 0, "workers_started": 0, "worker_cpu_s": 0.0}

    # ------------------------------------------------------------------------------------------ API
    def run(self, fn: Callable, args: Sequence = (), timeout_s: float = 5.0) -> Outcome:
        """Run ``fn(*args)`` in a worker; never waits more than ``timeout_s`` once a worker has it."""
        worker = self._acquire()
        t0 = time.perf_counter()
        try:
            worker.conn.send((fn, tuple(args), int(math.ceil(timeout_s)) + _BACKSTOP_EXTRA_S))
            if not worker.conn.poll(timeout_s):
                self._discard(worker)
                return self._count(Outcome("timeout", seconds=time.perf_counter() - t0))
            ok, value, cpu = worker.conn.recv()
        except (EOFError, OSError) as exc:
            self._discard(worker)
            return self._count(Outcome("crashed", seconds=time.perf_counter() - t0,
                                       error=f"grading worker died: {type(exc).__name__}"))
        except BaseException:
            self._release(worker)  # e.g. fn/args not picklable: nothing was sent
            raise
        self._release(worker)
        dt = time.perf_counter() - t0
        return self._count(Outcome("ok", value, dt, cpu_seconds=cpu) if ok else
                           Outcome("error", None, dt, value, cpu_seconds=cpu))

    def map(self, calls: Sequence[tuple[Callable, Sequence]], timeout_s: float = 5.0) -> list[Outcome]:
        """``[run(fn, args) for fn, args in calls]``, spread over the workers (results in order)."""
        calls = list(calls)
        if len(calls) <= 1 or self.max_workers == 1:
            return [self.run(fn, args, timeout_s) for fn, args in calls]
        with self._cond:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="grading")
            executor = self._executor
        return list(executor.map(lambda call: self.run(call[0], call[1], timeout_s), calls))

    def warmup(self) -> None:
        """Start the zygote and every worker now instead of on first use."""
        for w in [self._acquire() for _ in range(self.max_workers)]:
            self._release(w)

    def close(self) -> None:
        """Kill every worker and the zygote. Safe to call twice."""
        with self._cond:
            self._closed = True
            workers = list(self._live.values())
            self._idle.clear()
            self._live.clear()
            executor, self._executor = self._executor, None
            self._cond.notify_all()
        for w in workers:
            w.kill()
        if executor is not None:
            executor.shutdown(wait=False)
        with self._zygote_lock:
            self._stop_zygote()

    # ------------------------------------------------------------------------------------ internals
    def _count(self, outcome: Outcome) -> Outcome:
        with self._cond:
            self.stats[outcome.status] += 1
            self.stats["worker_cpu_s"] += outcome.cpu_seconds
        return outcome

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("GradingPool is closed")
                if self._idle:
                    return self._idle.pop()
                if self._n_workers < self.max_workers:
                    self._n_workers += 1
                    break
                self._cond.wait()
        try:
            worker = self._spawn_worker()
        except BaseException:
            with self._cond:
                self._n_workers -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._live[worker.pid] = worker
            self.stats["workers_started"] += 1
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(worker)
                self._cond.notify()
                return
        worker.kill()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._cond:
            self._live.pop(worker.pid, None)
            self._n_workers -= 1
            self._cond.notify()

    def _spawn_worker(self) -> _Worker:
        with self._zygote_lock:
            for attempt in (1, 2):
                self._ensure_zygote()
                ours, theirs = socket.socketpair()
                try:
                    socket.send_fds(self._ctrl, [b"S"], [theirs.fileno()])
                    (pid,) = _PID.unpack(_recv_exact(self._ctrl, _PID.size))
                    return _Worker(pid, Connection(ours.detach()))
                except OSError as exc:  # ConnectionError and socket timeouts included
                    ours.close()
                    self._stop_zygote()
                    if attempt == 2:
                        raise RuntimeError(f"GradingPool: the grading zygote stopped answering ({exc}); "
                                           "see its error output above") from exc
                    logger.warning("GradingPool: grading zygote lost (%s); restarting it", exc)
                finally:
                    theirs.close()

    def _ensure_zygote(self) -> None:
        if self._closed:
            raise RuntimeError("GradingPool is closed")
        if self._zygote is not None and self._zygote.poll() is None:
            return
        self._stop_zygote()
        ours, theirs = socket.socketpair()
        path = json.dumps([p or os.getcwd() for p in sys.path])
        cmd = [sys.executable, "-c", _BOOT, path, str(theirs.fileno()), self.preload, str(self.memory_limit_mb)]
        try:
            proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        ours.settimeout(self.start_timeout_s)  # bounds the start and then each fork request
        try:
            _recv_exact(ours, _PID.size)  # "ready", sent after the preload
        except OSError as exc:  # ConnectionError and socket timeouts included
            proc.kill()
            code = proc.wait()
            ours.close()
            raise RuntimeError(
                f"GradingPool: the grading zygote ({sys.executable}, preload {self.preload!r}) did not start "
                f"within {self.start_timeout_s:.0f}s (exit code {code}, {type(exc).__name__}); its error "
                "output is above. Check that math-verify is installed (pip install 'math-verify>=0.7') "
                "and that mix_src is importable.") from exc
        self._zygote, self._ctrl = proc, ours

    def _stop_zygote(self) -> None:
        proc, ctrl = self._zygote, self._ctrl
        self._zygote = self._ctrl = None
        if ctrl is not None:
            ctrl.close()  # the zygote exits on EOF
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# The zygote's entry point: runs as ``python -c _BOOT PATH_JSON FD PRELOAD MEM_MB``.
_BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); " \
        "from mix_src.rewards.pool import _zygote_main; _zygote_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))"


def _zygote_main(ctrl_fd: int, preload: str, memory_limit_mb: int) -> None:  # pragma: no cover (subprocess)
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's business
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished or killed workers
    ctrl = socket.socket(fileno=ctrl_fd)
    if preload:
        module, func = preload.split(":")
        getattr(importlib.import_module(module), func)()
    ctrl.sendall(_PID.pack(os.getpid()))
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 1, 1)
        except OSError:
            break
        if not msg or not fds:
            break  # the caller closed the pool or exited
        pid = os.fork()
        if pid == 0:
            try:
                ctrl.close()
                _worker_loop(fds[0], memory_limit_mb)
            finally:
                os._exit(0)
        os.close(fds[0])
        ctrl.sendall(_PID.pack(pid))
    os._exit(0)


def _worker_loop(fd: int, memory_limit_mb: int) -> None:  # pragma: no cover (subprocess)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the backstop alarm still bounds an orphan's life
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
        if os.getppid() == 1:  # the zygote is already gone
            os._exit(0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the backstop alarm ends the process
    if memory_limit_mb > 0:
        import resource

        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn = Connection(fd)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as exc:  # the task could not be unpickled here
            conn.send((False, f"{type(exc).__name__} while receiving the task: {str(exc)[:300]}", 0.0))
            continue
        fn, args, backstop_s = task
        signal.alarm(backstop_s)
        cpu0 = time.process_time()
        try:
            ok, value = True, fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, never raised here
            ok, value = False, f"{type(exc).__name__}: {str(exc)[:300]}"
        signal.alarm(0)
        cpu = time.process_time() - cpu0
        try:
            conn.send((ok, value, cpu))
        except OSError:
            return
        except Exception as exc:  # the return value could not be pickled
            conn.send((False, f"{type(exc).__name__} while sending the result: {str(exc)[:300]}", cpu))


# ---------------------------------------------------------------------------------------- registry
_POOLS: dict[tuple, GradingPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(max_workers: int, memory_limit_mb: int = 0, preload: str | None = None) -> GradingPool:
    """The process-wide pool for these settings (created on first use; a forked child gets its own)."""
    key = (int(max_workers), int(memory_limit_mb), preload or "")
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool.owner_pid != os.getpid() or pool._closed:
            pool = _POOLS[key] = GradingPool(max_workers, memory_limit_mb, preload)
        return pool


def pools() -> list[GradingPool]:
    with _POOLS_LOCK:
        return [p for p in _POOLS.values() if p.owner_pid == os.getpid()]


def close_all() -> None:
    """Close this process's pools (registered with atexit; the next get_pool starts afresh)."""
    for pool in pools():
        pool.close()


atexit.register(close_all)
