"""``cpu_gloo``: a verl checkpoint engine for the CPU backend, so ``trainer.v1.trainer_mode=separate_async`` trains.

Why it is needed. verl's separate-async trainer pushes the actor's weights to its standalone rollout pool through
a checkpoint engine (``verl/trainer/ppo/v1/trainer_separate_async.py``: ``CheckpointEngineManager`` in ``_setup``,
``update_weights`` in ``on_init_end`` / ``on_step_end``) and refuses the in-process ``naive`` engine (67-69). Each of
verl 0.9.1's other engines needs an accelerator or RDMA: ``nccl`` (cupy, CUDA buffers), ``hccl`` (Ascend), ``nixl``,
``mooncake``, ``kimi`` (RDMA transfer engines).

What it does. The topology of verl's ``nccl`` engine (``verl/checkpoint_engine/nccl_checkpoint_engine.py``, single
sender): actor rank 0 is rank 0 of a new group, the rollout pool's ``CheckpointEngineWorker``\\s are ranks 1..R, and
each bucket of weights is one broadcast from rank 0. The collective is a torch ``ProcessGroupGloo`` (CPU tensors,
TCP, any number of nodes) built on a ``TCPStore`` that actor rank 0 opens in ``prepare`` (a free port chosen by the
OS, handed to the others through ``build_topology``); the store also carries each bucket's metadata (where verl's
nccl engine uses a ZeroMQ PUB socket). Why gloo over torch.distributed rather than the Ray object store: verl's
``CheckpointEngine`` interface is that of a collective group (``prepare`` -> metadata, ``build_topology`` on the
driver -> per-rank kwargs, ``init_process_group``, then ``send_weights`` / ``receive_weights`` running concurrently
in the two worker groups), which gloo fills one to one, with no extra rendezvous actor; it is the stack torch and
verl already use on this backend (the FSDP workers' own group is gloo).

Every sync builds the group and ``finalize`` tears it down (``CheckpointEngineManager.update_weights`` calls
``prepare`` / ``init_process_group`` / ``finalize`` on every sync; the rollout worker group is rebuilt each time).
Each receiver acknowledges through the store how many tensors and bytes it took; the sender checks them against
what it sent (a mismatch raises) and returns ``checkpoint_engine/*`` metrics, which verl logs with the next step.

Registered like verl's own engines (``@CheckpointEngineRegistry.register``), when the CPU backend's hook on
``verl.checkpoint_engine`` imports this module (:func:`mix_src.cpu.activate`). Select it with
``actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo``; options through
``checkpoint_engine.engine_kwargs.cpu_gloo`` (``timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import AsyncGenerator, Generator, Optional

import ray
import torch
import torch.distributed as dist

from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

# the engine's name, and the versions it was written for (verl's CheckpointEngine interface, torch's gloo/TCPStore
# API): declared in mix_src.cpu, which imports this module lazily and the entry point reads the name from
from . import CHECKPOINT_ENGINE as BACKEND  # noqa: E402
from . import CHECKPOINT_ENGINE_WRITTEN_FOR as WRITTEN_FOR  # noqa: E402,F401

_ALIGN = 16  # byte alignment of every tensor in a bucket, so ``.view(dtype)`` of a received chunk is always legal


@dataclass
class MasterAddress:
    """Where actor rank 0's ``TCPStore`` listens."""

    host: str
    port: int


def _round_up(n: int, k: int = _ALIGN) -> int:
    return -(-n // k) * k


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    """Broadcast the actor's weights to the rollout pool over a gloo group (see the module docstring).

    Args:
        bucket_size: bytes per broadcast (``checkpoint_engine.update_weights_bucket_megabytes``); a bucket is
            allocated at the size it needs, not at this size.
        is_master: actor rank 0 (verl passes it to the actor side's engine).
        timeout_s: how long a rank waits for the others (store connection, rendezvous, a broadcast).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = timedelta(seconds=float(timeout_s))
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self._store: Optional[dist.Store] = None
        self._group = None

    # ------------------------------------------------------------------ group lifecycle (one per sync)
    def prepare(self) -> dict:
        if not self.is_master:
            return {"master": None}
        host = ray.util.get_node_ip_address().strip("[]")
        # port 0: the OS picks a free port (no race between choosing and binding it)
        self._store = dist.TCPStore(host, 0, None, True, self.timeout, wait_for_workers=False)
        return {"master": MasterAddress(host=host, port=int(self._store.port))}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        master = metadata[0]["master"]
        if master is None:
            raise RuntimeError("cpu_gloo checkpoint engine: actor rank 0 did not open the store (is_master unset)")
        world_size = 1 + rollout_world_size
        actor_kwargs = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),  # the other actor ranks only walk their generator
            "world_size": [world_size] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
        }
        rollout_kwargs = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master": [master] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master: MasterAddress):
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        if rank > 0:
            self._store = dist.TCPStore(master.host, master.port, None, False, self.timeout)
        # blocks until all world_size ranks have joined (the manager calls every rank concurrently)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self._store), rank, world_size, self.timeout)
        logger.info("cpu_gloo checkpoint engine: rank %d of %d joined %s:%d", rank, world_size, master.host, master.port)

    def finalize(self):
        self._group = None
        self._store = None  # the master's store server closes with it
        self.rank = self.world_size = None

    # ------------------------------------------------------------------ transfer
    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self._group.broadcast([tensor], opts).wait()

    async def _flush(self, index: int, metas: dict, chunks: list, length: int, is_last: bool) -> None:
        bucket = torch.zeros(length, dtype=torch.uint8)
        for meta, chunk in zip(metas.values(), chunks, strict=True):
            bucket[meta.offset : meta.offset + meta.chunk_size] = chunk
        self._store.set(f"bucket/{index}", pickle.dumps({"bucket_meta": metas, "is_last": is_last, "length": length}))
        await asyncio.to_thread(self._broadcast, bucket)

    @torch.no_grad()
    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: Optional[int] = None
    ) -> dict:
        if self.rank is None:
            raise RuntimeError("cpu_gloo checkpoint engine: send_weights before init_process_group")
        if self.rank < 0:  # producing each weight is collective over the actor group: every rank walks it
            for _name, _weight in weights:
                pass
            return {}
        assert self.rank == 0, "rollout workers do not send weights"
        start = time.perf_counter()
        index, offset, n_tensors, n_bytes = 0, 0, 0, 0
        metas: dict[str, TensorMeta] = {}
        chunks: list[torch.Tensor] = []
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if metas and offset + meta.chunk_size > self.bucket_size:
                await self._flush(index, metas, chunks, offset, is_last=False)
                index, offset, metas, chunks = index + 1, 0, {}, []
            meta.offset = offset
            metas[meta.name] = meta
            chunks.append(chunk.detach().to("cpu", copy=True))
            offset = _round_up(offset + meta.chunk_size)
            n_bytes += meta.chunk_size
            n_tensors += int(meta.chunk_offset == 0)
        await self._flush(index, metas, chunks, offset, is_last=True)
        acks = await asyncio.to_thread(self._wait_for_acks)
        for rank, ack in acks.items():
            if ack != (n_tensors, n_bytes):
                raise RuntimeError(
                    f"cpu_gloo checkpoint engine: rollout rank {rank} took {ack[0]} tensors / {ack[1]} bytes, "
                    f"sent {n_tensors} / {n_bytes}"
                )
        seconds = time.perf_counter() - start
        logger.info("cpu_gloo checkpoint engine: sent %d tensors (%.2f MiB) in %d buckets to %d rollout ranks in %.2f s",
                    n_tensors, n_bytes / 2**20, index + 1, len(acks), seconds)  # fmt: skip
        return {
            "checkpoint_engine/payload_mbytes": n_bytes / 2**20,
            "checkpoint_engine/tensors": float(n_tensors),
            "checkpoint_engine/buckets": float(index + 1),
            "checkpoint_engine/receivers": float(len(acks)),
            "checkpoint_engine/seconds": seconds,
        }

    def _wait_for_acks(self) -> dict[int, tuple[int, int]]:
        keys = [f"ack/{rank}" for rank in range(1, self.world_size)]
        self._store.wait(keys, self.timeout)
        return {int(k.split("/")[1]): pickle.loads(self._store.get(k)) for k in keys}

    @torch.no_grad()
    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        async for name, weight in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, weight

    async def _receive_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        if self.rank is None or self.rank < 1:
            raise RuntimeError(f"cpu_gloo checkpoint engine: receive_weights on rank {self.rank} (rollout ranks are >= 1)")
        index, n_tensors, n_bytes = 0, 0, 0
        while True:
            header = pickle.loads(await asyncio.to_thread(self._store.get, f"bucket/{index}"))
            bucket = torch.empty(header["length"], dtype=torch.uint8)  # fresh per bucket: yielded views stay valid
            await asyncio.to_thread(self._broadcast, bucket)
            for meta in header["bucket_meta"].values():
                n_bytes += meta.chunk_size
                n_tensors += int(meta.chunk_offset == 0)
                yield meta, bucket[meta.offset : meta.offset + meta.chunk_size]
            if header["is_last"]:
                break
            index += 1
        self._store.set(f"ack/{self.rank}", pickle.dumps((n_tensors, n_bytes)))


def check_registered() -> None:
    """``cpu_gloo`` is ``GlooCheckpointEngine`` in verl's registry (``verl.checkpoint_engine``, the package where verl
    registers its engines), so a registry that moved fails loudly. Run at the end of this module's body: importing
    the module (the CPU backend's hook on ``verl.checkpoint_engine``) registers and checks, in either import order."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    registered = CheckpointEngineRegistry.get(BACKEND)
    if registered is not GlooCheckpointEngine:
        raise RuntimeError(f"checkpoint engine {BACKEND!r} is registered as {registered}, not mix_src's")


check_registered()
