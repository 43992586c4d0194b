"""The planner's reading of a composed config and the model's ``config.json``, its report, and the check before
Ray (preflight slot 6); the arithmetic is in :mod:`mix_src.planner.estimate`."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Mapping, Optional

from mix_src.planner.estimate import (ADAM_BYTES, ADAM_STEP_TEMP_BYTES, ALLOCATOR_FRAGMENTATION_BYTES, CUDA_CONTEXT_BYTES,
                                      ERROR_BOUND, GB, GIB, GPUS, GRAD_BYTES, PARAM_BYTES, Gpu, MemoryPlan, RunShape,
                                      TimePlan, count_params, plan_memory, states_bytes, step_terms)
from mix_src.config.mix_config import MixConfigError
from mix_src.config.verl_parity import dotted_get
from mix_src.planner.presets import PRESETS


class PlannerRefusal(MixConfigError):
    """The run cannot fit: raised before Ray (a :class:`~mix_src.config.mix_config.MixConfigError` in preflight)."""


def run_shape(config: Mapping, steps: Optional[int] = None) -> RunShape:
    """The numbers :mod:`~mix_src.planner.estimate` needs, from a composed trainer config (the keys verl's FSDP
    engine reads: ``actor_rollout_ref.actor.fsdp_config.*``, which verl's dp_actor.yaml fills from the actor's
    ``entropy_from_logits_with_chunking`` / ``entropy_checkpointing`` keys)."""
    actor, rollout = config["actor_rollout_ref"]["actor"], config["actor_rollout_ref"]["rollout"]
    fsdp = actor.get("fsdp_config") or {}
    world = int(config["trainer"]["nnodes"]) * int(config["trainer"]["n_gpus_per_node"])
    shards = int(fsdp.get("fsdp_size", -1) or -1)
    sp = max(int(fsdp.get("ulysses_sequence_parallel_size", 1) or 1), int(actor.get("ulysses_sequence_parallel_size", 1) or 1))
    p, r = int(config["data"]["max_prompt_length"]), int(config["data"]["max_response_length"])
    n, bs = int(rollout["n"]), int(config["data"]["train_batch_size"])
    mini_rows = int(actor["ppo_mini_batch_size"]) * n // max(1, world // sp)  # rows of a mini-batch on one DP rank
    train_tokens = (int(actor["ppo_max_token_len_per_gpu"]) if actor.get("use_dynamic_bsz")
                    else int(actor.get("ppo_micro_batch_size_per_gpu") or 1) * (p + r) // sp)
    lp_tokens = (int(rollout["log_prob_max_token_len_per_gpu"]) if rollout.get("log_prob_use_dynamic_bsz")
                 else int(rollout.get("log_prob_micro_batch_size_per_gpu") or 1) * (p + r) // sp)
    cap = max(1, mini_rows) * (p + r) // sp  # a micro-batch holds at most the rank's rows
    mix = config.get("mix") or {}
    n_prefix = int(mix.get("n_prefix", 0) or 0)
    whole = float(mix.get("min_prefix_ratio", 1.0)) >= 1.0
    full_target = (n if n_prefix == -1 else n_prefix) if whole else 0
    kl = bool(actor.get("use_kl_loss")) or bool(dotted_get(config, "algorithm.use_kl_in_reward", False))
    total = steps if steps is not None else dotted_get(config, "trainer.total_training_steps")
    attn = dotted_get(config, "actor_rollout_ref.model.override_config.attn_implementation", None)
    return RunShape(
        world_size=world, fsdp_shards=world if shards <= 0 else shards,
        offload_policy=bool(fsdp.get("offload_policy", False)), param_offload=bool(fsdp.get("param_offload", False)),
        optimizer_offload=bool(fsdp.get("optimizer_offload", False)),
        train_tokens=min(train_tokens, cap), logprob_tokens=min(lp_tokens, cap),
        gradient_checkpointing=bool(dotted_get(config, "actor_rollout_ref.model.enable_gradient_checkpointing", False)),
        entropy_in_update=bool(actor.get("calculate_entropy")) or float(actor.get("entropy_coeff", 0.0)) != 0.0,
        entropy_chunking=bool(fsdp.get("entropy_from_logits_with_chunking", False)),
        entropy_chunk=int(fsdp.get("entropy_from_logits_chunk_size", 2048)),
        entropy_compiled=bool(fsdp.get("use_torch_compile", True)) and not bool(fsdp.get("entropy_checkpointing")),
        reference=kl, gpu_memory_utilization=float(rollout["gpu_memory_utilization"]),
        rollout_tp=int(rollout.get("tensor_model_parallel_size", 1) or 1),
        max_num_seqs=int(rollout.get("max_num_seqs", 256) or 256), prompt_len=p, response_len=r, n=n,
        n_full_target=full_target, batch_size=bs, ppo_epochs=int(actor.get("ppo_epochs", 1)),
        steps=int(total) if total else 0,
        # verl takes flash-attn's cross-entropy for log-probs unless an sdpa/eager override says flash-attn is not
        # installed (recipes/common.sh's NO_FLASH_ATTN=1) or VERL_DISABLE_FLASH_ATTN_CE=1
        flash_ce=attn in (None, "flash_attention_2") and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1",
    )


def load_model_config(path: str) -> tuple[Optional[dict], str]:
    """The model's ``config.json`` as a dict and where it came from; ``(None, why)`` when it cannot be read here
    (a Hub id that is neither a preset nor in the local Hugging Face cache: nothing is downloaded)."""
    expanded = os.path.expanduser(str(path))
    local = expanded if expanded.endswith(".json") else os.path.join(expanded, "config.json")
    if not os.path.isfile(local):
        if str(path) in PRESETS:
            return dict(PRESETS[str(path)]), f"preset {path} (mix_src/planner/presets.py)"
        with contextlib.suppress(Exception):  # not a valid repo id, no hub library: nothing to read
            from huggingface_hub import try_to_load_from_cache

            local = try_to_load_from_cache(str(path), "config.json")
    if isinstance(local, str) and os.path.isfile(local):
        with open(local) as f:
            return json.load(f), local
    return None, (f"{path}: no config.json at that path, not a preset ({', '.join(PRESETS)}) and not in the local "
                  "Hugging Face cache")


def gb(b: float) -> str:
    return f"{b / GB:.1f} GB"


def format_plan(mem: MemoryPlan, time: Optional[TimePlan], run: RunShape, n_params: int, *, mfu: float,
                mean_response: float) -> str:
    """The report: every term of every phase, each phase's total, the peak, vLLM's sequences, GPU-hours."""
    lines = [f"model: {n_params / 1e9:.2f}B parameters; {run.world_size} x {mem.gpu.name} "
             f"({mem.gpu.memory_bytes / GIB:.0f} GiB = {gb(mem.gpu.memory_bytes)}); FSDP over {run.fsdp_shards}"]
    for phase, terms in mem.phases.items():
        lines.append(f"{phase}:")
        lines += [f"    {t.name:<34} {gb(t.bytes):>10}   {t.basis}" for t in terms]
        lines.append(f"    {'CUDA context, NCCL, allocator':<34} {gb(CUDA_CONTEXT_BYTES):>10}   assumed")
        lines.append(f"    {'total':<34} {gb(mem.total(phase)):>10}   +/- {ERROR_BOUND:.0%}")
    fits = "fits" if mem.fits else f"DOES NOT FIT (with {gb(ALLOCATOR_FRAGMENTATION_BYTES)} of allocator fragmentation)"
    lines.append(f"peak per GPU: {gb(mem.peak)} ({mem.peak_phase}) +/- {ERROR_BOUND:.0%} of "
                 f"{gb(mem.gpu.memory_bytes)}: {fits}")
    lines.append(f"vLLM KV cache: {mem.kv_sequences} sequences of {run.prompt_len + run.response_len} tokens at "
                 f"once per engine (TP {run.rollout_tp}; max_num_seqs {run.max_num_seqs})")
    if time is not None:
        lines.append(f"time per step: training passes {time.train_s:.0f} s (at MFU {mfu:.0%}) + decode "
                     f"{time.decode_s:.0f} s (HBM-bound, mean response {mean_response:.0f} tokens) = {time.step_s:.0f} s")
        lines.append(f"GPU-hours for {time.steps} steps: {time.gpu_hours:.0f} ({run.world_size} x "
                     f"{time.gpu_hours / run.world_size:.1f} h) within a factor of 2")
    return "\n".join(lines)


def refusal(n_params: int, run: RunShape, gpu_bytes: int) -> Optional[str]:
    """The refusal message when AdamW's step alone exceeds the GPU (fp32 params + grads + moments + the foreach
    step's fp32 temporary: 20 B/param per shard, measured on an H200, mix_src/planner/README.md), else None."""
    terms = step_terms(n_params, run)
    step = sum(t.bytes for t in terms)
    if step <= gpu_bytes:
        return None
    need = -(-(PARAM_BYTES + GRAD_BYTES + ADAM_BYTES + ADAM_STEP_TEMP_BYTES) * n_params // gpu_bytes)
    listed = ", ".join(f"{t.name} {gb(t.bytes)}" for t in terms)
    return (f"the actor's optimizer step alone needs {gb(step)} per GPU ({listed}: 20 B/param x "
            f"{n_params / 1e9:.2f}B / {run.fsdp_shards} FSDP shards; fp32 params + grads + AdamW states are "
            f"{gb(states_bytes(n_params, run))} of it) > the GPU's {gb(gpu_bytes)}. Fix: shard over "
            f"at least {need} GPUs (trainer.n_gpus_per_node / trainer.nnodes; actor_rollout_ref.actor.fsdp_config."
            "fsdp_size=-1), or keep the states on the CPU through the update (actor_rollout_ref.actor.strategy=fsdp2 "
            "actor_rollout_ref.actor.fsdp_config.offload_policy=true). fsdp_config.param_offload / optimizer_offload "
            "do not help here (verl loads both back onto the GPU for the update), nor does sequence parallelism (it "
            "splits activations, not states). mix.planner.check=false skips this check")


def check_memory(config: Any) -> Optional[str]:
    """Preflight slot 6: refuse (:class:`PlannerRefusal`) when the states alone exceed the GPU; otherwise print
    the estimate's peak line. Skipped when ``mix.planner.check`` is false, and on the CPU backend
    (trainer.device=cpu) unless ``mix.planner.gpu`` names a GPU to plan for. Returns what was printed."""
    planner = dotted_get(config, "mix.planner") or {}
    if not planner.get("check", True):
        return None
    gpu = _gpu(planner.get("gpu"), cpu=config["trainer"].get("device") == "cpu")
    if gpu is None:
        return None
    path = dotted_get(config, "actor_rollout_ref.model.hf_config_path") or config["actor_rollout_ref"]["model"]["path"]
    hf, source = load_model_config(path)
    if hf is None:
        msg = f"[mix_src] planner: memory not checked: {source}"
        print(msg)
        return msg
    run = run_shape(config)
    n_params = count_params(hf)
    why = refusal(n_params, run, gpu.memory_bytes)
    if why:
        raise PlannerRefusal(f"mix.planner: {why}")
    mem = plan_memory(hf, run, gpu)
    msg = (f"[mix_src] planner: {n_params / 1e9:.2f}B params on {run.world_size} x {gpu.name}: peak "
           f"{gb(mem.peak)} +/- {ERROR_BOUND:.0%} per GPU ({mem.peak_phase}) of {gb(gpu.memory_bytes)}; "
           f"{'fits' if mem.fits else 'may not fit (an estimate: not refused)'}; "
           f"terms: python -m mix_src.planner --config-path ... (mix_src/planner/README.md)")
    print(msg)
    return msg


def _gpu(name: Optional[str], cpu: bool) -> Optional[Gpu]:
    """The GPU to plan for: ``mix.planner.gpu`` (a GPUS key: ``PlannerConfig`` checks it), else the driver's CUDA
    device 0; None on the CPU backend without a name, or with no CUDA device visible (then nothing is checked)."""
    if name:
        return GPUS[name]
    if cpu:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            print("[mix_src] planner: memory not checked: no CUDA device visible to the driver "
                  "(set mix.planner.gpu to plan for one)")
            return None
        props = torch.cuda.get_device_properties(0)
    except Exception as e:  # noqa: BLE001
        print(f"[mix_src] planner: memory not checked: {e}")
        return None
    known = next((g for k, g in GPUS.items() if k.split("-")[0] in props.name.lower()), None)
    return Gpu(props.name, int(props.total_memory), known.bf16_flops if known else 0.0,
               known.hbm_bytes_per_s if known else 0.0)
