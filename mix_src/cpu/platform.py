"""verl platform "cpu": torch CPU device, gloo collectives, Ray's (fake) "GPU" resource.

verl resolves every device question through ``verl.plugin.platform.get_platform()``; this class answers
them for a CPU-only host. Ray scheduling still asks for "GPU" bundles (verl's resource pools are
expressed in GPUs), so the CPU backend starts Ray with fake GPUs (``ray_kwargs.ray_init.num_gpus``,
see ``mix_src/config/backend/cpu.yaml``); a "GPU" there is just a slot for one FSDP rank.
"""

from __future__ import annotations

import types
from contextlib import nullcontext

import torch
import torch.cpu

from verl.plugin.platform import PlatformBase


def _noop(*args, **kwargs):
    return None


def _returns(value):
    """A method that answers ``value`` whatever it is asked."""
    return lambda self, *args, **kwargs: value


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
    vars(mod).update({name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")})
    vars(mod).update(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: "cpu")
    for name in ("set_device", "synchronize", "empty_cache", "ipc_collect", "reset_peak_memory_stats",
                 "set_per_process_memory_fraction"):
        setattr(mod, name, _noop)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, lambda device=None: 0)
    vars(mod).update(mem_get_info=_host_mem_get_info, get_device_name=lambda device=None: "cpu",
                     get_rng_state=lambda device=None: torch.get_rng_state(),
                     set_rng_state=lambda state, device=None: torch.set_rng_state(state),
                     manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed)
    return mod


DEVICE_MODULE = _make_device_module()


class PlatformCPU(PlatformBase):
    """CPU platform: ``device_name="cpu"``, gloo, no profiler, no IPC (``is_platform_available``: verl's default,
    ``is_available``; registered only when the CPU backend is selected, mix_src.cpu)."""

    device_name = vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: DEVICE_MODULE)

    # no device to select, synchronise, free, profile or load a runtime for
    set_device = synchronize = set_allocator_settings = empty_cache = profiler_start = profiler_stop = cudart = _noop
    is_available = _returns(True)
    current_device = _returns("cpu")  # verl passes it to ``tensor.to(...)`` (FSDPEngine.forward_step): 0 is cuda:0
    device_count = _returns(1)
    get_device_capability = _returns((None, None))
    communication_backend_name = _returns("gloo")
    visible_devices_envvar = _returns("CUDA_VISIBLE_DEVICES")  # Ray sets it for its fake GPUs; verl only records it
    nvtx_range = _returns(nullcontext())  # a reusable no-op context
    ray_resource_name = _returns("GPU")  # verl's default ray_resource_options then asks for {"num_gpus": n}
    is_ipc_supported = _returns(False)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed  # one CPU generator

    def ray_noset_envvars(self) -> list[str]:
        return []
