"""CPU-backend patches for verl's FSDP workers: the reference policy and the critic on a CPU-only host.

Each patch is one function, registered by :func:`mix_src.cpu.activate` with ``after_import`` on the verl
module it changes, and declares in ``WRITTEN_FOR`` the library versions whose source it was checked
against (a verl or torch upgrade must re-check the lines quoted in its docstring).

``unpin_reference_offload`` (on ``verl.workers.engine.fsdp.transformer_impl``)
    The forward-only engine (the reference policy, ``actor.use_kl_loss`` / ``algorithm.use_kl_in_reward``)
    is sharded with FSDP2 ``offload_policy = CPUOffloadPolicy(pin_memory=True)``
    (``verl/workers/engine/fsdp/transformer_impl.py`` 459-462, verl 0.9.1). torch pins each sharded
    parameter (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` 314-315,
    ``padded_sharded_param.pin_memory()``), and pinning needs an accelerator: a CPU-only torch raises
    "Cannot access accelerator device when none is available" during worker init. On CPU, where the
    "offloaded" parameters already live in host memory, the module's ``CPUOffloadPolicy`` becomes a subclass
    that always has ``pin_memory=False`` (still a ``CPUOffloadPolicy`` for torch's and verl's isinstance
    checks); nothing else changes.

``cpu_attention_critic`` (on ``verl.utils.model``)
    ``load_valuehead_model`` (``verl/utils/model.py`` 641-652) loads verl's primary critic,
    ``AutoModelForTokenClassification``, with ``attn_implementation="flash_attention_2"`` hard-coded; without
    flash-attn it falls back to trl's ``AutoModelForCausalLMWithValueHead`` or raises "is not a value head
    model, please install trl" (654-657). On CPU the same ``AutoModelForTokenClassification`` is loaded with the
    attention implementation of the critic's own config (``critic.model.override_config.attn_implementation``,
    which verl's ``HFModelConfig`` puts into ``hf_config._attn_implementation``, ``verl/workers/config/model.py``
    185-190; eager in ``backend/cpu.yaml``). A config that still asks for flash-attention gets ``eager``. The
    trl fallback is not used: a critic no GPU run uses would be tested.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

# Library versions each patch was written against (their quoted lines were read in these versions).
UNPIN_REFERENCE_OFFLOAD_WRITTEN_FOR = {"verl": "0.9.1", "torch": "2.13"}
CPU_ATTENTION_CRITIC_WRITTEN_FOR = {"verl": "0.9.1", "transformers": ">=5,<6"}

# Attention implementations that run on a CPU-only torch (flash-attention variants do not).
CPU_ATTENTION = ("eager", "sdpa", "flex_attention")


def unpin_reference_offload(mod) -> None:
    """``transformer_impl.CPUOffloadPolicy`` -> a subclass with ``pin_memory=False`` (see module docstring)."""
    original = mod.CPUOffloadPolicy
    if original is None or getattr(original, "_mix_src_cpu", False):
        return

    class UnpinnedCPUOffloadPolicy(original):
        """``CPUOffloadPolicy`` that never pins memory (pinning needs an accelerator)."""

        _mix_src_cpu = True

        def __init__(self, pin_memory: bool = False):
            super().__init__(pin_memory=False)

    UnpinnedCPUOffloadPolicy.__qualname__ = UnpinnedCPUOffloadPolicy.__name__
    mod.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


def critic_attention(model_config) -> str:
    """The critic's attention implementation on CPU: its config's, unless that one needs flash-attention."""
    attn = getattr(model_config, "_attn_implementation", None) or "eager"
    return attn if attn in CPU_ATTENTION else "eager"


def cpu_attention_critic(mod) -> None:
    """``verl.utils.model.load_valuehead_model`` -> the same primary critic with a CPU attention (docstring)."""
    original = mod.load_valuehead_model
    if getattr(original, "_mix_src_cpu", False):
        return

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        attn = critic_attention(model_config)
        logger.info("mix_src.cpu: critic AutoModelForTokenClassification with attn_implementation=%s", attn)
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=attn,
            trust_remote_code=trust_remote_code,
        )

    load_valuehead_model._mix_src_cpu = True
    load_valuehead_model.__wrapped_original__ = original  # verl's own, for the test that shows its failure
    load_valuehead_model.__doc__ = original.__doc__
    mod.load_valuehead_model = load_valuehead_model
