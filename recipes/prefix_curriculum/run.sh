#!/usr/bin/env bash
# Partial target prefixes per sample, fading linearly over prefix_steps.
# Usage: bash recipes/prefix_curriculum/run.sh [hydra overrides...]      (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the paper's 7B base with a 16k context
mix_train "$@"
