"""Per-request sampling seeds: what a rollout draws depends on *which* sample it is, never on when it ran.

The trainer gives every row of a generation batch a seed derived from (``actor_rollout_ref.rollout.seed``, global
step, generation batch of the step (filter groups draw extra ones), prompt index, sample index). The agent loop
passes it to the inference server as ``sampling_params["seed"]``: vLLM's per-request ``SamplingParams.seed``
(https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html) and the CPU backend's hf server seed a private
generator for that request, so its tokens do not depend on arrival order or on its decoding batch. Rows without a
trainer seed (validation) get one from (rollout seed, "validate", position): checkpoints compare on the same draws.
"""

from __future__ import annotations

import numpy as np

_PASS_TAG = 0x5A55  # a rollout policy's later pass over the same rows
_VALIDATION_TAG = 0x56414C  # "VAL": keeps validation seeds apart from any training (step, batch) pair


def _seed63(*entropy: int) -> int:
    """A 63-bit seed from a tuple of non-negative ints (numpy's SeedSequence hash: no collisions by layout)."""
    state = np.random.SeedSequence([int(e) for e in entropy]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def request_seeds(rollout_seed: int, global_step: int, gen_index: int, num_prompts: int, n: int) -> np.ndarray:
    """(num_prompts * n,) int64 63-bit seeds of a generation batch whose rows are ``i * n + j`` (prompt i, sample j)."""
    base = [int(rollout_seed), int(global_step), int(gen_index)]
    if min(base) < 0:
        raise ValueError(f"seeds need non-negative (rollout seed, step, batch), got {base}")
    return np.array([_seed63(*base, i, j) for i in range(num_prompts) for j in range(n)], dtype=np.int64)


def fallback_seed(rollout_seed: int, *position: int) -> int:
    """Seed of a row the trainer did not seed (validation), from its position (legacy: verl's ``priority``; V1:
    its data index and sample)."""
    return _seed63(int(rollout_seed), _VALIDATION_TAG, *(int(p) for p in position))


def pass_seeds(seeds: np.ndarray, pass_index: int) -> np.ndarray:
    """Seeds for a rollout policy's pass ``pass_index`` over rows seeded ``seeds`` (pass 0 keeps them), so a
    second pass over the same rows draws new samples, reproducibly. (rows,) int64 -> (rows,) int64."""
    if pass_index == 0:
        return np.asarray(seeds, dtype=np.int64)
    return np.array([_seed63(int(s), _PASS_TAG, int(pass_index)) for s in seeds], dtype=np.int64)
