"""Memory and GPU-hour estimates of a run, from the model's shape and the recipe's numbers. Pure arithmetic: no
torch, verl or Ray imports (:mod:`mix_src.planner.check` reads the configs). Units: bytes (``int``), parameter
counts, hours; GB means 1e9 bytes. Every term, its source and the GPU calibration: mix_src/planner/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mix_src.algo.flops import ModelShape

GB = 10**9
GIB = 2**30

# Bytes per parameter of the FSDP actor's training state. verl trains the actor in fp32 unless
# actor_rollout_ref.actor.fsdp_config.model_dtype says otherwise (verl/workers/engine/fsdp/transformer_impl.py
# _build_module: "if it is training, we force torch_dtype to fp32"), with torch.optim.AdamW (two fp32 moments).
PARAM_BYTES = 4  # fp32 parameter
GRAD_BYTES = 4  # fp32 gradient
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32 each
# AdamW's foreach step on CUDA (verl's FSDP engine's default) holds one fp32 temporary per parameter (measured on
# an H200 by scripts/gpu/calibrate_memory.py: 20.05 B/param at the step; mix_src/planner/README.md)
ADAM_STEP_TEMP_BYTES = 4
# A checkpoint's extra_state (lr scheduler + RNG states) and the huggingface/ config + tokenizer files: a few MB.
CHECKPOINT_EXTRA_BYTES = 64 * 2**20


def count_params(hf_config: Mapping) -> int:
    """Parameters of a decoder-only HF model (Qwen2/Llama family) from its ``config.json`` dict: embedding, decoder
    layers and final norm (:class:`mix_src.algo.flops.ModelShape`), LM head unless tied (Qwen2.5-7B: 7,615,616,512)."""
    shape = ModelShape.from_hf_config(hf_config)
    embed = shape.vocab * shape.d_model
    head = 0 if hf_config.get("tie_word_embeddings", False) else embed
    return shape.non_embedding_params + embed + head


def checkpoint_bytes(num_params: int, with_optimizer: bool = True) -> int:
    """Bytes of one verl FSDP actor checkpoint (``global_step_N/actor``) over all ranks: fp32 model shards (4 B/param),
    AdamW moments (8 B/param) when ``with_optimizer`` (verl's default ``checkpoint.save_contents``), and
    :data:`CHECKPOINT_EXTRA_BYTES` (verl/utils/checkpoint/fsdp_checkpoint_manager.py save_checkpoint)."""
    if num_params < 0:
        raise ValueError(f"num_params={num_params} must be >= 0")
    per_param = PARAM_BYTES + (ADAM_BYTES if with_optimizer else 0)
    return int(num_params) * per_param + CHECKPOINT_EXTRA_BYTES


@dataclass(frozen=True)
class Gpu:
    """One accelerator: memory in bytes, dense bf16 peak in FLOP/s, HBM bandwidth in bytes/s."""

    name: str
    memory_bytes: int
    bf16_flops: float
    hbm_bytes_per_s: float


# Dense bf16 (without sparsity) and HBM bandwidth from NVIDIA's A100 / H100 / H200 SXM datasheets. Memory: the
# A100's 80 GiB (not measured); the H100's torch total_memory and the H200's nvidia-smi MiB on the GPUs the
# calibration ran on (mix_src/planner/README.md, calibration; calibration/h200_2026-11-26_*.txt).
GPUS: dict[str, Gpu] = {
    "a100-80gb": Gpu("A100-SXM4-80GB", 80 * GIB, 312e12, 2.039e12),
    "h100-80gb": Gpu("H100-SXM5-80GB", 85_017_493_504, 989e12, 3.35e12),
    "h200-141gb": Gpu("H200-SXM-141GB", 143771 * 2**20, 989e12, 4.8e12),
}


@dataclass(frozen=True)
class RunShape:
    """What the estimate reads from a composed config (:func:`mix_src.planner.check.run_shape`); token counts are
    per micro-batch on one GPU, lengths in tokens."""

    world_size: int  # GPUs training the actor (trainer.nnodes x n_gpus_per_node)
    fsdp_shards: int  # GPUs one copy of the FSDP state is sharded over (fsdp_config.fsdp_size, -1 = world_size)
    offload_policy: bool  # fsdp_config.offload_policy (FSDP2 CPUOffloadPolicy): states stay on CPU through the update
    param_offload: bool  # fsdp_config.param_offload: parameters on CPU between phases, loaded for each pass
    optimizer_offload: bool  # fsdp_config.optimizer_offload: AdamW states on CPU between updates
    train_tokens: int  # tokens of one update micro-batch on one GPU
    logprob_tokens: int  # tokens of one log-prob micro-batch on one GPU
    gradient_checkpointing: bool  # model.enable_gradient_checkpointing
    entropy_in_update: bool  # the update computes the entropy (entropy_coeff != 0 or calculate_entropy)
    entropy_chunking: bool  # fsdp_config.entropy_from_logits_with_chunking (what verl's FSDP engine reads)
    entropy_chunk: int  # fsdp_config.entropy_from_logits_chunk_size, tokens
    entropy_compiled: bool  # fsdp_config.use_torch_compile: verl compiles the entropy function
    reference: bool  # a reference policy runs a log-prob pass (KL loss or KL in reward)
    gpu_memory_utilization: float  # vLLM's share of the GPU while it generates
    rollout_tp: int  # rollout.tensor_model_parallel_size
    max_num_seqs: int  # rollout.max_num_seqs: vLLM's cap on sequences decoded at once
    prompt_len: int  # data.max_prompt_length
    response_len: int  # data.max_response_length
    n: int  # rollout.n
    n_full_target: int  # rows of each group that are a whole target + EOS and generate nothing (LUFFY: 1)
    batch_size: int  # data.train_batch_size, prompts per step
    ppo_epochs: int
    steps: int  # training steps of the run
    # verl's log-probs through flash-attn's cross-entropy (verl/utils/torch_functional.py logprobs_from_logits);
    # without flash-attn (NO_FLASH_ATTN=1) logprobs_from_logits_v2 keeps each row's log_softmax for the backward
    flash_ce: bool = True


# ---------------------------------------------------------------------------------- memory terms, bytes per GPU
@dataclass(frozen=True)
class Term:
    """One memory term: ``bytes`` on one GPU, how it is counted (``basis``)."""

    name: str
    bytes: int
    basis: str


def state_terms(n_params: int, run: RunShape) -> list[Term]:
    """fp32 parameters, gradients and AdamW states of the FSDP actor during the update, per GPU: ``param_offload`` /
    ``optimizer_offload`` are loaded back for it (verl/workers/engine/base.py BaseEngineCtx._context_switch), only
    ``offload_policy`` keeps them on the CPU (verl/workers/engine/fsdp/transformer_impl.py _build_fsdp_module)."""
    if run.offload_policy:
        return [Term("fp32 params + grads + AdamW", 0, "fsdp_config.offload_policy: on the CPU")]
    s = run.fsdp_shards
    return [Term("fp32 params", PARAM_BYTES * n_params // s, f"4 B/param / {s} shards"),
            Term("fp32 grads", GRAD_BYTES * n_params // s, f"4 B/param / {s} shards"),
            Term("AdamW states", ADAM_BYTES * n_params // s, f"8 B/param / {s} shards")]


def states_bytes(n_params: int, run: RunShape) -> int:
    """The sum of :func:`state_terms`: what the refusal compares with the GPU's memory."""
    return sum(t.bytes for t in state_terms(n_params, run))


def gather_bytes(shape: ModelShape) -> int:
    """FSDP's unsharded bf16 copies during a pass: the root unit (token embedding + LM head, verl wraps the
    decoder layers) and two decoder layers (one computing, one prefetched)."""
    layer = shape.non_embedding_params // shape.n_layers
    return 2 * (2 * shape.vocab * shape.d_model + 2 * layer)


def activation_bytes(shape: ModelShape, tokens: int, checkpointing: bool) -> int:
    """Activations of an update micro-batch of ``tokens`` tokens: with gradient checkpointing each layer's
    input (bf16) plus one layer's activations recomputed in the backward; without, every layer's. One decoder
    layer keeps for its backward, per token, bf16: input, 2 norms, q, k, v, attention output, o_proj output,
    residual, gate, up, SiLU(gate), product, down output (flash attention keeps only its log-sum-exp)."""
    kv = shape.n_kv_heads * shape.head_dim
    one_layer = 2 * (7 * shape.d_model + 2 * kv + 4 * shape.d_ff) * tokens
    if checkpointing:
        return shape.n_layers * 2 * shape.d_model * tokens + one_layer
    return shape.n_layers * one_layer


def entropy_bytes(shape: ModelShape, run: RunShape, tokens: int, grad: bool) -> int:
    """What verl's entropy of ``[tokens, vocab]`` bf16 logits adds (verl/utils/torch_functional.py
    entropy_from_logits[_with_chunking]): with a gradient what autograd saves, without the temporaries' peak. Why
    each figure: mix_src/planner/README.md "Entropy"; tests/test_planner.py::test_entropy_bytes_match_verl."""
    if run.entropy_compiled:
        return 0
    tv = tokens * shape.vocab
    if grad:
        return 8 * tv if run.entropy_chunking else 2 * tv
    return 12 * min(run.entropy_chunk, tokens) * shape.vocab if run.entropy_chunking else 4 * tv


def update_terms(shape: ModelShape, n_params: int, run: RunShape) -> list[Term]:
    """The actor update's peak, per GPU: states, FSDP gathers, activations, logits (bf16) and their gradient,
    the entropy's share."""
    t, tv = run.train_tokens, run.train_tokens * shape.vocab
    terms = state_terms(n_params, run)
    terms.append(Term("FSDP gathered bf16 weights", gather_bytes(shape), "embed + head + 2 layers"))
    terms.append(Term("activations", activation_bytes(shape, t, run.gradient_checkpointing),
                      f"{t} tokens, checkpointing={'on' if run.gradient_checkpointing else 'off'}"))
    terms.append(Term("logits + their gradient", 4 * tv, f"2 x bf16 [{t}, {shape.vocab}]"))
    if not run.flash_ce:
        terms.append(Term("log_softmax kept for backward", 2 * tv, "no flash-attn: logprobs_from_logits_v2"))
    if run.entropy_in_update:
        terms.append(Term("entropy (with gradient)", entropy_bytes(shape, run, t, grad=True), _entropy_basis(run)))
    return terms


def step_terms(n_params: int, run: RunShape) -> list[Term]:
    """AdamW's step, per GPU: the states (logits and activations are gone by then) and the foreach step's fp32
    temporary; alone it decides whether a whole model fits one GPU (mix_src/planner/README.md, calibration)."""
    terms = state_terms(n_params, run)
    if not run.offload_policy:
        s = run.fsdp_shards
        terms.append(Term("AdamW step temporary (foreach)", ADAM_STEP_TEMP_BYTES * n_params // s,
                          f"4 B/param / {s} shards, measured"))
    return terms


def logprob_terms(shape: ModelShape, n_params: int, run: RunShape) -> list[Term]:
    """The old-log-prob pass (no gradient; verl computes the entropy there too, ray_trainer.py
    _compute_old_log_prob), per GPU: fp32 parameters (loaded for it) and AdamW states unless offloaded, gathers,
    one micro-batch's logits and the entropy's temporaries."""
    t, s = run.logprob_tokens, run.fsdp_shards
    params = 0 if run.offload_policy else PARAM_BYTES * n_params // s
    adam = 0 if (run.offload_policy or run.optimizer_offload) else ADAM_BYTES * n_params // s
    return [Term("fp32 params", params, f"4 B/param / {s} shards"),
            Term("AdamW states (resident)", adam, "0 with optimizer_offload"),
            Term("FSDP gathered bf16 weights", gather_bytes(shape), "embed + head + 2 layers"),
            Term("logits", 2 * t * shape.vocab, f"bf16 [{t}, {shape.vocab}]"),
            Term("entropy (no gradient)", entropy_bytes(shape, run, t, grad=False), _entropy_basis(run))]


def _entropy_basis(run: RunShape) -> str:
    if run.entropy_compiled:
        return "torch.compile: fused"
    return f"eager, chunked by {run.entropy_chunk}" if run.entropy_chunking else "eager, unchunked"


def kv_bytes_per_token(shape: ModelShape, tp: int) -> int:
    """bf16 K and V of one token on one GPU of a tensor-parallel group of ``tp`` (KV heads split over it,
    replicated when there are fewer heads than GPUs)."""
    heads = max(1, shape.n_kv_heads // tp)
    return 2 * 2 * shape.n_layers * heads * shape.head_dim


def rollout_terms(shape: ModelShape, n_params: int, run: RunShape, gpu: Gpu) -> tuple[list[Term], int]:
    """Generation, per GPU: the actor state left on the GPU (parameters unless param_offload, AdamW states unless
    optimizer_offload) beside vLLM's claim ``gpu_memory_utilization x memory`` (its bf16 weights, its
    activations, the rest KV cache). Returns the terms and how many sequences of prompt + response tokens the
    KV cache holds at once on one engine (0: the weights alone fill vLLM's share)."""
    s = run.fsdp_shards
    params = 0 if (run.offload_policy or run.param_offload) else PARAM_BYTES * n_params // s
    adam = 0 if (run.offload_policy or run.optimizer_offload) else ADAM_BYTES * n_params // s
    claim = int(run.gpu_memory_utilization * gpu.memory_bytes)
    weights = 2 * n_params // run.rollout_tp
    kv = max(0, claim - weights - VLLM_ACTIVATION_BYTES)
    seqs = kv // (kv_bytes_per_token(shape, run.rollout_tp) * (run.prompt_len + run.response_len))
    terms = [Term("actor fp32 params (resident)", params, "0 with param_offload"),
             Term("actor AdamW states (resident)", adam, "0 with optimizer_offload"),
             Term("vLLM: bf16 weights", weights, f"2 B/param / TP {run.rollout_tp}"),
             Term("vLLM: activations + CUDA graphs", VLLM_ACTIVATION_BYTES, "assumed"),
             Term("vLLM: KV cache", kv, f"the rest of {run.gpu_memory_utilization} x GPU")]
    return terms, int(seqs)


VLLM_ACTIVATION_BYTES = 4 * GIB  # vLLM's profiled activation peak and CUDA graphs: a few GiB at 8192 batched tokens
CUDA_CONTEXT_BYTES = 1 * GIB  # per process: CUDA context, NCCL buffers, allocator slack (outside torch's count)
# What torch's caching allocator holds but cannot hand out near the limit (2.61-2.74 GiB "reserved but unallocated"
# at AdamW's first step on an H100: calibration/h100_2026-11-26_boundary.txt). In the "fits" verdict, not the refusal.
ALLOCATOR_FRAGMENTATION_BYTES = 11 * GIB // 4
# The error bound claimed for a phase's total (states are exact; the rest is counted from shapes; README).
ERROR_BOUND = 0.25


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU peak of each phase (bytes) and the largest; ``kv_sequences``: sequences vLLM decodes at once."""

    phases: dict  # phase name -> list[Term]
    kv_sequences: int
    gpu: Gpu

    def total(self, phase: str) -> int:
        return sum(t.bytes for t in self.phases[phase]) + CUDA_CONTEXT_BYTES

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    @property
    def fits(self) -> bool:
        """The peak phase plus :data:`ALLOCATOR_FRAGMENTATION_BYTES` within the GPU's memory."""
        return self.peak + ALLOCATOR_FRAGMENTATION_BYTES <= self.gpu.memory_bytes


def plan_memory(hf_config: Mapping, run: RunShape, gpu: Gpu) -> MemoryPlan:
    """Per-GPU memory of each phase of a step: generation, old log-probs, reference log-probs, actor update."""
    shape = ModelShape.from_hf_config(hf_config)
    n = count_params(hf_config)
    phases = {}
    phases["rollout"], seqs = rollout_terms(shape, n, run, gpu)
    phases["old log-prob"] = logprob_terms(shape, n, run)
    if run.reference:  # verl keeps the bf16 reference model on the CPU (forced CPUOffload): only its gathers
        resident = [t for t in phases["rollout"] if t.name.startswith("actor")]
        t = run.logprob_tokens
        phases["ref log-prob"] = [*resident, Term("FSDP gathered bf16 weights", gather_bytes(shape), "ref"),
                                  Term("logits", 2 * t * shape.vocab, f"bf16 [{t}, {shape.vocab}]")]
    phases["actor update"] = update_terms(shape, n, run)
    phases["optimizer step"] = step_terms(n, run)
    return MemoryPlan(phases=phases, kv_sequences=seqs, gpu=gpu)


# -------------------------------------------------------------------------------------------------- GPU-hours
@dataclass(frozen=True)
class TimePlan:
    """Seconds per step on the whole cluster (wall clock) and GPU-hours of the run."""

    train_s: float  # old log-prob + reference + update passes: FLOPs / (GPUs x peak x MFU)
    decode_s: float  # generation: bytes read per decode step / HBM bandwidth, per engine
    steps: int
    world_size: int

    @property
    def step_s(self) -> float:
        return self.train_s + self.decode_s

    @property
    def gpu_hours(self) -> float:
        return self.step_s * self.steps * self.world_size / 3600.0


def plan_time(hf_config: Mapping, run: RunShape, gpu: Gpu, *, mean_response: float, mfu: float,
              kv_sequences: int) -> TimePlan:
    """GPU-hours of ``run.steps`` steps: training passes by :func:`mix_src.algo.flops.rl_step_flops` ("full" count)
    at ``mfu`` of the GPU's bf16 peak, plus decode, memory-bandwidth-bound (each engine ``min(max_num_seqs,
    kv_sequences)`` sequences at a time; mix_src/planner/README.md "Decode")."""
    from mix_src.algo.flops import rl_step_flops

    shape = ModelShape.from_hf_config(hf_config)
    n_params = count_params(hf_config)
    rows = run.batch_size * run.n
    flops = rl_step_flops(shape, [run.prompt_len] * rows, [mean_response] * rows, ppo_epochs=run.ppo_epochs,
                          ref_policy=run.reference, count="full")
    train_s = flops / (run.world_size * gpu.bf16_flops * mfu)
    engines = max(1, run.world_size // run.rollout_tp)
    gen_rows = run.batch_size * (run.n - run.n_full_target)
    rows_per_engine = -(-gen_rows // engines)
    concurrent = max(1, min(run.max_num_seqs, max(kv_sequences, 1), rows_per_engine))
    waves = -(-rows_per_engine // concurrent)
    context = run.prompt_len + mean_response / 2  # mean context over a response's decode steps
    kv_read = concurrent * context * kv_bytes_per_token(shape, 1)  # the whole engine's KV of the sequences
    per_token_step = (2 * n_params + kv_read) / (run.rollout_tp * gpu.hbm_bytes_per_s)
    decode_s = waves * mean_response * per_token_step
    return TimePlan(train_s=train_s, decode_s=decode_s, steps=run.steps, world_size=run.world_size)
