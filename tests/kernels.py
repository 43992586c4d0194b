"""Which CPU kernels a float result comes from: pinned before torch loads, and the fingerprint a record carries.

A float32 sum's last bits depend on the order it is added in, and the order depends on the kernel set torch picks at
start-up (``ATEN_CPU_CAPABILITY``: AVX-512, AVX2 or plain), MKL's code path (``MKL_CBWR``), oneDNN's (``ONEDNN_MAX_CPU_ISA``)
and the intra-op thread count. The guards (``tests/test_loss_guard.py``, ``tests/test_guard.py``) compare with records:

* ``pin_environment`` (called from ``tests/conftest.py`` before any test module imports torch) sets each of those
  variables the environment does not already set to the record's value (AVX2: what almost every x86-64 CPU since
  2013 runs; an AVX-512 CPU runs the AVX2 kernels when asked). A value the user set is kept, so
  ``ATEN_CPU_CAPABILITY=default make test-fast`` tests another kernel set. The guards' Ray jobs inherit the
  environment (``tests/e2e.py`` ``cpu_env``), and with it the pin, in every worker they start.
* ``fingerprint`` says what this process really runs (torch's own report, not the environment). A guard compares
  bit for bit where the fingerprint equals the record's, and within ``ULPS`` (below) where it does not: other kernels,
  another torch, ARM64 (which cannot run x86 kernels).
"""

from __future__ import annotations

import os
import platform

# The record's kernel settings (tests/guard/README.md, "Machines"). MKL_CBWR=AVX2 makes MKL take its AVX2 path on any
# CPU that has AVX2 (Intel's "conditional numerical reproducibility"); ONEDNN_MAX_CPU_ISA caps oneDNN the same way.
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
KERNEL_ENV = tuple(PINNED)


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def pin_environment(environ=os.environ) -> dict:
    """Set the kernel variables the environment leaves unset to ``PINNED``, on an x86-64 CPU with AVX2 only (elsewhere
    the variables would name kernels the CPU cannot run). Returns what it set."""
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_avx2():
        return {}
    added = {k: v for k, v in PINNED.items() if k not in environ}
    environ.update(added)
    return added


def fingerprint(threads: int) -> dict:
    """What decides the last bits of a CPU float result in this process: the architecture, the kernel set torch runs
    (its own report), MKL's and oneDNN's code paths, the torch build and the intra-op threads the result was made with."""
    import torch

    return {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl": torch.backends.mkl.is_available(),
        "MKL_CBWR": os.environ.get("MKL_CBWR", ""),
        "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "threads": threads,
    }


def fingerprint_diff(now: dict, recorded: dict) -> dict:
    """{key: (recorded, now)} for every key whose value differs ({} = compare bit for bit)."""
    return {k: (recorded.get(k), now.get(k)) for k in sorted(set(now) | set(recorded)) if now.get(k) != recorded.get(k)}


# Where the fingerprint differs, a guard compares within ULPS float32 ulps of each compared tensor's (or metric's)
# largest magnitude. Why this unit and this size: a kernel set changes the order a sum is added in, and a reordered
# float32 sum of n terms moves by at most about n * eps * sum(|terms|) (Higham, "Accuracy and Stability of Numerical
# Algorithms", 2nd ed., section 4.2), so the error scales with the terms' magnitude, not with the result's; a result
# that cancels (a KL estimate, a mean of +-advantages) moves many of its own ulps. Measured on the loss guard's record
# (AVX2 kernels, 2 threads) at f270849, this repository's AMD EPYC 2-core machine: under
# ATEN_CPU_CAPABILITY=avx512 42 tensors differ, by at most 0.15 ulps of their scale; under =default (no SIMD) 343
# differ, by at most 37 ulps (`actor/ppo_kl` of one micro-batch: a mean of log-ratio differences that cancel to 2e-3).
# 128 is 3.5x the worst seen. A change of what is computed (a coefficient off by 1e-4, a token dropped from a
# mean) moves values by thousands of ulps and is caught; a reordering is not, and is caught only where the fingerprint
# matches and the comparison is exact.
ULPS = 128
F32_EPS = 1.1920928955078125e-07


def within_ulps(got, want, ulps: float = ULPS) -> bool:
    """Tensors (or floats) equal within ``ulps`` float32 ulps of ``want``'s largest finite magnitude; NaN where the
    other is NaN; same dtype and shape."""
    import torch

    got, want = torch.as_tensor(got), torch.as_tensor(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    both_nan = got.isnan() & want.isnan()
    if bool((got.isnan() ^ want.isnan()).any()):
        return False
    g, w = got.double().masked_fill(both_nan, 0.0), want.double().masked_fill(both_nan, 0.0)
    if bool((g.isinf() | w.isinf()).any()):
        return bool((g == w).all())
    scale = w.abs().max().item() if w.numel() else 0.0
    return bool(((g - w).abs() <= ulps * F32_EPS * scale).all())
