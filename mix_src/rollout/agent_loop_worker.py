"""verl's agent-loop worker without per-row costs (why, and measured: scripts/bench/README.md):
:class:`MixAgentLoopManager` (workers :class:`MixAgentLoopWorker`), set by
:class:`~mix_src.trainer.legacy.MIXRayPPOTrainer` as ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
when unset. verl's worker code runs unchanged but for one instance of a ``reusable = True`` loop per worker (verl:
one per row, ``agent_loop.py`` ``_run_agent_loop``) and, on the CPU backend, rule rewards in this process when no
reward model runs (:class:`InProcessRewardWorker`, instead of one Ray call per row) and no load-balancer round
trips with one rollout server (:func:`pin_single_server`; verl's ``llm_server.py`` ``_acquire_server``/
``_release_server`` before and after every request).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import hydra
import ray

from verl.experimental.agent_loop.agent_loop import (AgentLoopManager, AgentLoopWorker, DictConfigWrap, ToolListWrap,
                                                     _agent_loop_registry)  # fmt: skip
from verl.utils.rollout_trace import rollout_trace_attr

MANAGER_FQN = "mix_src.rollout.agent_loop_worker.MixAgentLoopManager"


class InProcessRewardWorker:
    """A ``RewardLoopWorker`` in this process, called like its Ray actor handle (``compute_score.remote``), each call
    on its own copy of the row as after the Ray hop: verl's reward managers mutate it (``naive.py`` ``run_single``:
    ``extra_info.update(...)``), and ``extra_info`` is shared by a prompt's samples."""

    def __init__(self, worker):
        # handle.compute_score.remote(data): the coroutine, which verl awaits as it awaits an ObjectRef
        self.compute_score = SimpleNamespace(remote=lambda data: worker.compute_score(copy_row(data)))


def copy_row(data):
    """A copy of a reward call's ``DataProto`` sharing nothing with it: tensors cloned, the rest deep-copied
    (``copy.deepcopy(data)`` is the same but round-trips the TensorDict through ``torch.save``, slower per row:
    scripts/bench/README.md)."""
    from verl import DataProto

    if type(data) is not DataProto:
        return copy.deepcopy(data)
    non_tensor_batch, meta_info = copy.deepcopy((data.non_tensor_batch, data.meta_info))  # one memo, as deepcopy
    return DataProto(batch=None if data.batch is None else data.batch.clone(), non_tensor_batch=non_tensor_batch,
                     meta_info=meta_info)  # fmt: skip


def in_process_reward(config) -> bool:
    """Rule rewards (no reward model) on the CPU backend: computed in the agent-loop worker."""
    from mix_src import cpu

    return cpu.is_active() and not config.reward.reward_model.enable


def pin_single_server(client, get=ray.get) -> bool:
    """Route ``client``'s requests straight to the rollout server when its load balancer (verl's
    ``GlobalRequestLoadBalancer``) has exactly one; returns whether it did."""
    balancer = getattr(client, "_load_balancer", None)
    try:
        status = get(balancer.get_status.remote())
        if len(status["registered_handles"]) != 1:
            return False
        server_id, handle = get(balancer.acquire_server.remote(request_id=f"mix-pin-{id(client)}"))
        balancer.release_server.remote(server_id=server_id)
    except Exception:  # not verl's balancer: leave the client as it is
        return False

    async def acquire(request_id, **extra):
        return server_id, handle

    from mix_src.compat import checked

    checked("agent_loop.pin_server")
    client._acquire_server = acquire
    client._release_server = lambda server_id, request_id=None: None
    return True


class MixAgentLoopWorker(AgentLoopWorker):
    """verl's ``AgentLoopWorker`` with the changes the module docstring lists."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._reused_loops: dict[str, Any] = {}
        if self.reward_loop_worker_handles and in_process_reward(config):
            from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

            self.reward_loop_worker_handles = [InProcessRewardWorker(RewardLoopWorker(config))]
        from mix_src import cpu

        if cpu.is_active():
            pin_single_server(self.llm_client)

    def _reusable_loop(self, agent_name: str):
        """The worker's one instance of ``agent_name``'s loop if its class is reusable, else None."""
        if agent_name in self._reused_loops:
            return self._reused_loops[agent_name]
        loop = None
        agent_loop_config = _agent_loop_registry.get(agent_name)
        target = agent_loop_config.get("_target_") if agent_loop_config is not None else None
        if target is not None and getattr(hydra.utils.get_class(target), "reusable", False):
            # the same construction as verl's _run_agent_loop, once
            loop = hydra.utils.instantiate(
                config=agent_loop_config, trainer_config=DictConfigWrap(config=self.config),
                server_manager=self.llm_client, tokenizer=self.tokenizer, processor=self.processor,
                hf_model_type=self.hf_model_type, dataset_cls=self.dataset_cls,
                data_config=DictConfigWrap(self.config.data), tools=ToolListWrap(self.tools))  # fmt: skip
        self._reused_loops[agent_name] = loop
        return loop

    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name: str, trace: bool = True, **kwargs):
        agent_loop = self._reusable_loop(agent_name)
        if agent_loop is None:
            return await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name, trace=trace,
                                                 **kwargs)  # fmt: skip
        # verl's _run_agent_loop with the instance reused
        with rollout_trace_attr(step=trajectory["step"], sample_index=trajectory["sample_index"],
                                rollout_n=trajectory["rollout_n"], validate=trajectory["validate"],
                                name="agent_loop", trace=trace):  # fmt: skip
            output = await agent_loop.run(sampling_params, **kwargs)
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)


class MixAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` with :class:`MixAgentLoopWorker` worker processes."""

    def __init__(self, *args, **kwargs):
        self.agent_loop_workers_class = ray.remote(MixAgentLoopWorker)
        super().__init__(*args, **kwargs)
