"""The kernel pin and the guards' two comparison modes (tests/kernels.py; #51 item 1). No Ray: the run guard's
comparison function is exercised on its own record."""

from __future__ import annotations

import json
import math
import os
import platform

import pytest
import torch

import kernels
from kernels import F32_EPS, ULPS, fingerprint, fingerprint_diff, pin_environment, within_ulps


def test_pin_sets_only_what_the_environment_leaves_unset():
    env = {"ATEN_CPU_CAPABILITY": "default"}
    added = pin_environment(env)
    if platform.machine() != "x86_64" or not kernels._cpu_has_avx2():
        assert added == {} and env == {"ATEN_CPU_CAPABILITY": "default"}  # no x86 kernels to name here
        return
    assert env == {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert added == {"MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_this_process_runs_the_pinned_kernels_unless_told_otherwise():
    """conftest.py pinned before torch loaded: torch's own report follows the environment (AVX2 when unset)."""
    if platform.machine() != "x86_64" or not kernels._cpu_has_avx2():
        pytest.skip("no x86-64 AVX2 CPU: nothing is pinned")
    want = os.environ["ATEN_CPU_CAPABILITY"].upper()
    assert torch.backends.cpu.get_cpu_capability() == ("DEFAULT" if want == "DEFAULT" else want)
    fp = fingerprint(2)
    assert fp["machine"] == "x86_64" and fp["threads"] == 2 and fp["torch"] == torch.__version__


def test_fingerprint_diff_names_each_differing_key():
    a = {"aten_capability": "AVX2", "threads": 2, "machine": "x86_64"}
    assert fingerprint_diff(a, dict(a)) == {}
    assert fingerprint_diff({**a, "aten_capability": "AVX512"}, a) == {"aten_capability": ("AVX2", "AVX512")}


def test_within_ulps_is_relative_to_the_tensors_scale():
    want = torch.tensor([1.0, 1e-3, 0.0])
    eps = F32_EPS
    assert within_ulps(want + torch.tensor([0.0, ULPS * eps * 0.99, 0.0]), want)  # 0.99 x tolerance of the scale 1.0
    assert not within_ulps(want + torch.tensor([0.0, 0.0, ULPS * eps * 2]), want)
    assert within_ulps(torch.tensor([math.nan, 1.0]), torch.tensor([math.nan, 1.0]))
    assert not within_ulps(torch.tensor([math.nan, 1.0]), torch.tensor([0.0, 1.0]))
    assert not within_ulps(torch.tensor([1.0]), torch.tensor([1.0, 1.0]))  # shapes
    assert not within_ulps(torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0]))  # dtypes
    assert within_ulps(0.5, 0.5) and not within_ulps(0.5 * (1 + 2 * ULPS * eps), 0.5)


def test_the_run_guard_sees_one_ulp_where_exact_and_a_change_beyond_the_tolerance_elsewhere():
    """tests/test_guard.py ``differences`` on its own record: one float32 ulp on one recorded metric fails the exact
    comparison and passes the tolerance; 2 x ULPS fails both; 0.99 x ULPS passes the tolerance."""
    import test_guard

    recorded = [test_guard.guarded(m) for m in json.loads(test_guard.RECORD.read_text())["legacy"]["steps"]]
    assert test_guard.differences("legacy", recorded, recorded, exact=True) == []
    key = "actor/pg_loss"

    def moved(value):
        steps = [dict(m) for m in recorded]
        steps[0][key] = value
        return steps

    want = recorded[0][key]
    one_ulp = float(torch.nextafter(torch.tensor(want, dtype=torch.float32), torch.tensor(math.inf)))
    assert one_ulp != want
    assert len(test_guard.differences("legacy", recorded, moved(one_ulp), exact=True)) == 1
    assert test_guard.differences("legacy", recorded, moved(one_ulp), exact=False) == []
    step = abs(want) * F32_EPS
    assert test_guard.differences("legacy", recorded, moved(want + 0.99 * ULPS * step), exact=False) == []
    assert len(test_guard.differences("legacy", recorded, moved(want + 2 * ULPS * step), exact=False)) == 1
    extra = [dict(m) for m in recorded]
    extra[1]["actor/new_metric"] = 1.0
    assert "new ['actor/new_metric']" in test_guard.differences("legacy", recorded, extra, exact=False)[0]
