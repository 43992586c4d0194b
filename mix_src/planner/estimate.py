"""Memory and GPU-hour estimates of a run, from the model's shape and the recipe's numbers. Pure arithmetic:
no torch, verl or Ray imports (the CLI, :mod:`mix_src.planner.__main__`, and the pre-Ray check,
:mod:`mix_src.planner.check`, read the configs).

Units: bytes (``int``) for memory, parameters as counts, hours for time. GB below means 1e9 bytes.
"""

from __future__ import annotations

from typing import Mapping

from mix_src.flops import ModelShape

GB = 10**9

# Bytes per parameter of the FSDP actor's training state. verl trains the actor in fp32 unless
# actor_rollout_ref.actor.fsdp_config.model_dtype says otherwise (verl/workers/engine/fsdp/transformer_impl.py
# _build_module: "if it is training, we force torch_dtype to fp32"), with torch.optim.AdamW (two fp32 moments).
PARAM_BYTES = 4  # fp32 parameter
GRAD_BYTES = 4  # fp32 gradient
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32 each
# A checkpoint's extra_state (lr scheduler + RNG states) and the huggingface/ config + tokenizer files: a few MB.
CHECKPOINT_EXTRA_BYTES = 64 * 2**20


def count_params(hf_config: Mapping) -> int:
    """Parameters of a decoder-only HF model (Qwen2/Llama family) from its ``config.json`` dict: the token
    embedding (``vocab x hidden``), every decoder layer and the final norm (:class:`mix_src.flops.ModelShape`),
    and the LM head unless ``tie_word_embeddings`` (Qwen2.5-7B: 7,615,616,512)."""
    shape = ModelShape.from_hf_config(hf_config)
    embed = shape.vocab * shape.d_model
    head = 0 if hf_config.get("tie_word_embeddings", False) else embed
    return shape.non_embedding_params + embed + head


def checkpoint_bytes(num_params: int, with_optimizer: bool = True) -> int:
    """Bytes one verl FSDP actor checkpoint (``global_step_N/actor``) holds, summed over ranks: the model shards
    (``model_world_size_W_rank_R.pt``, fp32: 4 B/param), the AdamW states (``optim_world_size_W_rank_R.pt``, two
    fp32 moments: 8 B/param) when ``with_optimizer`` (verl's default ``checkpoint.save_contents`` includes
    ``optimizer``), and :data:`CHECKPOINT_EXTRA_BYTES` for ``extra_state_*.pt`` and ``huggingface/`` (verl/utils/
    checkpoint/fsdp_checkpoint_manager.py save_checkpoint). So 12 B/param with the optimizer, 4 without."""
    if num_params < 0:
        raise ValueError(f"num_params={num_params} must be >= 0")
    per_param = PARAM_BYTES + (ADAM_BYTES if with_optimizer else 0)
    return int(num_params) * per_param + CHECKPOINT_EXTRA_BYTES
