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
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import psutil
import pytest

# Enable the CPU backend fragment for stock ``python -m verl.trainer.main_ppo`` (its config dir does not
# contain our fragment, so add mix_src/config to the search path first).
STOCK_VERL_CPU = ["hydra.searchpath=[pkg://mix_src.config]", "+backend=cpu"]
# For entry points whose primary config dir is mix_src/config (python -m mix_src.main_mix_ppo).
MIX_CPU = ["+backend=cpu"]

REWARD_FN = ["reward.custom_reward_function.path=pkg://mix_src.rewards.math_verify_reward",
             "reward.custom_reward_function.name=compute_score"]


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


def run_command(
    cmd: Sequence[str], env: dict, log_path: Path, timeout: float, *, cwd: Path
) -> tuple[int, float, float, bool, list[str]]:
    """Run ``cmd`` in its own session with output to ``log_path``; on timeout and afterwards kill its whole
    process tree (by pid: the Ray cluster the job started included).

    Returns (returncode, wall seconds, peak summed RSS in MB, timed_out, descriptions of killed leftovers).
    """
    seen: dict[int, psutil.Process] = {}
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
                peak_rss = max(peak_rss, rss)
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
    return proc.returncode, time.monotonic() - start, peak_rss / 2**20, timed_out, killed


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
