"""mix_src: LUFFY-style off-policy guided RL (prefix-guided rollouts, grpo_split, shaped off-policy loss,
DAPO filter groups) as recipes on top of verl 0.9.1. The layout and why: mix_src/README.md.

Import layering (imports only point down; tests/test_import_graph.py):
    main_mix_ppo -> trainer -> {rollout, worker, rewards, config} -> extend -> algo (torch/numpy only)
"""

from mix_src import _moved

__version__ = "0.1.0"
_moved.install()  # the pre-0.2 import paths (mix_src.mix_trainer, mix_src.core_alg, ...) keep working for one release
