"""CPU-backend patches for verl's FSDP workers (the reference policy and the critic on a CPU-only host) and for
its V1 trainer's replay buffer.

Registered by :func:`mix_src.cpu.activate` with ``after_import``; a verl or torch upgrade must re-check the lines
each docstring quotes (``*_WRITTEN_FOR``). What each enables: mix_src/cpu/README.md "What runs on CPU".
"""

from __future__ import annotations

import logging

from . import replace

logger = logging.getLogger(__name__)  # its level: mix_src.cpu's (VERL_LOGGING_LEVEL)

UNPIN_REFERENCE_OFFLOAD_WRITTEN_FOR = {"verl": "0.9.1", "torch": "2.13"}
CPU_ATTENTION_CRITIC_WRITTEN_FOR = {"verl": "0.9.1", "transformers": ">=5,<6"}

CPU_ATTENTION = ("eager", "sdpa", "flex_attention")
CPU_POLL_INTERVAL_S = 0.05  # patch_replay_buffer_poll's default (written for verl 0.9.1)


def unpin_reference_offload(mod) -> None:
    """``transformer_impl.CPUOffloadPolicy`` -> a subclass with ``pin_memory=False``.

    The reference policy's FSDP2 engine uses ``CPUOffloadPolicy(pin_memory=True)``
    (``verl/workers/engine/fsdp/transformer_impl.py`` 459-462) and torch pins each shard
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` 314-315), which needs an accelerator ("Cannot access
    accelerator device when none is available"). Still a ``CPUOffloadPolicy`` for isinstance checks."""
    original = mod.CPUOffloadPolicy
    if original is None or getattr(original, "_mix_src_cpu", False):
        return

    class UnpinnedCPUOffloadPolicy(original):  # never pins memory (pinning needs an accelerator)
        def __init__(self, pin_memory: bool = False):
            super().__init__(pin_memory=False)

    UnpinnedCPUOffloadPolicy.__qualname__ = UnpinnedCPUOffloadPolicy.__name__
    replace(mod, "CPUOffloadPolicy", UnpinnedCPUOffloadPolicy)  # marked _mix_src_cpu, with torch's docstring


def critic_attention(model_config) -> str:
    """The critic's attention implementation on CPU: its config's, unless that one needs flash-attention."""
    attn = getattr(model_config, "_attn_implementation", None) or "eager"
    return attn if attn in CPU_ATTENTION else "eager"


def cpu_attention_critic(mod) -> None:
    """``verl.utils.model.load_valuehead_model`` -> the same primary critic with a CPU attention.

    verl loads ``AutoModelForTokenClassification`` with ``attn_implementation="flash_attention_2"`` hard-coded
    (``verl/utils/model.py`` 641-652, then a trl fallback or "please install trl", 654-657); here with the
    critic config's own (``critic.model.override_config.attn_implementation``, which ``HFModelConfig`` puts in
    ``hf_config._attn_implementation``, ``verl/workers/config/model.py`` 185-190), flash-attention -> eager."""
    original = mod.load_valuehead_model

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        attn = critic_attention(model_config)
        logger.info("mix_src.cpu: critic AutoModelForTokenClassification with attn_implementation=%s", attn)
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation=attn, trust_remote_code=trust_remote_code)  # fmt: skip

    load_valuehead_model.__wrapped_original__ = original  # verl's own, for the test that shows its failure
    replace(mod, "load_valuehead_model", load_valuehead_model)


def patch_replay_buffer_poll(mod) -> None:
    """``ReplayBuffer.__init__`` (``verl/trainer/ppo/v1/replay_buffer.py:144``) polls TransferQueue every
    ``poll_interval=2.0`` s (``_wait_for_next_poll``, 408) and the trainer passes no other value
    (``verl/trainer/ppo/v1/trainer_base.py`` 154-162); a tiny CPU model finishes a batch in well under 2 s, so every
    step waited for the poll (measured: scripts/bench/README.md). The default becomes :data:`CPU_POLL_INTERVAL_S`;
    an explicit ``poll_interval`` wins."""
    cls = mod.ReplayBuffer  # ReplayBufferAsync inherits __init__
    original = cls.__init__

    def __init__(self, *args, poll_interval: float = CPU_POLL_INTERVAL_S, **kwargs):
        original(self, *args, poll_interval=poll_interval, **kwargs)

    replace(cls, "__init__", __init__)
