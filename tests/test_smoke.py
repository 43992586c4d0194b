"""``make smoke-gpu``'s verdict (scripts/gpu/smoke.py). The script itself runs on the CPU backend (2 LUFFY steps, 1
validation, a checkpoint and a resume, each a real ``python -m mix_src.main_mix_ppo`` with its own Ray cluster) as
the smoke step of the visit script's CPU rehearsal: tests/test_gpu_visit.py
``test_visit_runs_end_to_end_on_the_cpu_backend`` (``--model random:tiny``), which asserts what its run here did."""

from __future__ import annotations

from pathlib import Path


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
    full = {"response_length/min": 32, "response_length/max": 32}
    steps12 = (0, [{"step": 1, **full}, {"step": 2, **full, **val}], 60.0, Path("a.log"))
    assert verdict(steps12, (0, [{"step": 3, **full}], 30.0, Path("b.log")), tmp_path, None, 32) is None
    short = (0, [{"step": 3, "response_length/min": 31, "response_length/max": 32}], 30.0, Path("b.log"))
    assert "step 3: response lengths (min, max) (31, 32), not all 32" in verdict(steps12, short, tmp_path, None, 32)
