#!/usr/bin/env bash
# PrefixRL: on-policy RL on the continuation of a successful trace's prefix (recipes/prefix_rl/README.md).
# Usage: bash recipes/prefix_rl/run.sh [hydra overrides...]      (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the LUFFY paper's 7B base with a 16k context
mix_train "$@"
