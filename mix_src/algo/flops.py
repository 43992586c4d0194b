"""Training compute (FLOPs) of a run, counted from its own tokens and the model's shape. Pure: numpy only.

Two counts, both per token and summed over the tokens a step actually processes:

* ``"6n"`` — the 6N rule (Kaplan et al. 2020, arXiv 2001.08361, sec. 2.1): a forward pass costs
  ``2 N`` FLOPs per token and a training pass (forward + backward) ``6 N``, where ``N`` is the number of
  **non-embedding** parameters (every decoder-layer weight and bias, the norms; not the token embedding,
  not the LM head).
* ``"full"`` — the 6N count plus what it leaves out, which at a 0.5M-parameter model is not negligible:

  - the LM head, a ``d_model x vocab`` matmul on every token: ``2 d V`` per token forward;
  - attention scores and the weighted sum of values: a token at position ``p`` (0-based) attends to
    ``p + 1`` positions, ``2 (p+1) d_head`` FLOPs for ``q.k`` and ``2 (p+1) d_head`` for ``softmax.v`` per
    head and layer, so a causal sequence of ``T`` tokens costs ``4 L H d_head * T (T+1) / 2``
    (Kaplan's ``2 n_layer n_ctx d_attn`` term, with the real causal context instead of ``n_ctx``);
  - the token-embedding lookup is a gather: 0 FLOPs (its backward, a scatter-add, is not counted either).

  Forward FLOPs of one sequence of ``T`` tokens::

      F(T) = 2 N T                              ("6n")
      F(T) = 2 N T + 2 d V T + 2 L H d_head T (T + 1)   ("full")

  and a training pass costs ``3 F(T)`` (backward = 2 x forward), in both counts.

An RL step of the legacy trainer (:meth:`mix_src.trainer.legacy.MIXRayPPOTrainer._step`) is counted as
(:func:`rl_step_flops`; the V1 trainer, :meth:`mix_src.trainer.v1.MixV1Mixin._count_flops`, the same):

* rollout: ``F(P + R)`` for every generated row of every generation pass (a KV-cached decode does the work
  of one forward over prompt + response; a prefix of target tokens is prefilled, which is the same work);
  rows that generated nothing (a whole target + EOS, LUFFY's expert row) cost 0; rows a rollout policy or
  the group filter later dropped are counted (they were generated);
* old log-probs: ``F(P + R)`` per training row; reference log-probs: the same again when a reference
  policy is used;
* actor update: ``ppo_epochs x 3 F(P + R)`` per training row.

Padding is not counted (the useful work, not what a padded batch computes), nor validation (evaluation is
not training compute). An SFT step is ``3 F(T)`` per sequence of the batch (:func:`sft_step_flops`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np

COUNTS = ("6n", "full")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (the Qwen2/Llama family: GQA attention, gated MLP, RMSNorm)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    qkv_bias: bool = True  # Qwen2: biases on q, k, v (not on o)

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> "ModelShape":
        """From an HF ``config.json`` dict (``hidden_size``, ``num_hidden_layers``, ...)."""
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"model config has no {missing}: cannot count FLOPs (a decoder-only HF config needed)")
        d, h = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        bias = cfg.get("attention_bias", cfg.get("model_type") == "qwen2")
        return cls(d_model=d, n_layers=int(cfg["num_hidden_layers"]), n_heads=h,
                   n_kv_heads=int(cfg.get("num_key_value_heads") or h), head_dim=int(cfg.get("head_dim") or d // h),
                   d_ff=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]), qkv_bias=bool(bias))

    @property
    def non_embedding_params(self) -> int:
        """N of the 6N rule: every decoder-layer parameter and the final norm."""
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        mlp = 3 * d * self.d_ff  # gate, up, down
        return self.n_layers * (attn + mlp + 2 * d) + d  # two RMSNorms per layer, one final

    def describe(self) -> dict:
        return {**asdict(self), "non_embedding_params": self.non_embedding_params}


def forward_flops(shape: ModelShape, seq_lens, count: str = "full") -> float:
    """Forward FLOPs of sequences of ``seq_lens`` tokens each (array-like of ints, shape ``[rows]``), summed.

    ``count``: ``"6n"`` = ``2 N T`` per sequence; ``"full"`` adds ``2 d V T + 2 L H d_head T (T+1)``."""
    if count not in COUNTS:
        raise ValueError(f"FLOPs count {count!r}: use one of {COUNTS}")
    t = np.asarray(seq_lens, dtype=np.float64).reshape(-1)
    if np.any(t < 0):
        raise ValueError("negative sequence length")
    total = 2.0 * shape.non_embedding_params * t.sum()
    if count == "full":
        total += 2.0 * shape.d_model * shape.vocab * t.sum()
        total += 2.0 * shape.n_layers * shape.n_heads * shape.head_dim * float((t * (t + 1)).sum())
    return float(total)


def train_flops(shape: ModelShape, seq_lens, count: str = "full") -> float:
    """Forward + backward (3 x forward) FLOPs of sequences of ``seq_lens`` tokens."""
    return 3.0 * forward_flops(shape, seq_lens, count)


def rollout_flops(shape: ModelShape, prompt_lens, response_lens, generated_lens, count: str = "full") -> float:
    """Generation FLOPs of rows ``[rows]``: ``F(P + R)`` for each row that generated at least one token
    (``generated_lens > 0``; a row that is a whole target generated nothing)."""
    p, r, g = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (prompt_lens, response_lens, generated_lens))
    return forward_flops(shape, (p + r)[g > 0], count)


def rl_step_flops(shape: ModelShape, prompt_lens, response_lens, *, ppo_epochs: int = 1,
                  ref_policy: bool = False, count: str = "full") -> float:
    """Training-side FLOPs of one RL step on rows ``[rows]`` (prompt / response token counts): old
    log-probs (one forward), reference log-probs (one forward, when ``ref_policy``), and ``ppo_epochs``
    training passes. Generation is counted separately (:func:`rollout_flops`), per generation pass."""
    t = np.asarray(prompt_lens, dtype=np.int64).reshape(-1) + np.asarray(response_lens, dtype=np.int64).reshape(-1)
    fwd = forward_flops(shape, t, count)
    return fwd * (1 + int(bool(ref_policy))) + 3.0 * int(ppo_epochs) * fwd


def sft_step_flops(shape: ModelShape, seq_lens: Sequence[int], count: str = "full") -> float:
    """One SFT optimiser step on a batch of sequences of ``seq_lens`` tokens (prompt + response, as trained)."""
    return train_flops(shape, seq_lens, count)


def lengths_from_masks(attention_mask, response_mask_or_len, prefix_mask=None):
    """``(prompt_lens, response_lens, generated_lens)`` per row from verl's batch tensors (numpy or torch):
    ``attention_mask [rows, P_max + R_max]``; the response is its last ``R_max`` columns (an int, or a
    ``response_mask``/``responses`` tensor of width ``R_max``); ``prefix_mask [rows, R_max]`` marks target
    (not generated) tokens."""
    am = np.asarray(attention_mask).astype(np.int64)
    width = response_mask_or_len if isinstance(response_mask_or_len, int) else np.asarray(response_mask_or_len).shape[-1]
    resp = am[:, am.shape[1] - width:].sum(-1)
    prompt = am.sum(-1) - resp
    gen = resp - (np.asarray(prefix_mask).astype(np.int64) * am[:, am.shape[1] - width:]).sum(-1) \
        if prefix_mask is not None else resp
    return prompt, resp, gen


def add_step_flops(shape: ModelShape, prompt_lens, response_lens, rollout: Mapping[str, float], totals: dict,
                   metrics: dict, *, ppo_epochs: int = 1, ref_policy: bool = False) -> None:
    """One RL step of both trainer bases: its training passes over the rows (lengths ``prompt_lens``,
    ``response_lens``: (rows,)) plus ``rollout`` (per count, the step's generation), added to ``totals`` (per count,
    the run so far) and logged as ``flops/rollout_*``, ``flops/step_*``, ``flops/total_*`` and ``flops/num_tokens``."""
    p, r = np.asarray(prompt_lens, dtype=np.int64), np.asarray(response_lens, dtype=np.int64)
    for c in COUNTS:
        step = rl_step_flops(shape, p, r, ppo_epochs=ppo_epochs, ref_policy=ref_policy, count=c) + rollout[c]
        totals[c] += step
        metrics[f"flops/rollout_{c}"] = rollout[c]
        metrics[f"flops/step_{c}"] = step
        metrics[f"flops/total_{c}"] = totals[c]
    metrics["flops/num_tokens"] = int((p + r).sum())


_UNREADABLE_WARNED: list[bool] = []


def shape_unreadable(read_shape, metrics: dict) -> bool:
    """With no ``mix.flops_budget`` counting is only metrics, so a model config this module cannot read is no
    error: True (``flops/unavailable`` = 1, and one printed line per process) when ``read_shape()`` raises."""
    try:
        read_shape()
    except Exception as e:  # noqa: BLE001
        metrics["flops/unavailable"] = 1
        if not _UNREADABLE_WARNED:
            print(f"[mix_src] FLOPs not counted (mix_src/algo/flops.py cannot read the actor's config): {e}")
            _UNREADABLE_WARNED.append(True)
        return True
    return False
