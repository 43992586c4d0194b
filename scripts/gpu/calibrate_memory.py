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
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mix_src.planner.estimate import (GB, GPUS, Gpu, RunShape, count_params, plan_memory)  # noqa: E402
from mix_src.algo.flops import ModelShape, forward_flops  # noqa: E402
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
    with torch.device(device):  # initialise on the GPU: a 7B fp32 model is 30 GB of host memory and minutes on the CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
    model.gradient_checkpointing_enable()
    return model


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """verl/utils/torch_functional.py entropy_from_logits: logsumexp - sum(softmax * logits)."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def log_probs_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """gather - logsumexp over the whole [T, V] at once (no row loop): the memory-hungry way."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def log_probs_verl(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl/utils/torch_functional.py logprobs_from_logits_v2 (verl 0.9.1), the path verl takes when flash-attn's
    cross-entropy does not import: row by row, log_softmax for bf16 (with remove-padding a row is one token)."""
    if logits.dtype in (torch.float32, torch.float64):
        lab = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        return lab - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    rows = [torch.log_softmax(r, dim=-1).gather(-1, l.unsqueeze(-1)).squeeze(-1) for r, l in zip(logits, labels)]
    return torch.stack(rows)


# How a pass turns logits into log-probs and entropy. "verl": verl 0.9.1's FSDP engine without flash-attn
# (verl/workers/engine/fsdp/transformer_impl.py ~183-187: entropy_from_logits under torch.compile(dynamic=True),
# use_torch_compile's default; ~1428: logprobs_from_logits -> logprobs_from_logits_v2). "eager": both eager and
# whole-tensor (this script's first version; what the planner's "eager, unchunked" terms describe).
PATHS = ("verl", "eager")
STAGES_REACHED: dict = {}  # stage -> (peak, held) of the update in progress, printed when it runs out of memory


def peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def measure(hf: dict, tokens: int, device: str, entropy_coeff: float = 0.001, path: str = "verl") -> dict:
    """Peak bytes of the update (after a first step, so AdamW's states exist) and of the log-prob pass, with the
    peak of each stage of the update (forward, log-prob + entropy, backward, optimizer step) and the logits' dtype."""
    torch.manual_seed(0)
    model = build_model(hf, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, hf["vocab_size"], (1, tokens + 1), device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    dtype = torch.bfloat16
    ent_fn = torch.compile(entropy, dynamic=True) if (path == "verl" and device == "cuda") else entropy
    lp_fn = log_probs_verl if path == "verl" else log_probs_naive
    stages = STAGES_REACHED
    stages.clear()

    def mark(name):
        if device == "cuda":
            torch.cuda.synchronize()
            stages[name] = (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        seconds[name] = time.perf_counter()  # each stage's end; "start" is the update's start

    def update():
        model.train()
        # cache_enabled=False: autocast would otherwise keep a bf16 copy of every weight for the whole forward;
        # FSDP's mixed precision gathers one layer's bf16 weights at a time (the planner's "gathered" term)
        with torch.autocast(device_type=device, dtype=dtype, cache_enabled=False):
            logits = model(input_ids=inputs).logits[0]
        stages["logits dtype"] = str(logits.dtype)
        mark("forward")
        loss = -lp_fn(logits, labels[0]).mean() - entropy_coeff * ent_fn(logits).mean()
        mark("log-prob + entropy")
        del logits
        loss.backward()
        mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer step")

    seconds: dict = {}
    update()  # AdamW allocates its states at the first step (and torch.compile compiles the entropy)
    reset(device)
    stages.clear()
    seconds.clear()
    seconds["start"] = time.perf_counter()
    update()
    ends = list(seconds.values())
    timing = {name: b - a for name, a, b in zip(list(seconds)[1:], ends, ends[1:])}  # the second update's stages
    out = {"update": max((v[0] for k, v in stages.items() if k not in ("logits dtype", "optimizer step")),
                         default=None),
           "step": stages["optimizer step"][0] if "optimizer step" in stages else None, "stages": dict(stages)}
    reset(device)
    model.eval()
    with torch.no_grad(), torch.autocast(device_type=device, dtype=dtype, cache_enabled=False):
        logits = model(input_ids=inputs).logits[0]
        lp_fn(logits, labels[0]), ent_fn(logits)
    out["log-prob"] = peak(device)
    out["seconds"] = timing
    out["params"] = count_params(hf)
    return out


def planner_terms(hf: dict, tokens: int, gpu: Gpu, path: str = "verl") -> dict:
    """The planner's phases for this measurement: 1 GPU, 1 shard, unchunked entropy, compiled on the verl path."""
    run = RunShape(world_size=1, fsdp_shards=1, offload_policy=False, param_offload=False, optimizer_offload=False,
                   train_tokens=tokens, logprob_tokens=tokens, gradient_checkpointing=True, entropy_in_update=True,
                   entropy_chunking=False, entropy_chunk=2048, entropy_compiled=path == "verl", reference=False,
                   gpu_memory_utilization=0.5, rollout_tp=1, max_num_seqs=256, prompt_len=tokens // 2,
                   response_len=tokens - tokens // 2, n=1, n_full_target=0, batch_size=1, ppo_epochs=1, steps=0,
                   flash_ce=path != "verl")  # the verl path measures v2
    return plan_memory(hf, run, gpu).phases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="Qwen/Qwen2.5-1.5B", help="config.json path, model dir or preset id")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the micro-batch (ppo_max_token_len_per_gpu)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--path", choices=PATHS, default="verl", help="how log-probs and entropy are computed (PATHS)")
    a = ap.parse_args(argv)
    hf = load_config(a.config)
    gpu = GPUS["h100-80gb"]
    if a.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu = Gpu(props.name, int(props.total_memory), 0.0, 0.0)
        print(f"GPU: {props.name}, {props.total_memory / GB:.1f} GB; torch {torch.__version__}")
    phases = planner_terms(hf, a.tokens, gpu, a.path)
    try:
        measured = measure(hf, a.tokens, a.device, path=a.path)
    except torch.OutOfMemoryError as e:  # a finding too: the planner should have said "does not fit"
        totals = {p: sum(t.bytes for t in terms) / GB for p, terms in phases.items()}
        print(f"model {a.config}: OUT OF MEMORY with a {a.tokens}-token micro-batch on {gpu.name} "
              f"({torch.cuda.max_memory_allocated() / GB:.1f} GB allocated at the peak); planner phases (GB): "
              + ", ".join(f"{p} {v:.1f}" for p, v in totals.items()) + f"\n    {str(e).splitlines()[0]}")
        for name, v in STAGES_REACHED.items():
            if name != "logits dtype":
                print(f"    stage {name:<20} passed: peak {v[0] / GB:8.3f} GB, held after {v[1] / GB:8.3f} GB")
        return 3
    print(f"model {a.config}: {measured['params'] / 1e9:.3f}B parameters; micro-batch {a.tokens} tokens; {a.device};"
          f" path {a.path}; logits {measured['stages'].get('logits dtype', '?')}")
    for name, v in measured["stages"].items():
        if name != "logits dtype":
            print(f"    update stage {name:<20} peak {v[0] / GB:8.3f} GB, held after {v[1] / GB:8.3f} GB")
    secs = measured["seconds"]
    fwd = forward_flops(ModelShape.from_hf_config(hf), [a.tokens], "full")  # mix_src/algo/flops.py, the planner's count
    update_s = sum(secs.values())
    peak_flops = GPUS["h200-141gb"].bf16_flops if a.device == "cuda" else float("nan")  # H100 and H200: 989 TFLOP/s
    print(f"timing (the second update, wall, synchronised): " + ", ".join(f"{k} {v:.3f} s" for k, v in secs.items())
          + f"; update {update_s:.3f} s = {3 * fwd / update_s / 1e12:.1f} TFLOP/s of 3 F(T) (MFU {3 * fwd / update_s / peak_flops:.3f}"
          f" of {peak_flops / 1e12:.0f} TFLOP/s); forward + backward alone"
          f" {(secs['forward'] + secs['log-prob + entropy'] + secs['backward']):.3f} s")
    for phase, key in (("actor update", "update"), ("optimizer step", "step"), ("old log-prob", "log-prob")):
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
