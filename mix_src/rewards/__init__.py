"""Rule rewards for math and multiple-choice answers (mix_src/rewards/README.md); verl's custom-reward entry points
live in :mod:`mix_src.rewards.math_verify_reward` (``reward.custom_reward_function.path=pkg://<that module>``).
"""

from mix_src.rewards.math_verify_reward import (ANSWER_TYPES, RewardConfig, compute_score, compute_score_batch,
                                                grading_stats, make_config, ungradable_counts, warmup)

__all__ = ["ANSWER_TYPES", "RewardConfig", "compute_score", "compute_score_batch", "grading_stats", "make_config",
           "ungradable_counts", "warmup"]
