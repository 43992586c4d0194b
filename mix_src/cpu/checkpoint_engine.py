"""``cpu_gloo``: a verl checkpoint engine for the CPU backend, so ``trainer.v1.trainer_mode=separate_async`` trains.

verl's separate-async trainer pushes weights to its rollout pool through a checkpoint engine
(``verl/trainer/ppo/v1/trainer_separate_async.py``: ``_setup``, ``on_init_end`` / ``on_step_end``) and refuses
``naive`` (67-69). The topology of verl's ``nccl`` engine (``verl/checkpoint_engine/nccl_checkpoint_engine.py``,
single sender) over a gloo group, rebuilt on every sync (how and why: mix_src/cpu/README.md). Select it with
``actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo``; ``engine_kwargs.cpu_gloo.timeout_s``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import AsyncGenerator, Generator, Optional

import ray
import torch
import torch.distributed as dist

from verl.checkpoint_engine.base import (CheckpointEngine, CheckpointEngineRegistry, TensorMeta, merge_weight_chunks,
                                         split_weight_chunks)

from . import CHECKPOINT_ENGINE as BACKEND  # declared in mix_src.cpu, which imports this module with its versions

logger = logging.getLogger(__name__)  # its level: mix_src.cpu's (VERL_LOGGING_LEVEL)
_ALIGN = 16  # byte alignment of every tensor in a bucket, so ``.view(dtype)`` of a received chunk is always legal


@dataclass
class MasterAddress:
    """Where actor rank 0's ``TCPStore`` listens."""

    host: str
    port: int


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    """Broadcast the actor's weights to the rollout pool over a gloo group (see the module docstring).

    ``bucket_size``: most bytes per broadcast (``update_weights_bucket_megabytes``; a bucket is allocated at the
    size it needs); ``is_master``: actor rank 0; ``timeout_s``: how long a rank waits for the others."""

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

        def kwargs(ranks: list[int]) -> dict:
            return {"rank": ranks, "world_size": [world_size] * len(ranks), "master": [master] * len(ranks)}

        # the other actor ranks only walk their generator
        return kwargs([0] + [-1] * (actor_wg_world_size - 1)), kwargs(list(range(1, world_size)))

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
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: Optional[int] = None) -> dict:
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
            offset = -(-(offset + meta.chunk_size) // _ALIGN) * _ALIGN
            n_bytes += meta.chunk_size
            n_tensors += int(meta.chunk_offset == 0)
        await self._flush(index, metas, chunks, offset, is_last=True)
        acks = await asyncio.to_thread(self._wait_for_acks)
        for rank, ack in acks.items():
            if ack != (n_tensors, n_bytes):
                raise RuntimeError(f"cpu_gloo checkpoint engine: rollout rank {rank} took {ack[0]} tensors / {ack[1]} "
                                   f"bytes, sent {n_tensors} / {n_bytes}")
        seconds = time.perf_counter() - start
        logger.info("cpu_gloo checkpoint engine: sent %d tensors (%.2f MiB) in %d buckets to %d rollout ranks in %.2f s",
                    n_tensors, n_bytes / 2**20, index + 1, len(acks), seconds)  # fmt: skip
        metrics = {"payload_mbytes": n_bytes / 2**20, "tensors": n_tensors, "buckets": index + 1,
                   "receivers": len(acks), "seconds": seconds}  # fmt: skip
        return {f"checkpoint_engine/{k}": float(v) for k, v in metrics.items()}

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


# ``cpu_gloo`` is GlooCheckpointEngine in verl's registry as the package exports it (a registry that moved fails
# loudly); at the end of this module's body, so importing it registers and checks, in either import order.
_registered = importlib.import_module("verl.checkpoint_engine").CheckpointEngineRegistry.get(BACKEND)
if _registered is not GlooCheckpointEngine:
    raise RuntimeError(f"checkpoint engine {BACKEND!r} is registered as {_registered}, not mix_src's")
