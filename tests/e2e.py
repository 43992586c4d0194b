"""Helpers for end-to-end tests that run a real verl job (Hydra entry point, own Ray cluster) on CPU.

Typical use (see tests/test_cpu_backend.py)::

    from e2e import STOCK_VERL_CPU, run_verl, tiny_overrides

    result = run_verl("verl.trainer.main_ppo", STOCK_VERL_CPU + tiny_overrides(tiny_assets) + [...], tmp_path)
    assert "actor/pg_loss" in result.metrics[-1]

* ``run_verl`` starts ``python -m <module> <overrides>`` in a subprocess (its own session), in ``tmp_path``
  as working directory, with ``VERL_PLATFORM=cpu`` and verl's ``file`` logger writing per-step metrics to
  ``tmp_path/metrics.jsonl``. The job's ``ray.init()`` starts a private local Ray cluster (``RAY_ADDRESS``
  is removed from the environment); every process of the job's process tree is tracked by pid while it
  runs and any survivor is killed (by pid, never by name) afterwards, so nothing outlives the test.
* A non-zero exit or a timeout fails the test with the command, the log path and the log tail.
* The result carries per-step metrics (``list[dict]``, one merged dict per logged step, ``"step"``
  included), wall time and the peak summed RSS of the whole process tree.
* The suite's time table: with ``MIX_E2E_TIMES=<file>`` set, every job (``run_verl`` and ``run_command``) appends
  one JSON line: the test id, the command's module, wall seconds, the CPU seconds of its process tree, and the
  seconds until the log first shows ``ray.init`` being called, Ray up and step 1 logged (see ``LOG_MARKS``).
  ``python tests/e2e.py <file>`` prints the table per test file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil
import pytest

# Enable the CPU backend fragment for stock ``python -m verl.trainer.main_ppo`` (its config dir does not
# contain our fragment, so add mix_src/config to the search path first).
STOCK_VERL_CPU = ["hydra.searchpath=[pkg://mix_src.config]", "+backend=cpu"]
# For entry points whose primary config dir is mix_src/config (python -m mix_src.main_mix_ppo).
MIX_CPU = ["+backend=cpu"]

REWARD_FN = ["reward.custom_reward_function.path=pkg://mix_src.rewards.math_verify_reward",
             "reward.custom_reward_function.name=compute_score"]
MIX = "mix_src.main_mix_ppo"

# LUFFY with partial prefixes on the tiny assets: 2 of 4 samples with a prefix whose ratio is drawn in [0.3, 0.7],
# seeded; the learned entropy coefficient and all_max_clip on. Its legacy run is one job that two test files
# assert on (tests/conftest.py's ``legacy_partial_prefix_run``): tests/test_bases_equivalence.py (legacy == V1
# sync) and tests/test_mix_trainer_e2e.py (a resumed run draws the same ratios).
PARTIAL_PREFIX_LUFFY = [
    "mix.n_prefix=2", "mix.min_prefix_ratio=0.3", "mix.max_prefix_ratio=0.7", "mix.seed=7",
    "algorithm.adv_estimator=grpo_split", "actor_rollout_ref.rollout.calculate_log_probs=true",
    # formerly refused on V1, on in every run here: the learned entropy coefficient (checkpointed), and
    # all_max_clip with token-mean (its kept-token counts per mini-batch)
    "mix.loss.use_adaptive_entropy=true", "actor_rollout_ref.actor.entropy_coeff=0.01", "mix.loss.alpha_lr=0.5",
    "mix.loss.all_max_clip=0.999",
]  # fmt: skip


def tiny_overrides(
    assets: dict,
    *,
    steps: int = 2,
    batch_size: int = 4,
    n: int = 2,
    prompt_length: int = 32,
    response_length: int = 16,
    lr: float = 1e-4,
    reward: Sequence[str] = tuple(REWARD_FN),
) -> list[str]:
    """Overrides for a tiny GRPO-style run on ``tiny_assets`` (sizes only; the backend comes separately).

    ``batch_size`` prompts per step, ``n`` samples each, one mini-batch per step, no validation, no
    checkpoints, console + file loggers.
    """
    return [
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['val']}",
        f"data.train_batch_size={batch_size}",
        f"data.max_prompt_length={prompt_length}",
        f"data.max_response_length={response_length}",
        f"actor_rollout_ref.model.path={assets['model']}",
        f"++actor_rollout_ref.model.tokenizer_path={assets['tokenizer']}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch_size * n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch_size * n}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={batch_size * n}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        *reward,
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=e2e",
        "trainer.experiment_name=tiny",
    ]


def partial_prefix_overrides(assets: dict, *extra: str, steps: int = 2) -> list[str]:
    """``python -m mix_src.main_mix_ppo`` overrides of a ``PARTIAL_PREFIX_LUFFY`` run (4 prompts x 4 samples,
    responses of 24 tokens) on the CPU backend, then ``extra``."""
    sizes = tiny_overrides(assets, steps=steps, n=4, batch_size=4, response_length=24)
    return [*MIX_CPU, *sizes, *PARTIAL_PREFIX_LUFFY, *extra]


PARTIAL_PREFIX_CKPT = "partial_prefix_ckpt"  # in the legacy batch's directory


def partial_prefix_saved(assets: dict, batch_dir: Path) -> list[str]:
    """The legacy batch's run ``partial_prefix``: ``PARTIAL_PREFIX_LUFFY``, 2 steps, a checkpoint after each."""
    return partial_prefix_overrides(assets, f"trainer.default_local_dir={batch_dir / PARTIAL_PREFIX_CKPT}",
                                    "trainer.save_freq=1")  # fmt: skip


@dataclass
class RunResult:
    """Outcome of one ``run_verl`` call."""

    cmd: list[str]
    returncode: int
    log_path: Path
    metrics: list[dict] = field(default_factory=list)  # one dict per logged step, with "step"
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0  # peak of the summed RSS of the job's whole process tree (shared pages counted
    # once per process, so an upper bound)
    killed: list[str] = field(default_factory=list)  # "pid name" of job processes still alive at the end

    def series(self, key: str) -> list:
        """Values of ``key`` across steps (steps that did not log it are skipped)."""
        return [m[key] for m in self.metrics if key in m]

    def log_tail(self, lines: int = 80) -> str:
        return tail(self.log_path, lines)


def tail(path: Path, lines: int = 80) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"<no log: {e}>"
    return "\n".join(text.splitlines()[-lines:])


def read_metrics(path: Path) -> list[dict]:
    """Parse verl's file logger JSONL (``{"step": n, "data": {...}}`` per line) into one dict per step."""
    by_step: dict[int, dict] = {}
    if not Path(path).exists():
        return []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], {"step": rec["step"]}).update(rec["data"])
    return [by_step[s] for s in sorted(by_step)]


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _kill(procs: dict[int, psutil.Process]) -> list[str]:
    """SIGKILL the given processes (by pid, only those recorded from this job's tree) and reap them.

    Returns ``"pid name"`` of each process that was still alive.
    """
    alive, names = [], []
    for p in procs.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                names.append(f"{p.pid} {p.name()}")
                p.kill()
                alive.append(p)
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    return names


def cpu_env(extra: Optional[dict] = None) -> dict:
    """Environment for a CPU e2e job: CPU backend forced, private Ray, quiet third parties."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "VERL_ENGINE_DEVICE"):
        env.pop(key, None)
    # the toy tasks are modules of the repository root (scripts.experiments.toy_tasks), as the recipes' run.sh
    # export: a job started in tmp_path and its Ray workers import them from there
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(
        VERL_PLATFORM="cpu",
        PYTHONUNBUFFERED="1",
        HYDRA_FULL_ERROR="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        RAY_DEDUP_LOGS="0",
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS="1",  # as Ray sets for its workers; torchrun jobs (SFT) too, as the old sft_cpu.py did
    )
    env.update(extra or {})
    return env


# What the time table reads from a job's log: the first line that says the driver calls ray.init (verl's
# main_ppo.py prints its kwargs just before), that Ray is up (Ray's worker.py), that step 1 is done (verl's console
# logger). Seconds from the job's start, to the poll (0.5 s) that first saw the line.
LOG_MARKS = {
    "ray_init_s": re.compile(r"ray init kwargs"),
    "ray_up_s": re.compile(r"Started a local Ray instance"),
    "step1_s": re.compile(r"\bstep:1 - "),
}
TIMES_ENV = "MIX_E2E_TIMES"


class _LogWatch:
    """Reads what a job appended to its log since the last poll and notes when each of ``LOG_MARKS`` first
    appears (only while ``MIX_E2E_TIMES`` is set)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled, self.offset, self.rest, self.seen = path, enabled, 0, "", {}

    def poll(self, elapsed: float) -> None:
        if not self.enabled or len(self.seen) == len(LOG_MARKS):
            return
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
        except OSError:
            return
        lines = (self.rest + text).split("\n")
        self.rest = lines.pop()  # an unfinished line waits for the next poll
        for line in lines:
            for key, pattern in LOG_MARKS.items():
                if key not in self.seen and pattern.search(line):
                    self.seen[key] = round(elapsed, 1)


def _cpu_seconds(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _record_time(cmd: Sequence[str], returncode: int, wall: float, cpu: dict, marks: dict) -> None:
    """Append one job's line to ``$MIX_E2E_TIMES``: test id, module, wall and CPU seconds, ``LOG_MARKS`` times."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # "tests/test_x.py::test_y[p] (call)"
    args = list(cmd)
    module = args[args.index("-m") + 1] if "-m" in args[:-1] else " ".join(Path(a).name for a in args[:2])
    rec = {"test": test, "module": module, "returncode": returncode, "wall_s": round(wall, 1),
           "cpu_s": round(sum(cpu.values()), 1), **marks}  # fmt: skip
    with open(os.environ[TIMES_ENV], "a") as f:
        f.write(json.dumps(rec) + "\n")


# ray/_private/node.py (ray 2.x) waits a hard-coded 30 s for its raylet to register; with `make test`'s two pytest
# workers two clusters can start at once on 2 cores and miss it. Such a job, if it trained no step yet (a batch may
# have: then the test fails as before), is run once more, its first log kept beside the second.
RAY_START_TIMEOUT = "The current node timed out during startup"


def run_command(
    cmd: Sequence[str], env: dict, log_path: Path, timeout: float, *, cwd: Path
) -> tuple[int, float, float, bool, list[str]]:
    """Run ``cmd`` in its own session with output to ``log_path``; on timeout and afterwards kill its whole
    process tree (by pid: the Ray cluster the job started included). With ``MIX_E2E_TIMES`` set, the job's
    times go to the time table (module docstring). A job whose Ray cluster timed out starting runs once more.

    Returns (returncode, wall seconds, peak summed RSS in MB, timed_out, descriptions of killed leftovers).
    """
    out = _run_once(cmd, env, log_path, timeout, cwd=cwd)
    text = Path(log_path).read_text(errors="replace")
    if out[0] != 0 and not out[3] and RAY_START_TIMEOUT in text and "step:" not in text:  # nothing trained yet
        Path(log_path).rename(Path(log_path).with_suffix(".ray_start_timeout.log"))
        out = _run_once(cmd, env, log_path, timeout, cwd=cwd)
    return out


def _run_once(
    cmd: Sequence[str], env: dict, log_path: Path, timeout: float, *, cwd: Path
) -> tuple[int, float, float, bool, list[str]]:
    seen: dict[int, psutil.Process] = {}
    cpu: dict[int, float] = {}  # CPU seconds per process of the tree, as last seen alive
    watch = _LogWatch(Path(log_path), enabled=bool(os.environ.get(TIMES_ENV)))
    peak_rss = 0
    timed_out = False
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            root = psutil.Process(proc.pid)
            while proc.poll() is None:
                rss = 0
                for p in _tree(root):
                    seen.setdefault(p.pid, p)
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:
                        pass
                    if watch.enabled:
                        cpu[p.pid] = max(cpu.get(p.pid, 0.0), _cpu_seconds(p))
                peak_rss = max(peak_rss, rss)
                watch.poll(time.monotonic() - start)
                if time.monotonic() - start > timeout:
                    timed_out = True
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the job's own session (start_new_session)
                except ProcessLookupError:
                    pass
            proc.wait()
            killed = _kill(seen)  # Ray daemons and workers of this job that are still alive
    wall = time.monotonic() - start
    if watch.enabled:
        watch.poll(wall)
        _record_time(cmd, proc.returncode, wall, cpu, watch.seen)
    return proc.returncode, wall, peak_rss / 2**20, timed_out, killed


def run_verl(
    module: str,
    overrides: Sequence[str],
    tmp_path: Path,
    timeout: float = 300,
    *,
    env: Optional[dict] = None,
    check: bool = True,
    name: str = "run",
) -> RunResult:
    """Run ``python -m module *overrides`` as an isolated job; see the module docstring.

    Args:
        module: e.g. ``"verl.trainer.main_ppo"`` or ``"mix_src.main_mix_ppo"``.
        overrides: Hydra overrides (include ``STOCK_VERL_CPU`` or ``MIX_CPU`` for the CPU backend).
        tmp_path: working directory; gets ``<name>.log`` and ``<name>_metrics.jsonl``.
        timeout: seconds before the whole process tree is killed and the test fails.
        env: extra environment variables (on top of ``cpu_env()``).
        check: fail the test (``pytest.fail``) on a non-zero exit; with False the caller inspects
            ``returncode`` itself (e.g. to test a clear config error).
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    log_path = tmp_path / f"{name}.log"
    metrics_path = tmp_path / f"{name}_metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", module, *overrides]
    run_env = cpu_env({"VERL_FILE_LOGGER_PATH": str(metrics_path), **(env or {})})

    returncode, wall, peak_rss_mb, timed_out, killed = run_command(cmd, run_env, log_path, timeout, cwd=tmp_path)
    result = RunResult(
        cmd=cmd,
        returncode=returncode,
        log_path=log_path,
        metrics=read_metrics(metrics_path),
        wall_s=wall,
        peak_rss_mb=peak_rss_mb,
        killed=killed,
    )
    if timed_out:
        pytest.fail(
            f"`python -m {module}` timed out after {timeout:.0f}s (killed). Log: {log_path}\n"
            f"--- last lines ---\n{result.log_tail()}",
            pytrace=False,
        )
    if check and result.returncode != 0:
        pytest.fail(
            f"`python -m {module}` exited with {result.returncode} after {wall:.0f}s. Log: {log_path}\n"
            f"Command: {' '.join(cmd)}\n--- last lines ---\n{result.log_tail()}",
            pytrace=False,
        )
    return result


# ---- several runs in one process ----------------------------------------------------------------------------
# Start-up dominates a tiny run (``MIX_E2E_TIMES``: on the shared 2-core machine the driver reaches ray.init after
# 15-40 s of imports and checks, and Ray is up 8-16 s later). Runs that need no process of their own (no failure
# path, no environment or log of their own: the tests assert on the metrics) join a batch: a session fixture trains
# the batch's runs one after another in ONE process and one Ray cluster per Ray-level environment
# (tests/mix_modes_run.py) and each test
# asserts on its run's result. Runs are registered at import (``batch_run``) with the tests that read them; the
# fixture trains only the runs of the selected tests, in registration order.
# What reaches a run's Ray processes only through ray.init (mix.plugins as MIX_PLUGINS, the rollout's name as
# MIX_CPU_ROLLOUT: mix_src/config/preflight.py export_plugins; ray_kwargs) makes tests/mix_modes_run.py restart Ray
# before that run when it differs from the cluster's (its ``Cluster``); the batch trains the runs that set none of
# RAY_LEVEL first, then the others grouped by those settings, so each group shares one cluster.
RAY_LEVEL = ("mix.plugins", "+mix.plugins", "++mix.plugins", "actor_rollout_ref.rollout.name", "ray_kwargs",
             "+ray_kwargs", "++ray_kwargs")
BATCH_BASES = {"legacy": False, "v1": True}  # the batches of tests/conftest.py: batch -> trainer.use_v1 of its runs
OverridesFn = Callable[[dict, Path], list]  # (tiny assets, the batch's directory) -> Hydra overrides
BATCHES: dict[str, dict[str, tuple[OverridesFn, tuple[str, ...]]]] = {}


def batch_run(batch: str, name: str, overrides: OverridesFn, tests: Sequence[str]) -> str:
    """Register the run ``name`` of ``batch``: ``overrides(assets, batch_dir)`` gives its ``python -m
    mix_src.main_mix_ppo`` overrides; ``tests`` are the "file::test function" names that read it. Returns ``name``."""
    runs = BATCHES.setdefault(batch, {})
    if name in runs:  # a run several test files read: each registers it, with the same function
        if runs[name][0] is not overrides:
            raise ValueError(f"batch {batch!r}: run {name!r} registered twice with different overrides")
        tests = (*runs[name][1], *tests)
    runs[name] = (overrides, tuple(tests))
    return name


def batch_overrides(batch: str, selected: set, assets: dict, batch_dir: Path) -> dict[str, list]:
    """{name: overrides} of the runs of ``batch`` that a test of ``selected`` ("file::function") reads, in
    registration order, the runs that set none of ``RAY_LEVEL`` first, the others grouped by what they set (each
    group one Ray cluster: tests/mix_modes_run.py restarts Ray between groups); refuses a run of the other base
    (``BATCH_BASES``)."""
    runs = {name: make(assets, batch_dir) for name, (make, tests) in BATCHES[batch].items() if selected & set(tests)}
    for name, overrides in runs.items():
        use_v1 = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.use_v1=")][-1:] == ["true"]
        if batch in BATCH_BASES and use_v1 != BATCH_BASES[batch]:
            raise ValueError(f"batch {batch!r}, run {name!r}: trainer.use_v1={str(use_v1).lower()}, but this batch "
                             f"trains runs with trainer.use_v1={str(BATCH_BASES[batch]).lower()}; register the run "
                             "in the batch of its base")  # fmt: skip
    return dict(sorted(runs.items(), key=lambda run: ray_level(run[1])))  # stable: registration order within a group


def ray_level(overrides: Sequence[str]) -> tuple:
    """The overrides of a run that set one of ``RAY_LEVEL`` (a run's Ray cluster is restarted when they change)."""
    return tuple(o for o in overrides if o.split("=", 1)[0].startswith(RAY_LEVEL))


def run_batch(batch: str, selected: set, assets: dict, tmp_path: Path, timeout_per_run: float = 420) -> dict:
    """Train the runs of ``batch`` that a selected test (``selected``: "file::function" names) needs, in one process
    (tests/mix_modes_run.py; a failing run is reported and the next still runs). Returns {name: RunResult}; the log
    is the batch's (a run's part ends at its ``MIX_MODES_RUN`` line)."""
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    runs = batch_overrides(batch, selected, assets, tmp_path)
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    env = cpu_env({"VERL_FILE_LOGGER_ROOT": str(tmp_path)})  # metrics: <root>/<trainer.project_name>/<name>.jsonl
    env.pop("VERL_FILE_LOGGER_PATH", None)
    log = tmp_path / f"{batch}.log"
    cmd = [sys.executable, str(Path(__file__).with_name("mix_modes_run.py")), str(spec)]
    code, wall, peak_mb, timed_out, killed = run_command(cmd, env, log, timeout_per_run * len(runs), cwd=tmp_path)
    text = log.read_text(errors="replace")
    results = {}
    for name, overrides in runs.items():
        done = re.search(rf"^MIX_MODES_RUN {re.escape(name)} (ok|FAILED) ([0-9.]+)s$", text, re.M)
        projects = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.project_name=")]
        project = projects[-1] if projects else "e2e"
        ok = done is not None and done.group(1) == "ok"
        results[name] = RunResult(
            cmd=[*cmd, name], returncode=0 if ok else (code or 1), log_path=log,
            metrics=read_metrics(tmp_path / project / f"{name}.jsonl"), wall_s=float(done.group(2)) if done else wall,
            peak_rss_mb=peak_mb, killed=killed,
        )  # fmt: skip
    if timed_out:
        print(f"batch {batch!r} timed out after {wall:.0f}s (killed); log {log}")
    return results


def batch_result(results: dict, name: str) -> RunResult:
    """The result of run ``name`` of a batch; fails the test (with the log's tail) when that run failed."""
    result = results[name]
    if result.returncode != 0:
        pytest.fail(f"run {name!r} of the batch failed (exit {result.returncode}). Log: {result.log_path}\n"
                    f"--- last lines ---\n{result.log_tail(120)}", pytrace=False)  # fmt: skip
    return result


def time_table(path: str) -> str:
    """The ``MIX_E2E_TIMES`` file as a table: per test file, its jobs, their summed wall and CPU seconds, and the
    median seconds to Ray up and to step 1 (the start-up) of its jobs that logged them."""
    from collections import defaultdict
    from statistics import median

    by_file: dict[str, list[dict]] = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_file[rec["test"].split("::")[0] or "?"].append(rec)
    rows = ["| file | jobs | wall s | CPU s | Ray up s (median) | step 1 s (median) |", "|---|---|---|---|---|---|"]
    for name, recs in sorted(by_file.items(), key=lambda kv: -sum(r["wall_s"] for r in kv[1])):
        up = [r["ray_up_s"] for r in recs if "ray_up_s" in r]
        step1 = [r["step1_s"] for r in recs if "step1_s" in r]
        wall, cpu = sum(r["wall_s"] for r in recs), sum(r["cpu_s"] for r in recs)
        rows.append(f"| {name} | {len(recs)} | {wall:.0f} | {cpu:.0f} | {median(up) if up else '-'} "
                    f"| {median(step1) if step1 else '-'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(time_table(sys.argv[1]))
