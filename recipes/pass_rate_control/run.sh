#!/usr/bin/env bash
# Pass-rate control (arXiv 2605.05112): skewed groups steered toward a 50 % pass rate by replayed prefixes whose
# length a per-prompt controller sets (plugin pass_rate_control.py).
# Usage: bash recipes/pass_rate_control/run.sh [hydra overrides...]
# (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the paper's 7B base with a 16k context
mix_train "mix.plugins=[$RECIPE_DIR/pass_rate_control.py]" "$@"
