#!/usr/bin/env bash
# Toy addition (LUFFY in miniature on CPU): one run of METHOD with SEED.
# Usage: bash recipes/toy_addition/run.sh METHOD SEED [hydra overrides...]
#   METHOD: luffy | on_policy_grpo   (python -m mix_src.main_mix_ppo, config METHOD.yaml, CPU backend)
#         | sft                      (verl's own verl.trainer.sft_trainer, config sft.yaml, torchrun on CPU)
# Env: STEPS (default 100), EVAL_EVERY (20), VARIANT (addition3 | demo: scripts/experiments/toy_addition.py),
#      ASSETS_DIR (outputs/toy_addition),
#      OUTPUT_DIR (outputs/toy_addition/runs/METHOD_seedSEED), MODEL_PATH, TRAIN_FILES, VAL_FILES,
#      SKIP_PREPARE=1 (ASSETS_DIR holds another toy task's assets: scripts/experiments/compare.py), plus
#      recipes/common.sh's PYTHON, LOGGER.
# The first call builds the tokenizer, parquets and base model into ASSETS_DIR (a few minutes, cached).
# RL runs log held-out greedy accuracy (val-core/toy_addition/acc/mean@1) every EVAL_EVERY steps to
# OUTPUT_DIR/metrics.jsonl and save the last step in HF format; SFT saves an HF checkpoint every
# EVAL_EVERY steps, which scripts/experiments/luffy_vs_grpo.py evaluates.
METHOD="${1:?usage: run.sh METHOD SEED [overrides]}"; SEED="${2:?usage: run.sh METHOD SEED [overrides]}"; shift 2
case "$METHOD" in luffy|on_policy_grpo|sft) ;; *) echo "unknown METHOD '$METHOD' (luffy|on_policy_grpo|sft)" >&2; exit 2;; esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${ASSETS_DIR:=$ROOT/outputs/toy_addition}"
: "${OUTPUT_DIR:=$ASSETS_DIR/runs/${METHOD}_seed$SEED}"
: "${STEPS:=100}" "${EVAL_EVERY:=20}" "${VARIANT:=addition3}"
EXPERIMENT_NAME="toy_addition_${METHOD}_seed$SEED"
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
export VERL_PLATFORM=cpu            # the CPU backend (mix_src.cpu), even on a machine with a GPU
export RAY_ADDRESS=local            # a private Ray cluster, never someone else's running one
export TOKENIZERS_PARALLELISM=false WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
NGPUS=                              # CPU only: the backend fragment sets one fake GPU

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # scripts.* are modules of the repository root
if [[ "${SKIP_PREPARE:-0}" != 1 ]]; then  # SKIP_PREPARE=1: ASSETS_DIR was built by the caller (another toy task)
  "$PYTHON" -m scripts.experiments.toy_addition prepare --out "$ASSETS_DIR" --variant "$VARIANT" >/dev/null  # no-op when cached
fi
TOKENIZER_PATH="$ASSETS_DIR/tokenizer"  # apart from the model: transformers 5 would swap it for Qwen2Tokenizer
MODEL_PATH="${MODEL_PATH:-$ASSETS_DIR/base_seed0}"
TRAIN_FILES="${TRAIN_FILES:-$ASSETS_DIR/train.parquet}"
if [[ -z "${VAL_FILES:-}" && -f "$ASSETS_DIR/ood.parquet" ]]; then
  VAL_FILES="[$ASSETS_DIR/heldout.parquet,$ASSETS_DIR/ood.parquet]"  # val-core/toy_addition{,_ood}/acc/mean@1
fi
VAL_FILES="${VAL_FILES:-$ASSETS_DIR/heldout.parquet}"
# RL runs resume from the newest checkpoint in OUTPUT_DIR (verl resume_mode auto; they save the last step).
# verl's file logger truncates metrics.jsonl when it starts, so on resume the metrics so far move to
# metrics.until_stepN.jsonl (luffy_vs_grpo.py reads both).
if [[ "$METHOD" != sft && -f "$OUTPUT_DIR/checkpoints/latest_checkpointed_iteration.txt" ]]; then
  resume_step="$(cat "$OUTPUT_DIR/checkpoints/latest_checkpointed_iteration.txt")"
  echo "[recipes/toy_addition] resuming $OUTPUT_DIR from step $resume_step" >&2
  [[ -f "$VERL_FILE_LOGGER_PATH" ]] && mv "$VERL_FILE_LOGGER_PATH" "${VERL_FILE_LOGGER_PATH%.jsonl}.until_step$resume_step.jsonl"
else
  rm -f "$VERL_FILE_LOGGER_PATH"
fi
mkdir -p "$OUTPUT_DIR"
start=$SECONDS

if [[ "$METHOD" == sft ]]; then
  "$PYTHON" -m scripts.experiments.toy_addition sft-data "$TRAIN_FILES" "$OUTPUT_DIR/sft_messages.parquet" --seed "$SEED"
  "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node=1 \
    -m verl.trainer.sft_trainer --config-path "$RECIPE_DIR" --config-name sft \
    "model.path=$MODEL_PATH" "model.tokenizer_path=$TOKENIZER_PATH" \
    "data.train_files=$OUTPUT_DIR/sft_messages.parquet" "trainer.default_local_dir=$OUTPUT_DIR/checkpoints" \
    "trainer.total_training_steps=$STEPS" "trainer.save_freq=$EVAL_EVERY" "trainer.seed=$SEED" \
    "trainer.logger=$LOGGER" "trainer.experiment_name=$EXPERIMENT_NAME" "hydra.run.dir=$OUTPUT_DIR/hydra" "$@"
else
  mix_common_overrides
  "$PYTHON" -m mix_src.main_mix_ppo --config-path "$RECIPE_DIR" --config-name "$METHOD" "${MIX_OVERRIDES[@]}" \
    "actor_rollout_ref.model.tokenizer_path=$TOKENIZER_PATH" \
    "trainer.total_training_steps=$STEPS" "trainer.test_freq=$EVAL_EVERY" "trainer.save_freq=$STEPS" \
    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]" \
    "data.seed=$SEED" "mix.seed=$SEED" "actor_rollout_ref.rollout.seed=$SEED" "$@"
fi
echo "[recipes/toy_addition] $METHOD seed $SEED: $STEPS steps in $((SECONDS - start)) s; metrics: $VERL_FILE_LOGGER_PATH" >&2
echo "$((SECONDS - start))" > "$OUTPUT_DIR/wall_seconds.txt"
