#!/usr/bin/env bash
# Toy tool use (prefix-guided multi-turn, LUFFY-style, on CPU): builds the toy assets if missing (character
# tokenizer, train/heldout/ood parquets, the tool-less base model and its measured tool-call and success
# rates: scripts/experiments/toy_calculator.py prepare, a few minutes, cached), then trains config.yaml.
# Usage: bash recipes/toy_calculator/run.sh [hydra overrides...]   e.g. trainer.use_v1=true
#        on-policy GRPO: ... mix.n_prefix=0 algorithm.filter_groups.enable=false
# Env: ASSETS_DIR (outputs/toy_calculator), OUTPUT_DIR, MODEL_PATH, TOKENIZER_PATH, TRAIN_FILES, VAL_FILES,
#      plus recipes/common.sh's PYTHON, LOGGER.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
export VERL_PLATFORM=cpu            # the CPU backend (mix_src.cpu), even on a machine with a GPU
export RAY_ADDRESS=local            # a private Ray cluster, never someone else's running one
export TOKENIZERS_PARALLELISM=false WANDB_MODE="${WANDB_MODE:-disabled}"
NGPUS=                              # CPU only: the backend fragment sets one fake GPU
export PYTHONPATH="$MIX_REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"  # scripts.* are modules of the repository root

: "${ASSETS_DIR:=$MIX_REPO_ROOT/outputs/toy_calculator}"
"$PYTHON" -m scripts.experiments.toy_calculator prepare --out "$ASSETS_DIR" >/dev/null  # no-op when cached
DEFAULT_MODEL_PATH="$ASSETS_DIR/base_seed0"
DEFAULT_TRAIN_FILES="$ASSETS_DIR/train.parquet"
DEFAULT_VAL_FILES="$ASSETS_DIR/heldout.parquet"
: "${TOKENIZER_PATH:=$ASSETS_DIR/tokenizer}"  # apart from the model: transformers 5 would swap it for Qwen2Tokenizer

start=$SECONDS
recipe_args=("actor_rollout_ref.model.tokenizer_path=$TOKENIZER_PATH"
  "actor_rollout_ref.rollout.multi_turn.function_tool_path=$RECIPE_DIR/tools.py")
mix_train "${recipe_args[@]}" "$@"
echo "[recipes/toy_calculator] trained in $((SECONDS - start)) s; metrics: $VERL_FILE_LOGGER_PATH" >&2
