#!/usr/bin/env bash
# ExGRPO: GRPO + replay of the model's own successful samples (plugin exgrpo.py on the core's off-policy
# behaviour stored_log_prob).
# Usage: bash recipes/exgrpo/run.sh [hydra overrides...]   (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the official README's Qwen2.5-Math-7B (16k positions)
mix_train "mix.plugins=[$RECIPE_DIR/exgrpo.py]" "$@"
