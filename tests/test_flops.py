"""mix_src/algo/flops.py on hand-computed cases, the parameter count against a real Qwen2, and the budget's
config refusals (a critic; the V1 trainer)."""

import numpy as np
import pytest
from omegaconf import OmegaConf

import composed
from mix_src.algo.flops import ModelShape, forward_flops, lengths_from_masks, rl_step_flops, rollout_flops, sft_step_flops

# d=4, 1 layer, 2 heads of 2, 1 kv head, d_ff=8, vocab 10, q/k/v biases:
# N = 1 * (attn 4*4 + 2*4*2 + 4*4 + (4 + 2*2) = 56, mlp 3*4*8 = 96, norms 2*4 = 8) + final norm 4 = 164
SHAPE = ModelShape(d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, d_ff=8, vocab=10, qkv_bias=True)


def test_non_embedding_params_by_hand():
    assert SHAPE.non_embedding_params == 164


def test_forward_flops_by_hand():
    # sequences of 3 and 5 tokens: sum T = 8, sum T(T+1) = 12 + 30 = 42
    assert forward_flops(SHAPE, [3, 5], "6n") == 2 * 164 * 8 == 2624
    # + LM head 2*d*V*sum T = 640, + attention 2*L*H*d_head*sum T(T+1) = 2*1*2*2*42 = 336
    assert forward_flops(SHAPE, [3, 5], "full") == 2624 + 640 + 336 == 3600
    assert sft_step_flops(SHAPE, [3, 5], "full") == 3 * 3600
    with pytest.raises(ValueError, match="count"):  # a direct call's typo never counts silently as "6n"
        forward_flops(SHAPE, [3], "7n")


def test_rl_step_and_rollout_by_hand():
    # prompts 2 and 2, responses 1 and 3: T = 3 and 5; old log-probs (1 fwd) + 1 epoch of training (3 fwd)
    assert rl_step_flops(SHAPE, [2, 2], [1, 3], count="full") == 4 * 3600
    assert rl_step_flops(SHAPE, [2, 2], [1, 3], count="6n") == 4 * 2624
    assert rl_step_flops(SHAPE, [2, 2], [1, 3], ppo_epochs=2, ref_policy=True, count="6n") == (2 + 6) * 2624
    # row 0 generated nothing (a whole target): only row 1 (T = 5) is a rollout: 2*164*5 = 1640 (+ 400 + 240)
    assert rollout_flops(SHAPE, [2, 2], [1, 3], [0, 3], "6n") == 1640
    assert rollout_flops(SHAPE, [2, 2], [1, 3], [0, 3], "full") == 1640 + 2 * 4 * 10 * 5 + 2 * 2 * 2 * 30


def test_lengths_from_masks():
    am = np.array([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])  # left-padded prompt (3 wide), right-padded response
    prefix = np.array([[1, 0, 0], [0, 0, 0]])
    p, r, g = lengths_from_masks(am, 3, prefix)
    assert p.tolist() == [2, 3] and r.tolist() == [1, 2] and g.tolist() == [0, 2]
    p2, r2, g2 = lengths_from_masks(am, np.zeros((2, 3)))
    assert p2.tolist() == [2, 3] and g2.tolist() == r2.tolist() == [1, 2]


def test_shape_matches_a_real_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=50, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    embedding = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    shape = ModelShape.from_hf_config(cfg.to_dict())
    assert shape.non_embedding_params == sum(p.numel() for p in model.parameters()) - embedding


def _compose(overrides):
    return composed.compose_mix(overrides)  # tests/composed.py: the YAML read once per session


def test_budget_refused_with_a_critic_and_bad_values():
    from mix_src.config.mix_config import MixConfigError, validate_mix_config

    assert validate_mix_config(_compose(["mix.flops_budget=1e9"])).flops_budget == 1e9
    with pytest.raises(MixConfigError, match="mix.flops_budget.*critic"):
        validate_mix_config(_compose(["mix.flops_budget=1e9", "algorithm.adv_estimator=gae"]))
    with pytest.raises(MixConfigError, match="mix.flops_count"):
        validate_mix_config(_compose(["mix.flops_count=7n"]))
    with pytest.raises(MixConfigError, match="mix.flops_budget"):
        validate_mix_config(_compose(["mix.flops_budget=0"]))


def test_budget_accepted_on_v1_before_ray():
    """The V1 trainer counts and stops too (MixV1Mixin.step / on_step_end; run in tests/test_bases_equivalence.py
    and tests/test_mix_trainer_v1.py)."""
    from mix_src.main_mix_ppo import check_v1_config

    for mode in ("sync", "colocate_async"):
        cfg = OmegaConf.create({"trainer": {"v1": {"trainer_mode": mode}, "device": "cpu"}, "mix": {"flops_budget": 1e9},
                                "algorithm": {}})  # fmt: skip
        check_v1_config(cfg)


def test_add_step_flops_and_an_unreadable_shape_as_both_trainer_bases_log_them(capsys):
    from mix_src.algo.flops import add_step_flops, shape_unreadable

    totals, metrics = {"6n": 1.0, "full": 2.0}, {}
    add_step_flops(SHAPE, [2, 2], [1, 3], {"6n": 10.0, "full": 20.0}, totals, metrics)
    assert totals == {"6n": 1.0 + 4 * 2624 + 10, "full": 2.0 + 4 * 3600 + 20}  # the run so far + this step
    assert metrics["flops/step_full"] == 4 * 3600 + 20 and metrics["flops/rollout_6n"] == 10.0
    assert metrics["flops/total_6n"] == totals["6n"] and metrics["flops/num_tokens"] == 8

    def unreadable():
        raise KeyError("num_attention_heads")

    metrics = {}
    assert shape_unreadable(lambda: SHAPE, metrics) is False and metrics == {}
    assert shape_unreadable(unreadable, metrics) is True and metrics == {"flops/unavailable": 1}
    assert shape_unreadable(unreadable, {}) is True
    assert capsys.readouterr().out.count("FLOPs not counted") <= 1  # one line per process
