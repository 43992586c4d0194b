"""`make install`'s choice of source for torch's CPU build (scripts/install_torch.py via `make install-torch`).

Offline: a fake tiny ``torch`` wheel stands in for the real one, a local simple index (``file://``) for
PyTorch's CPU wheel index, and a throw-away venv (pip copied in, nothing else) for the user's ``.venv``.
pip's own config and this machine's sources are switched off (``PIP_CONFIG_FILE=/dev/null``), so each case
sees only the sources it sets up. Nothing is downloaded and the shared venv is not touched.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UNREACHABLE = "http://127.0.0.1:9/simple"  # the discard port: connection refused at once


def _wheel(directory: Path, version: str, build: str) -> Path:
    """A minimal valid wheel ``torch-<version>-py3-none-any.whl`` whose module says which build it is."""
    name = f"torch-{version}-py3-none-any.whl"
    dist = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f'BUILD = "{build}"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / name, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return directory / name


def _index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 simple index at ``root`` serving ``wheels`` as project ``torch``; returns its file:// URL."""
    project = root / "torch"
    project.mkdir(parents=True)
    links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in wheels)
    for w in wheels:
        shutil.copy(w, project / w.name)
    (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    (root / "index.html").write_text('<html><body><a href="torch/">torch</a></body></html>\n')
    return root.as_uri()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("torch_sources")
    built = base / "built"
    cpu, cuda = _wheel(built, "2.13.0+cpu", "cpu"), _wheel(built, "2.13.0", "cuda")
    empty = base / "empty"
    empty.mkdir()
    (empty / "index.html").write_text("<html><body></body></html>\n")
    return {
        "cpu": cpu,
        "cuda": cuda,
        "empty_index": empty.as_uri(),  # pip's primary index here: PyPI stays out of the test
        "index_both": _index(base / "index_both", [cuda, cpu]),  # PyTorch's CPU index (and a CUDA wheel)
        "index_cuda": _index(base / "index_cuda", [cuda]),  # what PyPI has: only the CUDA build
        "find_links": cpu.parent,
    }


@pytest.fixture
def venv(tmp_path):
    """A fresh venv with a copy of this interpreter's pip and nothing else (no torch)."""
    import importlib.util

    # pip's folder without importing pip here: importing it leaves the stdlib distutils in sys.modules, and a later
    # `import setuptools` in this process (vLLM -> torch.utils.cpp_extension) then fails its distutils check
    pip_dir = Path(importlib.util.find_spec("pip").submodule_search_locations[0])
    path = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next(path.glob("lib/python*/site-packages"))
    shutil.copytree(pip_dir, site / "pip")
    return path


def _make(venv: Path, assets: dict, index: str, find_links: Path | None = None, args: str = "--no-deps"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=assets["empty_index"], PIP_NO_CACHE_DIR="1")
    if find_links:
        env["PIP_FIND_LINKS"] = str(find_links)
    cmd = ["make", "-s", "--no-print-directory", "-C", str(REPO), "install-torch", f"VENV={venv}",
           f"TORCH_CPU_INDEX={index}", f"TORCH_INSTALL_ARGS={args}"]  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    return out, time.monotonic() - start


def _installed(venv: Path) -> tuple[str, str] | None:
    code = "import importlib.metadata as m, torch; print(m.version('torch'), torch.BUILD)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True)
    return tuple(out.stdout.split()) if out.returncode == 0 else None


def test_no_wheel_at_hand_takes_the_cpu_build_from_the_index(venv, assets):
    """A user's machine: nothing at hand -> PyTorch's CPU index (here a local stand-in that also serves a
    CUDA-named torch 2.13.0): the +cpu build goes in; a second run finds it installed and does nothing."""
    out, _ = _make(venv, assets, assets["index_both"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"from the CPU wheel index {assets['index_both']}" in out.stdout
    assert _installed(venv) == ("2.13.0+cpu", "cpu")
    again, _ = _make(venv, assets, assets["index_both"])
    assert again.returncode == 0 and "already installed" in again.stdout, again.stdout + again.stderr


def test_wheel_at_hand_is_used_without_asking_the_index(venv, assets):
    """This machine: the wheel lies in a find-links directory and the index cannot be reached. The choice
    is made offline, the index is never contacted (an unreachable one costs nothing)."""
    dry, _ = _make(venv, assets, UNREACHABLE, find_links=assets["find_links"], args="--dry-run")
    assert dry.returncode == 0 and "from a wheel at hand" in dry.stdout, dry.stdout + dry.stderr
    assert _installed(venv) is None  # --dry-run installs nothing
    out, seconds = _make(venv, assets, UNREACHABLE, find_links=assets["find_links"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "from a wheel at hand" in out.stdout and UNREACHABLE not in out.stdout + out.stderr
    assert _installed(venv) == ("2.13.0+cpu", "cpu")
    print(f"wheel at hand: {seconds:.1f} s")


def test_never_a_cuda_build_and_an_unreachable_index_fails_fast(venv, assets):
    """Only the CUDA build reachable (PyPI's case): the install fails and names what to do, and no torch is
    installed. An unreachable index fails within seconds, not after pip's minutes of retries."""
    out, _ = _make(venv, assets, assets["index_cuda"])
    assert out.returncode != 0 and _installed(venv) is None
    assert "could not install torch==2.13.0+cpu" in out.stderr and "PIP_FIND_LINKS" in out.stderr, out.stderr
    out, seconds = _make(venv, assets, UNREACHABLE)
    assert out.returncode != 0 and _installed(venv) is None
    assert seconds < 60, f"an unreachable index took {seconds:.0f} s"
