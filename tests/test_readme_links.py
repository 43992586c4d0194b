"""The README is a front page (issue #38 item 5): at most 250 lines, and every relative markdown link in it, and
in each document it links, points at a file or folder that exists (anchors are not checked)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
# [text](target) and ![alt](target); the target ends at the first space or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*```")


def relative_links(md: Path, keep_anchor: bool = False) -> list[str]:
    """Relative link targets of a markdown file, outside fenced code blocks, anchors stripped ('' for '#x')
    unless keep_anchor."""
    links, in_code = [], False
    for line in md.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            links.append(target if keep_anchor else target.split("#", 1)[0])
    return links


def heading_anchors(md: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation but '-' and '_' dropped, spaces
    to '-' (no duplicate suffixes: the front page's targets are unique headings)."""
    anchors, in_code = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and re.match(r"^#{1,6} ", line):
            text = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def broken_links(md: Path) -> list[str]:
    return [f"{md.relative_to(ROOT)} -> {t}" for t in relative_links(md) if t and not (md.parent / t).exists()]


def linked_docs(md: Path) -> list[Path]:
    docs = {(md.parent / t).resolve() for t in relative_links(md) if t.endswith(".md")}
    return sorted(d for d in docs if d.is_file())


def test_readme_is_a_front_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES}: move detail into the docs beside the code"


def test_readme_links_resolve():
    assert broken_links(README) == []


def test_readme_anchors_name_headings():
    """The front page's links into a section (file.md#section) land on a heading of that file."""
    bad = []
    for target in relative_links(README, keep_anchor=True):
        path, _, anchor = target.partition("#")
        doc = (README.parent / path) if path else README
        if anchor and doc.suffix == ".md" and doc.is_file() and anchor not in heading_anchors(doc):
            bad.append(target)
    assert bad == []


def test_links_of_linked_docs_resolve():
    docs = linked_docs(README)
    assert len(docs) >= 10, [str(d) for d in docs]  # the link table itself
    broken = [b for doc in docs for b in broken_links(doc)]
    assert broken == []


def test_checker_sees_a_broken_link(tmp_path):
    md = tmp_path / "x.md"
    (tmp_path / "there.md").write_text("ok")
    md.write_text("[a](there.md#anchor) [b](missing.md) [c](https://x.org/y.md) ![d](gone.png)\n```\n[e](no.md)\n```\n")
    assert relative_links(md) == ["there.md", "missing.md", "gone.png"]
    assert relative_links(md, keep_anchor=True)[0] == "there.md#anchor"
    (tmp_path / "h.md").write_text("## The demo (`make demo`)\n```\n# not a heading\n```\n### verl's own vLLM rollout\n")
    assert heading_anchors(tmp_path / "h.md") == {"the-demo-make-demo", "verls-own-vllm-rollout"}
