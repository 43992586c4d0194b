#!/usr/bin/env bash
# The paper's "RL w/ SFT loss" baseline: grpo_split + NLL on the demonstration.
# Usage: bash recipes/rl_with_sft_loss/run.sh [hydra overrides...]      (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # the paper's 7B base with a 16k context
mix_train "$@"
