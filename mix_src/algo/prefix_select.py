"""Per-token selection of the prefix (demonstration) tokens that enter the actor loss: a registry.

The worker loss (:mod:`mix_src.worker.loss`) calls the entry ``mix.loss.prefix_token_select`` names (null, the
default: every prefix token kept) once per micro-batch, after the forward pass; a prefix token not kept gets
advantage 0 and stays in the loss's token count (as Prefix-RFT's official code drops low-entropy prefix tokens,
recipe/prefix_rft/dp_actor.py ``reshape_func``/``entropy``). Entry option ``prefix_tokens_on_policy`` (default
False): the kept prefix tokens get PPO-clip on exp(log_prob - old_log_probs) instead of the off-policy shaping
-A * f(p). Torch only (no verl).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mix_src.extend import Registry

__all__ = ["PREFIX_TOKEN_SELECTS", "PrefixTokenView", "apply_prefix_token_selection", "register_prefix_token_select",
           "select_prefix_tokens"]  # fmt: skip


@dataclass(frozen=True)
class PrefixTokenView:
    """What a selection entry sees for one micro-batch: (B, L) tensors without gradient (entropy None when the
    worker computed none: the entry's check should require ``actor.calculate_entropy=true``; the masks bool,
    prefix_mask within response_mask); ratio: the entry's setting ``mix.plugin_options.<name>.ratio`` (older
    spelling ``mix.loss.prefix_token_select_ratio``; its meaning is the entry's)."""

    entropy: Optional[torch.Tensor]
    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    prefix_mask: torch.Tensor
    ratio: float


PrefixTokenSelect = Callable[[PrefixTokenView], torch.Tensor]
PREFIX_TOKEN_SELECTS: Registry[PrefixTokenSelect] = Registry(
    "prefix token selection", "mix.loss.prefix_token_select", old_settings={"ratio": "mix.loss.prefix_token_select_ratio"})
"""``fn(view: PrefixTokenView) -> keep``, (B, L) bool, True = the prefix token keeps its advantage."""
register_prefix_token_select = PREFIX_TOKEN_SELECTS.register


def apply_prefix_token_selection(advantages: torch.Tensor, prefix_mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, L) advantages, prefix_mask, keep -> new (B, L) advantages with 0 on the prefix tokens not kept (the shapes:
    checked by select_prefix_tokens)."""
    drop = prefix_mask.bool() & ~keep.bool()
    return torch.where(drop, torch.zeros_like(advantages), advantages)


def select_prefix_tokens(name: str, view: PrefixTokenView) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Entry ``name`` on ``view`` -> (advantages (B, L), dropped prefix tokens zeroed; kept prefix tokens (B, L) bool;
    the entry's ``prefix_tokens_on_policy``)."""
    entry = PREFIX_TOKEN_SELECTS.describe(name)
    keep = entry.fn(view)
    if not isinstance(keep, torch.Tensor) or keep.shape != view.prefix_mask.shape:
        raise ValueError(f"prefix token selection {name!r} must return a (B, L) bool tensor of shape "
                         f"{tuple(view.prefix_mask.shape)}, got {getattr(keep, 'shape', type(keep))}")  # fmt: skip
    advantages = apply_prefix_token_selection(view.advantages, view.prefix_mask, keep)
    kept = view.prefix_mask.bool() & keep.bool()
    return advantages, kept, bool(entry.options.get("prefix_tokens_on_policy", False))
