# Shared launch helpers for recipes/<name>/run.sh. Source it, then call `mix_train "$@"`:
#
#     source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
#     DEFAULT_MODEL_PATH=Elliott/Qwen2.5-Math-7B-16k-think     # used when MODEL_PATH is unset
#     mix_train "$@"                                           # extra Hydra overrides pass through
#
# Environment (every variable is optional; a recipe sets DEFAULT_<NAME> for its own defaults):
#   PYTHON        interpreter                 default: VENV's python (VENV=.venv-gpu, as given to make), else
#                                             the <repo>/.venv* holding the GPU install (.mix_src-gpu), else
#                                             <repo>/.venv/bin/python if present, else python3
#   NO_FLASH_ATTN 1 = no flash-attn installed (make install-gpu NO_FLASH_ATTN=1): adds MIX_SDPA_OVERRIDES
#   MODEL_PATH    HF model dir or hub id      default: the recipe's DEFAULT_MODEL_PATH, or with
#                                             NGPUS=1 DEFAULT_MODEL_PATH_1GPU (Qwen/Qwen2.5-Math-1.5B)
#   TRAIN_FILES   training parquet            default: DEFAULT_TRAIN_FILES or <repo>/data/openr1.parquet
#   VAL_FILES     validation parquet          default: DEFAULT_VAL_FILES or <repo>/data/valid.parquet
#   NGPUS         GPUs on the node            default: unset = the recipe's own (8 x 80 GB for the GPU
#                                             recipes); 1 = the scaled-down variant (MIX_ONE_GPU_OVERRIDES)
#   OUTPUT_DIR    checkpoints, metrics, logs  default: <repo>/outputs/<recipe>
#   LOGGER        trainer.logger              default: [console,file] (metrics: OUTPUT_DIR/metrics.jsonl);
#                                             e.g. LOGGER='[console,wandb]'
#   PROJECT_NAME / EXPERIMENT_NAME            default: mix_src / <recipe>
#
# Paths are resolved from this file's location at run time, so the repository can live anywhere and
# the scripts work from any working directory. Command-line overrides ("$@") come last and win.

set -euo pipefail

MIX_REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"  # the run.sh that sourced this file
RECIPE_NAME="$(basename "$RECIPE_DIR")"

# The interpreter: PYTHON, else VENV's (as `make ... VENV=...` names it), else the repository venv holding the GPU
# install (marker .mix_src-gpu, written by `make install-gpu`), else .venv, else python3.
mix_pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then return; fi
  if [[ -n "${VENV:-}" ]]; then
    local venv="$VENV"; [[ "$venv" == /* ]] || venv="$MIX_REPO_ROOT/$venv"
    [[ -x "$venv/bin/python" ]] || { echo "VENV=$VENV: no $venv/bin/python; run \`make install-gpu VENV=$VENV\` first" >&2; return 1; }
    PYTHON="$venv/bin/python"; return
  fi
  local marker
  for marker in "$MIX_REPO_ROOT"/.venv*/.mix_src-gpu; do
    if [[ -f "$marker" && -x "$(dirname "$marker")/bin/python" ]]; then PYTHON="$(dirname "$marker")/bin/python"; return; fi
  done
  if [[ -x "$MIX_REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$MIX_REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
}
mix_pick_python
: "${NGPUS:=}"
: "${OUTPUT_DIR:=$MIX_REPO_ROOT/outputs/$RECIPE_NAME}"
: "${LOGGER:=[console,file]}"
: "${PROJECT_NAME:=mix_src}"
: "${EXPERIMENT_NAME:=$RECIPE_NAME}"
export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$OUTPUT_DIR/metrics.jsonl}"
export HYDRA_FULL_ERROR=1

# The scaled-down variant of every GPU recipe (NGPUS=1): one 80 GB GPU, a 1.5B model, a quarter of the
# batch (same mini-batch : batch ratio), prompt + response within Qwen2.5-Math-1.5B's 4k context
# (targets + EOS must fit the response too). Same algorithm; expect lower scores than the paper's 7B.
MIX_ONE_GPU_OVERRIDES=(
  trainer.n_gpus_per_node=1
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  data.train_batch_size=32
  actor_rollout_ref.actor.ppo_mini_batch_size=16
  data.max_response_length=3072
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5
  actor_rollout_ref.actor.fsdp_config.param_offload=true
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
  mix.data.max_target_length=3071
)
# Qwen2.5-Math-1.5B: the base of LUFFY's released LUFFY-Qwen-Math-1.5B-Zero (LUFFY README, Models), 4k context.
# It needs LUFFY's system prompt in the data (scripts/data/prepare_openr1.py writes it; LUFFY issue #43: without
# it 1.5B runs got zero reward); its chat template is Qwen2.5-Math's (tests/test_prompt_format.py).
DEFAULT_MODEL_PATH_1GPU=Qwen/Qwen2.5-Math-1.5B

# Attention without flash-attn (NO_FLASH_ATTN=1): torch's SDPA, which cannot take verl's packed (remove-padding)
# sequences (mix_src/config/model_context.py check_attention; the same string as the Makefile's SDPA_OVERRIDES).
MIX_SDPA_OVERRIDES=(
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  actor_rollout_ref.model.use_remove_padding=false
)

# The overrides every run gets: model and data paths, output locations, logger, and the 1-GPU set.
mix_common_overrides() {
  MIX_OVERRIDES=(
    "actor_rollout_ref.model.path=$MODEL_PATH"
    "data.train_files=$TRAIN_FILES"
    "data.val_files=$VAL_FILES"
    "trainer.default_local_dir=$OUTPUT_DIR/checkpoints"
    "trainer.logger=$LOGGER"
    "trainer.project_name=$PROJECT_NAME"
    "trainer.experiment_name=$EXPERIMENT_NAME"
    "hydra.run.dir=$OUTPUT_DIR/hydra"
  )
  if [[ "${NO_FLASH_ATTN:-}" == 1 ]]; then
    MIX_OVERRIDES+=("${MIX_SDPA_OVERRIDES[@]}")
  fi
  if [[ "$NGPUS" == 1 ]]; then
    MIX_OVERRIDES+=("${MIX_ONE_GPU_OVERRIDES[@]}")
  elif [[ -n "$NGPUS" ]]; then
    MIX_OVERRIDES+=("trainer.n_gpus_per_node=$NGPUS")
  fi
}

# mix_train [hydra overrides...]: one run of `python -m mix_src.main_mix_ppo` with this recipe's config.
mix_train() {
  : "${TRAIN_FILES:=${DEFAULT_TRAIN_FILES:-$MIX_REPO_ROOT/data/openr1.parquet}}"
  : "${VAL_FILES:=${DEFAULT_VAL_FILES:-$MIX_REPO_ROOT/data/valid.parquet}}"
  if [[ -z "${MODEL_PATH:-}" ]]; then
    if [[ "$NGPUS" == 1 ]]; then MODEL_PATH="$DEFAULT_MODEL_PATH_1GPU"; else MODEL_PATH="${DEFAULT_MODEL_PATH:-}"; fi
  fi
  : "${MODEL_PATH:?set MODEL_PATH (a local HF model directory or a hub id)}"
  mix_common_overrides
  mkdir -p "$OUTPUT_DIR"
  echo "[recipes/$RECIPE_NAME] python=$PYTHON model=$MODEL_PATH train=$TRAIN_FILES gpus=$NGPUS out=$OUTPUT_DIR" >&2
  "$PYTHON" -m mix_src.main_mix_ppo --config-path "$RECIPE_DIR" --config-name config \
    "${MIX_OVERRIDES[@]}" "$@"
}
