#!/usr/bin/env bash
# HPT: per prompt, SFT on the target when the 8 on-policy samples solve it at most switch_gate times, else RL
# (plugin hpt.py on the core row loss sft_rows).
# Usage: bash recipes/hpt/run.sh [hydra overrides...]   (env: see recipes/common.sh; NGPUS=1 = 1-GPU variant)
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think   # Qwen2.5-Math-7B with rope_theta 40000, 16k positions (as the official script asks)
HPT_1GPU=()
if [[ "$NGPUS" == 1 ]]; then HPT_1GPU=(mix.loss.sft_loss_coef=0.3); fi  # official: 0.3 for Qwen2.5-Math-1.5B
mix_train "mix.plugins=[$RECIPE_DIR/hpt.py]" "${HPT_1GPU[@]}" "$@"
