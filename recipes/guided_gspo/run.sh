#!/usr/bin/env bash
# Guided GSPO: LUFFY's demonstrations with verl's GSPO loss on the on-policy tokens (recipes/guided_gspo/README.md).
# Usage: bash recipes/guided_gspo/run.sh [hydra overrides...]      (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the paper's 7B base with a 16k context
mix_train "$@"
