"""verl's agent-loop worker without two per-row costs, for the MIX trainer's rollouts.

:class:`MixAgentLoopManager` is verl's ``AgentLoopManager`` whose worker processes run
:class:`MixAgentLoopWorker`; :class:`~mix_src.trainer.legacy.MIXRayPPOTrainer` selects it through verl's own
option ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` when that is unset (a manager set there
is kept). verl's worker code runs unchanged except for:

* **one agent-loop instance per worker** for loop classes that declare ``reusable = True`` (our
  ``prefix_guided``: ``run()`` keeps no per-row state on ``self``). verl builds a fresh instance for every
  row with ``hydra.utils.instantiate`` (``agent_loop.py`` ``_run_agent_loop``), which deep-copies and merges
  its keyword arguments into an OmegaConf node: 1.5-4 ms a row, ~0.5 s of a 256-row toy step on 2 cores.
  Other loops (verl's tool agent loop keeps per-row state) are still built per row by verl.
* **rule rewards in the worker process** when the CPU backend is active (:func:`mix_src.cpu.is_active`) and
  no reward model is enabled: verl sends every row to a ``RewardLoopWorker`` actor with one Ray call (a
  pickled ``DataProto`` each way, ~1/3 of the agent-loop worker's time on the toy step). Here the same
  ``RewardLoopWorker`` class runs in this process and verl's ``_compute_score`` calls it through a
  handle-shaped wrapper: same inputs, same reward manager, no serialisation. On an accelerator host verl's
  separate reward processes are kept (they spread a slow reward function over processes). Each call gets its
  own copy of the row (:func:`copy_row`: tensors cloned, the rest deep-copied, no ``torch.save`` round trip).
* **no load-balancer round trips with one rollout server** on the CPU backend: verl's server client makes
  an awaited Ray call to its ``GlobalRequestLoadBalancer`` actor before every request and a second one
  after it (``llm_server.py`` ``_acquire_server``/``_release_server``). With a single registered server
  the answer is always that server, so :func:`pin_single_server` asks once and skips both calls (the
  balancer's in-flight counts then stay 0; verl's legacy trainer does not read them).
"""

from __future__ import annotations

import copy
from typing import Any

import hydra
import ray

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopManager,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.utils.rollout_trace import rollout_trace_attr

MANAGER_FQN = "mix_src.rollout.agent_loop_worker.MixAgentLoopManager"


class _LocalMethod:
    """``handle.method.remote(*args)`` of a Ray actor, for an object in this process: returns the method's
    coroutine, which verl awaits as it awaits an ObjectRef."""

    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


class InProcessRewardWorker:
    """A ``RewardLoopWorker`` in this process, called like its Ray actor handle (``compute_score.remote``).

    Each call gets its own deep copy of the row's ``DataProto``, as the Ray hop gave the actor: verl's reward
    managers mutate it (``naive.py`` ``run_single``: ``extra_info.update(...)``), and the row's ``extra_info``
    dict is shared by the n samples of its prompt (and with the worker's batch) until it is copied."""

    def __init__(self, worker):
        self.worker = worker
        self.compute_score = _LocalMethod(lambda data: worker.compute_score(copy_row(data)))


def copy_row(data):
    """A copy of a reward call's ``DataProto`` sharing nothing with it: tensors cloned, non-tensor fields and
    meta info deep-copied. ``copy.deepcopy(data)`` gives the same but goes through ``DataProto.__getstate__``,
    which ``torch.save``-s the TensorDict and loads it back: 1.2 ms a toy-step reward row vs 0.07 ms here, 256
    rows a step (measured on the shared 2-core machine, 1 thread; 3.6-6.7 ms a row there under load)."""
    from verl import DataProto

    if type(data) is not DataProto:
        return copy.deepcopy(data)
    non_tensor_batch, meta_info = copy.deepcopy((data.non_tensor_batch, data.meta_info))  # one memo, as deepcopy
    return DataProto(batch=None if data.batch is None else data.batch.clone(), non_tensor_batch=non_tensor_batch,
                     meta_info=meta_info)  # fmt: skip


def cpu_backend_active() -> bool:
    from mix_src import cpu

    return cpu.is_active()


def in_process_reward(config) -> bool:
    """Rule rewards (no reward model) on the CPU backend: computed in the agent-loop worker."""
    return cpu_backend_active() and not config.reward.reward_model.enable


def pin_single_server(client, get=ray.get) -> bool:
    """Route ``client``'s requests straight to the rollout server when its load balancer has exactly one
    (verl's ``GlobalRequestLoadBalancer``: ``get_status``); returns whether it did. Other balancers, or
    several servers, keep verl's per-request routing."""
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
    """verl's ``AgentLoopWorker`` with reusable agent loops and, on the CPU backend, in-process rule rewards
    and no load-balancer calls for a single rollout server."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._reused_loops: dict[str, Any] = {}
        if self.reward_loop_worker_handles and in_process_reward(config):
            from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

            self.reward_loop_worker_handles = [InProcessRewardWorker(RewardLoopWorker(config))]
        if cpu_backend_active():
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
                config=agent_loop_config,
                trainer_config=DictConfigWrap(config=self.config),
                server_manager=self.llm_client,
                tokenizer=self.tokenizer,
                processor=self.processor,
                hf_model_type=self.hf_model_type,
                dataset_cls=self.dataset_cls,
                data_config=DictConfigWrap(self.config.data),
                tools=ToolListWrap(self.tools),
            )
        self._reused_loops[agent_name] = loop
        return loop

    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name: str, trace: bool = True, **kwargs):
        agent_loop = self._reusable_loop(agent_name)
        if agent_loop is None:
            return await super()._run_agent_loop(sampling_params, trajectory, agent_name=agent_name, trace=trace,
                                                 **kwargs)  # fmt: skip
        # verl's _run_agent_loop with the instance reused
        with rollout_trace_attr(
            step=trajectory["step"],
            sample_index=trajectory["sample_index"],
            rollout_n=trajectory["rollout_n"],
            validate=trajectory["validate"],
            name="agent_loop",
            trace=trace,
        ):
            output = await agent_loop.run(sampling_params, **kwargs)
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)


class MixAgentLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` with :class:`MixAgentLoopWorker` worker processes."""

    def __init__(self, *args, **kwargs):
        self.agent_loop_workers_class = ray.remote(MixAgentLoopWorker)
        super().__init__(*args, **kwargs)
