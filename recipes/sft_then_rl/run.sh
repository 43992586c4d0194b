#!/usr/bin/env bash
# The paper's "SFT+RL" baseline in two stages:
#   1. SFT of the base model on the demonstrations (prompt + target of SFT_FILES) with verl's own SFT
#      trainer (sft.yaml, torchrun); the last checkpoint is saved in HF format too;
#   2. on-policy GRPO (config.yaml) from that checkpoint on held-out prompts (TRAIN_FILES).
# Usage: bash recipes/sft_then_rl/run.sh [hydra overrides of stage 2...]
# Env (besides recipes/common.sh): BASE_MODEL_PATH (stage 1 base), SFT_FILES (stage 1 data, default
# data/openr1.parquet), SFT_OVERRIDES (extra stage-1 overrides, space-separated), SFT_MODEL_PATH (skip
# stage 1 and start stage 2 from this model, e.g. the paper's Elliott/Qwen2.5-Math-7B-SFT).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
DEFAULT_TRAIN_FILES="$MIX_REPO_ROOT/data/openr1.complement.parquet"  # prompts not used by stage 1
: "${SFT_FILES:=$MIX_REPO_ROOT/data/openr1.parquet}"
SFT_DIR="$OUTPUT_DIR/sft"

if [[ -z "${SFT_MODEL_PATH:-}" ]]; then
  if [[ "$NGPUS" == 1 ]]; then
    : "${BASE_MODEL_PATH:=$DEFAULT_MODEL_PATH_1GPU}"
    sft_scale=(data.max_length=4096 data.max_token_len_per_gpu=4096)  # 1.5B model: 4k context
  else
    : "${BASE_MODEL_PATH:=Elliott/Qwen2.5-Math-7B-16k-think}"      # the paper's base, 16k context
    sft_scale=()
  fi
  mkdir -p "$SFT_DIR"
  # verl's SFT trainer reads chat `messages`: prompt + [{role: assistant, content: target}].
  "$PYTHON" - "$SFT_FILES" "$SFT_DIR/sft_messages.parquet" <<'PY'
import sys
import pandas as pd

src, dst = sys.argv[1], sys.argv[2]
df = pd.read_parquet(src)
def target_text(t):
    if isinstance(t, str):
        return t
    t = list(t) if t is not None else []
    return t[0]["content"] if t and isinstance(t[0], dict) else ""
texts = df["target"].map(target_text)
keep = texts.str.len() > 0
messages = [list(p) + [{"role": "assistant", "content": t}] for p, t in zip(df["prompt"][keep], texts[keep])]
pd.DataFrame({"messages": messages}).to_parquet(dst, index=False)
print(f"[sft_then_rl] {keep.sum()} SFT conversations ({(~keep).sum()} rows without a target skipped) -> {dst}")
PY
  read -r -a sft_extra <<< "${SFT_OVERRIDES:-}"
  VERL_FILE_LOGGER_PATH="$SFT_DIR/metrics.jsonl" \
  "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="${NGPUS:-8}" \
    -m verl.trainer.sft_trainer --config-path "$RECIPE_DIR" --config-name sft \
    "model.path=$BASE_MODEL_PATH" "data.train_files=$SFT_DIR/sft_messages.parquet" \
    "trainer.default_local_dir=$SFT_DIR" "trainer.n_gpus_per_node=${NGPUS:-8}" "trainer.logger=$LOGGER" \
    "hydra.run.dir=$SFT_DIR/hydra" "${sft_scale[@]}" "${sft_extra[@]}"
  step="$(cat "$SFT_DIR/latest_checkpointed_iteration.txt")"
  SFT_MODEL_PATH="$SFT_DIR/global_step_$step/huggingface"
fi

MODEL_PATH="$SFT_MODEL_PATH"
mix_train "$@"
