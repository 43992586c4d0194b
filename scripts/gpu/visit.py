"""One visit to a GPU node, start to end: install, record the host, check imports, run the smoke test.

Standard library only (it runs before anything is installed), from the repository root of a copy of the tree::

    python3 scripts/gpu/visit.py --out /tmp/visit --pieces /tmp/pieces --venv /tmp/venv   # GPU node, qwen2.5-0.5b
    python3 scripts/gpu/visit.py --out /tmp/visit --no-install --python .venv/bin/python   # packages already there
    .venv/bin/python scripts/gpu/visit.py --out DIR --backend cpu --shape tiny --no-install  # the CPU rehearsal (CI)

Steps, in order, each timed and logged to ``OUT/<step>.log``; the first that fails ends the visit (exit 1) with
its reason, and ``OUT/visit.json`` holds every step's seconds, status and reason whatever happened:

1. ``host``: the machine before the install: Python, glibc, CPUs, memory, disk, ``nvidia-smi`` (driver, GPU; on
   the GPU backend a node without it fails here), the commit, ``pip freeze`` of the interpreter (``host.json``,
   ``nvidia-smi.txt``, ``pip_freeze_host.txt``).
2. ``install`` (skipped with ``--no-install``): ``python scripts/gpu/wheelhouse.py install --pieces DIR`` with
   ``--python PY``, or ``--venv DIR --host-python <this python>`` (a venv over the host's packages: its torch is
   reused), joins the wheelhouse's pieces, verifies them and installs with no index, this package included (the
   air-gapped issue's command, scripts/gpu/README.md); ``pip_freeze.txt`` after it.
3. ``imports``: torch, transformers, ray, verl, mix_src (and vLLM and CUDA on the GPU backend; flash-attn is
   optional: without it the smoke gets the sdpa overrides) with their versions (``imports.json``).
4. ``smoke``: ``python -m scripts.gpu.smoke --model random:<shape>`` (no Hub; scripts/gpu/random_model.py), on
   the GPU backend with ``enforce_eager`` (no CUDA-graph capture: minutes saved on a 15-minute visit); its output
   under ``OUT/smoke``, PASS/FAIL and the reason from its last line.

``--bundle FILE`` writes OUT's records and logs (no weights, checkpoints or data) as one .tar.gz, the one file to
bring back. The visit's minutes are planned in scripts/gpu/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SDPA = ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false"]  # scripts/gpu/README.md, "Without flash-attn"
STEPS = ("host", "install", "imports", "smoke")
TIMEOUTS = {"host": 120, "install": 900, "imports": 300, "smoke": {"gpu": 1500, "cpu": 900}}

IMPORTS = r"""
import importlib, json, sys
need, optional, cuda = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3] == "1"
out = {"python": sys.version.split()[0], "modules": {}}
for name in need + optional:
    try:
        mod = importlib.import_module(name)
        out["modules"][name] = getattr(mod, "__version__", "?")
    except Exception as e:
        out["modules"][name] = None
        if name in need:
            out["error"] = f"import {name}: {type(e).__name__}: {e}"
            break
if "error" not in out and cuda:
    import torch
    if not torch.cuda.is_available():
        out["error"] = f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"
    else:
        out["cuda"] = {"torch_cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
                       "memory_bytes": torch.cuda.get_device_properties(0).total_memory}
print(json.dumps(out))
sys.exit(1 if "error" in out else 0)
"""


class StepFailed(Exception):
    """A step's reason to end the visit."""


class Visit:
    """The steps' records: ``OUT/visit.json`` rewritten after every step."""

    def __init__(self, out: Path, args: dict, resume: bool):
        """``resume``: a later call of the same visit (``--steps`` without host): OUT/visit.json's steps kept."""
        self.out, self.record = out, {"calls": [], "steps": [], "result": None, "reason": None, "seconds": 0.0}
        if resume and (out / "visit.json").is_file():
            self.record.update(json.loads((out / "visit.json").read_text()))
        self.record["calls"].append(args)

    def step(self, name: str, fn) -> dict:
        """Run ``fn()`` (returns a dict of facts, raises StepFailed), timed; record it; re-raise a failure."""
        start, rec = time.monotonic(), {"step": name, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(f"[visit] {name} ...", flush=True)
        try:
            rec.update(fn() or {}, status="ok")
        except StepFailed as e:
            rec.update(status="failed", reason=str(e))
            raise
        except Exception as e:  # noqa: BLE001  (a bug of this script: recorded as the step's failure too)
            rec.update(status="failed", reason=f"{type(e).__name__}: {e}")
            raise StepFailed(rec["reason"]) from e
        finally:
            rec["seconds"] = round(time.monotonic() - start, 1)
            self.record["steps"].append(rec)
            self.save()
            said = f": {rec['reason']}" if "reason" in rec else ""
            print(f"[visit] {name}: {rec['status']} in {rec['seconds']} s{said}", flush=True)
        return rec

    def skip(self, name: str, why: str) -> None:
        self.record["steps"].append({"step": name, "status": "skipped", "reason": why, "seconds": 0.0})
        self.save()
        print(f"[visit] {name}: skipped ({why})", flush=True)

    def save(self) -> None:
        (self.out / "visit.json").write_text(json.dumps(self.record, indent=1) + "\n")


def sh(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``cmd`` from the repository root in its own session, its output appended to ``log`` as it comes;
    (exit code, that output). On a timeout its session is killed: 124 (the smoke kills its own runs' sessions, their
    Ray clusters included, at its shorter per-run timeout)."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        start = f.tell()
        try:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as e:
            f.write(f"{type(e).__name__}: {e}\n")
            return 127, f"{type(e).__name__}: {e}"
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
            f.write(f"[visit] killed after {timeout} s\n")
    with open(log, errors="replace") as f:
        f.seek(start)
        return rc, f.read()


def last_line(text: str, prefix: str = "") -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and ln.startswith(prefix)]
    return lines[-1].strip() if lines else "(no output)"


def commit() -> str:
    """The tree's commit: ``git rev-parse`` where the copy has its .git, else ``VISIT_COMMIT``, else unknown."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("VISIT_COMMIT", "unknown (no git in this copy; set VISIT_COMMIT)")


def host(out: Path, python: str, backend: str) -> dict:
    meminfo = {}
    if os.path.exists("/proc/meminfo"):
        for line in open("/proc/meminfo"):
            key, _, value = line.partition(":")
            meminfo[key] = value.strip()
    facts = {
        "hostname": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
        "visit_python": sys.version.split()[0], "python": python, "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
        "cpus": os.cpu_count(), "memory": meminfo.get("MemTotal"), "commit": commit(),
        "disk_free_gib": round(shutil.disk_usage(out).free / 2**30, 1),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        rc, text = sh([smi, "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
                      out / "host.log", 60)
        facts["gpus"] = [ln.strip() for ln in text.splitlines() if ln.strip()] if rc == 0 else f"nvidia-smi exit {rc}"
        sh([smi], out / "nvidia-smi.txt", 60)
    elif backend == "gpu":
        raise StepFailed("no nvidia-smi on PATH: no NVIDIA driver here, so no GPU run (--backend cpu rehearses)")
    frozen = python if shutil.which(python) else sys.executable  # a venv still to be made: the host's python
    facts["frozen"] = frozen
    rc, text = sh([frozen, "-m", "pip", "freeze"], out / "host.log", 120)
    (out / "pip_freeze_host.txt").write_text(text if rc == 0 else f"pip freeze exit {rc}\n{text}")
    facts["packages"] = len(text.splitlines()) if rc == 0 else f"pip freeze exit {rc}"
    (out / "host.json").write_text(json.dumps(facts, indent=1) + "\n")
    return {"glibc": facts["glibc"], "gpus": facts.get("gpus", "none"), "commit": facts["commit"]}


def install(out: Path, python: str, pieces: str, venv: str | None) -> dict:
    wheelhouse = REPO / "scripts" / "gpu" / "wheelhouse.py"
    if not Path(pieces).is_dir():
        raise StepFailed(f"--pieces {pieces}: no such folder (the wheelhouse's pieces; or --no-install)")
    if not wheelhouse.is_file():
        raise StepFailed(f"{wheelhouse.relative_to(REPO)} is missing: this tree has no wheelhouse command")
    log = out / "install.log"
    target = ["--venv", venv, "--host-python", sys.executable] if venv else ["--python", python]
    rc, text = sh([sys.executable, str(wheelhouse), "install", "--pieces", pieces, *target], log, TIMEOUTS["install"])
    if rc:
        said = last_line(text, "install:")  # the wheelhouse's own reason (a missing wheel is named), else pip's
        raise StepFailed(f"wheelhouse install exited {rc}: {last_line(text) if said == '(no output)' else said} "
                         f"(log {log})")
    rc, text = sh([python, "-m", "pip", "freeze"], log, 120)
    (out / "pip_freeze.txt").write_text(text)
    return {"packages": len(text.splitlines())}


def imports(out: Path, python: str, backend: str, env: dict) -> dict:
    need = ["torch", "transformers", "ray", "verl", "mix_src"] + (["vllm"] if backend == "gpu" else [])
    optional = ["flash_attn"] if backend == "gpu" else ["vllm"]
    rc, text = sh([python, "-c", IMPORTS, ",".join(need), ",".join(optional), "1" if backend == "gpu" else "0"],
                  out / "imports.log", TIMEOUTS["imports"], env)
    try:
        facts = json.loads(last_line(text, "{"))
    except ValueError:
        raise StepFailed(f"the import check exited {rc}: {last_line(text)} (log {out / 'imports.log'})") from None
    (out / "imports.json").write_text(json.dumps(facts, indent=1) + "\n")
    if rc or "error" in facts:
        raise StepFailed(facts.get("error", f"the import check exited {rc}"))
    return {"modules": facts["modules"], **({"cuda": facts["cuda"]} if "cuda" in facts else {})}


def smoke(out: Path, python: str, backend: str, shape: str, gpu: str, extra: list[str], env: dict,
          flash_attn: bool) -> dict:
    args = list(extra)
    if backend == "gpu":
        args = ["actor_rollout_ref.rollout.enforce_eager=true", *([] if flash_attn else SDPA), *args]
    cmd = [python, "-m", "scripts.gpu.smoke", "--backend", backend, "--model", f"random:{shape}",
           "--out", str(out / "smoke"), "--gpu", gpu, *args]
    rc, text = sh(cmd, out / "smoke.log", TIMEOUTS["smoke"][backend], env)
    facts = {"verdict": last_line(text, "[smoke] PASS") if rc == 0 else last_line(text, "[smoke]"),
             "lines": [ln for ln in text.splitlines() if ln.startswith("[smoke]")]}
    if rc != 0 or "[smoke] PASS" not in text:
        raise StepFailed(f"the smoke test exited {rc}: {facts['verdict']} (log {out / 'smoke.log'})")
    return facts


def bundle(out: Path, path: Path) -> None:
    """OUT's records and logs as one .tar.gz: no weights, checkpoints or data."""
    skip = {"checkpoints", "assets"}

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        return None if skip & set(parts) or info.name.endswith((".safetensors", ".parquet", ".pt")) else info

    with tarfile.open(path, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=keep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the one folder every record and log goes to")
    ap.add_argument("--backend", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--shape", default=None, help="random:<shape> for the smoke (default qwen2.5-0.5b; cpu: tiny)")
    ap.add_argument("--pieces", help="the wheelhouse's pieces (scripts/gpu/wheelhouse.py)")
    ap.add_argument("--no-install", action="store_true", help="the interpreter already has the packages")
    ap.add_argument("--python", help="the interpreter to install into and run with (default: this one)")
    ap.add_argument("--venv", help="the venv the wheelhouse makes over this python's packages and installs into; "
                    "sets --python")
    ap.add_argument("--gpu", default="h200-141gb", help="the planner's GPU for the smoke's estimate line")
    ap.add_argument("--bundle", help="write OUT's records and logs (no weights) to this .tar.gz at the end")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help="the steps this call runs, in order (a visit split over calls of at most 10 minutes: "
                         "host,install,imports then smoke; a call without host adds to OUT/visit.json)")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for the smoke's runs")
    a = ap.parse_args(argv)
    steps = a.steps.split(",")
    if not set(steps) <= set(STEPS):
        ap.error(f"--steps {a.steps}: each of {','.join(STEPS)}")
    if "install" in steps and not a.no_install and not a.pieces:
        ap.error("give --pieces DIR (the wheelhouse's pieces) or --no-install")
    if a.venv and a.python:
        ap.error("--venv sets the interpreter: give --venv or --python, not both")
    python = str(Path(a.venv) / "bin" / "python") if a.venv else (a.python or sys.executable)
    shape = a.shape or ("tiny" if a.backend == "cpu" else "qwen2.5-0.5b")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    visit = Visit(out, {"steps": steps, "backend": a.backend, "shape": shape, "python": python, "pieces": a.pieces,
                        "install": not a.no_install, "extra": a.extra}, resume="host" not in steps)
    start, seconds = time.monotonic(), visit.record["seconds"]
    try:
        for name in STEPS:
            if name not in steps:
                continue
            if name == "host":
                visit.step("host", lambda: host(out, python, a.backend))
            elif name == "install" and a.no_install:
                visit.skip("install", "--no-install")
            elif name == "install":
                visit.step("install", lambda: install(out, python, a.pieces, a.venv))
            elif name == "imports":
                visit.step("imports", lambda: imports(out, python, a.backend, env))
            else:  # without flash-attn (imports.json, this call's or an earlier one's) the smoke trains with sdpa
                found = json.loads((out / "imports.json").read_text()) if (out / "imports.json").is_file() else {}
                flash = bool(found.get("modules", {}).get("flash_attn"))
                visit.step("smoke", lambda: smoke(out, python, a.backend, shape, a.gpu, a.extra, env, flash))
        visit.record.update(result="PASS" if "smoke" in steps else "so far ok", reason=None)
    except StepFailed as e:
        visit.record.update(result="FAIL", reason=f"{visit.record['steps'][-1]['step']}: {e}")
    visit.record["seconds"] = round(seconds + time.monotonic() - start, 1)
    visit.save()
    if a.bundle:
        bundle(out, Path(a.bundle))
    times = ", ".join(f"{s['step']} {s['seconds']:.0f} s" for s in visit.record["steps"])
    print(f"[visit] {visit.record['result']}" + (f": {visit.record['reason']}" if visit.record["reason"] else "")
          + f" ({times}; {visit.record['seconds']:.0f} s in all; records in {out})", flush=True)
    return 1 if visit.record["result"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
