"""MixAgentLoopWorker (mix_src/rollout/agent_loop_worker.py) without Ray: the worker is made with ``object.__new__`` and
the attributes verl's ``_run_agent_loop`` reads."""

from __future__ import annotations

import asyncio

import pytest
from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry

from mix_src.rollout.agent_loop import PrefixGuidedAgentLoop
from mix_src.rollout.agent_loop_worker import InProcessRewardWorker, MixAgentLoopWorker, in_process_reward, pin_single_server

BUILT: list[str] = []


class _Loop:
    reusable = False

    def __init__(self, **kwargs):
        BUILT.append(type(self).__name__)
        self.server_manager = kwargs["server_manager"]

    async def run(self, sampling_params, **kwargs):
        return {"row": kwargs["row"], "loop": id(self)}


class ReusableLoop(_Loop):
    reusable = True


class PerRowLoop(_Loop):
    pass


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.setitem(_agent_loop_registry, "t_reusable", {"_target_": f"{__name__}.ReusableLoop"})
    monkeypatch.setitem(_agent_loop_registry, "t_per_row", {"_target_": f"{__name__}.PerRowLoop"})
    w = object.__new__(MixAgentLoopWorker)
    w.config = OmegaConf.create({"data": {}})
    w.llm_client, w.tokenizer, w.processor, w.hf_model_type, w.dataset_cls, w.tools = "llm", None, None, None, None, []
    w._reused_loops = {}

    async def postprocess(output, validate, **kwargs):
        return output

    w._agent_loop_postprocess = postprocess
    BUILT.clear()
    return w


def _rows(worker, agent_name, n=3):
    trajectory = {"step": 0, "sample_index": 0, "rollout_n": 0, "validate": False}

    async def go():
        return [await worker._run_agent_loop({}, trajectory, agent_name=agent_name, trace=False, row=i)
                for i in range(n)]  # fmt: skip

    return asyncio.run(go())


def test_a_reusable_loop_is_built_once_per_worker(worker):
    out = _rows(worker, "t_reusable")
    assert [o["row"] for o in out] == [0, 1, 2]
    assert BUILT == ["ReusableLoop"] and len({o["loop"] for o in out}) == 1


def test_other_loops_are_built_per_row_by_verl(worker):
    out = _rows(worker, "t_per_row")
    assert [o["row"] for o in out] == [0, 1, 2] and BUILT == ["PerRowLoop"] * 3


def test_prefix_guided_is_reusable_and_keeps_no_row_state():
    assert PrefixGuidedAgentLoop.reusable and issubclass(MixAgentLoopWorker, AgentLoopWorker)


def test_in_process_reward_answers_like_the_actor_handle(monkeypatch):
    class Rewarder:
        async def compute_score(self, data):
            return {"reward_score": float(data), "reward_extra_info": {}}

    handle = InProcessRewardWorker(Rewarder())
    assert asyncio.run(handle.compute_score.remote(2)) == {"reward_score": 2.0, "reward_extra_info": {}}

    from mix_src import cpu

    rm = {"reward": {"reward_model": {"enable": True}}}
    rule = {"reward": {"reward_model": {"enable": False}}}
    monkeypatch.setattr(cpu, "is_active", lambda: True)
    assert in_process_reward(OmegaConf.create(rule)) and not in_process_reward(OmegaConf.create(rm))
    monkeypatch.setattr(cpu, "is_active", lambda: False)  # an accelerator host keeps verl's reward workers
    assert not in_process_reward(OmegaConf.create(rule))


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakeBalancer:
    """verl's GlobalRequestLoadBalancer surface, answering in-process (get = identity)."""

    def __init__(self, servers):
        self.servers, self.calls = servers, []
        self.get_status = _Method(lambda: {"registered_handles": list(self.servers)})
        self.acquire_server = _Method(lambda request_id: self.calls.append("acquire") or next(iter(self.servers.items())))
        self.release_server = _Method(lambda server_id: self.calls.append("release"))


def test_one_rollout_server_is_pinned_and_the_balancer_left_alone():
    from verl.workers.rollout.llm_server import LLMServerClient

    client = LLMServerClient(OmegaConf.create({}), load_balancer_handle=FakeBalancer({"s0": "handle0"}))
    assert pin_single_server(client, get=lambda x: x)
    calls = list(client._load_balancer.calls)
    assert asyncio.run(client._acquire_server("r1", prompt_ids=[1])) == ("s0", "handle0")
    client._release_server("s0", request_id="r1")
    assert client._load_balancer.calls == calls == ["acquire", "release"]  # nothing per request

    several = LLMServerClient(OmegaConf.create({}), load_balancer_handle=FakeBalancer({"s0": 0, "s1": 1}))
    assert not pin_single_server(several, get=lambda x: x) and "_acquire_server" not in vars(several)
    other = LLMServerClient(OmegaConf.create({}), load_balancer_handle=object())  # not verl's balancer
    assert not pin_single_server(other, get=lambda x: x) and "_acquire_server" not in vars(other)


def test_the_in_process_reward_gets_its_own_copy_of_the_row():
    """verl's naive reward manager updates the row's extra_info in place; over Ray that was the actor's copy."""
    import numpy as np
    import torch

    from verl import DataProto

    class Mutating:
        async def compute_score(self, data):
            data.non_tensor_batch["extra_info"][0].update(seen=True)
            return {"reward_score": 1.0, "reward_extra_info": {}}

    shared = {"answer_type": "numeric"}  # one dict for all samples of a prompt
    data = DataProto.from_dict(tensors={"x": torch.zeros(1, 2)},
                               non_tensors={"extra_info": np.array([shared], dtype=object)})  # fmt: skip
    asyncio.run(InProcessRewardWorker(Mutating()).compute_score.remote(data))
    assert shared == {"answer_type": "numeric"} and data.non_tensor_batch["extra_info"][0] is shared


def test_the_row_copy_does_not_round_trip_through_torch_save(monkeypatch):
    """copy_row copies every tensor and non-tensor field (a mutation in the reward call reaches no other row)
    without DataProto.__getstate__, which torch.save-s the TensorDict: copy.deepcopy(DataProto) took 1.2 ms a
    toy-step row (copy_row: 0.07 ms), the largest per-row cost in the agent-loop worker's profile."""
    import numpy as np
    import torch

    from verl import DataProto
    from verl.protocol import DataProto as _DP

    from mix_src.rollout.agent_loop_worker import copy_row

    shared = {"answer_type": "numeric"}
    data = DataProto.from_dict(tensors={"responses": torch.arange(6).view(1, 6)},
                               non_tensors={"extra_info": np.array([shared], dtype=object),
                                            "tool_extra_fields": np.array([{"mask": np.ones(3)}], dtype=object)},
                               meta_info={"m": [1]})  # fmt: skip
    monkeypatch.setattr(_DP, "__getstate__", lambda self: pytest.fail("torch.save round trip"), raising=False)
    copied = copy_row(data)
    copied.batch["responses"][0, 0] = 99
    copied.non_tensor_batch["extra_info"][0]["seen"] = True
    copied.non_tensor_batch["tool_extra_fields"][0]["mask"][0] = 0
    copied.meta_info["m"].append(2)
    assert data.batch["responses"].tolist() == [[0, 1, 2, 3, 4, 5]] and shared == {"answer_type": "numeric"}
    assert data.non_tensor_batch["tool_extra_fields"][0]["mask"].tolist() == [1, 1, 1] and data.meta_info == {"m": [1]}
    assert copy_row(3) == 3  # anything else: copy.deepcopy
