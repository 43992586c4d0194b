"""Training compute (FLOPs) of a run, counted from its own tokens and the model's shape. Pure: numpy only.

Forward FLOPs of one sequence of ``T`` tokens, in two counts; a training pass costs ``3 F(T)`` in both::

    F(T) = 2 N T                                      ("6n": Kaplan et al. 2020, arXiv 2001.08361, sec. 2.1)
    F(T) = 2 N T + 2 d V T + 2 L H d_head T (T + 1)   ("full")

N = non-embedding parameters (decoder layers and norms; not the embedding, not the LM head). "full" adds what
6N leaves out, not negligible at 0.5M parameters: the LM head (``2 d V`` per token) and attention over the real
causal context (a token at position p attends to p + 1 positions: ``4 (p+1) d_head`` per head and layer, i.e.
Kaplan's ``2 n_layer n_ctx d_attn`` with the causal context for ``n_ctx``); the embedding lookup is a gather (0).

An RL step (both trainer bases, :func:`add_step_flops`): rollout ``F(P + R)`` per row that generated a token, in
every generation pass (KV-cached decode; a prefilled prefix is the same work; rows dropped later still count);
old log-probs ``F(P + R)`` per training row, reference log-probs the same when used; the update
``ppo_epochs x 3 F(P + R)``. Padding and validation are not counted. An SFT step: ``3 F(T)`` per sequence.
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
    """Summed forward FLOPs F(T) (module docstring; ``count`` as mix.flops_count) of sequences ``seq_lens`` [rows]."""
    t = np.asarray(seq_lens, dtype=np.float64).reshape(-1)
    if count not in COUNTS:  # a run's count is refused as mix.flops_count before Ray; this stops a direct call's typo
        raise ValueError(f"FLOPs count {count!r}: use one of {COUNTS}")
    if np.any(t < 0):
        raise ValueError("negative sequence length")
    total = 2.0 * shape.non_embedding_params * t.sum()
    if count == "full":
        total += 2.0 * shape.d_model * shape.vocab * t.sum()
        total += 2.0 * shape.n_layers * shape.n_heads * shape.head_dim * float((t * (t + 1)).sum())
    return float(total)


def rollout_flops(shape: ModelShape, prompt_lens, response_lens, generated_lens, count: str = "full") -> float:
    """Generation FLOPs of rows ``[rows]``: ``F(P + R)`` per row that generated a token (``generated_lens > 0``)."""
    p, r, g = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (prompt_lens, response_lens, generated_lens))
    return forward_flops(shape, (p + r)[g > 0], count)


def rl_step_flops(shape: ModelShape, prompt_lens, response_lens, *, ppo_epochs: int = 1,
                  ref_policy: bool = False, count: str = "full") -> float:
    """Training-side FLOPs of one RL step on rows ``[rows]``: old log-probs, reference log-probs (``ref_policy``)
    and ``ppo_epochs`` training passes (generation: :func:`rollout_flops`)."""
    t = np.asarray(prompt_lens, dtype=np.int64).reshape(-1) + np.asarray(response_lens, dtype=np.int64).reshape(-1)
    fwd = forward_flops(shape, t, count)
    return fwd * (1 + int(bool(ref_policy))) + 3.0 * int(ppo_epochs) * fwd


def sft_step_flops(shape: ModelShape, seq_lens: Sequence[int], count: str = "full") -> float:
    """One SFT optimiser step (forward + backward = 3 x forward) on sequences of ``seq_lens`` tokens."""
    return 3.0 * forward_flops(shape, seq_lens, count)


def lengths_from_masks(attention_mask, response_mask_or_len, prefix_mask=None):
    """``(prompt_lens, response_lens, generated_lens)`` per row from ``attention_mask [rows, P_max + R_max]``, whose
    last ``R_max`` columns (an int, or a tensor of that width) are the response; ``prefix_mask [rows, R_max]``."""
    am = np.asarray(attention_mask).astype(np.int64)
    width = response_mask_or_len if isinstance(response_mask_or_len, int) else np.asarray(response_mask_or_len).shape[-1]
    response_am = am[:, am.shape[1] - width:]
    resp = response_am.sum(-1)
    gen = resp if prefix_mask is None else resp - (np.asarray(prefix_mask).astype(np.int64) * response_am).sum(-1)
    return am.sum(-1) - resp, resp, gen


def add_step_flops(shape: ModelShape, prompt_lens, response_lens, rollout: Mapping[str, float], totals: dict,
                   metrics: dict, *, ppo_epochs: int = 1, ref_policy: bool = False) -> None:
    """One RL step of both trainer bases: its training passes over the rows (rows,) plus ``rollout`` (per count),
    added to ``totals`` (per count) and logged as ``flops/{rollout,step,total}_*`` and ``flops/num_tokens``."""
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
    """True (``flops/unavailable`` = 1, one printed line per process) when ``read_shape()`` raises: without
    ``mix.flops_budget`` the count is only metrics, so an unreadable model config is no error."""
    try:
        read_shape()
    except Exception as e:  # noqa: BLE001
        metrics["flops/unavailable"] = 1
        if not _UNREADABLE_WARNED:
            print(f"[mix_src] FLOPs not counted (mix_src/algo/flops.py cannot read the actor's config): {e}")
            _UNREADABLE_WARNED.append(True)
        return True
    return False
