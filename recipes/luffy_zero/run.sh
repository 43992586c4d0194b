#!/usr/bin/env bash
# LUFFY zero-RL, the paper's main run: 1 full demonstration + 7 on-policy samples per prompt.
# Usage: bash recipes/luffy_zero/run.sh [hydra overrides...]      (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the paper's 7B base with a 16k context
mix_train "$@"
