#!/usr/bin/env bash
# CHORD: a scheduled mix of expert SFT and on-policy GRPO with phi = p(1-p) token weights (plugin chord.py).
# Usage: bash recipes/chord/run.sh [hydra overrides...]   (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the LUFFY paper's 7B base with a 16k context
mix_train "mix.plugins=[$RECIPE_DIR/chord.py]" "$@"
