"""Every recipe README's "Differences from the official code, by scope" section (issue #39, item 4): a table with one
row per scope (loss, advantage, sampling, data, schedule), or, for a recipe with no official code, the one line
"Official code: none" saying what it is instead; and every file:line of ours in the table still points at today's code:
the file exists, the line exists, and a `name` written right after a `file:N` reference is on line N.

Text only (no Ray, no model): about 1 s.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"
RECIPES = sorted(p.parent.name for p in RECIPES_DIR.glob("*/README.md"))
HEADING = "## Differences from the official code, by scope"
SCOPES = ("loss", "advantage", "sampling", "data", "schedule")
NO_OFFICIAL = "Official code: none"
# `path:N` or `path:N-M` (path with an extension), or a bare `:N` continuing the cell's last path, then an optional
# `name` right after it
REF = re.compile(r"`(?P<path>[\w./-]+\.\w+)?:(?P<line>\d+)(?:-(?P<end>\d+))?`(?:\s+`(?P<name>[\w.]+)`)?")


def section(text: str) -> str:
    """The text of the scope section, up to the next heading of the same or a higher level."""
    start = text.index(HEADING) + len(HEADING)
    end = re.search(r"^#{1,2} ", text[start:], flags=re.MULTILINE)
    return text[start : start + end.start()] if end else text[start:]


def scope_rows(body: str) -> dict[str, list[str]]:
    """scope -> its table row's cells (scope, official, ours, difference)."""
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in SCOPES:
            rows[cells[0]] = cells
    return rows


def resolve(path: str, recipe: str) -> Path | None:
    """Our file named ``path``: from the repository root, else in the recipe's folder, else in mix_src/ (or a
    sub-folder of it); None if it is not ours (an official file)."""
    for base in (REPO_ROOT, RECIPES_DIR / recipe, REPO_ROOT / "mix_src"):
        if (base / path).is_file():
            return base / path
    hits = sorted((REPO_ROOT / "mix_src").rglob(Path(path).name)) if "/" not in path else []
    return hits[0] if len(hits) == 1 else None


def stale_references(cell: str, recipe: str) -> list[str]:
    """The references of one "ours" cell that do not match today's files (empty when all do)."""
    problems, current = [], None
    for m in REF.finditer(cell):
        if m["path"]:
            current = resolve(m["path"], recipe)
            if current is None:
                problems.append(f"{m['path']}: no such file of ours")
                continue
        elif current is None:
            problems.append(f"`:{m['line']}` follows no file of ours")
            continue
        lines = current.read_text().splitlines()
        first, last = int(m["line"]), int(m["end"] or m["line"])
        if not 1 <= first <= last <= len(lines):
            problems.append(f"{current.relative_to(REPO_ROOT)}:{first}-{last} is past its {len(lines)} lines")
        elif m["name"] and m["name"].split(".")[-1] not in lines[first - 1]:
            name = m["name"].split(".")[-1]
            now = [i for i, line in enumerate(lines, 1) if re.search(rf"\b(def|class) {re.escape(name)}\b", line)]
            problems.append(f"{current.relative_to(REPO_ROOT)}:{first} does not hold `{m['name']}` "
                            f"(it reads {lines[first - 1].strip()[:60]!r}; defined at {now or 'no line'})")  # fmt: skip
    return problems


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_readme_lists_differences_by_scope(recipe):
    text = (RECIPES_DIR / recipe / "README.md").read_text()
    assert HEADING in text, f"recipes/{recipe}/README.md has no '{HEADING}' section (issue #39 item 4)"
    body = section(text)
    rows = scope_rows(body)
    if not rows:
        assert NO_OFFICIAL in body, f"recipes/{recipe}/README.md: neither a scope table nor '{NO_OFFICIAL}'"
        return
    assert list(rows) == list(SCOPES), f"recipes/{recipe}/README.md: scope rows {list(rows)}, want {list(SCOPES)}"
    for scope, cells in rows.items():
        assert len(cells) == 4 and all(cells), f"recipes/{recipe}/README.md, {scope}: want 4 filled cells, got {cells}"
        assert REF.search(cells[1]) or "none" in cells[1].lower(), (
            f"recipes/{recipe}/README.md, {scope}: the official side has no file:line ({cells[1]!r})")
        assert REF.search(cells[2]), f"recipes/{recipe}/README.md, {scope}: our side has no file:line ({cells[2]!r})"
        assert not stale_references(cells[2], recipe), (recipe, scope, stale_references(cells[2], recipe))


def test_stale_reference_is_caught():
    """The checker itself: a wrong line, a missing file and a name not on its line are reported."""
    assert stale_references("`mix_src/algo/row_loss.py:1` `sft_rows`", "hpt")
    assert stale_references("`mix_src/nope.py:3`", "hpt")
    assert stale_references("`mix_src/algo/row_loss.py:999999`", "hpt")
    line = next(i for i, s in enumerate((REPO_ROOT / "mix_src/algo/row_loss.py").read_text().splitlines(), 1)
                if s.startswith("def sft_rows("))  # fmt: skip
    assert not stale_references(f"`mix_src/algo/row_loss.py:{line}` `sft_rows`, `:{line}` `sft_rows`", "hpt")
