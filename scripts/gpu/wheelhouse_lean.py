"""The ``gpu-lean`` set: the GPU lock less the wheels that vLLM 0.24.0 declares but the rollout never reaches
(Qwen2/Qwen2.5 dense bf16 on an H200, cc 9.0, as verl 0.9.1 starts it). Each entry of :data:`LEAN` says where
vLLM reaches the package, read in the vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl of the committed lock; the
wheels only they need go with them (``lean_drop`` follows the lock's Requires-Dist).

Which kernels run, lean or full, on an H200 with a Qwen2 model (Qwen2ForCausalLM):

* **Attention: FLASH_ATTN, vLLM's own FlashAttention 3** (``vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so``, compiled into
  the vllm wheel). ``vllm/platforms/cuda.py`` ``_get_backend_priorities``: for a non-MLA model on a device whose major
  capability is not 10, the order is FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION, TURBOQUANT, and the first
  that validates wins; ``vllm/v1/attention/backends/fa_utils.py`` ``get_flash_attn_version`` takes FA3 on major 9.
  ``get_valid_backends`` imports every candidate's module; FLASHINFER's (``backends/flashinfer.py``: ``from flashinfer
  import ...`` at the top) then raises ImportError, which it catches ("ImportError" as the reason).
* **Sampler: vLLM's PyTorch/Triton path** (``TopKTopPSampler.forward_native``). Qwen2ForCausalLM is not in
  ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`` (``vllm/config/vllm.py``), so the V1 runner's ``Sampler`` is built with
  the model's ``logprobs_mode``, which verl 0.9.1 sets to ``processed_logprobs`` (``verl/workers/config/rollout.py``,
  passed by ``vllm_async_server.py``); ``TopKTopPSampler.__init__`` then never asks ``flashinfer_sampler_supported``
  (``vllm/v1/sample/ops/topk_topp_sampler.py``). The V2 runner (Qwen3, Llama, Mistral, DeepseekV2, Qwen2Moe,
  GraniteMoe) calls ``flashinfer_sampler_supported()`` in its Sampler's constructor, which imports the FlashInfer
  backend before any check: with the lean set that raises, unless ``VLLM_USE_FLASHINFER_SAMPLER=0`` (read first).
  ``install`` of a lean set therefore writes ``mix_src_lean_vllm.pth`` into the environment, which sets that variable
  (if unset) in every interpreter it starts, Ray's workers included.
* **FlashInfer nowhere**: ``vllm/utils/flashinfer.py`` ``has_flashinfer()`` is False when ``flashinfer`` is not found
  (``importlib.util.find_spec``), and every other FlashInfer use in vllm 0.24.0 (warm-up autotune for cc 9.0 in
  ``model_executor/warmup/kernel_warmup.py``, all-reduce fusion, MoE, FP4/FP8 GEMMs, MLA) is behind it or behind a
  model or quantization the rollout does not use. With the full set (FlashInfer and its cubins there), the warm-up
  autotune runs on an H200; with flashinfer-python but without flashinfer-cubin, ``has_flashinfer()`` depends on an
  ``nvcc`` on PATH and FlashInfer would compile its kernels at run time: this is why the lean set drops both.

Checked by reading vllm 0.24.0's code only: no GPU run of the lean set has been made here.
"""

from __future__ import annotations

# name -> where vLLM 0.24.0 reaches it, and why the rollout does not
LEAN: dict[str, str] = {
    "flashinfer-cubin": "FlashInfer's prebuilt kernels (427 MiB): only FlashInfer loads them; FlashInfer is left out "
    "too (flashinfer-python)",
    "flashinfer-python": "vllm/utils/flashinfer.py has_flashinfer() is False without it, which turns off every "
    "FlashInfer path; attention on cc 9.0 is FLASH_ATTN (FA3 in the vllm wheel); the V1 sampler with verl's "
    "processed_logprobs never asks for it; the V2 runner's sampler needs VLLM_USE_FLASHINFER_SAMPLER=0 (set by "
    "install's mix_src_lean_vllm.pth)",
    "tilelang": "vllm/model_executor/kernels/mhc (DeepSeek V4's mHC kernels) only, behind has_tilelang()",
    "tokenspeed-mla": "MLA attention backends (vllm/v1/attention/backends/mla/*tokenspeed*, DeepSeek-style MLA "
    "models, cc 10 priority list) only; Qwen2 is not an MLA model",
    "humming-kernels": "quantized (w4a16 / mxfp4) linear and MoE kernels only, behind has_humming(); it alone brings "
    "nvidia-cuda-nvcc and nvidia-cuda-cccl (its cu13 extra)",
    "opencv-python-headless": "video/image decoding of multimodal inputs: vllm/multimodal/video.py imports cv2 in "
    "try/except (a placeholder module otherwise); mistral_common imports it only if installed",
    "av": "audio/video decoding: vllm/multimodal/video.py, audio.py and media/audio.py import it in try/except; "
    "qwen-vl-utils (verl's multimodal datasets, imported lazily) declares it",
}
SAMPLER_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
PTH_NAME = "mix_src_lean_vllm.pth"


def lean_drop(lock: dict) -> dict[str, str]:
    """{name: reason} of the lock's wheels the lean set leaves out: :data:`LEAN` and what only they need."""
    from scripts.gpu.wheelhouse_lock import walk

    entries = {e["name"]: e for e in lock["wheels"]}
    have = lock.get("host", {}).get("freeze", {})
    named = {n: r for n, r in LEAN.items() if n in entries}
    needed, _, _, _, _ = walk(lock["requirements"], entries, have, lock["target"]["environment"], frozenset(named))
    drop = dict(named)
    for n in sorted(set(entries) - needed - set(named)):
        drop[n] = "needed only by wheels the lean set leaves out"
    return drop


def lean_lock(lock: dict) -> dict:
    """The lock of the ``gpu-lean`` set: the wheels ``lean_drop`` names left out, recorded with their reasons."""
    drop = lean_drop(lock)
    return {**lock, "set": "gpu-lean", "lean": drop, "wheels": [w for w in lock["wheels"] if w["name"] not in drop]}


def pth_text() -> str:
    """A .pth line (run by the site module at every start) that sets :data:`SAMPLER_ENV` where it is unset."""
    sets = "; ".join(f"os.environ.setdefault({k!r}, {v!r})" for k, v in SAMPLER_ENV.items())
    return f"import os; {sets}\n"
