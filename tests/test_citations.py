"""Every official file:line cited in the repository has a committed snippet of the cited lines (tests/citations/
official.txt), checked offline; with an official checkout at hand the snippets are compared with its files.

A citation is a ``path:line`` or ``path:first-last`` token in a tracked .md, .py, .yaml or .sh file. Tokens whose
path is this repository's own (from the root, from the citing file's folder, or a unique tracked path ending in it)
are this repository's and not checked here. Every other token is official: an entry ``## <owner/repo> <full
path>:<first>-<last>`` of official.txt whose path ends in the cited path, with the same lines, holds its snippet
(``| `` + each line). Entries of ``volcengine/verl`` are compared with the installed verl 0.9.1 on every run;
the others when the environment names a checkout (a work tree or a bare git directory, read at the entry's
commit): OFFICIAL_LUFFY, OFFICIAL_HPT, OFFICIAL_PREFIX_RFT, OFFICIAL_TRINITY, OFFICIAL_VERL_RECIPE. A citation whose source could not be
fetched when the snippets were taken is listed as ``!! <citing file> <token> <why>`` and reported, not passed
silently.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "tests" / "citations" / "official.txt"
# owner/repo -> (environment variable naming a checkout, the commit the snippets were read at)
REPOS = {
    "ElliottYan/LUFFY": ("OFFICIAL_LUFFY", "01f4ae0"),
    "TsinghuaC3I/Unify-Post-Training": ("OFFICIAL_HPT", "ae332f5fa4dc8b4c3d3cd77ebc9cff3a3abab2d0"),
    "ZeroYuHuang/prefix_rft": ("OFFICIAL_PREFIX_RFT", "5f5d2a1fb18f0efb6d5ac51839b2750490cefaf8"),
    "modelscope/Trinity-RFT": ("OFFICIAL_TRINITY", "b458e2c2"),
    "verl-project/verl-recipe": ("OFFICIAL_VERL_RECIPE", "48ea0a797fa29867ea0ad92aff7d284eec7d4be3"),
    "volcengine/verl": (None, "0.9.1"),  # the installed packages, compared on every run
    "vllm-project/vllm": (None, "installed"),
    "ray-project/ray": (None, "installed"),
}
INSTALLED = {"volcengine/verl": "verl", "vllm-project/vllm": "vllm", "ray-project/ray": "ray"}
HEADER = ("# Snippets of the official file:line citations in this repository (tests/test_citations.py).\n"
          "# '## <owner/repo> <path>:<first>-<last>' then the lines, each prefixed '| '; '!! <file> <token> <why>':\n"
          "# a citation whose source was not at hand when the snippets were taken.\n")
TOKEN = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:py|sh|yaml|md)):(\d+)(?:-(\d+))?(?![\w])")
SUFFIXES = (".md", ".py", ".yaml", ".sh")


@dataclass(frozen=True)
class Citation:
    where: str  # the citing file, relative to the repository root
    line: int
    path: str
    start: int
    end: int

    @property
    def token(self) -> str:
        return f"{self.path}:{self.start}" + (f"-{self.end}" if self.end != self.start else "")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [p for p in out if p.endswith(SUFFIXES) and not p.startswith("tests/citations/")]


def all_citations() -> list[Citation]:
    out = []
    for rel in tracked():
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for m in TOKEN.finditer(line):
                start = int(m.group(2))
                out.append(Citation(rel, number, m.group(1), start, int(m.group(3) or start)))
    return out


def _own(c: Citation, files: set[str], by_suffix: dict[str, int]) -> bool:
    path = c.path.lstrip("./")
    if path in files or str(Path(c.where).parent / path) in files:
        return True
    if "/" in path:
        return by_suffix.get(path, 0) >= 1  # a tracked path ending in it
    return by_suffix.get(path, 0) == 1  # a unique tracked file name


def official_citations() -> list[Citation]:
    files = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split())  # fmt: skip
    by_suffix: dict[str, int] = {}
    for f in files:
        parts = f.split("/")
        for i in range(1, len(parts)):
            key = "/".join(parts[i:])
            by_suffix[key] = by_suffix.get(key, 0) + 1
    return [c for c in all_citations() if not _own(c, files, by_suffix)]


@dataclass
class Entry:
    repo: str
    path: str
    start: int
    end: int
    lines: list[str]


def registry() -> tuple[list[Entry], list[tuple[str, str, str]]]:
    entries, unchecked = [], []
    for number, raw in enumerate(REGISTRY.read_text(encoding="utf-8").splitlines(), 1):
        if raw.startswith("## "):
            m = re.fullmatch(r"## (\S+/\S+) (\S+):(\d+)-(\d+)", raw)
            assert m, f"{REGISTRY.name}:{number}: bad entry header {raw!r}"
            assert m.group(1) in REPOS, f"{REGISTRY.name}:{number}: unknown repository {m.group(1)}"
            entries.append(Entry(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), []))
        elif raw.startswith("|"):
            assert entries, f"{REGISTRY.name}:{number}: a snippet line before any entry"
            entries[-1].lines.append(raw[2:] if raw.startswith("| ") else "")
        elif raw.startswith("!! "):
            where, token, why = raw[3:].split(" ", 2)
            unchecked.append((where, token, why))
        else:
            assert raw.startswith("#") or not raw.strip(), f"{REGISTRY.name}:{number}: unexpected line {raw!r}"
    return entries, unchecked


def covering(c: Citation, entries: list[Entry]) -> list[Entry]:
    path = c.path.lstrip("./")
    return [e for e in entries if (e.path == path or e.path.endswith("/" + path)) and (e.start, e.end) == (c.start, c.end)]


def test_citations_have_their_snippets():
    """Form (first <= last, from line 1) and a snippet of exactly the cited lines for every official citation."""
    entries, unchecked = registry()
    for e in entries:
        assert 1 <= e.start <= e.end and len(e.lines) == e.end - e.start + 1, (e.repo, e.path, e.start, e.end)
        assert any(line.strip() for line in e.lines), f"{e.path}:{e.start}-{e.end}: an empty snippet"
    waived = {(where, token) for where, token, _ in unchecked}
    bad = [f"{c.where}:{c.line}: {c.token}" for c in official_citations()
           if not 1 <= c.start <= c.end or not (covering(c, entries) or (c.where, c.token) in waived)]  # fmt: skip
    assert not bad, "official citations without a snippet in tests/citations/official.txt (or a bad line range):\n" + "\n".join(bad)


def _official_lines(repo: str, path: str, checkout: Path, commit: str) -> list[str]:
    if (checkout / path).is_file() and not (checkout / "HEAD").is_file():
        return (checkout / path).read_text(encoding="utf-8").splitlines()
    out = subprocess.run(["git", "--git-dir", str(checkout), "show", f"{commit}:{path}"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return out.stdout.splitlines()


def compare(entries: list[Entry], repo: str, checkout: Path) -> int:
    """The entries of ``repo`` against its checkout; returns how many were compared."""
    commit, done, wrong = REPOS[repo][1], 0, []
    for e in (e for e in entries if e.repo == repo):
        lines = [line.rstrip() for line in _official_lines(repo, e.path, checkout, commit)[e.start - 1:e.end]]
        if lines != [line.rstrip() for line in e.lines]:
            wrong.append(f"{e.path}:{e.start}-{e.end}")
        done += 1
    assert not wrong, f"{repo}: snippets differ from the files at {commit}: {wrong}"
    return done


@pytest.mark.parametrize("repo", sorted(INSTALLED))
def test_installed_snippets_match_the_installed_packages(repo):
    """Snippets of verl 0.9.1, vLLM and Ray (paths from the package folder) against the installed packages."""
    import importlib.util

    spec = importlib.util.find_spec(INSTALLED[repo])
    if spec is None or spec.origin is None:
        pytest.skip(f"{INSTALLED[repo]} not installed")
    entries, _ = registry()
    compare(entries, repo, Path(spec.origin).resolve().parents[1])


@pytest.mark.parametrize("repo", [r for r, (env, _) in REPOS.items() if env])
def test_snippets_match_an_official_checkout(repo):
    """With OFFICIAL_<NAME>=<dir> set: every snippet of that repository equals its file's lines at the commit."""
    env = REPOS[repo][0]
    if not os.environ.get(env):
        pytest.skip(f"{env} not set (an official {repo} checkout or bare git directory)")
    entries, _ = registry()
    checked = compare(entries, repo, Path(os.environ[env]))
    citations = [c for c in official_citations() if any(e.repo == repo for e in covering(c, entries))]
    print(f"{repo}: {checked} snippets compared, covering {len(citations)} citations")
