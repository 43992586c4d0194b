"""scripts/gpu/wheelhouse.py (issue #53): the committed GPU lock is complete for its host, and an install from a
wheelhouse works with no index reachable, naming what is missing.

No network: the lock check reads the committed JSON; the install tests build a tiny wheelhouse of wheels made here,
switch pip's config off (``PIP_CONFIG_FILE=/dev/null``) and point its index at a closed port, and install with
``--no-index`` into throw-away venvs. ``make install`` itself goes through ``fetch`` + ``install`` (the Makefile), so
CI's own install proves the offline install of the real CPU set on every run.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from scripts.gpu import wheelhouse_lock as L
from scripts.gpu.wheelhouse_lean import LEAN, lean_drop, lean_lock

REPO = Path(__file__).resolve().parents[1]
WH = [sys.executable, str(REPO / "scripts" / "gpu" / "wheelhouse.py")]
UNREACHABLE = "http://127.0.0.1:9/simple"


# ---- the committed GPU lock ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lock():
    return json.loads(L.DEFAULT_LOCK.read_text())


def test_gpu_lock_is_the_default_targets_and_asks_for_the_set(lock):
    """The lock is for CPython 3.12 on manylinux x86_64, made against the recorded H200 freeze, and asks for what
    `make install-gpu` installs now (setup.py's gpu and test extras, the Makefile's GPU_PINS, the tools, flash-attn's
    prebuilt wheel): a change to either shows here until the lock is made again."""
    target = lock["target"]
    assert (target["python"], target["machine"], target["environment"]["python_version"]) == ("3.12", "x86_64", "3.12")
    assert lock["host"]["file"] == "scripts/gpu/hosts/h200-cuda-image.txt"
    assert lock["host"]["freeze"] == L.read_freeze(L.DEFAULT_HOST)
    reqs, extras = L.set_requirements("gpu")
    fa = L.FLASH_ATTN[("3.12", "x86_64")]
    assert lock["requirements"] == [*reqs, f"flash-attn=={fa['version']}"] and lock["extras"] == extras
    pins = {w["name"]: w["version"] for w in lock["wheels"]}
    assert pins["vllm"] == "0.24.0" and pins["transformers"] == "5.9.0" and pins["verl"] == "0.9.1"
    # the host's torch 2.11.0+cu130 meets torch==2.11.0: not in the lock; its numpy 2.5 and transformers 5.17 do not
    assert "torch" not in pins and lock["host"]["left_out"]["torch"] == "2.11.0+cu130"
    assert L.Version(pins["numpy"]) < L.Version("2.4") and L.Version(pins["transformers"]) < L.Version("5.11")
    assert pins["antlr4-python3-runtime"] == "4.9.3"  # sdist-only: built into a wheel
    assert {w["name"]: w["source"] for w in lock["wheels"]}["antlr4-python3-runtime"] == "sdist-built"
    for w in lock["wheels"]:
        assert w["sha256"] and len(w["sha256"]) == 64, w["filename"]
        assert w["size"] or w["name"] == "flash-attn", w["filename"]


def test_gpu_lock_requires_dist_all_met_and_a_removed_entry_fails(lock):
    """Every Requires-Dist of every locked wheel, under the target's markers and the extras asked of it, is met by
    the lock plus the recorded host freeze; full and lean. Removing any wheel something needs, or a host package the
    lock counts on, makes the check fail naming it."""
    assert L.check(lock) == []
    assert L.check(lock, lean=True) == []
    assert L.check(lean_lock(lock)) == []
    for name in ("pydantic-core", "numpy", "vllm", "antlr4-python3-runtime"):
        broken = copy.deepcopy(lock)
        broken["wheels"] = [w for w in broken["wheels"] if w["name"] != name]
        problems = L.check(broken)
        assert any(f"no wheel for {name} " in p or f"host's {name} " in p for p in problems), (name, problems)
    numpy = next(p for p in L.check({**lock, "wheels": [w for w in lock["wheels"] if w["name"] != "numpy"]}))
    assert "host's numpy 2.5.2 does not meet" in numpy  # the host has it, at a version numba/mistral_common exclude
    host = {k: v for k, v in lock["host"]["freeze"].items() if k != "torch"}
    assert any("torch" in p and "none on the host" in p for p in L.check(lock, have=host))
    # a version the set does not allow
    broken = copy.deepcopy(lock)
    next(w for w in broken["wheels"] if w["name"] == "transformers")["version"] = "5.17.0"
    assert any("transformers" in p and "the lock has transformers 5.17.0" in p for p in L.check(broken))


def test_lean_leaves_out_what_the_rollout_does_not_reach(lock):
    drop = lean_drop(lock)
    assert set(LEAN) <= set(drop)
    assert {"tokenspeed-triton", "nvidia-cuda-nvcc", "nvidia-nvvm", "z3-solver"} <= set(drop)  # only via LEAN's
    kept = {w["name"] for w in lock["wheels"]} - set(drop)
    assert {"vllm", "verl", "ray", "flash-attn", "nvidia-cutlass-dsl", "xgrammar"} <= kept


def test_target_markers_and_freeze_parsing(tmp_path):
    t = L.Target()
    assert t.platforms[0] == "manylinux_2_34_x86_64" and "manylinux_2_5_x86_64" in t.platforms
    assert "manylinux2014_x86_64" in t.platforms and t.environment["python_full_version"] == "3.12.3"
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# comment\nTorch==2.11.0+cu130\nnvidia_nvtx\n-e git+https://x#egg=y\nfoo @ file:///x\n")
    assert L.read_freeze(freeze) == {"torch": "2.11.0+cu130", "nvidia-nvtx": None}
    assert L.host_meets(None, L.Requirement("nvidia-nvtx")) and not L.host_meets(None, L.Requirement("x>=1"))
    assert L.host_meets("2.11.0+cu130", L.Requirement("torch==2.11.0"))


# ---- a tiny wheelhouse, installed with no index -----------------------------------------------------------------
def _wheel(directory: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A minimal pure-Python wheel whose module holds its version."""
    dist = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    noise, block = b"", name.encode()  # 6 KiB that compress poorly, so that a few KiB make several pieces
    while len(noise) < 6144:
        block = hashlib.sha256(block).digest()
        noise += block
    files = {f"{name}/__init__.py": f'VERSION = "{version}"\nNOISE = "{noise.hex()}"\n', f"{dist}/METADATA": meta,
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
             "Tag: py3-none-any\n"}  # fmt: skip
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for p, text in files.items():
            zf.writestr(p, text)
    return path


def _wheelhouse(directory: Path, wheels: list[Path], dropped: list[Path] = ()) -> Path:
    """A folder as `download` leaves it: the wheels and the manifest (``dropped`` listed but not there)."""
    from scripts.gpu.wheelhouse_pack import sha256, write_manifest

    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for w in [*wheels, *dropped]:
        name, version = w.name.split("-")[:2]
        rows.append({"name": name, "version": version, "filename": w.name, "source": "test", "index_sha256": sha256(w),
                     "sha256": sha256(w), "size": w.stat().st_size})  # fmt: skip
        if w in wheels:
            (directory / w.name).write_bytes(w.read_bytes())
    write_manifest(directory, {"set": "test", "extras": [], "target": "any", "lean": None, "wheels": rows})
    return directory


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=UNREACHABLE, PIP_NO_CACHE_DIR="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")  # fmt: skip
    return env


def _wh(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*WH, *map(str, args)], capture_output=True, text=True, env=_env(), timeout=240)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Wheels: ``app`` needs ``lib>=1`` and ``hostpkg>=2``; ``orphan`` needs ``absent`` (no wheel anywhere); a host
    venv (no pip) that has ``hostpkg`` 2.0 installed, as a CUDA image has torch."""
    base = tmp_path_factory.mktemp("tiny")
    built = base / "built"
    wheels = {"app": _wheel(built, "app", "1.0", ["lib>=1", "hostpkg>=2"]), "lib": _wheel(built, "lib", "1.2"),
              "hostpkg": _wheel(built, "hostpkg", "2.0"),
              "orphan": _wheel(built, "orphan", "0.1", ["absent"])}  # fmt: skip
    host = base / "host"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(host)], check=True)
    with zipfile.ZipFile(wheels["hostpkg"]) as zf:  # installed as pip would (a pure wheel unpacks into site-packages)
        zf.extractall(next(host.glob("lib/python*/site-packages")))
    return {"base": base, "wheels": wheels, "host": host / "bin" / "python"}


def _import(python, *mods) -> str:
    code = "import importlib; print(' '.join(importlib.import_module(m).__file__ for m in %r))" % (mods,)
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else f"FAILED {out.stderr[-300:]}"


def test_pieces_install_with_no_index_over_a_hosts_packages(tiny, tmp_path):
    """pack (re-zipped stored, zstd, pieces of 2 KiB) -> install --pieces --venv over a host interpreter: the pieces
    and every wheel are verified, pip installs with --no-index, the host's hostpkg 2.0 meets app's need and is used
    where it lies (not installed again)."""
    w = tiny["wheels"]
    wh = _wheelhouse(tmp_path / "wh", [w["app"], w["lib"]])
    pieces = tmp_path / "pieces"
    out = _wh("pack", "--wheelhouse", wh, "--out", pieces, "--piece-mib", 2 / 1024, "--compress", "zstd", "--level", 3)
    assert out.returncode == 0, out.stderr
    meta = json.loads((pieces / "pieces.json").read_text())
    assert len(meta["pieces"]) >= 2 and meta["compression"] == "zstd" and meta["manifest"]["repacked"]
    app = next(x for x in meta["manifest"]["wheels"] if x["name"] == "app")
    assert app["index_sha256"] != app["sha256"]  # re-packed: both hashes kept
    venv = tmp_path / "venv"
    out = _wh("install", "--pieces", pieces, "--venv", venv, "--host-python", tiny["host"], "--no-project",
              "--unpack-to", tmp_path / "unpacked")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pieces verified" in out.stdout and "wheels verified (sha256)" in out.stdout
    files = _import(venv / "bin" / "python", "app", "lib", "hostpkg").split()
    assert str(venv) in files[0] and str(venv) in files[1], files
    assert str(tiny["host"].parents[1]) in files[2], files  # the host's copy, seen through the .pth


def test_install_names_what_is_missing(tiny, tmp_path):
    """A wheel the manifest lists but the folder lacks, a piece lost in transit, a corrupt wheel, and a requirement
    no wheel meets (the set incomplete): each is named, and nothing reaches an index."""
    w = tiny["wheels"]
    bare = tmp_path / "bare"  # never the shared venv, even if a check below let pip run
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    bare = bare / "bin" / "python"
    wh = _wheelhouse(tmp_path / "wh", [w["app"]], dropped=[w["lib"]])
    out = _wh("install", "--wheelhouse", wh, "--python", bare, "--no-project")
    assert out.returncode != 0 and "missing wheel lib-1.2-py3-none-any.whl" in out.stderr, out.stderr

    wh = _wheelhouse(tmp_path / "wh2", [w["orphan"]])
    venv = tmp_path / "venv"
    out = _wh("install", "--wheelhouse", wh, "--venv", venv, "--host-python", tiny["host"], "--no-project")
    assert out.returncode != 0
    assert "has no wheel for absent (needed by orphan" in out.stderr, out.stderr
    assert UNREACHABLE not in out.stdout + out.stderr

    (wh / w["orphan"].name).write_bytes(b"not the wheel")
    out = _wh("install", "--wheelhouse", wh, "--python", bare, "--no-project")
    assert out.returncode != 0 and "sha256 or size is not the manifest's" in out.stderr

    wh = _wheelhouse(tmp_path / "wh3", [w["app"], w["lib"]])
    pieces = tmp_path / "pieces"
    assert _wh("pack", "--wheelhouse", wh, "--out", pieces, "--piece-mib", 1 / 1024, "--compress", "gz").returncode == 0
    lost = json.loads((pieces / "pieces.json").read_text())["pieces"][1]["name"]
    (pieces / lost).unlink()
    out = _wh("install", "--pieces", pieces, "--python", bare, "--no-project")
    assert out.returncode != 0 and f"pieces missing in {pieces}: {lost}" in out.stderr, out.stderr


def test_fetch_takes_torch_at_hand_or_from_the_cpu_index(tmp_path):
    """make install's download of torch's CPU build (scripts/install_torch.py's choice): a wheel at hand is taken
    with no index; with none at hand, PyTorch's CPU index (here a local stand-in) serves it; never a CUDA build."""
    from scripts.gpu.wheelhouse_pack import fetch_torch

    sys.path.insert(0, str(REPO / "tests"))
    from test_install_torch import _index
    from test_install_torch import _wheel as torch_wheel

    cpu, cuda = torch_wheel(tmp_path / "built", "2.13.0+cpu", "cpu"), torch_wheel(tmp_path / "built", "2.13.0", "cuda")
    index = _index(tmp_path / "index", [cuda, cpu])
    venv = tmp_path / "venv"  # a python without torch; this interpreter's pip acts on it (pip's --python)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = _env()
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        dest = tmp_path / "wh_index"
        assert fetch_torch(str(venv / "bin" / "python"), dest, index, log=lambda *_: None) == "index"
        assert [p.name for p in dest.glob("*.whl")] == [cpu.name]
        os.environ["PIP_FIND_LINKS"] = str(cpu.parent)
        dest = tmp_path / "wh_hand"
        assert fetch_torch(str(venv / "bin" / "python"), dest, UNREACHABLE, log=lambda *_: None) == "at hand"
        assert [p.name for p in dest.glob("*.whl")] == [cpu.name]
    finally:
        os.environ.clear()
        os.environ.update(saved)
