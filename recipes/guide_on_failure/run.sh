#!/usr/bin/env bash
# Guidance on failure: prefixes only for prompts whose on-policy samples all failed (plugin guide_on_failure.py).
# Usage: bash recipes/guide_on_failure/run.sh [hydra overrides...]   (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the paper's 7B base with a 16k context
mix_train "mix.plugins=[$RECIPE_DIR/guide_on_failure.py]" mix.rollout_policy=guide_on_failure "$@"
