"""mix_src: LUFFY-style off-policy guided RL (prefix-guided rollouts, grpo_split, shaped off-policy loss,
DAPO filter groups) as recipes on top of verl 0.9.1.

Import layering (imports only point down):
    main_mix_ppo -> mix_trainer -> {agent_loop, loss, dataset, adv_estimators, rewards} -> {core_alg, prefix, filter_groups}
The three pure modules at the bottom import only torch/numpy.
"""

__version__ = "0.1.0"
