"""Off-policy behaviour: whose probability the off-policy (prefix) tokens' importance weight divides by.

LUFFY takes the expert's probability as 1 (the shaped term of a prefix token is f(p), p = exp(l)). A method that
replays the model's OWN earlier samples (ExGRPO, recipes/exgrpo) weighs them by w = exp(l - l_b), l_b the behaviour
policy's log-probs recorded when they were sampled (ExGRPO's official ``mix_trainer_experience.py`` puts them in
``old_log_probs`` of the replayed rows, its ``mix_core_alg.py`` shapes ``exp(log_prob - old_log_prob)``).
``mix.loss.off_policy_behaviour=name`` (null = LUFFY) picks ``fn(prefix_mask (bsz, L) bool, fields: the worker
batch) -> (bsz, L) float l_b`` (read on the prefix tokens only), passed to ``loss_terms.token_loss`` as
``TokenBatch.behaviour_log_prob``. Torch only (no verl).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from mix_src.extend import Registry

__all__ = ["BEHAVIOUR_LOG_PROB", "OFF_POLICY_BEHAVIOURS", "register_off_policy_behaviour"]

BEHAVIOUR_LOG_PROB = "behaviour_log_prob"  # (bsz, L) float: log-probs recorded when the tokens were sampled

Behaviour = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
OFF_POLICY_BEHAVIOURS: Registry[Behaviour] = Registry("off-policy behaviour", "mix.loss.off_policy_behaviour")
register_off_policy_behaviour = OFF_POLICY_BEHAVIOURS.register


@register_off_policy_behaviour("stored_log_prob", reads=("mix.loss.off_policy_behaviour",))
def stored_log_prob(prefix_mask: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The recorded log-probs in the batch field ``behaviour_log_prob``: (bsz, L) bool, mapping -> (bsz, L)."""
    if BEHAVIOUR_LOG_PROB not in fields.keys():
        raise KeyError(f"mix.loss.off_policy_behaviour=stored_log_prob needs the per-token field "
                       f"'{BEHAVIOUR_LOG_PROB}' (bsz, response_len) in the batch; a rollout policy must set it")
    b = fields[BEHAVIOUR_LOG_PROB]
    if b.shape != prefix_mask.shape:
        raise ValueError(f"'{BEHAVIOUR_LOG_PROB}' has shape {tuple(b.shape)}; prefix_mask has {tuple(prefix_mask.shape)}")
    return torch.where(prefix_mask.to(torch.bool), b.to(torch.float32), 0.0)
