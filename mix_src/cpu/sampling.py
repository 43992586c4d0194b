"""Batched token-in/token-out sampling with a Hugging Face causal LM (no ``model.generate``).

Own decoding loop so that nothing from a ``generation_config`` (top_k=50, repetition penalty, ...) leaks into
sampling, and log-probs come from the raw logits, as verl's actor computes ``old_log_probs``:

    logprob(token) = log_softmax(logits / T)[token]          (T = 1 for greedy, temperature <= 0)

top-k / top-p (vLLM order: top-k, renormalise, top-p) only restrict which token is drawn. Each request's
``seed`` (vLLM's ``SamplingParams.seed``) seeds its own generator, one uniform per token, inverse CDF: a row's
tokens depend on its seed and logits only, not on arrival order or batch-mates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Sampling keys this backend understands; anything else that would change the distribution is refused.
_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
_IGNORED = {"n", "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "prompt_logprobs"}


# A float32 matmul's row i is bit-identical for every number of rows M only when M is a multiple of the CPU
# kernel's row block (MKL's AVX-512 sgemm, torch 2.13; measured: mix_src/cpu/README.md "Seeded runs reproduce").
ROW_MULTIPLE = 8


@dataclass
class SamplingSpec:
    """One request's decoding parameters (vLLM semantics: top_k <= 0 and top_p = 1 mean off)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: bool = False
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: Optional[int] = None  # the request's own generator; None = drawn from the server's

    @classmethod
    def from_params(cls, params: dict[str, Any], default_max_tokens: int, max_possible_tokens: int) -> "SamplingSpec":
        """Parse a verl/vLLM-style ``sampling_params`` dict; ``max_tokens`` (or sglang's ``max_new_tokens``, else
        ``default_max_tokens``) is clamped to ``[0, max_possible_tokens]`` (the room left in the context)."""
        params = dict(params)
        for key, neutral in _NEUTRAL.items():
            value = params.pop(key, None)
            if value is not None and float(value) != neutral:
                raise ValueError(f"hf rollout: sampling param {key}={value} is not supported (only {neutral})")
        for key in _IGNORED:
            params.pop(key, None)
        given = (params.pop("max_tokens", None), params.pop("max_new_tokens", None), default_max_tokens)
        max_tokens = next(v for v in given if v is not None)

        def pop(key: str, cast, default=None):  # a value of None means the default
            value = params.pop(key, None)
            return default if value is None else cast(value)

        spec = cls(
            max_tokens=max(0, min(int(max_tokens), int(max_possible_tokens))),
            temperature=pop("temperature", float, 1.0), top_p=pop("top_p", float, 1.0), top_k=pop("top_k", int, -1),
            logprobs=pop("logprobs", bool, False), ignore_eos=pop("ignore_eos", bool, False),
            stop_token_ids=tuple(int(t) for t in (params.pop("stop_token_ids", None) or ())), seed=pop("seed", int),
        )
        if params:
            raise ValueError(f"hf rollout: unsupported sampling params {sorted(params)}")
        if not 0.0 < spec.top_p <= 1.0:
            raise ValueError(f"hf rollout: top_p must be in (0, 1], got {spec.top_p}")
        return spec


def filter_top_k_top_p(scaled_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    Args:
        scaled_logits: (B, V) logits already divided by the temperature.
        top_k: (B,) long, V (or more) = off.
        top_p: (B,) float in (0, 1], 1 = off.
    Returns:
        (B, V) masked logits; the most likely token of each row is always kept.
    """
    sorted_logits, sorted_idx = scaled_logits.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_logits.size(-1), device=scaled_logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(scaled_logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: the first whose cumulative probability exceeds ``u * total``.

    Args:
        probs: (B, V) non-negative, rows need not be normalised; zero-probability tokens are never drawn.
        uniforms: (B,) float64 in [0, 1).
    Returns:
        (B,) long token ids.
    """
    cdf = probs.double().cumsum(dim=-1)
    x = (uniforms.double() * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    # u * total rounds to total only for u within 2**-53 of 1: take the last token with mass then
    last = probs.size(-1) - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(idx, last)


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], specs: list[SamplingSpec], eos_token_ids: set[int],
                   pad_token_id: int, generator: Optional[torch.Generator] = None,
                   width: Optional[int] = None) -> list[tuple[list[int], list[float]]]:  # fmt: skip
    """Decode ``prompts`` (token ids) with per-row ``specs``; returns ``[(token_ids, logprobs)]``.

    Each row stops after ``max_tokens`` tokens or right after a stop token (EOS unless ``ignore_eos``, plus
    ``stop_token_ids``), which is included, as vLLM does. ``generator`` seeds requests without a ``seed``.
    Prompts are left-padded to ``width`` (default: the longest) and the batch filled with idle rows to a multiple
    of ``ROW_MULTIPLE``: given the width, a row's tokens and log-probs do not depend on its batch-mates.
    """
    bsz = len(prompts)
    assert bsz == len(specs) and bsz > 0
    outputs: list[tuple[list[int], list[float]]] = [([], []) for _ in range(bsz)]
    max_new = max(s.max_tokens for s in specs)
    if max_new <= 0:
        return outputs
    if any(len(p) == 0 for p in prompts):
        raise ValueError("hf rollout: empty prompt")
    longest = max(len(p) for p in prompts)
    width = longest if width is None else int(width)
    if width < longest:
        raise ValueError(f"hf rollout: a prompt of {longest} tokens does not fit the batch width {width}")
    idle = -bsz % ROW_MULTIPLE  # rows that only pad the batch: no tokens, never returned
    prompts = list(prompts) + [prompts[0]] * idle
    specs = list(specs) + [SamplingSpec(max_tokens=0, seed=0)] * idle
    rows = bsz + idle
    device = next(model.parameters()).device

    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long, device=device)
        attention_mask[i, width - len(p) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    greedy = torch.tensor([s.temperature <= 0 for s in specs], device=device)
    temps = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in specs], device=device).unsqueeze(1)
    big = torch.iinfo(torch.long).max
    top_k = torch.tensor([s.top_k if s.top_k > 0 else big for s in specs], dtype=torch.long, device=device)
    top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device)
    filtering = bool((top_k < big).any() or (top_p < 1.0).any())
    stops = [set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids)) for s in specs]
    done = [s.max_tokens <= 0 for s in specs]
    # one CPU generator per request, seeded with its ``seed`` (or a seed drawn from ``generator``)
    seeds = [s.seed if s.seed is not None else int(torch.randint(0, 2**62, (), generator=generator)) for s in specs]
    gens = [torch.Generator().manual_seed(seed) for seed in seeds]

    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    next_pos = position_ids[:, -1:] + 1
    for _ in range(max_new):
        scaled = out.logits[:, -1, :].float() / temps
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = (filter_top_k_top_p(scaled, top_k, top_p) if filtering else scaled).softmax(dim=-1)
        uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
        tokens = torch.where(greedy, scaled.argmax(dim=-1), sample_inverse_cdf(probs, uniforms))
        token_lp = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        for i, (tok, lp) in enumerate(zip(tokens.tolist(), token_lp.tolist())):
            if done[i]:
                continue
            outputs[i][0].append(tok)
            outputs[i][1].append(lp)
            if tok in stops[i] or len(outputs[i][0]) >= specs[i].max_tokens:
                done[i] = True
        if all(done):
            break
        feed = torch.where(torch.tensor(done, device=device), pad_token_id, tokens).unsqueeze(1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
        out = model(input_ids=feed, attention_mask=attention_mask, position_ids=next_pos,
                    past_key_values=out.past_key_values, use_cache=True)  # fmt: skip
        next_pos = next_pos + 1
    return outputs[:bsz]
