#!/usr/bin/env bash
# Prefix-RFT: cosine-decayed demonstration prefixes, entropy-selected prefix tokens (plugin prefix_rft.py).
# Usage: bash recipes/prefix_rft/run.sh [hydra overrides...]   (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the LUFFY paper's 7B base with a 16k context
mix_train "mix.plugins=[$RECIPE_DIR/prefix_rft.py]" "$@"
