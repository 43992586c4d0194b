"""recipes/GPU_FIRST_DAY.md: every command on the page exists here (make targets, `python -m` modules, this
repository's scripts and files), it says first that nothing on it has run on a GPU, and the missing-data error
points at it. No Ray, no network."""

import importlib.util
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mix_src.config.preflight import _check_paths

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "recipes" / "GPU_FIRST_DAY.md"
OURS = ("recipes/", "scripts/", "mix_src/", "tests/", "data/")  # top-level folders of this repository


def commands(text: str) -> list[str]:
    """The page's shell commands: lines of ```bash blocks (continuations joined) and inline `code` spans."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [line for line in lines if line]


def referenced(text: str) -> tuple[set[str], set[str], set[str]]:
    """(make targets, python -m modules, repository paths) named by the page's commands."""
    targets, modules, paths = set(), set(), set()
    for cmd in commands(text):
        targets |= {m.group(1) for m in re.finditer(r"\bmake\s+(?:[A-Z_]+=\S+\s+)*([a-z][\w-]*)", cmd)}
        modules |= set(re.findall(r"\bpython -m ([\w.]+)", cmd))
        paths |= {p for p in re.findall(r"[\w./-]+\.(?:py|sh|md|yaml)\b", cmd) if p.startswith(OURS)}
    return targets, modules, paths


def test_every_command_on_the_page_exists():
    text = PAGE.read_text()
    targets, modules, paths = referenced(text)
    makefile = (REPO / "Makefile").read_text()
    assert {"install-gpu", "check-gpu-install"} <= targets and "verl.model_merger" in modules  # the parser sees them
    assert {"recipes/luffy_zero/run.sh", "scripts/gpu_install.py"} <= paths
    missing = sorted(t for t in targets if not re.search(rf"^{re.escape(t)}:", makefile, flags=re.M))
    missing += sorted(m for m in modules if importlib.util.find_spec(m) is None)
    missing += sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"recipes/GPU_FIRST_DAY.md names what does not exist: {missing}"


def test_the_page_says_first_that_it_has_not_run_on_a_gpu():
    head = PAGE.read_text()[:600]
    assert "Not yet run on a GPU" in head


def test_the_parser_catches_a_missing_command():
    """The checks above fail on a page that names what is not there (so they are not vacuous)."""
    text = "```bash\nmake no-such-target\npython -m mix_src.no_such_module\nbash recipes/nope/run.sh\n```"
    targets, modules, paths = referenced(text)
    assert targets == {"no-such-target"} and modules == {"mix_src.no_such_module"} and paths == {"recipes/nope/run.sh"}
    assert importlib.util.find_spec("mix_src.no_such_module") is None and not (REPO / "recipes/nope/run.sh").exists()


def _paths_config(train: str, model: str) -> OmegaConf:
    return OmegaConf.create({"data": {"train_files": train, "val_files": train},
                             "actor_rollout_ref": {"model": {"path": model}}})  # fmt: skip


def test_missing_data_points_at_the_data_section_not_the_tiny_assets(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.train_files: .*GPU_FIRST_DAY\.md, '2\. Data'") as e:
        _check_paths(_paths_config(str(tmp_path / "openr1.parquet"), "Qwen/Qwen2.5-Math-1.5B"))
    assert "make_tiny_assets" not in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"make_tiny_assets\.py DIR"):  # the CPU demo's files
        _check_paths(_paths_config(str(tmp_path / "tiny" / "train.parquet"), "Qwen/Qwen2.5-Math-1.5B"))
    data = tmp_path / "d.parquet"
    data.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.path: .*a local Hugging Face model"):
        _check_paths(_paths_config(str(data), str(tmp_path / "no_model")))
