"""mix_src.planner: the estimates checked by hand (no Ray, no torch)."""

import pytest

from mix_src.planner import checkpoint_bytes, count_params
from mix_src.planner.presets import PRESETS


def test_count_params_qwen25_7b_by_hand():
    # embedding 152064*3584 twice (untied head) + 28 layers of (attn 3584*(3584+2*512) + 3584*3584 + biases
    # 3584+2*512, MLP 3*3584*18944, 2 norms 2*3584) + final norm 3584
    embed = 152064 * 3584
    layer = 3584 * (3584 + 2 * 512) + 3584 * 3584 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
    assert count_params(PRESETS["Qwen/Qwen2.5-7B"]) == 2 * embed + 28 * layer + 3584 == 7_615_616_512


def test_count_params_tied_head_qwen25_1p5b():
    n = count_params(PRESETS["Qwen/Qwen2.5-1.5B"])
    assert n == 1_543_714_304  # the model card's 1.54B; tied embeddings count once


def test_checkpoint_bytes_basis():
    n = 1_000_000
    assert checkpoint_bytes(n) - checkpoint_bytes(n, with_optimizer=False) == 8 * n  # AdamW's two fp32 moments
    assert checkpoint_bytes(2 * n, with_optimizer=False) - checkpoint_bytes(n, with_optimizer=False) == 4 * n
    with pytest.raises(ValueError):
        checkpoint_bytes(-1)
