"""The rollout side, inside verl's agent-loop workers: the prefix-guided agent loops, the multi-turn tool loop, environments."""
