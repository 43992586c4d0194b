"""Model settings the driver resolves and checks before Ray: ``rollout.max_model_len`` (the model context the
prefix-guided agent loop clamps to) and the attention implementation (:func:`check_attention`).

verl fills a null ``rollout.max_model_len`` only inside its server actor, from the model config's
``max_position_embeddings`` (``vllm_async_server.py`` ``_validate_configs``, same in ``async_sglang_server.py``),
and its server raises when a prompt leaves no room. The agent loop runs in another process and would
see ``null``, so its "no room left -> no server call" clamp (:mod:`mix_src.rollout.agent_loop`) never fired.

* :func:`resolve_max_model_len` runs on the driver before Ray (``mix_src.main_mix_ppo.prepare_config``):
  a null value becomes the model's context, as verl's server would set it; ``data.max_prompt_length +
  data.max_response_length`` beyond that context is refused, naming the keys (an explicit
  ``max_model_len`` below it is taken as deliberate: answers are clamped to the room left); an explicit
  value beyond the context is refused, as verl's server refuses it.
* :func:`model_context_length` is verl's rule itself (``HFModelConfig``: ``AutoConfig`` of
  ``hf_config_path`` or ``path``, then ``override_config``; ``get_max_position_embeddings``). The agent loop
  calls it in its worker when the driver could not (a hub id not cached on the driver: the driver never
  downloads), so stock ``verl.trainer.main_ppo`` with our loop clamps too.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from mix_src.config.mix_config import MixConfigError, uses_critic
from mix_src.config.verl_parity import _get


def is_hub_id(path: str) -> bool:
    """'Qwen/Qwen2.5-Math-7B'-style model ids are resolved by transformers, not local paths."""
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1


def model_context_length(model_cfg: Any, *, local_files_only: Optional[bool] = None) -> int:
    """``max_position_embeddings`` of ``actor_rollout_ref.model`` after its ``override_config``, as verl's
    servers compute it. ``local_files_only`` defaults to True for a hub id (no download). Raises on failure."""
    from transformers import AutoConfig
    from verl.utils.model import update_model_config
    from verl.workers.rollout.utils import get_max_position_embeddings

    path = str(_get(model_cfg, "hf_config_path") or _get(model_cfg, "path"))
    path = os.path.expanduser(path)
    if local_files_only is None:
        local_files_only = is_hub_id(path)
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=bool(_get(model_cfg, "trust_remote_code", False)),
                                           local_files_only=local_files_only)  # fmt: skip
    override = _get(model_cfg, "override_config", {}) or {}
    override = override.get("model_config", override) if hasattr(override, "get") else {}
    keep = {k: v for k, v in dict(override).items() if k in ("max_position_embeddings", "text_config")}
    if keep:
        from omegaconf import OmegaConf

        keep = OmegaConf.to_container(OmegaConf.create(keep), resolve=True)
        update_model_config(hf_config, override_config_kwargs=keep)
    return get_max_position_embeddings(hf_config)


def resolve_max_model_len(config) -> Optional[int]:
    """Fill or check ``actor_rollout_ref.rollout.max_model_len`` on the driver (see the module docstring).
    Returns the value the rollout will use, or None where the model config cannot be read here."""
    from omegaconf import open_dict

    rollout = config.actor_rollout_ref.rollout
    model = config.actor_rollout_ref.model
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
            raise MixConfigError(
                f"actor_rollout_ref.rollout.max_model_len={explicit} exceeds the context of actor_rollout_ref.model."
                f"path={model.path} (max_position_embeddings {context}; verl's rollout server refuses it too): "
                f"set it to at most {context}"
            )
        if int(explicit) < need:
            print(f"[mix_src] actor_rollout_ref.rollout.max_model_len={explicit} < data.max_prompt_length + "
                  f"data.max_response_length = {need}: answers are cut to the room left after prompt + prefix")  # fmt: skip
        return int(explicit)
    if need > context:
        raise MixConfigError(
            f"data.max_prompt_length ({prompt_len}) + data.max_response_length ({response_len}) = {need} tokens do not "
            f"fit the context of actor_rollout_ref.model.path={model.path} (max_position_embeddings {context}): "
            f"lower data.max_response_length (or data.max_prompt_length) to fit, use a model with a longer context, "
            f"or set actor_rollout_ref.rollout.max_model_len={context} to accept answers cut to the room left "
            "after prompt + prefix"
        )
    with open_dict(config):
        rollout.max_model_len = context
    return context


# verl's HFModelConfig default (verl/workers/config/model.py: override_config.get("attn_implementation", ...))
VERL_DEFAULT_ATTN = "flash_attention_2"
SDPA_OVERRIDES = (
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=false"
)


def check_attention(config, *, cuda: Optional[bool] = None) -> None:
    """Refuse, before Ray, attention settings that cannot work; the path without flash-attn is
    ``override_config.attn_implementation=sdpa`` (or ``eager``, as the CPU backend uses) with
    ``use_remove_padding=false``.

    * ``use_remove_padding=true`` packs a batch's sequences into one row and relies on flash-attn's varlen
      kernels to keep them apart (verl/models/transformers/monkey_patch.py patches transformers'
      ``_flash_attention_forward``); under sdpa/eager the packed sequences would attend to each other.
    * ``flash_attention_2`` (verl's default) where ``flash_attn`` is not importable, on a CUDA machine: verl
      would fail when its workers load the model (``make install-gpu NO_FLASH_ATTN=1`` skips flash-attn).
      Checked on the driver, in the driver's environment (``cuda``: default ``torch.cuda.is_available()``).
    """
    sections = [("actor_rollout_ref.model", config.actor_rollout_ref.model)]
    if uses_critic(config) and (config.get("critic") or {}).get("model") is not None:
        sections.append(("critic.model", config.critic.model))
    for key, model in sections:
        impl = str((model.get("override_config") or {}).get("attn_implementation") or VERL_DEFAULT_ATTN)
        varlen = impl.startswith("flash_attention")
        if not varlen and model.get("use_remove_padding", True):
            raise MixConfigError(
                f"{key}.override_config.attn_implementation={impl} with {key}.use_remove_padding=true: remove-padding "
                "packs the batch's sequences into one row and only flash-attn's varlen kernels keep them apart "
                "(verl/models/transformers/monkey_patch.py); set "
                f"{key}.use_remove_padding=false (the path without flash-attn: {SDPA_OVERRIDES})"
            )
        if impl == VERL_DEFAULT_ATTN:
            import importlib.util

            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if cuda and importlib.util.find_spec("flash_attn") is None:
                raise MixConfigError(
                    f"{key}.override_config.attn_implementation={impl} (verl's default) but flash_attn is not installed "
                    "here (`make install-gpu NO_FLASH_ATTN=1` skips it: it has no wheel for torch 2.11 + CUDA 13). "
                    f"Install it (scripts/gpu/README.md), or train without it: {SDPA_OVERRIDES}"
                )
