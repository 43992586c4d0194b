"""Multi-rank equivalence harness for loss weights: FSDP data-parallel training, simulated exactly on CPU.

What a data-parallel step does to one mini-batch, in verl 0.9.1 and in the official LUFFY-family code alike:

* the driver dispatches the rows to the N ranks in contiguous chunks (``DataProto.chunk``);
* each rank splits its rows into micro-batches, statically (consecutive chunks of a fixed number of rows) or
  dynamically (verl's ``rearrange_micro_batches``, packing by token count), and calls ``loss.backward()`` on
  each (verl: ``FSDPEngine.forward_backward_batch``, verl/workers/engine/fsdp/transformer_impl.py; official:
  ``loss = policy_loss / self.gradient_accumulation; loss.backward()``, e.g. LUFFY
  luffy/verl/verl/mix_src/mix_actor.py:243-244), so a rank's gradient is the sum over its micro-batches;
* FSDP's reduce-scatter averages the ranks' gradients.

So the gradient of a mini-batch on N ranks is  g = (1/N) * sum_r sum_{k on r} d loss(r, k) / d theta,  which
:func:`dp_gradient` computes exactly in one process. A check with real gloo processes (torch.distributed, 2
ranks, DDP's all-reduce average) is ``tests/test_multirank.py::test_simulation_equals_gloo_averaging``.

The batch helpers build what the engine hands the loss (verl's nested no-padding layout, global numbers);
:func:`ours_micro_losses` drives the real worker loss (mix_src.worker.loss.MixPolicyLoss) and
:func:`official_micro_losses` a transcription of an official loss on padded tensors, under the same split.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import rearrange_micro_batches
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

Split = list[list[torch.Tensor]]  # rank -> micro-batches -> global row indices

PADDED_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def rank_rows(rows: int, ranks: int) -> list[torch.Tensor]:
    """The rows each DP rank gets: contiguous equal chunks, as verl's DataProto.chunk dispatch."""
    if rows % ranks:
        raise ValueError(f"{rows} rows do not split into {ranks} equal DP chunks")
    return list(torch.arange(rows).chunk(ranks))


def static_split(rows: int, ranks: int, micro_rows: int) -> Split:
    """Each rank's rows in consecutive micro-batches of ``micro_rows`` rows (use_dynamic_bsz=False)."""
    return [list(r.split(micro_rows)) for r in rank_rows(rows, ranks)]


def dynamic_split(attention_mask: torch.Tensor, ranks: int, max_token_len: int) -> Split:
    """Each rank's rows packed into micro-batches of at most ``max_token_len`` tokens (prompt + response) by
    verl's own rearrange_micro_batches (use_dynamic_bsz=True; no dp_group: each rank packs alone)."""
    out = []
    for rows in rank_rows(len(attention_mask), ranks):
        td = tu.get_tensordict({"attention_mask": attention_mask[rows], "input_ids": attention_mask[rows]})
        _, index_lists = rearrange_micro_batches(td, max_token_len=max_token_len)
        out.append([rows[torch.as_tensor(idx, dtype=torch.long)] for idx in index_lists])
    return out


def verl_balanced_order(attention_mask: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """The rows each DP rank gets after verl 0.9.1's ``RayPPOTrainer._balance_batch`` (trainer.balance_batch, on by
    default): verl's own ``get_seqlen_balanced_partitions`` over ``calculate_workload`` of the row lengths, each
    partition sorted by (workload, row) and zig-zagged, then the contiguous DataProto.chunk dispatch
    (verl/trainer/ppo/ray_trainer.py ``_balance_batch``, as ray_trainer calls it: equal_size=True)."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    workload = calculate_workload(attention_mask.sum(-1)).tolist()
    out = []
    for partition in get_seqlen_balanced_partitions(workload, k_partitions=ranks, equal_size=True):
        partition = sorted(partition, key=lambda x: (workload[x], x))
        out.append(torch.as_tensor(partition[::2] + partition[1::2][::-1], dtype=torch.long))
    return out


def verl_split(attention_mask: torch.Tensor, ranks: int, *, micro_rows: int | None = None,
               max_token_len: int | None = None) -> Split:
    """verl 0.9.1's whole layout of one mini-batch: :func:`verl_balanced_order`, then each rank's micro-batches as its
    engine makes them (verl/workers/engine/utils.py prepare_micro_batches): ``micro_rows`` consecutive rows
    (use_dynamic_bsz=False, tu.chunk_tensordict) or verl's ``rearrange_micro_batches`` up to ``max_token_len`` tokens
    with the ranks' micro-batch count made equal (its all-reduce MAX over the DP group, here min_num_micro_batch)."""
    per_rank = verl_balanced_order(attention_mask, ranks)
    if micro_rows is not None:
        return [list(rows.split(micro_rows)) for rows in per_rank]

    def pack(rows, at_least=None):
        td = tu.get_tensordict({"attention_mask": attention_mask[rows], "input_ids": attention_mask[rows]})
        return rearrange_micro_batches(td, max_token_len=max_token_len, min_num_micro_batch=at_least)[1]

    count = max(len(pack(rows)) for rows in per_rank)
    return [[rows[torch.as_tensor(idx, dtype=torch.long)] for idx in pack(rows, count)] for rows in per_rank]


def group_split(tokens_per_group: Sequence[int], group_rows: Sequence[torch.Tensor], ranks: int,
                max_tokens: int | None, groups_per_micro: int | None = None) -> Split:
    """Whole groups (prompts) to ranks in contiguous chunks, then to micro-batches: ``groups_per_micro`` groups
    each (static) or packed greedily in order up to ``max_tokens`` (dynamic, at least one group each)."""
    groups = list(range(len(group_rows)))
    if len(groups) % ranks:
        raise ValueError(f"{len(groups)} groups do not split into {ranks} equal DP chunks")
    per_rank = len(groups) // ranks
    out = []
    for r in range(ranks):
        mine, micro, cur, used = groups[r * per_rank:(r + 1) * per_rank], [], [], 0
        for g in mine:
            full = (len(cur) == groups_per_micro) if groups_per_micro else (cur and used + tokens_per_group[g] > max_tokens)
            if full:
                micro.append(cur)
                cur, used = [], 0
            cur.append(g)
            used += tokens_per_group[g]
        micro.append(cur)
        out.append([torch.cat([group_rows[g] for g in mb]) for mb in micro])
    return out


def dp_gradient(params: Sequence[torch.nn.Parameter], rank_losses: Sequence[Sequence[Callable[[], torch.Tensor]]]):
    """(1/N) sum_r sum_k d loss_{r,k} / d params: each rank's micro-batch losses backward into a zeroed gradient
    (accumulated, as FSDP does within a rank), then the ranks' gradients averaged. Returns (grads, total loss)."""
    grads, total = [torch.zeros_like(p) for p in params], 0.0
    for losses in rank_losses:
        for p in params:
            p.grad = None
        for loss in losses:
            value = loss()
            value.backward()
            total += value.item() / len(rank_losses)
        for g, p in zip(grads, params):
            if p.grad is not None:
                g += p.grad / len(rank_losses)
    for p in params:
        p.grad = None
    return grads, total


def _select(padded: dict, rows: torch.Tensor) -> dict:
    return {k: v[rows] for k, v in padded.items()}


def engine_micro_batch(padded: dict, rows: torch.Tensor, *, dp_size: int, global_rows: int, global_tokens: int,
                       use_dynamic_bsz: bool, micro_rows: int | None, extra: Sequence[str] = ()) -> "tu.TensorDict":
    """One micro-batch as verl's engine hands it to the loss: nested (no padding) tensors plus the global numbers
    (``global_batch_size`` rows and ``batch_num_tokens`` response tokens over all ranks, ``dp_size``)."""
    sub = _select(padded, rows)
    keys = [*PADDED_KEYS, "advantages", "prefix_mask", "old_log_probs", *extra]
    td = left_right_2_no_padding(tu.get_tensordict({k: sub[k] for k in keys if k in sub}))
    tu.assign_non_tensor(td, global_batch_size=global_rows, batch_num_tokens=global_tokens, dp_size=dp_size,
                         calculate_entropy=True, use_remove_padding=True, use_dynamic_bsz=use_dynamic_bsz)  # fmt: skip
    if micro_rows is not None:
        tu.assign_non_tensor(td, micro_batch_size_per_gpu=micro_rows)
    return td


def ours_micro_losses(loss_fn, model, padded: dict, split: Split, *, use_dynamic_bsz: bool,
                      micro_rows: int | None = None, extra: Sequence[str] = (), drop_entropy: bool = False,
                      dp_size: int | None = None):
    """Per rank, per micro-batch: a closure running the model and the real worker loss ``loss_fn`` (MixPolicyLoss).
    dp_size: the data-parallel size (default: the ranks of ``split``)."""
    dp_size = dp_size or len(split)
    global_rows = len(padded["response_mask"])
    global_tokens = int(padded["response_mask"].sum())

    def closure(rows):
        def run():
            td = engine_micro_batch(padded, rows, dp_size=dp_size, global_rows=global_rows,
                                    global_tokens=global_tokens, use_dynamic_bsz=use_dynamic_bsz,
                                    micro_rows=micro_rows, extra=extra)  # fmt: skip
            out = model(td)
            if drop_entropy:
                out.pop("entropy")
            return loss_fn(model_output=out, data=td)[0]
        return run

    return [[closure(rows) for rows in rank] for rank in split]


def padded_forward(model, sub: dict):
    """(log_prob, entropy), each (rows, response_len) padded, of the model on padded rows ``sub``."""
    td = left_right_2_no_padding(tu.get_tensordict({k: sub[k] for k in PADDED_KEYS}))
    out = model(td)
    return no_padding_2_padding(out["log_probs"], td), no_padding_2_padding(out["entropy"], td)


def official_micro_losses(official, model, padded: dict, split: Split, grad_accum: float = 1.0):
    """Per rank, per micro-batch: ``official(sub, log_prob, entropy) / grad_accum`` on the padded rows ``sub`` of
    the micro-batch (the official actors' ``loss = policy_loss / self.gradient_accumulation``)."""

    def closure(rows):
        def run():
            sub = _select(padded, rows)
            log_prob, entropy = padded_forward(model, sub)
            return official(sub, log_prob, entropy) / grad_accum
        return run

    return [[closure(rows) for rows in rank] for rank in split]


def random_batch(model, seed: int, groups: int, group_size: int, *, vocab: int, prompt: int, response: int,
                 expert_rows: Sequence[int] = (), full_length: bool = False, noise: float = 0.3) -> dict:
    """A padded mini-batch as the trainer has it at update_actor: ``groups`` x ``group_size`` rows (left-padded
    prompts, right-padded responses, row 0 full width), rows ``expert_rows`` of each group whole demonstrations
    (prefix_mask = response_mask), advantages constant per row, old_log_probs = the model's + noise."""
    g = torch.Generator().manual_seed(seed)
    rows = groups * group_size
    prompt_lens = torch.randint(1, prompt + 1, (rows,), generator=g)
    response_lens = torch.full((rows,), response) if full_length else torch.randint(1, response + 1, (rows,), generator=g)
    response_lens[0] = response
    prompt_mask = torch.arange(prompt)[None, :] >= (prompt - prompt_lens)[:, None]
    response_mask = torch.arange(response)[None, :] < response_lens[:, None]
    prompts = torch.randint(1, vocab, (rows, prompt), generator=g) * prompt_mask
    responses = torch.randint(1, vocab, (rows, response), generator=g) * response_mask
    expert = torch.zeros(rows, dtype=torch.bool)
    for j in expert_rows:
        expert[j::group_size] = True
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    padded = dict(
        prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask, position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        response_mask=response_mask.long(), prefix_mask=(response_mask & expert[:, None]).long(),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, response) * response_mask,
    )  # fmt: skip
    with torch.no_grad():
        current, _ = padded_forward(model, padded)
    padded["old_log_probs"] = (current + noise * torch.randn(current.shape, generator=g)) * response_mask
    return padded


def _gloo_rank(rank: int, world: int, init_file: str, model, loss_fn, padded: dict, split: Split, run: dict,
               out_file: str) -> None:
    """One real data-parallel rank (torch.multiprocessing.spawn target): gloo process group, the model wrapped in
    DistributedDataParallel (its gradient all-reduce divides by the world size, as FSDP's reduce-scatter), this
    rank's micro-batches under ``no_sync`` but the last, then the averaged gradient saved by rank 0."""
    import contextlib

    import torch.distributed as dist

    import datetime

    # a stalled peer raises after 2 minutes instead of holding the suite until pytest's timeout
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        losses = ours_micro_losses(loss_fn, ddp, padded, [split[rank]], **run)[0]
        for k, loss in enumerate(losses):
            with ddp.no_sync() if k < len(losses) - 1 else contextlib.nullcontext():
                loss().backward()  # the last one returns after the all-reduce is done on every rank
        if rank == 0:
            torch.save([p.grad.clone() for p in model.parameters()], out_file)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done: leave without the group's teardown and the interpreter's, where a rank once hung for good (futex wait,
    # grad.pt already written) with `make test`'s two pytest workers on 2 cores; exit code 0 is all mp.spawn reads.
    os._exit(0)


def gloo_gradient(model, loss_fn, padded: dict, split: Split, tmp_dir, **run) -> list[torch.Tensor]:
    """The gradient of real gloo processes, one per rank of ``split``; each rank's loss closures see dp_size =
    len(split) as in :func:`ours_micro_losses`."""
    import torch.multiprocessing as mp

    init_file, out_file = str(tmp_dir / "gloo_init"), str(tmp_dir / "grad.pt")
    args = (len(split), init_file, model, loss_fn, padded, split, dict(run, dp_size=len(split)), out_file)
    mp.spawn(_gloo_rank, args=args, nprocs=len(split), join=True)  # fresh processes (fork hangs gloo here)
    return torch.load(out_file)
