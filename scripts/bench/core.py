"""Benchmark of the pure LUFFY core: `python -m scripts.bench core [--repeats N]`.

1. grpo_split, vectorised vs a naive per-row loop (the original's algorithm), at 8,192 rows x 1,024
   tokens, n = 8, uid strings as verl passes them, int64 response mask as verl builds it. The floor is
   what any implementation must do: sum the rewards over tokens and write one broadcast rows x tokens
   tensor. Target: vectorised <= 1.5x the floor.
2. The mixed token loss, forward + backward, at 64 x 8,192 tokens (1 row in 8 fully off-policy, as in the
   main LUFFY recipe), vs a plain PPO-clip loss (ratio, clip, max, token-mean) on the same tensors.
   Targets: <= 1.3x in time and in peak memory.

Times are medians over repeats of the CPU time of this thread (torch runs single-threaded here), with
the compared functions interleaved: on a shared machine, wall time mostly measures the other processes.
Peak memory: torch's profiler records every CPU-allocator allocation and free
("[memory]" events, profile_memory=True); the peak of their running sum during one forward + backward is
the largest amount of tensor memory the call held at once beyond its inputs (the log_prob gradient it
creates included). This counts exactly the tensors torch allocates, not the process RSS.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections import defaultdict
from typing import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from mix_src.algo.core_alg import compute_grpo_outcome_advantage_split, compute_token_on_off_policy_loss


def _median_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time in seconds of each function, calls interleaved round-robin (1 warm-up each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.thread_time()
            fn()
            times[name].append(time.thread_time() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated during fn() (allocator events from torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------------------------------------
# 1. grpo_split
# ----------------------------------------------------------------------------------------------------


def naive_grpo_split(token_level_rewards, response_mask, index, on_policy_mask, epsilon=1e-6, use_std=True):
    """The original's algorithm (the original's compute_grpo_outcome_advantage_split) as a per-row Python loop, with the all-off-policy fallback."""
    scores = token_level_rewards.sum(dim=-1)
    on_scores, all_scores = defaultdict(list), defaultdict(list)
    for i in range(scores.shape[0]):
        all_scores[index[i]].append(scores[i])
        if on_policy_mask[i]:
            on_scores[index[i]].append(scores[i])
    mean, std = {}, {}
    for uid, group in all_scores.items():
        s = torch.stack(on_scores[uid] if on_scores[uid] else group)
        if len(s) == 1:
            mean[uid], std[uid] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean[uid], std[uid] = s.mean(), s.std()
            if std[uid] == 0:
                std[uid] = torch.tensor(1.0)
    adv = scores.clone()
    for i in range(scores.shape[0]):
        adv[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon) if use_std else scores[i] - mean[index[i]]
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def bench_grpo_split(repeats: int, rows: int = 8192, tokens: int = 1024, n: int = 8) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=gen)
    response_mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.int64)  # verl: int64
    rewards = torch.zeros(rows, tokens)
    rewards[torch.arange(rows), lengths - 1] = torch.randint(0, 2, (rows,), generator=gen).float()
    index = np.array([str(uuid.uuid4()) for _ in range(rows // n)], dtype=object).repeat(n)
    on_policy = torch.ones(rows, dtype=torch.bool)
    on_policy[::n] = False  # n_prefix = 1: sample 0 of every group is the demonstration

    def vectorised():
        return compute_grpo_outcome_advantage_split(rewards, response_mask, index, on_policy)

    def floor():
        scores = rewards.sum(dim=-1)
        return scores[:, None].expand(rows, tokens).contiguous()

    def loop():
        return naive_grpo_split(rewards, response_mask, index, on_policy)

    assert torch.allclose(vectorised()[0], loop()[0], atol=1e-5), "vectorised and loop disagree"
    fast = _median_times({"vectorised": vectorised, "floor": floor}, repeats)
    slow = _median_times({"loop": loop}, max(3, repeats // 3))
    print(f"grpo_split  {rows} rows x {tokens} tokens, n={n}, uid strings, int64 response_mask")
    print(f"  floor (sum rewards + write rows x tokens) {fast['floor'] * 1e3:9.2f} ms")
    print(f"  vectorised grpo_split                     {fast['vectorised'] * 1e3:9.2f} ms"
          f"   ratio to floor {fast['vectorised'] / fast['floor']:.2f}x (target <= 1.5x)")  # fmt: skip
    print(f"  naive per-row loop                        {slow['loop'] * 1e3:9.2f} ms"
          f"   ratio to floor {slow['loop'] / fast['floor']:.2f}x, {slow['loop'] / fast['vectorised']:.1f}x slower"
          " than vectorised")  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# 2. token loss
# ----------------------------------------------------------------------------------------------------


def plain_ppo_clip_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=0.2):
    """Textbook PPO-clip, token-mean: the baseline (no metrics)."""
    ratio = torch.exp(log_prob - old_log_prob)
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange))
    mask = response_mask.bool()
    return torch.where(mask, losses, 0.0).sum() / torch.count_nonzero(mask)


def bench_token_loss(repeats: int, rows: int = 64, tokens: int = 8192, n: int = 8) -> None:
    gen = torch.Generator().manual_seed(0)
    log_prob = (-torch.rand(rows, tokens, generator=gen) * 3).requires_grad_()
    old_log_prob = log_prob.detach() + 0.05 * torch.randn(rows, tokens, generator=gen)
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, tokens).contiguous()
    lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=gen)
    response_mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.int64)
    full_demo = torch.zeros(rows, tokens, dtype=torch.bool)
    full_demo[::n] = response_mask[::n].bool()  # 1 row in n is a full demonstration (ratio 1.0)
    partial = (torch.arange(tokens)[None, :] < (0.3 * lengths)[:, None]) & response_mask.bool()
    tensors = (old_log_prob, log_prob, advantages, response_mask)

    configs = {
        "LUFFY main recipe (1 demo row in 8; p_div_p 0.1, no clip, luffy-token-sum-norm)": (full_demo, dict(
            off_policy_reshape="p_div_p", off_policy_reshape_gamma=0.1, loss_remove_clip=True,
            loss_agg_mode="luffy-token-sum-norm",
        )),
        "as mix_src.worker.loss runs verl's defaults (1 demo row in 8; clip 0.2, dual clip 3, token-mean)": (
            full_demo, dict(clip_ratio_c=3.0)),
        "worst case: every row a 30% prefix (clip 0.2, dual clip 3, p_div_p, token-mean)": (partial, dict(
            off_policy_reshape="p_div_p", clip_ratio_c=3.0,
        )),
    }  # fmt: skip

    def run(fn):
        def call():
            log_prob.grad = None
            fn().backward()

        return call

    plain = run(lambda: plain_ppo_clip_loss(*tensors))
    print(f"token loss forward+backward  {rows} x {tokens} tokens")
    for name, (prefix_mask, kwargs) in configs.items():
        mixed = run(lambda g=prefix_mask, kw=kwargs: compute_token_on_off_policy_loss(*tensors, g, **kw)["pg_loss"])
        t = _median_times({"mixed": mixed, "plain": plain}, repeats)
        mem_mixed, mem_plain = _peak_bytes(mixed), _peak_bytes(plain)
        print(f"  {name}")
        print(f"    time   mixed {t['mixed'] * 1e3:8.2f} ms   plain PPO-clip {t['plain'] * 1e3:8.2f} ms"
              f"   ratio {t['mixed'] / t['plain']:.2f}x (target <= 1.3x)")  # fmt: skip
        print(f"    peak   mixed {mem_mixed / 2**20:8.2f} MiB  plain PPO-clip {mem_plain / 2**20:8.2f} MiB"
              f"  ratio {mem_mixed / mem_plain:.2f}x (target <= 1.3x)")  # fmt: skip
    print(f"  (one {rows} x {tokens} float32 tensor = {rows * tokens * 4 / 2**20:.2f} MiB)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench core", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per function (median)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # see the docstring: CPU time of one thread is what we compare
    print(__doc__.split("\n\n")[-1].replace("\n", " ").strip())
    bench_grpo_split(args.repeats)
    bench_token_loss(args.repeats)
