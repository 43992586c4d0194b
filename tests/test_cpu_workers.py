"""The CPU backend's worker patches (mix_src/cpu/worker_patches.py), each against the verl/torch line it works
around, in a fresh process with the backend active (VERL_PLATFORM=cpu) -- and the same code without the patch,
which must fail as verl 0.9.1 does on a CPU-only host."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from mix_src.cpu import worker_patches

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code: str, tmp_path, **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, VERL_PLATFORM="cpu", PYTHONPATH=REPO_ROOT, **env_extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )


# verl's forward-only (reference) engine: `offload_policy = CPUOffloadPolicy(pin_memory=True)` then fully_shard
# (verl/workers/engine/fsdp/transformer_impl.py 459-462 and verl.utils.fsdp_utils.apply_fsdp2). Both policies in
# one process (verl import is the slow part): torch's own class as verl 0.9.1 uses it, then the patched module's.
REFERENCE_SHARD = """
import torch, torch.distributed as dist
import verl.workers.engine.fsdp.transformer_impl as ti
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchPolicy, fully_shard

dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
for which, cls in (("torch", TorchPolicy), ("verl", ti.CPUOffloadPolicy)):
    policy = cls(pin_memory=True)
    assert isinstance(policy, TorchPolicy)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    try:
        fully_shard(model, mesh=mesh, offload_policy=policy)
        print(which, "OK", policy.pin_memory, tuple(model(torch.ones(2, 4)).shape))
    except RuntimeError as e:
        print(which, "ERROR", e)
"""


def test_reference_engine_offload_policy_shards_on_cpu(tmp_path):
    """With the patch verl's module-level CPUOffloadPolicy shards and runs forward on a CPU-only torch; torch's
    own CPUOffloadPolicy(pin_memory=True), which verl 0.9.1 uses unpatched, fails as in the issue."""
    out = run_py(REFERENCE_SHARD.format(store=tmp_path / "store"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch ERROR Cannot access accelerator device when none is available" in out.stdout
    assert "verl OK False (2, 1)" in out.stdout


# verl's load_valuehead_model (verl/utils/model.py 641) with the critic config's attention implementation; then
# verl's own function (kept by the patch as __wrapped_original__), which needs flash-attention or trl.
CRITIC_LOAD = """
import torch
from transformers import AutoConfig
import verl.utils.model as vm

def load(fn, attn):
    cfg = AutoConfig.from_pretrained("{model}", attn_implementation=attn)
    cfg.num_labels = 1
    m = fn("{model}", torch.float32, cfg, False)
    print(attn, "->", type(m).__name__, m.config._attn_implementation, m.score.out_features)

for attn in ("eager", "sdpa", "flash_attention_2"):
    load(vm.load_valuehead_model, attn)
try:
    load(vm.load_valuehead_model.__wrapped_original__, "eager")
except RuntimeError as e:
    print("original ERROR", e)
"""


def test_critic_is_verls_token_classification_model_with_a_cpu_attention(tiny_assets, tmp_path):
    out = run_py(CRITIC_LOAD.format(model=tiny_assets["model"]), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for attn, expected in (("eager", "eager"), ("sdpa", "sdpa"), ("flash_attention_2", "eager")):
        assert f"{attn} -> Qwen2ForTokenClassification {expected} 1" in out.stdout
    # verl 0.9.1's own loader on this host: flash_attention_2 fails, then the trl fallback
    assert "original ERROR" in out.stdout and "is not a value head model, please install trl" in out.stdout


def test_critic_attention_choice():
    class Cfg:
        _attn_implementation = "flash_attention_3"

    assert worker_patches.critic_attention(Cfg()) == "eager"
    Cfg._attn_implementation = "sdpa"
    assert worker_patches.critic_attention(Cfg()) == "sdpa"


def test_patches_declare_the_versions_they_were_written_for():
    for name in ("UNPIN_REFERENCE_OFFLOAD_WRITTEN_FOR", "CPU_ATTENTION_CRITIC_WRITTEN_FOR"):
        assert getattr(worker_patches, name)["verl"] == "0.9.1"
