"""``make smoke-gpu``'s script on the CPU backend (SMOKE_BACKEND=cpu): 2 LUFFY steps, 1 validation, a checkpoint
and a resume, each a real ``python -m mix_src.main_mix_ppo`` with its own Ray cluster. It checks the plumbing on
CPU, not GPU kernels, vLLM or memory (scripts/gpu/smoke.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from e2e import cpu_env, run_command, read_metrics, tail

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_smoke_script_passes_on_the_cpu_backend(tmp_path):
    log = tmp_path / "smoke.log"
    cmd = [sys.executable, "-m", "scripts.gpu.smoke", "--out", str(tmp_path / "out")]
    env = cpu_env({"SMOKE_BACKEND": "cpu", "PYTHONPATH": str(REPO)})
    rc, wall, _, timed_out, _ = run_command(cmd, env, log, timeout=900, cwd=REPO)
    text = log.read_text()
    assert not timed_out and rc == 0 and "[smoke] PASS" in text, tail(log)
    assert "tokens/s" in text and "planner (" in text
    out = tmp_path / "out"
    assert [m["step"] for m in read_metrics(out / "train_metrics.jsonl")] == [1, 2]
    assert [m["step"] for m in read_metrics(out / "resume_metrics.jsonl")] == [3]  # resumed from global_step_2
    assert (out / "checkpoints" / "global_step_2" / "actor").is_dir()
    assert "global_step_2" in (out / "resume.log").read_text()  # verl's "Load from checkpoint folder" line


def test_verdict_names_the_first_failure(tmp_path):
    from scripts.gpu.smoke import verdict

    (tmp_path / "global_step_2" / "actor").mkdir(parents=True)
    val = {"val-core/x/acc/mean@1": 0.5}
    ok = (0, [{"step": 1}, {"step": 2, **val}], 60.0, Path("a.log"))
    assert verdict(ok, (0, [{"step": 3}], 30.0, Path("b.log")), tmp_path, 600) is None
    assert "did not resume" in verdict(ok, (0, [{"step": 1}, {"step": 2}, {"step": 3}], 30.0, Path("b.log")),
                                       tmp_path, 600)
    assert "no validation" in verdict((0, [{"step": 1}, {"step": 2}], 60.0, Path("a.log")), ok, tmp_path, 600)
    assert "> 600 s" in verdict(ok, (0, [{"step": 3}], 590.0, Path("b.log")), tmp_path, 600)
    assert "no checkpoint" in verdict(ok, ok, tmp_path / "missing", None)
