"""Loss combinations: how the on-policy rows' RL loss and the expert rows' loss make the policy loss.

An extension point of the worker loss (:class:`mix_src.worker.loss.MixPolicyLoss`), picked by ``mix.loss.combine``
(unset: unused), with the entry's settings in ``mix.plugin_options.<name>`` (older spelling ``mix.loss.combine_args``).
A row with any prefix token is an *expert row*, every other row an *on-policy row*; the worker loss computes the
vanilla PPO-clip loss of the on-policy rows and hands it, with the expert tokens' log-probs, to the entry
``fn(inputs: CombineInputs, args) -> (policy loss () with grad, metrics)``; args: its settings, defaults filled in;
metrics are logged as ``actor/<key>``, averaged over micro-batches (report means, not shares of a sum). Each
population is normalised by its own size in the global mini-batch (counted on the driver,
:func:`mix_src.worker.loss.add_combine_inputs`), so no term depends on the micro-batch split. Torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from mix_src.extend import Registry

__all__ = ["LOSS_COMBINES", "CombineInputs", "LossCombine", "register_loss_combine"]


@dataclass
class CombineInputs:
    """What a loss combination gets, for one micro-batch."""

    log_prob: torch.Tensor  # (B, L) float, with grad: log p of every response token under the current policy
    on_mask: torch.Tensor  # (B, L) bool: the on-policy rows' valid tokens
    expert_mask: torch.Tensor  # (B, L) bool: the expert rows' prefix tokens
    rl_loss: torch.Tensor  # () with grad: PPO-clip over on_mask, aggregated like agg_on
    agg_on: Callable[[torch.Tensor], torch.Tensor]  # (B, L) loss -> (): over on_mask (actor.loss_agg_mode)
    agg_expert: Callable[[torch.Tensor], torch.Tensor]  # (B, L) loss -> (): over expert_mask, the same mode
    global_step: int  # the trainer's step (verl's global_steps, from 1)


LossCombine = Callable[[CombineInputs, Mapping[str, Any]], "tuple[torch.Tensor, dict[str, float]]"]
LOSS_COMBINES: Registry[LossCombine] = Registry("loss combination", "mix.loss.combine",
                                                old_settings={"*": "mix.loss.combine_args"})
register_loss_combine = LOSS_COMBINES.register
