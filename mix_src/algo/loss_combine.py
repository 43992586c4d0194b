"""Loss combinations: how the on-policy rows' RL loss and the expert rows' loss make the policy loss.

An extension point of the worker loss (:class:`mix_src.worker.loss.MixPolicyLoss`), picked by
``mix.loss.combine=<name>`` with the entry's declared settings in ``mix.plugin_options.<name>`` (older spelling:
``mix.loss.combine_args``; mix_src/extend.py ``resolve_settings``). Unset (the default), the worker loss is LUFFY's (``mix.loss.*``) and this module is not used.

With a combination selected, a row with any prefix token is an *expert row* (e.g. ``mix.n_prefix`` rows at
prefix ratio 1.0: the whole target, never sent to the inference server) and every other row is an
*on-policy row*. The worker loss computes the vanilla PPO-clip loss of the on-policy rows (verl's actor
clip settings, dual clip ``clip_ratio_c``) and hands it, with the expert tokens' log-probs, to the entry:

    @register_loss_combine("name", bases=(...), why_not={...}, check=..., reads=(...))
    def fn(inputs: CombineInputs, args: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]

    inputs.log_prob      (B, L) float, with grad: log p of every response token under the current policy
    inputs.on_mask       (B, L) bool: the on-policy rows' valid tokens
    inputs.expert_mask   (B, L) bool: the expert rows' prefix tokens
    inputs.rl_loss       () float, with grad: PPO-clip over ``on_mask``, aggregated like ``agg_on``
    inputs.agg_on        (B, L) loss matrix -> (): aggregate over ``on_mask`` (actor.loss_agg_mode)
    inputs.agg_expert    (B, L) loss matrix -> (): aggregate over ``expert_mask``, the same mode
    inputs.global_step   int: the trainer's step (verl's ``global_steps``, counts from 1)
    args                 the entry's settings, defaults filled in (``LOSS_COMBINES.settings``)
    returns              the policy loss () (with grad) and scalar metrics (logged as ``actor/<key>``, averaged
                         over micro-batches: report means, e.g. a micro-batch's token mean, not shares of a sum)

Each population is normalised by its own size in the whole global mini-batch (``agg_on``: its on-policy
tokens, or rows for the seq-mean modes; ``agg_expert``: its expert tokens/rows), counted on the driver before
the update (:func:`mix_src.worker.loss.add_combine_inputs`), so a term is the same whatever the micro-batch split
and the share of expert rows does not rescale the RL term. The entropy bonus and the KL loss stay the worker
loss's (actor.entropy_coeff, actor.use_kl_loss), over every valid token.

This module is torch-only; an entry is pure maths on the tensors above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from mix_src.extend import Registry

__all__ = ["LOSS_COMBINES", "CombineInputs", "LossCombine", "register_loss_combine"]


@dataclass
class CombineInputs:
    """What a loss combination gets (shapes: see the module docstring)."""

    log_prob: torch.Tensor
    on_mask: torch.Tensor
    expert_mask: torch.Tensor
    rl_loss: torch.Tensor
    agg_on: Callable[[torch.Tensor], torch.Tensor]
    agg_expert: Callable[[torch.Tensor], torch.Tensor]
    global_step: int


LossCombine = Callable[[CombineInputs, Mapping[str, Any]], "tuple[torch.Tensor, dict[str, float]]"]
LOSS_COMBINES: Registry[LossCombine] = Registry("loss combination", "mix.loss.combine",
                                                old_settings={"*": "mix.loss.combine_args"})


def register_loss_combine(name: str, **entry) -> Callable[[LossCombine], LossCombine]:
    """Register ``fn(inputs: CombineInputs, args) -> (loss, metrics)`` under ``name``. ``entry``: the
    self-description of :meth:`mix_src.extend.Registry.register` (bases, why_not, settings, check, reads)."""
    return LOSS_COMBINES.register(name, **entry)
