"""CPU backend for verl 0.9.1: run the real Ray trainer, FSDP2 workers and agent loop on a CPU-only host.

A verl plugin (setup.py: ``mix_src_cpu = mix_src.cpu``), so ``verl/__init__.py`` imports it in every process.
It activates when ``VERL_PLATFORM=cpu``, or with ``VERL_PLATFORM`` unset when :func:`accelerator_signs` finds
none (when and why: mix_src/cpu/README.md "CPU backend"). When active it registers verl platform "cpu"
(``platform.PlatformCPU``), sets ``VERL_PLATFORM=cpu`` for the Ray workers it starts, and declares the patches
:func:`activate` lists with :func:`after_import`, each run right after its module is first imported.
The Hydra side is ``mix_src/config/backend/cpu.yaml``.

Patches fail loudly, by the patch's name: another installed version of a ``written_for`` library ->
:class:`PatchVersionError` (checked by :func:`mix_src.compat.check_written_for`, as the main path's patches);
a hooked module that does not exist -> :class:`PatchTargetMissing`; a hook that has not run by a checkpoint of
its ``required_in`` -> :class:`HookNotFired` from :func:`check_hooks_fired` (``"trainer"`` once the workers are
up, ``"worker"`` in each actor worker when the MIX loss arrives: :func:`mix_src.worker.loss.install_loss`).
These are raised while this plugin is imported; verl's loader would only log them, so
:func:`mix_src.extend.load_verl_plugins` imports every ``verl.plugins`` entry point first, on the driver and in
every Ray process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

from mix_src.compat import check_written_for

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

ROLLOUT_NAME = "hf"  # the rollout this backend registers (verl's "vllm" runs on vLLM's CPU build)
ROLLOUT_ENV = "MIX_CPU_ROLLOUT"  # actor_rollout_ref.rollout.name, exported by the entry point to every process
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
        cls = PlatformRegistry.get(name)
        with contextlib.suppress(Exception):  # a probe that fails is no sign; "cpu": ours, once registered
            if name != "cpu" and cls is not None and cls().is_platform_available(use_smi_check=True):
                return True
    return False


def _torch_sees_accelerator() -> bool:
    import torch

    return (hasattr(torch, "accelerator") and torch.accelerator.is_available()) or torch.cuda.is_available()


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
    return choice == "cpu" if choice else not accelerator_signs()


def is_active() -> bool:
    return _ACTIVE


# --------------------------------------------------------------------------- post-import hooks (patches)
class PatchError(RuntimeError):
    """A CPU-backend patch cannot be trusted here; the message names the patch and what to do."""


class PatchVersionError(PatchError):
    """A patch was written for other library versions than the ones installed."""


class PatchTargetMissing(PatchError):
    """The module a patch hooks does not exist (the library moved or renamed it)."""


class HookNotFired(PatchError):
    """A registered hook did not run although its module should have been imported by now."""


@dataclass
class Patch:
    """One registered post-import hook (see :func:`after_import`)."""

    module: str
    callback: Callable
    written_for: dict = field(default_factory=dict)
    required_in: tuple = ("trainer",)
    fired: bool = False

    @property
    def name(self) -> str:
        return f"{getattr(self.callback, '__module__', '?')}.{getattr(self.callback, '__qualname__', self.callback)}"


PATCHES: list[Patch] = []  # every hook registered in this process, in order
CHECKPOINTS = ("trainer", "worker")  # where check_hooks_fired runs (see its docstring)


def _module_file_exists(module_name: str) -> bool:
    """Whether ``module_name`` can be found, without importing it (its top-level package is located, not run)."""
    import importlib.machinery
    import importlib.util

    if module_name in sys.modules:
        return True
    top, *rest = module_name.split(".")
    top_mod = sys.modules.get(top)
    locations = list(getattr(top_mod, "__path__", []) or [])
    if not locations:
        spec = importlib.util.find_spec(top)
        if spec is None:
            return False
        locations = list(spec.submodule_search_locations or [])
    if not rest:
        return True
    # the module's file (.py, package, extension) in its parent's directories; a bare directory is not one
    spec = importlib.machinery.PathFinder.find_spec(module_name, [os.path.join(b, *rest[:-1]) for b in locations])
    return spec is not None and spec.loader is not None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run callbacks right after a given module finishes executing (the first time it is imported)."""

    def __init__(self):
        self.callbacks: dict[str, list[Patch]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        finders = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        spec = next((s for f in finders if (s := f.find_spec(fullname, path, target)) is not None), None)
        if spec is None:
            return None
        loader, patches = spec.loader, self.callbacks.pop(fullname)
        exec_module = loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            for patch in patches:
                _run_hook(patch, module)

        loader.exec_module = exec_then_hook  # per-module loader instance
        return spec


_HOOKS = _AfterImport()


def _run_hook(patch: Patch, module) -> None:
    try:
        patch.callback(module)
    except Exception:
        logger.exception("mix_src.cpu: patch %s on %s failed", patch.name, module.__name__)
        raise
    patch.fired = True


def after_import(module_name: str, cb: Callable, *, written_for: Optional[dict] = None,
                 required_in: tuple = ("trainer",)) -> Patch:
    """Declare a patch: run ``cb(module)`` right after ``module_name`` is first imported (at once if it
    already is). ``written_for``: the library versions it was written against (``{"verl": "0.9.1"}``, or a
    specifier such as ``">=2.12,<2.14"``), checked now, as is that the module exists (located without importing
    it). ``required_in``: the :data:`CHECKPOINTS` by which the hook must have run (``()`` for a module only some
    runs import, such as vLLM's); see the module docstring for the errors."""
    patch = Patch(module_name, cb, dict(written_for or {}), tuple(required_in))
    unknown = [c for c in patch.required_in if c not in CHECKPOINTS]
    if unknown:
        raise ValueError(f"after_import({module_name!r}, {patch.name}): unknown checkpoint(s) {unknown}; use {CHECKPOINTS}")
    check_written_for(patch.name, patch.written_for, error=PatchVersionError)
    if not _module_file_exists(module_name):
        raise PatchTargetMissing(f"mix_src.cpu patch {patch.name} hooks module {module_name!r}, which does not exist "
                                 "in this environment (moved or renamed by the library?): find where the patched code "
                                 "lives now and update the patch")
    PATCHES.append(patch)
    if module_name in sys.modules:
        _run_hook(patch, sys.modules[module_name])
    else:
        _HOOKS.callbacks.setdefault(module_name, []).append(patch)
        if _HOOKS not in sys.meta_path:
            sys.meta_path.insert(0, _HOOKS)
    return patch


def check_hooks_fired(checkpoint: str) -> None:
    """Raise :class:`HookNotFired` naming every patch of this process that has not run although its module is
    imported or ``checkpoint`` is in its ``required_in`` (a no-op when the backend is off: nothing registered)."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {checkpoint!r}; use {CHECKPOINTS}")
    missing = [p for p in PATCHES if not p.fired and (p.module in sys.modules or checkpoint in p.required_in)]
    if missing:
        lines = "; ".join(
            f"{p.name} on {p.module!r} ({'imported without the hook running' if p.module in sys.modules else 'never imported'})"
            for p in missing
        )
        raise HookNotFired(f"mix_src.cpu: {len(missing)} patch(es) did not apply by the {checkpoint!r} checkpoint "
                           f"(pid {os.getpid()}): {lines}. The patched code moved or is imported differently in this "
                           "verl; update the patch.")


def replace(owner, name: str, patched: Callable) -> None:
    """Set ``owner.<name>`` to ``patched``, marked ``_mix_src_cpu`` and given the original's docstring; a no-op
    when the attribute is already ours (a hook may run twice)."""
    original = getattr(owner, name)
    if not getattr(original, "_mix_src_cpu", False):
        patched._mix_src_cpu = True
        patched.__doc__ = original.__doc__
        setattr(owner, name, patched)


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
    """``verl/utils/distributed.py`` builds the backend ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"``
    in ``initialize_global_process_group`` (line 62, torchrun) and ``initialize_global_process_group_ray`` (line
    89): ``"cpu:gloo,cpu:gloo"`` on cpu, which torch rejects ("Duplicate device type cpu"). Both default to
    "gloo" (an explicit Ray backend is kept). Remove when verl dedups the string."""
    original_ray = mod.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original_ray(timeout_second=timeout_second, backend=backend or "gloo")

    def initialize_global_process_group(timeout_second=36000):
        # verl's body with backend "gloo"; there is no device to select on the cpu platform
        from datetime import timedelta

        import torch.distributed

        torch.distributed.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_second),
                                             init_method=os.environ.get("DIST_INIT_METHOD", None))
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    for patched in (initialize_global_process_group_ray, initialize_global_process_group):
        replace(mod, patched.__name__, patched)


def _register_rollout_adapter(mod) -> None:
    mod._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "mix_src.cpu.hf_rollout.HFServerAdapter"


def _register_replica(mod) -> None:
    loader = lambda: importlib.import_module(".hf_rollout", __name__).HFReplica  # noqa: E731  (imported when used)
    mod.RolloutReplicaRegistry.register(ROLLOUT_NAME, loader)


VERL_0_9_1 = {"verl": "0.9.1"}  # written_for of the patches on verl's own modules
CHECKPOINT_ENGINE = "cpu_gloo"  # checkpoint_engine.py's name in verl's CheckpointEngineRegistry


def _register_checkpoint_engine(mod) -> None:
    """Register ``cpu_gloo`` in verl's registry: importing ``checkpoint_engine.py`` registers and checks it. By
    module name, never ``from .checkpoint_engine import <name>``: a process that imports that module first runs this
    hook from its ``import verl.checkpoint_engine.base``, its body half done (reading a name would fail)."""
    importlib.import_module(f"{__name__}.checkpoint_engine")


def log_active() -> None:
    """The one line saying the backend is on in this process, and which rollout it runs (:data:`ROLLOUT_ENV`)."""
    chosen = os.environ.get(ROLLOUT_ENV)
    rollout = repr(chosen) if chosen else "not chosen yet (set from actor_rollout_ref.rollout.name before Ray starts)"
    logger.info("mix_src.cpu: CPU backend active (pid %d; platform cpu/gloo, fsdp engines on cpu, rollout %s; "
                "%d patches)", os.getpid(), rollout, len(PATCHES))  # fmt: skip


def activate() -> None:
    """Register everything (idempotent). Called at import when ``is_selected()``."""
    global _ACTIVE
    if _ACTIVE:
        return
    from verl.plugin.platform import PlatformRegistry

    from . import logprobs, vllm_cpu, worker_patches
    from .platform import PlatformCPU

    both = ("trainer", "worker")  # modules the trainer process and every actor worker have imported by then
    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    os.environ["VERL_PLATFORM"] = "cpu"  # inherited by the Ray cluster this process may start
    after_import("verl.utils.distributed", _patch_gloo, written_for={**VERL_0_9_1, "torch": "2.13.0"}, required_in=("worker",))
    after_import("verl.workers.engine.fsdp.transformer_impl", _register_engines, written_for=VERL_0_9_1, required_in=both)
    after_import("verl.workers.rollout.base", _register_rollout_adapter, written_for=VERL_0_9_1)
    after_import("verl.utils.torch_functional", logprobs.patch_logprobs, written_for=VERL_0_9_1, required_in=both)
    after_import("verl.workers.rollout.replica", _register_replica, written_for=VERL_0_9_1)
    vllm_cpu.alias_vllm_distribution()
    after_import("verl.utils.config", vllm_cpu.patch_validate_config, written_for=VERL_0_9_1)
    if vllm_cpu.cpu_build_on_path():  # vLLM's CPU build installed; only runs with rollout.name=vllm import it
        after_import("vllm.model_executor.layers.utils", vllm_cpu.keep_linear_weights, written_for=vllm_cpu.WRITTEN_FOR, required_in=())
    after_import("verl.trainer.ppo.v1.replay_buffer", worker_patches.patch_replay_buffer_poll, written_for=VERL_0_9_1,
                 required_in=())
    after_import("verl.workers.engine.fsdp.transformer_impl", worker_patches.unpin_reference_offload,
                 written_for=worker_patches.UNPIN_REFERENCE_OFFLOAD_WRITTEN_FOR, required_in=both)
    after_import("verl.utils.model", worker_patches.cpu_attention_critic,
                 written_for=worker_patches.CPU_ATTENTION_CRITIC_WRITTEN_FOR, required_in=())
    # checkpoint_engine.py: written for verl's interface and torch's gloo
    after_import("verl.checkpoint_engine", _register_checkpoint_engine,
                 written_for={**VERL_0_9_1, "torch": ">=2.12,<2.14"}, required_in=both)
    importlib.import_module(f"{__name__}.lean_start").install()  # start-up trims, no effect on results
    _ACTIVE = True
    log_active()


try:
    if is_selected():
        activate()
except Exception:
    logger.exception("mix_src.cpu: failed to activate the CPU backend")
    raise
