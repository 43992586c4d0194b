"""Run each test file in its own pytest process and report the files that fail alone.

A test that passes in the full suite but fails alone depends on what an earlier file imported or set up (issue
#38: the CPU checkpoint engine's circular import). Not part of CI (one Python start-up and collection per file);
run it after changing imports or fixtures::

    python scripts/check_tests_alone.py                 # every file, Ray tests deselected (-m "not ray")
    python scripts/check_tests_alone.py --ray           # Ray tests too (wrap in flock /tmp/ray.lock: ~40 min)
    python scripts/check_tests_alone.py tests/test_x.py # the files named

Exit status 1 when a file fails alone; each failure is printed with the tail of its output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pytest's exit codes that mean "nothing wrong": 0 passed, 5 no test collected (a file of Ray tests, deselected)
OK_CODES = {0: "passed", 5: "no test selected"}


def test_files(names: list[str]) -> list[Path]:
    if names:
        return [Path(n).resolve() for n in names]
    return sorted((ROOT / "tests").glob("test_*.py"))


def run_alone(path: Path, ray: bool, timeout: float) -> tuple[int, float, str]:
    """(pytest's exit code, seconds, output) of ``pytest <path>`` in a fresh interpreter (124: timed out)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", str(path)]
    if not ray:
        cmd += ["-m", "not ray"]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        code, text = 124, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    return code, time.monotonic() - start, text if isinstance(text, str) else text.decode(errors="replace")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="test files (default: every tests/test_*.py)")
    ap.add_argument("--ray", action="store_true", help="run the Ray tests too (default: -m 'not ray')")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per file (default 1800)")
    args = ap.parse_args(argv)
    failed = []
    files = test_files(args.files)
    for i, path in enumerate(files, 1):
        code, secs, text = run_alone(path, args.ray, args.timeout)
        status = OK_CODES.get(code, f"FAILED (exit {code})")
        print(f"[{i}/{len(files)}] {path.relative_to(ROOT)}: {status}, {secs:.0f} s", flush=True)
        if code not in OK_CODES:
            failed.append((path, text))
    for path, text in failed:
        tail = "\n".join(text.splitlines()[-40:])
        print(f"\n==== {path.relative_to(ROOT)} fails alone ====\n{tail}")
    print(f"\n{len(files) - len(failed)} of {len(files)} files pass alone" + (f"; failing: {[str(p.relative_to(ROOT)) for p, _ in failed]}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
