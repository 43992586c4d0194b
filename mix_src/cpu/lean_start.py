"""CPU-backend start-up trims, installed by :func:`mix_src.cpu.activate`; what a run computes is unchanged.

* ``defer_reward_workers``: verl's ``RewardLoopManager._init_reward_loop_workers`` (``verl/experimental/
  reward_loop/reward_loop.py:324``) starts its ``RewardLoopWorker`` actors at once, but under the MIX agent-loop
  manager a rule reward runs in the agent-loop worker (mix_src/rollout/agent_loop_worker.py ``in_process_reward``)
  and that process (about 8 s of CPU a run: torch and verl imported) sat idle. There each handle becomes a
  :class:`DeferredActor`, started only if called; other runs start them as verl does.
* ``RAY_prestart_worker_first_driver=0`` (unless set): the raylet's prestarted workers sat idle (``ray::IDLE``,
  two or three a run, about 1.5 s of CPU each); verl's actors start their own.
"""

from __future__ import annotations

import os
from types import SimpleNamespace


class DeferredActor:
    """``ray.remote(actor_class).options(**options).remote(*args)``, made at the first method lookup
    (``handle.method.remote(...)``) with ``get_if_exists`` (options name the actor); picklable like a handle."""

    def __init__(self, actor_class, options: dict, args: tuple):
        self._start, self._handle = (actor_class, options, args), None

    def __getattr__(self, name):
        if name.startswith("_"):  # pickle's and copy's probes; the handle's methods have public names
            raise AttributeError(name)
        if self._handle is None:
            import ray

            actor_class, options, args = self._start
            self._handle = ray.remote(actor_class).options(**options, get_if_exists=True).remote(*args)
        return getattr(self._handle, name)


def defer_reward_workers(mod) -> None:
    from . import replace

    original = mod.RewardLoopManager._init_reward_loop_workers

    def _init_reward_loop_workers(self):
        from mix_src.rollout.agent_loop_worker import MANAGER_FQN, in_process_reward

        manager = self.config.actor_rollout_ref.rollout.agent.get("agent_loop_manager_class")
        if manager == MANAGER_FQN and in_process_reward(self.config):
            # verl's body calls self.reward_loop_workers_class.options(name=..., scheduling_strategy=...).remote(...)
            self.reward_loop_workers_class = SimpleNamespace(options=lambda **options: SimpleNamespace(
                remote=lambda *args: DeferredActor(mod.RewardLoopWorker, options, args)))
        original(self)

    replace(mod.RewardLoopManager, "_init_reward_loop_workers", _init_reward_loop_workers)


def install() -> None:
    from . import VERL_0_9_1, after_import

    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # read by the raylet this process may start
    after_import("verl.experimental.reward_loop.reward_loop", defer_reward_workers, written_for=VERL_0_9_1,
                 required_in=())  # fmt: skip
