"""Rule rewards for math and multiple-choice answers (mix_src/rewards/README.md).

``compute_score`` / ``compute_score_batch`` (verl's custom-reward signatures) live in
:mod:`mix_src.rewards.math_verify_reward` (``reward.custom_reward_function.path=pkg://<that module>``).
Symbolic grading runs in :mod:`mix_src.rewards.pool` worker processes with a hard per-item deadline.
"""

from mix_src.rewards.math_verify_reward import (ANSWER_TYPES, RewardConfig, compute_score, compute_score_batch,
                                                grading_stats, make_config, ungradable_counts, warmup)

__all__ = ["ANSWER_TYPES", "RewardConfig", "compute_score", "compute_score_batch", "grading_stats", "make_config",
           "ungradable_counts", "warmup"]
