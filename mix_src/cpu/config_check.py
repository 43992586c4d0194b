"""Worker settings the CPU backend cannot honour, refused on the driver before Ray starts, naming the key.

verl would fail inside a Ray worker instead. :func:`check_worker_keys` runs in ``mix_src.main_mix_ppo`` and, for
stock ``verl.trainer.main_ppo``, in ``verl.utils.config.validate_config`` (``vllm_cpu.patch_validate_config``).
Each entry of :data:`CHECKS` returns the refusal, or None.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from mix_src.config.mix_config import MixConfigError, uses_critic
from mix_src.config.verl_parity import dotted_get
from mix_src.cpu.worker_patches import CPU_ATTENTION

# Model sections the FSDP workers build (actor/rollout/ref share one model config; the critic has its own).
MODEL_SECTIONS = ("actor_rollout_ref.model", "critic.model")
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy")


def _built(config: Any, keys: tuple) -> list[str]:
    """The ``keys`` of the workers this run builds (the critic's only when it has one)."""
    return [key for key in keys if not key.startswith("critic.") or uses_critic(config)]


def refuse_strategy(config: Any) -> Optional[str]:
    for key in _built(config, STRATEGY_KEYS):
        value = dotted_get(config, key)
        if value is not None and str(value) != "fsdp2":
            return (f"{key}={value}: the CPU backend runs FSDP2 only. FSDP1 (fsdp) builds its module with "
                    "sync_module_states=True, which torch refuses for CPU parameters ('requires them to be on GPU'), "
                    "and mix_src.cpu registers verl's FSDP engines alone for device cpu (no megatron/veomni engine). "
                    f"Set {key}=fsdp2 (backend/cpu.yaml does).")
    return None


def refuse_flash_attention(config: Any) -> Optional[str]:
    for section in _built(config, MODEL_SECTIONS):
        key = f"{section}.override_config.attn_implementation"
        value = dotted_get(config, key)
        if value is not None and str(value) not in CPU_ATTENTION:
            return (f"{key}={value}: flash-attention kernels are CUDA kernels and flash-attn is not installable on a "
                    f"CPU-only host; use one of {', '.join(CPU_ATTENTION)} (backend/cpu.yaml sets eager).")
    return None


def refuse_liger(config: Any) -> Optional[str]:
    for section in _built(config, MODEL_SECTIONS):
        if dotted_get(config, f"{section}.use_liger", False):
            return (f"{section}.use_liger=true: Liger kernels are Triton GPU kernels (liger-kernel, not installed on "
                    f"the CPU backend); set {section}.use_liger=false.")
    return None


CHECKS: dict[str, Callable[[Any], Optional[str]]] = {
    "actor_rollout_ref.actor.strategy=fsdp": refuse_strategy,
    "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2": refuse_flash_attention,
    "actor_rollout_ref.model.use_liger=true": refuse_liger,
}


def check_worker_keys(config: Any) -> None:
    """Raise :class:`MixConfigError` naming the first worker setting the CPU backend cannot honour; only on a CPU
    run (``trainer.device=cpu``): composing a GPU recipe on a CPU-only machine is not one."""
    if dotted_get(config, "trainer.device") != "cpu":
        return
    for check in CHECKS.values():
        message = check(config)
        if message:
            raise MixConfigError(message)
