"""The prefix-guided agent loop against verl's own single-turn loop and servers (no Ray): priority and
full_determinism reach the server, a lowered ``rollout.max_model_len`` gives a shorter answer instead of
the server's ValueError, and SGLang's one-token-smaller room and empty answers are handled."""

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

TARGET = "<think>1+2=3</think> \\boxed{3}"


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


class StrictServer:
    """verl's vLLM server rules (vllm_async_server.py: ValueError when the prompt leaves no room, max_tokens
    clamped to ``max_model_len - len(prompt)``), or SGLang's (room - 1, an empty answer on a mismatch)."""

    def __init__(self, token_id, max_model_len, sglang=False, empty=False):
        self.calls, self.token_id, self.max_model_len, self.sglang, self.empty = [], token_id, max_model_len, sglang, empty

    async def generate(self, request_id, *, prompt_ids, sampling_params, priority=0, **kw):
        from verl.workers.rollout.replica import TokenOutput

        room = self.max_model_len - len(prompt_ids) - (1 if self.sglang else 0)
        if room < (0 if self.sglang else 1):
            raise ValueError(f"Prompt length ({len(prompt_ids)}) leaves no room (max_model_len {self.max_model_len})")
        assert sampling_params["max_tokens"] <= room, "the agent loop asked for more tokens than fit"
        self.calls.append({"request_id": request_id, "priority": priority, "prompt_len": len(prompt_ids),
                           "max_tokens": sampling_params["max_tokens"]})  # fmt: skip
        if self.empty:  # SGLang on a token/log-prob length mismatch
            return TokenOutput(token_ids=[], log_probs=[])
        k = sampling_params["max_tokens"]
        return TokenOutput(token_ids=[self.token_id] * k, log_probs=[-0.5] * k)


def _loop(tokenizer, server, *, response_length=40, max_model_len=None, name="vllm", full_determinism=False):
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from mix_src.rollout.agent_loop import PrefixGuidedAgentLoop
    from mix_src.trainer.dataset import RLHFDatasetWithTarget as cls

    rollout = {"response_length": response_length, "prompt_length": 64, "calculate_log_probs": True, "name": name,
               "max_model_len": max_model_len, "full_determinism": full_determinism}  # fmt: skip
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}, "data": {}})
    return PrefixGuidedAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                                 processor=None, dataset_cls=cls, data_config=DictConfigWrap(cfg.data))  # fmt: skip


def _run(loop, **kw):
    coro = loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "1+2?"}], **kw)
    return loop.loop.run_until_complete(coro)


def _lengths(tokenizer, loop, ratio):
    prompt = loop.loop.run_until_complete(loop.ct_build_initial_tokens([{"role": "user", "content": "1+2?"}]))
    return len(prompt), len(loop.target_prefix_ids(TARGET, ratio))


def test_priority_reaches_the_server_and_full_determinism_fixes_the_request_id(tokenizer):
    import numpy as np

    server = StrictServer(tokenizer.convert_tokens_to_ids("7"), max_model_len=10**6)
    _run(_loop(tokenizer, server), priority=np.int64(5))
    _run(_loop(tokenizer, server, full_determinism=True), priority=np.int64(7), target=TARGET, prefix_ratio=0.5)
    assert server.calls[0]["priority"] == 5 and len(server.calls[0]["request_id"]) == 32  # uuid4 hex
    assert server.calls[1]["priority"] == 7 and server.calls[1]["request_id"] == "det-7"


@pytest.mark.parametrize("sglang", [False, True])
def test_lowered_max_model_len_gives_a_shorter_answer_not_an_error(tokenizer, sglang):
    tok7 = tokenizer.convert_tokens_to_ids("7")
    name = "sglang" if sglang else "vllm"
    probe = _loop(tokenizer, StrictServer(tok7, 10**6))
    n_prompt, n_prefix = _lengths(tokenizer, probe, 0.5)
    # room for 2 new tokens after prompt + prefix: less than response_length - prefix
    max_model_len = n_prompt + n_prefix + 2 + (1 if sglang else 0)
    server = StrictServer(tok7, max_model_len, sglang=sglang)
    out = _run(_loop(tokenizer, server, max_model_len=max_model_len, name=name), target=TARGET, prefix_ratio=0.5)
    assert server.calls[-1]["max_tokens"] == 2
    assert len(out.response_ids) == n_prefix + 2 and out.extra_fields["prefix_token_mask"].sum() == n_prefix
    # no room at all after the prefix: the prefix alone, and no call (the server would raise)
    tight = n_prompt + n_prefix + (1 if sglang else 0)
    server = StrictServer(tok7, tight, sglang=sglang)
    out = _run(_loop(tokenizer, server, max_model_len=tight, name=name), target=TARGET, prefix_ratio=0.5)
    assert server.calls == [] and len(out.response_ids) == n_prefix
    assert out.response_logprobs == [0.0] * n_prefix


def test_sglang_empty_answer_keeps_the_prefix(tokenizer):
    server = StrictServer(tokenizer.convert_tokens_to_ids("7"), 10**6, sglang=True, empty=True)
    loop = _loop(tokenizer, server, name="sglang", max_model_len=10**6)
    n_prompt, n_prefix = _lengths(tokenizer, loop, 0.5)
    out = _run(loop, target=TARGET, prefix_ratio=0.5)
    assert len(server.calls) == 1 and len(out.response_ids) == n_prefix
    assert out.response_logprobs == [0.0] * n_prefix and out.response_mask == [1] * n_prefix
