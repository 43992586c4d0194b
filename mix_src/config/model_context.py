"""Model settings the driver resolves and checks before Ray: ``rollout.max_model_len`` and the attention.

verl fills a null ``rollout.max_model_len`` only inside its server actor, from ``max_position_embeddings``
(``vllm_async_server.py`` / ``async_sglang_server.py`` ``_validate_configs``); the prefix-guided agent loop
(:mod:`mix_src.rollout.agent_loop`) runs elsewhere and would see ``null``, so its "no room left" clamp would never
fire. :func:`resolve_max_model_len` fills it on the driver; the agent loop calls :func:`model_context_length` in its
worker when the driver could not (a hub id not cached on the driver: the driver never downloads).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import torch
from omegaconf import OmegaConf, open_dict

from mix_src.config.mix_config import MixConfigError, uses_critic
from mix_src.config.verl_parity import dotted_get


def is_hub_id(path: str) -> bool:
    """'Qwen/Qwen2.5-Math-7B'-style model ids are resolved by transformers, not local paths."""
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1


def model_context_length(model_cfg: Any, *, local_files_only: Optional[bool] = None) -> int:
    """``max_position_embeddings`` of ``actor_rollout_ref.model`` after its ``override_config``, as verl's
    servers compute it. ``local_files_only`` defaults to True for a hub id (no download). Raises on failure."""
    from transformers import AutoConfig
    from verl.utils.model import update_model_config
    from verl.workers.rollout.utils import get_max_position_embeddings

    path = os.path.expanduser(str(dotted_get(model_cfg, "hf_config_path") or dotted_get(model_cfg, "path")))
    local_files_only = is_hub_id(path) if local_files_only is None else local_files_only
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=bool(dotted_get(model_cfg, "trust_remote_code", False)),
                                           local_files_only=local_files_only)  # fmt: skip
    override = dotted_get(model_cfg, "override_config", {}) or {}
    override = override.get("model_config", override) if hasattr(override, "get") else {}
    keep = {k: v for k, v in dict(override).items() if k in ("max_position_embeddings", "text_config")}
    if keep:
        keep = OmegaConf.to_container(OmegaConf.create(keep), resolve=True)
        update_model_config(hf_config, override_config_kwargs=keep)
    return get_max_position_embeddings(hf_config)


def resolve_max_model_len(config) -> Optional[int]:
    """Fill a null ``actor_rollout_ref.rollout.max_model_len`` with the model's context, as verl's server would, and
    refuse a prompt + response that does not fit it, or an explicit value beyond it (verl's server refuses that too);
    an explicit value below prompt + response is deliberate (answers are clamped to the room left). Returns the value
    the rollout will use, or None where the model config cannot be read here."""
    rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    explicit = rollout.get("max_model_len")
    prompt_len, response_len = int(config.data.max_prompt_length), int(config.data.max_response_length)
    need = prompt_len + response_len
    try:
        context = model_context_length(model)
    except Exception as e:  # noqa: BLE001  (the model itself is loaded, and its errors reported, by verl)
        if explicit is None:
            print(f"[mix_src] actor_rollout_ref.rollout.max_model_len: the context of actor_rollout_ref.model.path="
                  f"{model.path} cannot be read on the driver ({type(e).__name__}); the prefix-guided agent loop "
                  "reads it in its worker")  # fmt: skip
        return None if explicit is None else int(explicit)
    if explicit is not None:
        if int(explicit) > context:
            raise MixConfigError(f"actor_rollout_ref.rollout.max_model_len={explicit} exceeds the context of "
                                 f"actor_rollout_ref.model.path={model.path} (max_position_embeddings {context}; "
                                 f"verl's rollout server refuses it too): set it to at most {context}")
        if int(explicit) < need:
            print(f"[mix_src] actor_rollout_ref.rollout.max_model_len={explicit} < data.max_prompt_length + "
                  f"data.max_response_length = {need}: answers are cut to the room left after prompt + prefix")  # fmt: skip
        return int(explicit)
    if need > context:
        raise MixConfigError(f"data.max_prompt_length ({prompt_len}) + data.max_response_length ({response_len}) = "
                             f"{need} tokens do not fit the context of actor_rollout_ref.model.path={model.path} "
                             f"(max_position_embeddings {context}): lower data.max_response_length (or "
                             "data.max_prompt_length) to fit, use a model with a longer context, or set "
                             f"actor_rollout_ref.rollout.max_model_len={context} to accept answers cut to the room "
                             "left after prompt + prefix")
    with open_dict(config):
        rollout.max_model_len = context
    return context


# verl's HFModelConfig default (verl/workers/config/model.py: override_config.get("attn_implementation", ...))
VERL_DEFAULT_ATTN = "flash_attention_2"
SDPA_OVERRIDES = ("+actor_rollout_ref.model.override_config.attn_implementation=sdpa "
                  "actor_rollout_ref.model.use_remove_padding=false")


def check_attention(config, *, cuda: Optional[bool] = None) -> None:
    """Refuse, before Ray, attention settings that cannot work (each error says why): ``use_remove_padding=true``
    without flash-attn's varlen kernels, and ``flash_attention_2`` (verl's default) on a CUDA machine where
    ``flash_attn`` is not importable (``cuda``: default ``torch.cuda.is_available()``, the driver's)."""
    sections = [("actor_rollout_ref.model", config.actor_rollout_ref.model)]
    if uses_critic(config) and (config.get("critic") or {}).get("model") is not None:
        sections.append(("critic.model", config.critic.model))
    for key, model in sections:
        impl = str((model.get("override_config") or {}).get("attn_implementation") or VERL_DEFAULT_ATTN)
        if not impl.startswith("flash_attention") and model.get("use_remove_padding", True):  # no varlen kernels
            raise MixConfigError(f"{key}.override_config.attn_implementation={impl} with "
                                 f"{key}.use_remove_padding=true: remove-padding packs the batch's sequences into one "
                                 "row and only flash-attn's varlen kernels keep them apart "
                                 f"(verl/models/transformers/monkey_patch.py); set {key}.use_remove_padding=false (the "
                                 f"path without flash-attn: {SDPA_OVERRIDES})")
        if impl == VERL_DEFAULT_ATTN and (torch.cuda.is_available() if cuda is None else cuda) \
                and importlib.util.find_spec("flash_attn") is None:  # fmt: skip
            raise MixConfigError(f"{key}.override_config.attn_implementation={impl} (verl's default) but flash_attn is "
                                 "not installed here (`make install-gpu NO_FLASH_ATTN=1` skips it: it has no wheel for "
                                 "torch 2.11 + CUDA 13). Install it (scripts/gpu/README.md), or train without it: "
                                 f"{SDPA_OVERRIDES}")
