#!/usr/bin/env bash
# The CPU smoke run (CI; `make demo` is the toy-addition demo): builds the tiny assets if missing, trains LUFFY's main setting with the MIX
# trainer on CPU for 8 steps (real Ray + verl, about 1-2 minutes on 2 cores), then plots the curves.
# Usage: bash recipes/cpu_tiny/run.sh [hydra overrides...]     e.g. trainer.total_training_steps=4
# Output: outputs/cpu_tiny/{assets/, metrics.jsonl, learning_curves.png} (OUTPUT_DIR to change).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
export VERL_PLATFORM=cpu            # the CPU backend (mix_src.cpu), even on a machine with a GPU
export RAY_ADDRESS=local            # a private Ray cluster, never someone else's running one
export TOKENIZERS_PARALLELISM=false WANDB_MODE="${WANDB_MODE:-disabled}"
NGPUS=                              # no GPU variant: the backend fragment sets one fake GPU

: "${ASSETS_DIR:=$OUTPUT_DIR/assets}"
"$PYTHON" "$MIX_REPO_ROOT/scripts/make_tiny_assets.py" "$ASSETS_DIR" >/dev/null  # no-op when present
DEFAULT_MODEL_PATH="$ASSETS_DIR/model"
DEFAULT_TRAIN_FILES="$ASSETS_DIR/train.parquet"
DEFAULT_VAL_FILES="$ASSETS_DIR/val.parquet"

# The tiny tokenizer lives apart from the model (transformers 5 would swap it for Qwen2Tokenizer there).
if [[ -z "${MODEL_PATH:-}" ]]; then : "${TOKENIZER_PATH:=$ASSETS_DIR/tokenizer}"; fi
tokenizer=()
if [[ -n "${TOKENIZER_PATH:-}" ]]; then tokenizer=("actor_rollout_ref.model.tokenizer_path=$TOKENIZER_PATH"); fi

start=$SECONDS
mix_train "${tokenizer[@]}" "$@"
echo "[recipes/cpu_tiny] trained in $((SECONDS - start)) s; metrics: $VERL_FILE_LOGGER_PATH" >&2

"$PYTHON" "$MIX_REPO_ROOT/scripts/plot_metrics.py" "$VERL_FILE_LOGGER_PATH" \
  --out "$OUTPUT_DIR/learning_curves.png" --title "cpu_tiny: LUFFY on a tiny random Qwen2 (CPU)"
