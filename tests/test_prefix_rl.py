"""PrefixRL's loss setting, ``mix.loss.prefix_tokens=context`` (issue #55 item 4): the token accounting against a hand
computation, through the trainer's mask (mix_src/trainer/stages.py ``prefix_context_mask``), verl's own padding
conversion and micro-batching (``left_right_2_no_padding``, ``prepare_micro_batches``) and the MIX worker loss.

The batch: row 0 has 4 response tokens, the first 2 a prefix; row 1 has 3 on-policy tokens. With ``context`` the
update's token count is 2 + 3 = 5 (LUFFY's ``off_policy``: 7); old log-probs equal the current ones (ratio 1), so
the PPO term is -A per token, and with token-mean:

    loss = -(sum over the 5 continuation tokens of A) / 5 - c_H * (sum of their entropies) / 5
           + c_KL * (sum of their log p - log p_ref) / 5        (kl_loss_type=kl, i.e. k1)

No prefix token is in the policy term, the entropy bonus, the KL term or any denominator."""

from __future__ import annotations

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from verl.workers.config import ActorConfig
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from mix_src.config.mix_config import MixConfigError, mix_config_from_dict
from mix_src.trainer.stages import prefix_context_mask
from mix_src.worker.loss import MixLossConfig, MixPolicyLoss

VOCAB, H_COEF, KL_COEF = 11, 0.01, 0.2


class Bigram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)))

    def forward(self, micro_batch) -> dict:  # nested (bsz, j) log-probs and entropy, as verl's engine returns them
        ids = micro_batch["input_ids"].values()
        logits = self.w[ids]
        offsets = micro_batch["input_ids"].offsets()
        return {"log_probs": torch.nested.nested_tensor_from_jagged(
                    logprobs_from_logits(logits, torch.roll(ids, shifts=-1, dims=0)), offsets),
                "entropy": torch.nested.nested_tensor_from_jagged(entropy_from_logits(logits), offsets)}


def _batch(prefix_tokens: str, model: Bigram):
    prompts = torch.tensor([[0, 3], [4, 5]])  # row 0 left-padded (prompt of 1 token)
    prompt_mask = torch.tensor([[0, 1], [1, 1]], dtype=torch.bool)
    responses = torch.tensor([[6, 7, 8, 9], [1, 2, 3, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    prefix_mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    advantages = torch.tensor([[0.5] * 4, [-1.5] * 4]) * response_mask
    mask = prefix_context_mask(response_mask, prefix_mask) if prefix_tokens == "context" else response_mask
    attention_mask = torch.cat([prompt_mask.long(), response_mask], dim=1)
    td = tu.get_tensordict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                            "response_mask": mask, "advantages": advantages, "prefix_mask": prefix_mask})
    td = left_right_2_no_padding(td)  # what RayPPOTrainer._update_actor does (loss_mask = response_mask)
    with torch.no_grad():
        current = no_padding_2_padding(model(td)["log_probs"], td)
    td["old_log_probs"] = current * response_mask  # ratio 1
    td["ref_log_prob"] = (current - 0.25) * response_mask  # log p - log p_ref = 0.25 on every token
    tu.assign_non_tensor(td, global_batch_size=2, calculate_entropy=True, use_remove_padding=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2)
    tu.assign_non_tensor(td, batch_num_tokens=int(td["loss_mask"].sum()), dp_size=1)  # fsdp transformer_impl.py
    return td


def _loss(prefix_tokens: str):
    model = Bigram()
    td = _batch(prefix_tokens, model)
    (micro_batch,), _ = prepare_micro_batches(td)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, entropy_coeff=H_COEF,
                      use_kl_loss=True, kl_loss_coef=KL_COEF, kl_loss_type="kl", loss_agg_mode="token-mean")
    out = model(micro_batch)
    loss, metrics = MixPolicyLoss(cfg, MixLossConfig(prefix_tokens=prefix_tokens))(model_output=out, data=micro_batch)
    entropy = no_padding_2_padding(out["entropy"], micro_batch).detach()
    return td, loss.item(), metrics, entropy


def test_context_counts_only_the_continuation():
    td, loss, metrics, entropy = _loss("context")
    assert int(td["batch_num_tokens"]) == 5  # verl's count from the loss mask: 2 + 3, the prefix out
    cont = [(0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    adv = {0: 0.5, 1: -1.5}
    pg = -sum(adv[i] for i, _ in cont) / 5
    ent = sum(float(entropy[i, t]) for i, t in cont) / 5
    kl = sum(0.25 for _ in cont) / 5
    assert loss == pytest.approx(pg - H_COEF * ent + KL_COEF * kl, rel=1e-5)
    assert metrics["kl_loss"].values[0] == pytest.approx(0.25, rel=1e-5)


def test_luffy_counts_the_prefix_tokens():
    td, loss, metrics, _ = _loss("off_policy")
    assert int(td["batch_num_tokens"]) == 7
    assert "actor/off_pg_loss" in metrics and metrics["actor/off_policy_prob"].values[0] > 0


def test_context_refuses_the_prefix_token_settings():
    for bad in ({"off_max_clip": 0.5}, {"use_sft_multitask_loss": True}, {"all_max_clip": 0.9}):
        with pytest.raises(MixConfigError, match=r"prefix_tokens=context"):
            mix_config_from_dict({"loss": {"prefix_tokens": "context", **bad}})
    with pytest.raises(MixConfigError, match=r"mix\.loss\.prefix_tokens='whole'"):
        mix_config_from_dict({"loss": {"prefix_tokens": "whole"}})
