"""Measure the actor's memory on one CUDA GPU and print it beside the planner's terms (mix_src/planner).

Needs torch and transformers only: no vLLM, Ray, network or weights. It builds a random-initialised model from a
Qwen2.5 ``config.json`` (a path, or a preset id of mix_src/planner/presets.py) the way verl's FSDP actor holds
it (fp32 parameters, bf16 compute, AdamW, gradient checkpointing, one packed micro-batch of ``--tokens`` tokens,
no padding), then runs

* the update: forward with gradient, log-prob of the labels + entropy bonus, backward, ``AdamW.step()``;
* the log-prob pass: forward without gradient, log-probs and entropy (verl computes both there),

and prints ``torch.cuda.max_memory_allocated`` of each beside the planner's terms for one GPU. Differences from
verl, on purpose: one process (no FSDP: the whole model is the "shard", and bf16 weights are cast per op by autocast
instead of gathered per layer), log-probs as gather - logsumexp (the memory flash-attn's cross-entropy has), eager
entropy (verl compiles it by default: fsdp_config.use_torch_compile). On a machine without CUDA it runs the same
passes on the CPU and prints no peak (a plumbing check: tests/test_planner.py runs it on a tiny config).

    python scripts/gpu/calibrate_memory.py --config Qwen/Qwen2.5-1.5B --tokens 32768
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mix_src.planner.estimate import (GB, GPUS, Gpu, RunShape, count_params, plan_memory)  # noqa: E402
from mix_src.planner.presets import PRESETS  # noqa: E402


def load_config(spec: str) -> dict:
    if spec in PRESETS:
        return dict(PRESETS[spec])
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    with open(path) as f:
        return json.load(f)


def build_model(hf: dict, device: str):
    """A random Qwen2 causal LM in fp32 (verl trains the actor in fp32), gradient checkpointing on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "transformers_version")}
    cfg = AutoConfig.for_model(hf.get("model_type", "qwen2"), **keys)
    cfg.use_cache = False
    attn = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn).to(device)
    model.gradient_checkpointing_enable()
    return model


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """verl/utils/torch_functional.py entropy_from_logits: logsumexp - sum(softmax * logits)."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def measure(hf: dict, tokens: int, device: str, entropy_coeff: float = 0.001) -> dict:
    """Peak bytes of the update (after a first step, so AdamW's states exist) and of the log-prob pass."""
    torch.manual_seed(0)
    model = build_model(hf, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, hf["vocab_size"], (1, tokens + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    dtype = torch.bfloat16

    def update():
        model.train()
        with torch.autocast(device_type=device, dtype=dtype):
            logits = model(input_ids=inputs).logits[0]
        loss = -log_probs(logits, labels[0]).mean() - entropy_coeff * entropy(logits).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    update()  # AdamW allocates its states at the first step
    reset(device)
    update()
    out = {"update": peak(device)}
    reset(device)
    model.eval()
    with torch.no_grad(), torch.autocast(device_type=device, dtype=dtype):
        logits = model(input_ids=inputs).logits[0]
        log_probs(logits, labels[0]), entropy(logits)
    out["log-prob"] = peak(device)
    out["params"] = count_params(hf)
    return out


def planner_terms(hf: dict, tokens: int, gpu: Gpu) -> dict:
    """The planner's update and log-prob phases for this measurement: 1 GPU, 1 shard, eager unchunked entropy."""
    run = RunShape(world_size=1, fsdp_shards=1, offload_policy=False, param_offload=False, optimizer_offload=False,
                   train_tokens=tokens, logprob_tokens=tokens, gradient_checkpointing=True, entropy_in_update=True,
                   entropy_chunking=False, entropy_chunk=2048, entropy_compiled=False, reference=False,
                   gpu_memory_utilization=0.5, rollout_tp=1, max_num_seqs=256, prompt_len=tokens // 2,
                   response_len=tokens - tokens // 2, n=1, n_full_target=0, batch_size=1, ppo_epochs=1, steps=0)
    return plan_memory(hf, run, gpu).phases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="Qwen/Qwen2.5-1.5B", help="config.json path, model dir or preset id")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the micro-batch (ppo_max_token_len_per_gpu)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    hf = load_config(a.config)
    gpu = GPUS["h100-80gb"]
    if a.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu = Gpu(props.name, int(props.total_memory), 0.0, 0.0)
        print(f"GPU: {props.name}, {props.total_memory / GB:.1f} GB; torch {torch.__version__}")
    measured = measure(hf, a.tokens, a.device)
    phases = planner_terms(hf, a.tokens, gpu)
    print(f"model {a.config}: {measured['params'] / 1e9:.3f}B parameters; micro-batch {a.tokens} tokens; {a.device}")
    for phase, key in (("actor update", "update"), ("old log-prob", "log-prob")):
        terms = phases[phase]
        print(f"{phase}:")
        for t in terms:
            print(f"    planner {t.name:<34} {t.bytes / GB:9.3f} GB   {t.basis}")
        total = sum(t.bytes for t in terms)
        got = measured[key]
        shown = f"{got / GB:.3f} GB ({(got - total) / total:+.0%})" if got is not None else "n/a (no CUDA)"
        print(f"    planner total (no CUDA context)     {total / GB:9.3f} GB   measured max_memory_allocated {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
