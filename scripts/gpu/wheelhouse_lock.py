"""The lock of ``scripts/gpu/wheelhouse.py``: resolve a set for a target with pip's own resolver, leave out what a
host already has, and check a lock with no network.

A lock is JSON: the target (Python version, platform tags, glibc, marker environment), the set's requirements, the
host freeze it was made against, and one entry per wheel: name, version, file name, source, url, index sha256, size,
Requires-Dist. The resolve is ``pip install --dry-run --ignore-installed --report`` with ``--python-version``,
``--platform`` and ``--only-binary=:all:`` for the target. pip evaluates environment markers (``python_version >
"3.11"``) against the interpreter that runs it, not the target (``--python-version`` sets only tags and
Requires-Python), so the resolve runs pip with its marker environment replaced by the target's; the report's
``environment`` proves it took. Run with pip's config switched off (``PIP_CONFIG_FILE=/dev/null``): a machine's
find-links, mirrors and constraints stay out of a lock that others use.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

try:  # the check needs PEP 508 parsing; pip's vendored copy where packaging is not installed
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pragma: no cover
    from pip._vendor.packaging.markers import Marker  # noqa: F401
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK_DIR = REPO / "scripts" / "gpu" / "locks"
HOST_DIR = REPO / "scripts" / "gpu" / "hosts"
DEFAULT_LOCK = LOCK_DIR / "gpu-cp312-manylinux_2_34_x86_64.json"
DEFAULT_HOST = HOST_DIR / "h200-cuda-image.txt"
PYPI = "https://pypi.org/simple"

# make install-gpu's first step (Makefile): pip itself and the build tools the editable install and flash-attn use
GPU_TOOLS = ["pip>=25", "setuptools>=77", "wheel", "ninja", "packaging", "psutil"]
CPU_TOOLS = ["pip>=25", "setuptools>=64", "wheel"]
# Pure-Python packages whose releases on PyPI are sdists only, built here into py3-none-any wheels before the resolve
# (a foreign-target resolve takes wheels only). More are found by the resolve itself (see resolve()).
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]  # hydra-core 1.3's pin (antlr4-python3-runtime==4.9.*)

# flash-attn: PyPI has its sdist only; the prebuilt torch 2.11 / CUDA 13.0 wheel comes from a GitHub release
# (scripts/gpu_install.py FLASH_ATTN_WHEELS). Not downloadable from this repository's machine (no network to
# GitHub): the sha256 is the one a public install script checks this file against before installing it
# (`sha256sum --check`); `download` verifies it. Its Requires-Dist: flash-attn 2.8.3's setup.py install_requires.
FLASH_ATTN = {
    ("3.12", "x86_64"): {
        "name": "flash-attn",
        "version": "2.8.3+cu130torch2.11",
        "filename": "flash_attn-2.8.3+cu130torch2.11-cp312-cp312-linux_x86_64.whl",
        "sha256": "173b0e1a5d6a0becb4ce11b755605c4b20289a6d17816a00cfd7a69078c3e612",
        "sha256_from": "a public install script that checks this file with sha256sum before installing it; "
        "not downloaded here (GitHub is out of this machine's reach)",
    },
    ("3.11", "x86_64"): {
        "name": "flash-attn",
        "version": "2.8.3+cu130torch2.11",
        "filename": "flash_attn-2.8.3+cu130torch2.11-cp311-cp311-linux_x86_64.whl",
        "sha256": None,
        "sha256_from": "unknown: `download` records the hash it gets (trust on first use)",
    },
}
FLASH_ATTN_REQUIRES = ["torch", "einops"]


@dataclasses.dataclass(frozen=True)
class Target:
    """A Python and a platform to resolve for: CPython ``python`` on Linux ``machine`` with glibc >= ``glibc``."""

    python: str = "3.12"
    python_full: str = "3.12.3"
    machine: str = "x86_64"
    glibc: str = "2.34"

    @property
    def platforms(self) -> list[str]:
        """pip's ``--platform`` tags: pip matches each exactly, so every manylinux_2_N up to glibc, and the aliases."""
        major, minor = (int(x) for x in self.glibc.split("."))
        tags = [f"manylinux_{major}_{n}_{self.machine}" for n in range(minor, 4, -1)]
        aliases = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}
        tags += [f"{alias}_{self.machine}" for alias, need in aliases.items() if (major, minor) >= need]
        return tags

    @property
    def environment(self) -> dict[str, str]:
        """PEP 508 marker environment of the target (platform_release/version are the kernel's: left empty)."""
        return {
            "implementation_name": "cpython", "implementation_version": self.python_full, "os_name": "posix",
            "platform_machine": self.machine, "platform_release": "", "platform_system": "Linux",
            "platform_version": "", "python_full_version": self.python_full,
            "platform_python_implementation": "CPython", "python_version": self.python, "sys_platform": "linux",
        }  # fmt: skip

    @property
    def tag(self) -> str:
        return f"cp{self.python.replace('.', '')}-manylinux_{self.glibc.replace('.', '_')}_{self.machine}"

    def pip_args(self) -> list[str]:
        args = ["--python-version", self.python, "--implementation", "cp", "--only-binary=:all:"]
        for p in self.platforms:
            args += ["--platform", p]
        return args

    @classmethod
    def here(cls) -> "Target":
        import platform

        libc = platform.libc_ver()[1] or "2.17"
        return cls(python=f"{sys.version_info[0]}.{sys.version_info[1]}", python_full=platform.python_version(),
                   machine=platform.machine(), glibc=libc)  # fmt: skip


# ---- what a set asks for ----------------------------------------------------------------------------------------
def project_requirements(extras: list[str], root: Path = REPO) -> list[str]:
    """The project's install_requires plus the given extras, read from setup.py: its setup() call is captured by a
    stand-in setuptools module (none needs to be installed)."""
    import types

    captured: dict = {}
    fake = types.ModuleType("setuptools")
    fake.setup = lambda **kw: captured.update(kw)
    fake.find_packages = lambda *a, **k: []
    saved, cwd = sys.modules.get("setuptools"), os.getcwd()
    sys.modules["setuptools"] = fake
    try:
        os.chdir(root)
        runpy.run_path(str(root / "setup.py"), run_name="__main__")
    finally:
        os.chdir(cwd)
        if saved is None:
            sys.modules.pop("setuptools", None)
        else:
            sys.modules["setuptools"] = saved
    reqs = list(captured["install_requires"])
    for extra in extras:
        reqs += captured.get("extras_require", {})[extra]
    return reqs


def gpu_pins(root: Path = REPO) -> list[str]:
    """``GPU_PINS`` of the Makefile (verl 0.9.1's own pins; tests/test_verl_key_parity.py keeps them verl's)."""
    text = (root / "Makefile").read_text()
    return re.search(r"^GPU_PINS\s*:=(.*)$", text, re.M).group(1).split()


def set_requirements(name: str) -> tuple[list[str], list[str]]:
    """(requirements, project extras) of a set."""
    if name == "cpu":
        from scripts.install_torch import TORCH_CPU

        return [*project_requirements(["test", "cpu"]), TORCH_CPU, *CPU_TOOLS], ["test", "cpu"]
    if name in ("gpu", "gpu-lean"):
        return [*project_requirements(["gpu", "test"]), *gpu_pins(), *GPU_TOOLS], ["gpu", "test"]
    raise ValueError(f"unknown set {name!r} (cpu, gpu, gpu-lean)")


# ---- host freeze -------------------------------------------------------------------------------------------------
def read_freeze(path: str | Path | None) -> dict[str, str | None]:
    """{canonical name: version} of a ``pip freeze`` file: ``name==version`` lines, and bare ``name`` lines for a
    package known to be there at a version not recorded (None: it meets only requirements with no version)."""
    if not path:
        return {}
    have: dict[str, str | None] = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+))?$", line)
        if m:
            have[canonicalize_name(m.group(1))] = m.group(2)
    return have


def host_meets(version: str | None, req: Requirement) -> bool:
    """A host package at ``version`` (None: not recorded) meets ``req`` (its extras aside)."""
    if req.url:
        return False
    if version is None:
        return not req.specifier
    return req.specifier.contains(_version(version), prereleases=True)


# ---- the resolve -----------------------------------------------------------------------------------------------
_PIP_WITH_TARGET_MARKERS = """
import json, runpy, sys
env = json.loads(sys.argv.pop(1))
from pip._vendor.packaging import markers
markers.default_environment = lambda: dict(env)
if hasattr(markers, "_cached_default_environment"):
    markers._cached_default_environment = lambda: dict(env)
try:
    from pip._internal.models import installation_report
    installation_report.default_environment = lambda: dict(env)
except ImportError:
    pass
sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def pip_env(extra: dict | None = None) -> dict[str, str]:
    """The environment for pip runs that must not see this machine's pip config (find-links, mirrors, caps)."""
    keep = {"PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env["PIP_CONFIG_FILE"] = os.devnull
    env.update(extra or {})
    return env


def simple_files(project: str, index: str = PYPI) -> dict[str, dict]:
    """{file name: {url, sha256, size}} from the index's JSON simple API (PEP 691/700)."""
    url = f"{index.rstrip('/')}/{canonicalize_name(project)}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        data = json.load(r)
    return {f["filename"]: {"url": f["url"], "sha256": f.get("hashes", {}).get("sha256"), "size": f.get("size")}
            for f in data["files"]}  # fmt: skip


def build_sdist_wheel(spec: str, out: Path, index: str = PYPI) -> dict:
    """Build a pure-Python sdist-only package into a wheel under ``out``; returns its lock entry fields.
    Refuses a build that yields a platform wheel: that one must be built on the target."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", ":all:", "--index-url", index,
           "-w", str(out), spec]  # fmt: skip
    subprocess.run(cmd, check=True, env=pip_env())
    want = canonicalize_name(Requirement(spec).name)
    made = sorted(set(out.glob("*.whl")) - before) or [w for w in out.glob("*.whl")
                                                       if canonicalize_name(w.name.split("-")[0]) == want]  # fmt: skip
    wheel = made[0]
    tags = wheel.name[:-4].split("-")[-3:]
    if tags[1:] != ["none", "any"]:
        raise SystemExit(f"{spec} ships only an sdist and builds a platform wheel ({wheel.name}): build it on the "
                         "target machine")  # fmt: skip
    name, version = wheel.name.split("-")[:2]
    sdists = {f: i for f, i in simple_files(name, index).items()
              if f.endswith((".tar.gz", ".zip")) and f"-{version}." in f}  # fmt: skip
    sdist_name, sdist = next(iter(sdists.items()))
    return {"filename": wheel.name, "sdist": {"filename": sdist_name, **sdist}, "path": str(wheel)}


def run_resolve(reqs: list[str], target: Target, index: str, find_links: list[str],
                report: Path) -> subprocess.CompletedProcess:  # fmt: skip
    cmd = [sys.executable, "-c", _PIP_WITH_TARGET_MARKERS, json.dumps(target.environment), "install", "--dry-run",
           "--ignore-installed", "--quiet", "--report", str(report), "--index-url", index,
           *target.pip_args()]  # fmt: skip
    for link in find_links:
        cmd += ["--find-links", str(link)]
    return subprocess.run([*cmd, *reqs], capture_output=True, text=True, env=pip_env())


def resolve(reqs: list[str], target: Target, index: str = PYPI, work: Path | None = None, log=print,
            find_links: tuple[str, ...] = ()) -> tuple[dict, dict]:  # fmt: skip
    """pip's resolve of ``reqs`` for ``target``: (report, {canonical name: built-wheel fields}). A requirement that
    only an sdist satisfies (pip: "No matching distribution found for X") is built into a wheel and the resolve
    runs again."""
    work = Path(work or tempfile.mkdtemp(prefix="wheelhouse-lock-"))
    built_dir, built = work / "built", {}
    for spec in SDIST_ONLY:
        built[canonicalize_name(Requirement(spec).name)] = build_sdist_wheel(spec, built_dir, index)
    for _ in range(10):
        out = run_resolve(reqs, target, index, [str(built_dir), *find_links], work / "report.json")
        if out.returncode == 0:
            report = json.loads((work / "report.json").read_text())
            if report["environment"].get("python_version") != target.python:
                raise SystemExit(f"pip did not take the target's markers (report environment {report['environment']})")
            return report, built
        missing = re.search(r"No matching distribution found for (\S+)", out.stderr)
        if not missing:
            raise SystemExit(f"the resolve failed:\n{out.stderr[-4000:]}")
        spec = missing.group(1)
        name = canonicalize_name(Requirement(spec).name)
        if "+" in spec:  # a local version (torch==2.13.0+cpu): no index builds it; it comes from --find-links
            raise SystemExit(f"lock: no wheel for {spec} on {index}: give the folder that holds it (--find-links DIR; "
                             "this machine: /opt/wheels) or its index (--find-links URL)")  # fmt: skip
        if name in built:
            raise SystemExit(f"the resolve failed on {spec} after building it:\n{out.stderr[-4000:]}")
        log(f"lock: {spec} has no wheel for {target.tag}: building its sdist into a wheel (pure Python only)")
        built[name] = build_sdist_wheel(spec, built_dir, index)
    raise SystemExit("the resolve did not settle after 10 sdist builds")


def source_of(url: str) -> str:
    if "files.pythonhosted.org" in url or "pypi.org" in url:
        return "pypi"
    if "download.pytorch.org" in url:
        return "pytorch-index"
    if "github.com" in url:
        return "github-release"
    if url.startswith("file:"):
        return "local-wheel"
    return url.split("/")[2] if "://" in url else "local"


def entries_from_report(report: dict, built: dict, index: str) -> list[dict]:
    """Lock entries from pip's report, with each file's size (and sha256 checked) from the index's JSON API."""
    rows = []
    for item in report["install"]:
        meta, info = item["metadata"], item["download_info"]
        name = canonicalize_name(meta["name"])
        url = info["url"]
        filename = urllib.parse.unquote(url.rsplit("/", 1)[1])
        row = {"name": name, "version": meta["version"], "filename": filename, "source": source_of(url),
               "url": url, "sha256": info.get("archive_info", {}).get("hashes", {}).get("sha256"), "size": None,
               "requires_python": meta.get("requires_python"),
               "requires_dist": meta.get("requires_dist", [])}  # fmt: skip
        if name in built:
            b = built[name]
            row.update(filename=b["filename"], source="sdist-built", url=b["sdist"]["url"], sha256=b["sdist"]["sha256"],
                       size=b["sdist"]["size"], sdist=b["sdist"]["filename"],
                       built_size=os.path.getsize(b["path"]))  # fmt: skip
        rows.append(row)

    def size(row):
        if row["url"].startswith("file:"):
            row["size"] = os.path.getsize(urllib.request.url2pathname(urllib.parse.urlparse(row["url"]).path))
        if row["size"] is None and row["source"] == "pypi":
            files = simple_files(row["name"], index)
            f = files.get(row["filename"])
            if f:
                if f["sha256"] and row["sha256"] and f["sha256"] != row["sha256"]:
                    raise SystemExit(f"{row['filename']}: report sha256 {row['sha256']} != index {f['sha256']}")
                row["size"] = f["size"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(size, rows))
    return sorted(rows, key=lambda r: r["name"])


# ---- what is needed, given a host --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _req(text: str) -> Requirement:
    """A parsed requirement (cached: a lock check parses the same few thousand strings again and again)."""
    return Requirement(text)


@functools.lru_cache(maxsize=None)
def _applies_cached(text: str, env: tuple, extras: frozenset) -> bool:
    r = _req(text)
    return r.marker is None or any(r.marker.evaluate({**dict(env), "extra": e}) for e in (extras | {""}))


@functools.lru_cache(maxsize=None)
def _version(text: str) -> Version:
    return Version(text)


def walk(roots: list[str], entries: dict[str, dict], have: dict[str, str], env: dict, dropped=frozenset()):
    """Follow the requirements from ``roots`` through the locked ``entries`` ({name: entry}). A locked name is met
    by its locked version (installed, it shadows the host's); any other name by the host's version (``have``), and
    the walk ends there: the host's own needs are the host's. ``dropped`` names are skipped (lean).
    Returns (needed entry names, host names used, problems, {name: [(specifier, required by)]}, names asked with
    extras)."""
    needed, from_host, problems, wanted, with_extras = set(), set(), [], {}, set()
    extras_of: dict[str, set[str]] = {}
    env_key = tuple(sorted(env.items()))
    queue = [(t, "the set's requirements") for t in roots if _applies_cached(t, env_key, frozenset())]
    while queue:
        text, by = queue.pop()
        req = _req(text)
        name = canonicalize_name(req.name)
        wanted.setdefault(name, []).append((str(req.specifier), by))
        if req.extras:
            with_extras.add(name)
        if name in dropped:
            continue
        entry, host = entries.get(name), have.get(name)
        if entry is None:
            if name not in have:
                problems.append(f"{by} requires {req}: no wheel for {name} in the lock and none on the host")
            elif not host_meets(host, req):
                problems.append(f"{by} requires {req}: not in the lock, and the host's {name} {host} does not meet it")
            else:
                from_host.add(name)
            continue
        if req.specifier and not req.url and not req.specifier.contains(_version(entry["version"]), prereleases=True):
            problems.append(f"{by} requires {req}: the lock has {name} {entry['version']}")
        new_extras = set(req.extras) - extras_of.get(name, set())
        if name in needed and not new_extras:
            continue
        needed.add(name)
        extras_of.setdefault(name, set()).update(req.extras)
        active = frozenset(extras_of[name])
        for t in entry.get("requires_dist") or []:
            if _applies_cached(t, env_key, active):
                queue.append((t, f"{name} {entry['version']}"))
    return needed, from_host, problems, wanted, with_extras


def prune(roots: list[str], rows: list[dict], have: dict[str, str], env: dict) -> tuple[list[dict], dict[str, str]]:
    """Leave out what the host has at a version that meets every requirement on it, then what only such host
    packages needed. A package asked for with extras stays (the host freeze does not say what its extras need).
    Repeats until nothing changes: an entry taken back adds its requirements. Returns (kept rows, {name: host
    version} left out)."""
    every = {r["name"]: r for r in rows}
    from_host = set(have) & set(every)
    while True:
        entries = {n: e for n, e in every.items() if n not in from_host}
        needed, used, problems, wanted, with_extras = walk(roots, entries, have, env)
        bad = {n for n in from_host if n in with_extras
               or not all(host_meets(have[n], Requirement(f"{n}{s}")) for s, _ in wanted.get(n, []))}  # fmt: skip
        if bad:
            from_host -= bad
            continue
        if problems:
            raise SystemExit("the lock is incomplete:\n  " + "\n  ".join(problems))
        return [entries[n] for n in sorted(needed)], {n: have[n] for n in sorted(used)}


def check(lock: dict, have: dict[str, str] | None = None, lean: bool = False) -> list[str]:
    """Problems of ``lock`` (empty: complete): every Requires-Dist of every locked wheel, under the target's markers
    and the extras asked of it, is met by a locked wheel or, for a name the lock does not hold, by the host freeze
    (``have``; default the one recorded in the lock). With ``lean``, the wheels that :mod:`wheelhouse_lean` leaves
    out are skipped; nothing else may go unmet. A locked wheel that nothing needs is a problem too."""
    env = lock["target"]["environment"]
    have = lock.get("host", {}).get("freeze", {}) if have is None else have
    entries = {e["name"]: e for e in lock["wheels"]}
    dropped: set[str] = set()
    if lean or lock.get("lean"):  # a full lock checked as lean, or a lean lock
        from scripts.gpu.wheelhouse_lean import LEAN, lean_drop

        gone = lean_drop(lock)
        entries = {n: e for n, e in entries.items() if n not in gone}
        dropped = set(LEAN) | set(lock.get("lean") or {})
    needed, _, problems, _, _ = walk(lock["requirements"], entries, have, env, frozenset(dropped))
    problems += [f"{n} {entries[n]['version']} is locked but nothing in the set needs it"
                 for n in sorted(set(entries) - needed)]  # fmt: skip
    return problems


def make_lock(set_name: str, target: Target, have_path: str | None = None, flash_attn: bool = True,
              index: str = PYPI, log=print, find_links: tuple[str, ...] = ()) -> dict:  # fmt: skip
    reqs, extras = set_requirements(set_name)
    log(f"lock: resolving {len(reqs)} requirements for {target.tag} with pip (index {index})")
    report, built = resolve(reqs, target, index, log=log, find_links=find_links)
    rows = entries_from_report(report, built, index)
    roots = list(reqs)
    if set_name.startswith("gpu") and flash_attn:
        fa = FLASH_ATTN.get((target.python, target.machine))
        if fa is None:
            raise SystemExit(f"no prebuilt flash-attn wheel for Python {target.python} on {target.machine}: "
                             "lock with --no-flash-attn (sdpa attention)")  # fmt: skip
        from scripts.gpu_install import FLASH_ATTN_WHEEL_BASE

        rows.append({**{k: v for k, v in fa.items()}, "source": "github-release", "size": None,
                     "url": FLASH_ATTN_WHEEL_BASE + fa["filename"].replace("+", "%2B"), "requires_python": ">=3.9",
                     "requires_dist": FLASH_ATTN_REQUIRES})  # fmt: skip
        roots.append(f"flash-attn=={fa['version']}")
    have = read_freeze(have_path)
    kept, left_out = prune(roots, rows, have, target.environment) if have else (rows, {})
    lock = {
        "lock_version": 1,
        "set": set_name,
        "made_by": "python scripts/gpu/wheelhouse.py lock (pip install --dry-run --ignore-installed --report, "
        "target markers)",
        "pip_version": report.get("pip_version"),
        "index": index,
        "target": {**dataclasses.asdict(target), "tag": target.tag, "platforms": target.platforms,
                   "environment": target.environment},  # fmt: skip
        "extras": extras,
        "flash_attn": "prebuilt wheel" if any(r["name"] == "flash-attn" for r in kept) else "left out (sdpa)",
        "requirements": roots,
        "host": {"file": _rel(have_path), "freeze": have, "left_out": left_out} if have else {},
        "wheels": kept,
    }
    if set_name == "gpu-lean":
        from scripts.gpu.wheelhouse_lean import lean_lock

        lock = lean_lock(lock)
    return lock


def _rel(path) -> str | None:
    if not path:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def sizes(lock: dict) -> tuple[int, int]:
    """(number of wheels, bytes) of a lock, built wheels counted at their built size."""
    total = sum((w.get("built_size") or w.get("size") or 0) for w in lock["wheels"])
    return len(lock["wheels"]), total
