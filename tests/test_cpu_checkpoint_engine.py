"""The ``cpu_gloo`` checkpoint engine (mix_src/cpu/checkpoint_engine.py), driven as verl's CheckpointEngineManager
drives it (prepare -> build_topology -> init_process_group -> send/receive concurrently -> finalize), with the
ranks in threads of this process instead of Ray actors. The Ray run is in tests/test_mix_trainer_v1.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import mix_src.cpu  # noqa: F401  (activates the backend under VERL_PLATFORM=cpu)


def _run_threads(fns):
    out, errors = [None] * len(fns), []

    def call(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def _weights():
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 7, generator=g),  # 1400 bytes: chunked over several 512-byte buckets
        "odd.bf16": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: the next tensor must stay aligned
        "norm.weight": torch.randn(5, generator=g),
        "ids": torch.arange(9, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
    }


def _sync(engine_cls, weights, n_actor=2, n_rollout=2, bucket_size=512):
    actors = [engine_cls(bucket_size=bucket_size, is_master=(r == 0), timeout_s=60) for r in range(n_actor)]
    rollouts = [engine_cls(bucket_size=bucket_size, timeout_s=60) for _ in range(n_rollout)]
    metadata = [e.prepare() for e in actors + rollouts]
    actor_kw, rollout_kw = engine_cls.build_topology(n_actor, n_rollout, metadata)
    engines = actors + rollouts
    kwargs = [{k: v[i] for k, v in actor_kw.items()} for i in range(n_actor)]
    kwargs += [{k: v[i] for k, v in rollout_kw.items()} for i in range(n_rollout)]
    _run_threads([lambda e=e, kw=kw: e.init_process_group(**kw) for e, kw in zip(engines, kwargs, strict=True)])

    async def receive(engine):
        return {name: tensor.clone() async for name, tensor in engine.receive_weights(global_steps=3)}

    sends = [lambda e=e: asyncio.run(e.send_weights(iter(weights.items()), global_steps=3)) for e in actors]
    receives = [lambda e=e: asyncio.run(receive(e)) for e in rollouts]
    results = _run_threads(sends + receives)
    for e in engines:
        e.finalize()
    return results[:n_actor], results[n_actor:]


def test_cpu_gloo_is_registered_like_verls_engines():
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from mix_src.cpu.checkpoint_engine import BACKEND, GlooCheckpointEngine

    assert mix_src.cpu.is_active()
    assert CheckpointEngineRegistry.get(BACKEND) is GlooCheckpointEngine
    hook = [p for p in mix_src.cpu.PATCHES if p.module == "verl.checkpoint_engine"]
    assert len(hook) == 1 and hook[0].fired and hook[0].required_in == ("trainer", "worker")


def test_cpu_gloo_broadcasts_every_weight_bit_exact_to_every_rollout_rank():
    from mix_src.cpu.checkpoint_engine import GlooCheckpointEngine

    weights = _weights()
    (master_metrics, other_actor), received = _sync(GlooCheckpointEngine, weights)
    assert other_actor == {}  # actor rank 1 only walked its generator
    assert master_metrics["checkpoint_engine/tensors"] == len(weights)
    assert master_metrics["checkpoint_engine/receivers"] == 2
    assert master_metrics["checkpoint_engine/buckets"] >= 3  # the 1400-byte tensor spans buckets
    assert master_metrics["checkpoint_engine/payload_mbytes"] * 2**20 == sum(w.nbytes for w in weights.values())
    for got in received:
        assert list(got) == list(weights)
        for name, w in weights.items():
            assert got[name].dtype == w.dtype and got[name].shape == w.shape
            assert torch.equal(got[name], w), name


def test_a_second_sync_builds_a_fresh_group():
    from mix_src.cpu.checkpoint_engine import GlooCheckpointEngine

    for scale in (1.0, -3.0):
        weights = {k: v * scale if v.is_floating_point() else v for k, v in _weights().items()}
        _, received = _sync(GlooCheckpointEngine, weights, n_actor=1, n_rollout=1)
        assert all(torch.equal(received[0][k], v) for k, v in weights.items())


def test_send_before_the_group_exists_is_an_error():
    from mix_src.cpu.checkpoint_engine import GlooCheckpointEngine

    with pytest.raises(RuntimeError, match="before init_process_group"):
        asyncio.run(GlooCheckpointEngine(bucket_size=512, is_master=True).send_weights(iter([])))


@pytest.mark.parametrize("first", ["mix_src.cpu.checkpoint_engine", "verl.checkpoint_engine"])
def test_cpu_gloo_registers_whichever_module_a_process_imports_first(first):
    """A fresh process that imports the engine's module before verl's package ran the backend's hook while the
    module was half done, and failed (circular import); both orders register it now."""
    import subprocess
    import sys

    code = (f"import {first}\nfrom verl.checkpoint_engine import CheckpointEngineRegistry\n"
            "from mix_src.cpu.checkpoint_engine import BACKEND, GlooCheckpointEngine\n"
            "assert CheckpointEngineRegistry.get(BACKEND) is GlooCheckpointEngine")  # fmt: skip
    env = {**__import__("os").environ, "VERL_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
