"""verl platform "cpu": torch CPU device, gloo collectives, Ray's (fake) "GPU" resource.

verl resolves every device question through ``verl.plugin.platform.get_platform()``; this class answers
them for a CPU-only host. Ray scheduling still asks for "GPU" bundles (verl's resource pools are
expressed in GPUs), so the CPU backend starts Ray with fake GPUs (``ray_kwargs.ray_init.num_gpus``,
see ``mix_src/config/backend/cpu.yaml``); a "GPU" there is just a slot for one FSDP rank.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.cpu

from verl.plugin.platform import PlatformBase


def _noop(*args, **kwargs):
    return None


def _host_mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of host memory, what ``torch.cuda.mem_get_info`` reports for a GPU."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:  # psutil is a Ray dependency, but stay usable without it
        return 0, 0


def _make_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl 0.9.1 makes on ``get_torch_device()`` (grep
    ``get_torch_device()\\.``; ``torch.cpu`` itself has current_stream, stream, Stream and Event)."""
    mod = types.ModuleType("mix_src.cpu.device_module", "torch.cpu with torch.cuda-style memory/RNG no-ops")
    for name in dir(torch.cpu):
        if not name.startswith("_"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: "cpu"
    for name in ("set_device", "synchronize", "empty_cache", "ipc_collect", "reset_peak_memory_stats",
                 "set_per_process_memory_fraction"):
        setattr(mod, name, _noop)
    mod.mem_get_info = _host_mem_get_info
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, lambda device=None: 0)
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    return mod


DEVICE_MODULE = _make_device_module()


class PlatformCPU(PlatformBase):
    """CPU platform: ``device_name="cpu"``, gloo, no profiler, no IPC."""

    device_name = vendor_name = property(lambda self: "cpu")

    @property
    def device_module(self) -> types.ModuleType:
        return DEVICE_MODULE

    # no device to select, synchronise, free, profile or load a runtime for
    set_device = synchronize = set_allocator_settings = empty_cache = profiler_start = profiler_stop = cudart = _noop

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True  # registered only when the CPU backend is selected (mix_src.cpu)

    def current_device(self):
        return "cpu"  # verl passes it to ``tensor.to(...)`` (FSDPEngine.forward_step): an int 0 would mean cuda:0

    def device_count(self) -> int:
        return 1

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed  # one CPU generator

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for the fake GPUs it hands out; verl only records it.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False
