"""CPU backend for verl 0.9.1: run the real Ray trainer, FSDP2 workers and agent loop on a CPU-only host.

Loaded in every process (driver and Ray workers) by verl itself: ``verl/__init__.py`` imports every
``verl.plugins`` entry point, and setup.py declares ``mix_src_cpu = mix_src.cpu``. Importing this
module *activates* the backend only when it is selected:

* ``VERL_PLATFORM=cpu``                      -> active (the recipes, tests/e2e.py and ``make demo`` set it);
* ``VERL_PLATFORM`` set to anything else      -> inactive (e.g. ``nvidia`` on a GPU box);
* ``VERL_PLATFORM`` unset                     -> active only on a machine with no accelerator at all: no
  sign of one from :func:`accelerator_signs` (torch sees a device; a device-visibility variable such as
  ``CUDA_VISIBLE_DEVICES`` is set, even empty, as Ray sets it in GPU-less actors of a GPU host; a device
  node ``/dev/nvidia*``, ``/dev/kfd``, ``/dev/davinci*`` exists; ``nvidia-smi``/``npu-smi`` is on PATH;
  verl's own platform probe succeeds). A failed probe alone (a Ray actor of a GPU host whose PATH lacks
  ``nvidia-smi``) can no longer switch a GPU worker to the CPU backend.

The entry point refuses ``+backend=cpu`` (``trainer.device=cpu``) when the backend is not active, rather
than switch it on after verl has picked its platform.

When active it (1) registers verl platform "cpu" (``platform.PlatformCPU``: gloo, device shims) and sets
``VERL_PLATFORM=cpu`` so Ray workers started later agree; and, lazily, right after the verl module in
question is first imported (no heavy import at plugin load):
(2) registers the FSDP/FSDP2 engines for device "cpu"   (``verl.workers.engine.fsdp.transformer_impl``);
(3) patches the process-group backend string to "gloo"  (``verl.utils.distributed``, Ray and torchrun
    variants, see ``_patch_gloo``);
(4) registers the "hf" rollout replica and server adapter (``verl.workers.rollout.replica`` / ``.base``);
(5) replaces verl's per-row log-prob fallback by a blocked one (``verl.utils.torch_functional``, see
    ``logprobs.py``: bit-identical, ~30x less time at small vocabularies);
(6) lets verl's own vLLM rollout run on vLLM's CPU build (``vllm_cpu``: the ``vllm`` distribution alias,
    a check before Ray starts, CPU linear layers whose weights verl can reload);
(7) shortens verl's V1 replay-buffer poll from 2 s to 0.05 s (``verl.trainer.ppo.v1.replay_buffer``, see
    ``v1_patches.py``);
(8) lets the reference policy's FSDP2 engine offload without pinned memory (``transformer_impl``) and loads
    verl's critic with a CPU attention implementation (``verl.utils.model``), see ``worker_patches.py``.
It logs one line ``mix_src.cpu: CPU backend active (...)`` per process, and logs failures at ERROR level
(verl itself only logs a failing plugin import at DEBUG).

The Hydra side (fake Ray GPUs, eager attention, fsdp2 fp32, rollout name hf, ...) is the config fragment
``mix_src/config/backend/cpu.yaml``.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
from typing import Callable

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

ROLLOUT_NAME = "hf"
_ACTIVE = False


# Signs of an accelerator on this machine, any one of which keeps the backend off unless VERL_PLATFORM=cpu.
DEVICE_VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                          "ASCEND_RT_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")  # fmt: skip
DEVICE_NODE_GLOBS = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/kfd", "/dev/davinci[0-9]*")
SMI_TOOLS = ("nvidia-smi", "npu-smi", "rocm-smi")


def _accelerator_detected() -> bool:
    """verl's own probe (``platform_manager._detect_platform_name``) without its fallback to nvidia."""
    from verl.plugin.platform import PlatformRegistry

    for name in PlatformRegistry.registered_names():
        if name == "cpu":  # ours, once registered
            continue
        cls = PlatformRegistry.get(name)
        try:
            if cls is not None and cls().is_platform_available(use_smi_check=True):
                return True
        except Exception:
            continue
    return False


def _torch_sees_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return True
    return torch.cuda.is_available()


def accelerator_signs() -> list[str]:
    """Every sign of an accelerator on this machine (empty on a CPU-only host)."""
    import glob
    import shutil

    signs = [f"{var} is set" for var in DEVICE_VISIBILITY_VARS if var in os.environ]
    signs += [f"{path} exists" for pattern in DEVICE_NODE_GLOBS for path in glob.glob(pattern)[:1]]
    signs += [f"{tool} is on PATH" for tool in SMI_TOOLS if shutil.which(tool)]
    if _torch_sees_accelerator():
        signs.append("torch sees an accelerator")
    if _accelerator_detected():
        signs.append("verl's platform probe finds an accelerator")
    return signs


def is_selected() -> bool:
    """Whether this process should run verl on CPU (see the module docstring)."""
    choice = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if choice:
        return choice == "cpu"
    return not accelerator_signs()


def is_active() -> bool:
    return _ACTIVE


# --------------------------------------------------------------------------- post-import hooks
class _AfterImport(importlib.abc.MetaPathFinder):
    """Run callbacks right after a given module finishes executing (the first time it is imported)."""

    def __init__(self):
        self.callbacks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, callbacks = spec.loader, self.callbacks.pop(fullname)
        exec_module = loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            for cb in callbacks:
                _run_hook(cb, module)

        loader.exec_module = exec_then_hook  # per-module loader instance
        return spec


_HOOKS = _AfterImport()


def _run_hook(cb: Callable, module) -> None:
    try:
        cb(module)
    except Exception:
        logger.exception("mix_src.cpu: hook %s on %s failed", cb.__name__, module.__name__)
        raise


def after_import(module_name: str, cb: Callable) -> None:
    if module_name in sys.modules:
        _run_hook(cb, sys.modules[module_name])
        return
    _HOOKS.callbacks.setdefault(module_name, []).append(cb)
    if _HOOKS not in sys.meta_path:
        sys.meta_path.insert(0, _HOOKS)


# --------------------------------------------------------------------------- the registrations
def _register_engines(mod) -> None:
    """FSDPEngine is registered for devices ["cuda", "npu"] only (transformer_impl.py:1143, :1594)."""
    from verl.workers.engine.base import EngineRegistry

    registry = EngineRegistry._engines
    for model_type, cls in (("language_model", mod.FSDPEngineWithLMHead), ("value_model", mod.FSDPEngineWithValueHead)):
        backends = [b for b in ("fsdp", "fsdp2") if "cpu" not in registry.get(model_type, {}).get(b, {})]
        if backends:
            EngineRegistry.register(model_type=model_type, backend=backends, device="cpu")(cls)


def _patch_gloo(mod) -> None:
    """Monkeypatches, documented: ``verl/utils/distributed.py`` builds the process-group backend string
    ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"`` in both ``initialize_global_process_group``
    (torchrun entry points such as ``verl.trainer.sft_trainer``, line 62) and
    ``initialize_global_process_group_ray`` (Ray workers, line 89). On the cpu platform that is
    ``"cpu:gloo,cpu:gloo"`` and torch rejects it ("Duplicate device type cpu"). Both now default to plain
    "gloo"; Ray callers that pass an explicit backend are untouched. Remove when verl dedups the string.
    """
    original_ray = mod.initialize_global_process_group_ray
    if getattr(original_ray, "_mix_src_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original_ray(timeout_second=timeout_second, backend=backend or "gloo")

    def initialize_global_process_group(timeout_second=36000):
        # verl's body with backend "gloo"; there is no device to select on the cpu platform
        from datetime import timedelta

        import torch.distributed

        torch.distributed.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    for patched, original in ((initialize_global_process_group_ray, original_ray),
                              (initialize_global_process_group, mod.initialize_global_process_group)):
        patched._mix_src_cpu = True
        patched.__doc__ = original.__doc__
        setattr(mod, original.__name__, patched)


_VERL_LOGPROBS_V2 = None  # verl's original, kept for non-fp32 logits


def _patch_logprobs(mod) -> None:
    global _VERL_LOGPROBS_V2
    from .logprobs import logprobs_from_logits_chunked

    if mod.logprobs_from_logits_v2 is not logprobs_from_logits_chunked:
        _VERL_LOGPROBS_V2 = mod.logprobs_from_logits_v2
        mod.logprobs_from_logits_v2 = logprobs_from_logits_chunked


def _register_rollout_adapter(mod) -> None:
    mod._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "mix_src.cpu.hf_rollout.HFServerAdapter"


def _load_hf_replica():
    from mix_src.cpu.hf_rollout import HFReplica

    return HFReplica


def _register_replica(mod) -> None:
    mod.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_hf_replica)


def _register_vllm() -> None:
    """verl's own vLLM rollout on CPU (``mix_src.cpu.vllm_cpu``): the ``vllm`` distribution alias for
    vllm-cpu, a check before Ray starts that ``rollout.name=vllm`` can import vLLM here, and vLLM CPU linear
    layers that keep their weights so that verl's weight sync can load into them."""
    from . import vllm_cpu

    vllm_cpu.alias_vllm_distribution()
    after_import("verl.utils.config", vllm_cpu.patch_validate_config)
    after_import("vllm.model_executor.layers.utils", vllm_cpu.keep_linear_weights)


def _patch_replay_buffer_poll(mod) -> None:
    from .v1_patches import patch_replay_buffer_poll

    patch_replay_buffer_poll(mod)


def _patch_reference_offload(mod) -> None:
    """The reference (forward-only) engine's ``CPUOffloadPolicy(pin_memory=True)``
    (``verl/workers/engine/fsdp/transformer_impl.py:462``) pins memory in torch's
    ``_fsdp_param.py:315`` -> "Cannot access accelerator device"; on CPU it does not pin (``worker_patches``)."""
    from .worker_patches import unpin_reference_offload

    unpin_reference_offload(mod)


def _patch_critic_attention(mod) -> None:
    """``load_valuehead_model`` hard-codes ``attn_implementation="flash_attention_2"`` (``verl/utils/model.py:649``);
    on CPU verl's critic gets its config's attention (``worker_patches``)."""
    from .worker_patches import cpu_attention_critic

    cpu_attention_critic(mod)


def activate() -> None:
    """Register everything (idempotent). Called at import when ``is_selected()``."""
    global _ACTIVE
    if _ACTIVE:
        return
    from verl.plugin.platform import PlatformRegistry

    from .platform import PlatformCPU

    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    os.environ["VERL_PLATFORM"] = "cpu"  # inherited by the Ray cluster this process may start
    after_import("verl.utils.distributed", _patch_gloo)
    after_import("verl.workers.engine.fsdp.transformer_impl", _register_engines)
    after_import("verl.workers.rollout.base", _register_rollout_adapter)
    after_import("verl.utils.torch_functional", _patch_logprobs)
    after_import("verl.workers.rollout.replica", _register_replica)
    _register_vllm()
    after_import("verl.trainer.ppo.v1.replay_buffer", _patch_replay_buffer_poll)
    after_import("verl.workers.engine.fsdp.transformer_impl", _patch_reference_offload)
    after_import("verl.utils.model", _patch_critic_attention)
    _ACTIVE = True
    logger.info(
        "mix_src.cpu: CPU backend active (pid %d; platform cpu/gloo, fsdp engines on cpu, rollout '%s')",
        os.getpid(),
        ROLLOUT_NAME,
    )


def _activate_if_selected() -> None:
    try:
        if is_selected():
            activate()
    except Exception:
        logger.exception("mix_src.cpu: failed to activate the CPU backend")
        raise


_activate_if_selected()
