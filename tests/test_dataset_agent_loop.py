"""RLHFDatasetWithTarget (target normalisation, counts, errors) and the prefix-guided agent loop (no Ray)."""

import asyncio
import math

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from mix_src.trainer.dataset import RLHFDatasetWithTarget, normalize_target


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


def _prompt(q):
    return [{"role": "user", "content": q}]


def _write(tmp_path, rows, name="d.parquet"):
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _data_cfg(tmp_path, mix=None):
    cfg = {"prompt_key": "prompt", "max_prompt_length": 256, "filter_overlong_prompts": False, "seed": 3,
           "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    if mix is not None:
        cfg["mix"] = mix
    return OmegaConf.create(cfg)


def _row(i, target):
    row = {"data_source": "t", "prompt": _prompt(f"q{i}"), "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}}  # fmt: skip
    if target is not ...:
        row["target"] = target
    return row


def test_normalize_target_forms():
    assert normalize_target([{"role": "assistant", "content": "abc"}]) == "abc"
    assert normalize_target(np.array([{"role": "assistant", "content": "abc"}], dtype=object)) == "abc"
    assert normalize_target({"content": "x"}) == "x"
    assert normalize_target("plain") == "plain"
    for bad in (None, "", "   ", [], [{"role": "assistant", "content": ""}], 3, [{"content": 5}]):
        assert normalize_target(bad) is None


def test_targets_normalised_counted_and_long_ones_dropped(tmp_path, tokenizer, capsys):
    mix = {"n_prefix": 1, "data": {"max_target_length": 20}}
    luffy_form = [  # LUFFY's [{role, content}] column; an empty content makes the row on-policy only
        _row(0, [{"role": "assistant", "content": "<think>1+1=2</think> \\boxed{2}"}]),
        _row(1, [{"role": "assistant", "content": ""}]),
    ]
    ds = RLHFDatasetWithTarget(_write(tmp_path, luffy_form, "a.parquet"), tokenizer, _data_cfg(tmp_path, mix))
    assert [ds[i]["target"] for i in range(2)] == ["<think>1+1=2</think> \\boxed{2}", ""]
    assert ds.target_stats["invalid_target"] == 1
    assert "1 empty/non-string targets -> on-policy only" in capsys.readouterr().out

    plain_form = [_row(0, "plain \\boxed{1}"), _row(1, "x" * 50), _row(2, None)]  # too long -> row dropped
    ds = RLHFDatasetWithTarget(_write(tmp_path, plain_form, "b.parquet"), tokenizer, _data_cfg(tmp_path, mix))
    assert len(ds) == 2 and [ds[i]["target"] for i in range(2)] == ["plain \\boxed{1}", ""]
    assert ds.target_stats["dropped_too_long"] == 1 and ds.target_stats["invalid_target"] == 1
    assert "1 rows dropped for targets over mix.data.max_target_length=20" in capsys.readouterr().out


def test_truncate_targets_keeps_row_and_counts(tmp_path, tokenizer):
    rows = [_row(0, "abcdefghij" * 5)]
    mix = {"n_prefix": 1, "data": {"max_target_length": 12, "truncate_targets": True}}
    ds = RLHFDatasetWithTarget(_write(tmp_path, rows), tokenizer, _data_cfg(tmp_path, mix))
    assert len(ds) == 1 and ds.target_stats["truncated"] == 1
    assert len(tokenizer.encode(ds[0]["target"], add_special_tokens=False)) == 12


def test_missing_target_column_is_an_error_naming_file_and_column(tmp_path, tokenizer):
    path = _write(tmp_path, [_row(0, ...)], "no_target.parquet")
    with pytest.raises(ValueError, match=r"no_target\.parquet.*no 'target' column.*mix\.n_prefix"):
        RLHFDatasetWithTarget(path, tokenizer, _data_cfg(tmp_path, {"n_prefix": 1}))
    # fine for on-policy training and for validation sets (no mix section)
    assert RLHFDatasetWithTarget(path, tokenizer, _data_cfg(tmp_path, {"n_prefix": 0}))[0]["target"] == ""
    assert "target" not in RLHFDatasetWithTarget(path, tokenizer, _data_cfg(tmp_path))[0]


def test_sample_target_ratio_is_seeded_and_counted(tmp_path, tokenizer):
    rows = [_row(i, f"t{i}") for i in range(40)]
    mix = {"n_prefix": 1, "data": {"sample_target_ratio": 0.5}}
    a = RLHFDatasetWithTarget(_write(tmp_path, rows), tokenizer, _data_cfg(tmp_path, mix))
    b = RLHFDatasetWithTarget(_write(tmp_path, rows), tokenizer, _data_cfg(tmp_path, mix))
    kept = [a[i]["target"] != "" for i in range(40)]
    assert kept == [b[i]["target"] != "" for i in range(40)]  # same seed -> same rows
    assert 10 <= sum(kept) <= 30 and a.target_stats["unsampled_target"] == 40 - sum(kept)


def test_think_prefix_stripped_only_when_prompt_ends_with_it(tmp_path, tokenizer):
    think_template = tokenizer.chat_template.replace("assistant\n' }}", "assistant\n<think>\n' }}")
    assert think_template != tokenizer.chat_template
    rows = [_row(0, "<think>\nreasoning</think> \\boxed{0}")]
    ds = RLHFDatasetWithTarget(_write(tmp_path, rows), tokenizer, _data_cfg(tmp_path, {"n_prefix": 1}))
    assert ds[0]["target"].startswith("<think>\n")  # plain ChatML prompt: unchanged
    tokenizer.chat_template, saved = think_template, tokenizer.chat_template
    try:
        ds = RLHFDatasetWithTarget(_write(tmp_path, rows), tokenizer, _data_cfg(tmp_path, {"n_prefix": 1}))
    finally:
        tokenizer.chat_template = saved
    assert ds[0]["target"] == "reasoning</think> \\boxed{0}" and ds.target_stats["think_prefix_stripped"] == 1


# ---------------------------------------------------------------------------------------------------
# agent loop


class RecordingServer:
    """Stands in for verl's LLM server client: records calls, returns fixed tokens with log-probs."""

    def __init__(self, token_id):
        self.calls, self.token_id = [], token_id

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        k = min(3, sampling_params["max_tokens"])
        return TokenOutput(token_ids=[self.token_id] * k, log_probs=[-0.5] * k)


def _agent_loop(tokenizer, server, response_length=40):
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from mix_src.rollout.agent_loop import PrefixGuidedAgentLoop
    from mix_src.trainer.dataset import RLHFDatasetWithTarget as cls

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": response_length, "prompt_length": 64,
                                                              "calculate_log_probs": True}}, "data": {}})  # fmt: skip
    return PrefixGuidedAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                                 processor=None, dataset_cls=cls, data_config=DictConfigWrap(cfg.data))  # fmt: skip


def _run(loop, **kw):
    # the agent loop keeps the event loop it was built in (verl's AgentLoopBase.loop): run on that one
    coro = loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1}, raw_prompt=_prompt("1+2?"), **kw)
    return loop.loop.run_until_complete(coro)


TARGET = "<think>1+2=3</think> \\boxed{3}"


def test_ratio_one_rows_make_no_server_call(tokenizer):
    server = RecordingServer(tokenizer.convert_tokens_to_ids("7"))
    loop = _agent_loop(tokenizer, server)
    out = _run(loop, target=TARGET, prefix_ratio=1.0)
    target_ids = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert server.calls == []
    assert out.response_ids == target_ids
    assert out.extra_fields["prefix_token_mask"].tolist() == [1] * len(target_ids)
    assert out.response_logprobs == [0.0] * len(target_ids) and out.response_mask == [1] * len(target_ids)


def test_partial_prefix_continues_with_reduced_max_tokens(tokenizer):
    tok7 = tokenizer.convert_tokens_to_ids("7")
    server = RecordingServer(tok7)
    loop = _agent_loop(tokenizer, server, response_length=40)
    out = _run(loop, target=TARGET, prefix_ratio=0.5)
    target_ids = tokenizer.encode(TARGET, add_special_tokens=False) + [tokenizer.eos_token_id]
    k = math.floor(0.5 * len(target_ids))
    assert len(server.calls) == 1
    call = server.calls[0]
    assert call["prompt_ids"][-k:] == target_ids[:k]  # prompt + prefix, no re-tokenisation
    assert call["sampling_params"]["max_tokens"] == 40 - k
    assert out.response_ids == target_ids[:k] + [tok7] * 3
    assert out.extra_fields["prefix_token_mask"].tolist() == [1] * k + [0] * 3
    assert out.response_logprobs == [0.0] * k + [-0.5] * 3
    assert out.extra_fields["prefix_ratio"] == 0.5 and out.extra_fields["prefix_truncated"] is False


def test_no_ratio_or_no_target_is_plain_generation(tokenizer):
    server = RecordingServer(tokenizer.convert_tokens_to_ids("7"))
    loop = _agent_loop(tokenizer, server)
    for kw in ({}, {"target": TARGET, "prefix_ratio": 0.0}, {"target": "", "prefix_ratio": 1.0}):
        out = _run(loop, **kw)
        assert out.extra_fields["prefix_token_mask"].sum() == 0 and len(out.response_ids) == 3
        assert server.calls[-1]["sampling_params"]["max_tokens"] == 40
    assert len(server.calls) == 3


def test_prefix_longer_than_response_is_cut_and_flagged(tokenizer):
    server = RecordingServer(tokenizer.convert_tokens_to_ids("7"))
    loop = _agent_loop(tokenizer, server, response_length=5)
    out = _run(loop, target=TARGET, prefix_ratio=1.0)
    assert server.calls == [] and len(out.response_ids) == 5
    assert out.extra_fields["prefix_truncated"] is True and out.extra_fields["prefix_token_mask"].sum() == 5


def test_a_reused_loop_renders_each_prompt_once(tokenizer, monkeypatch):
    """The n samples of a prompt share its token ids: one chat-template rendering per distinct prompt."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase

    server = RecordingServer(tokenizer.convert_tokens_to_ids("7"))
    loop = _agent_loop(tokenizer, server)
    rendered = []
    real = AgentLoopBase.ct_build_initial_tokens

    async def counting(self, messages, *a, **k):
        rendered.append(messages[0]["content"])
        return await real(self, messages, *a, **k)

    monkeypatch.setattr(AgentLoopBase, "ct_build_initial_tokens", counting)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    outs = [loop.loop.run_until_complete(loop.run(params, raw_prompt=_prompt(q))) for q in ("1+2?", "1+2?", "3+4?")]
    assert rendered == ["1+2?", "3+4?"]
    assert outs[0].prompt_ids == outs[1].prompt_ids != outs[2].prompt_ids
    outs[0].prompt_ids.append(-1)  # callers get their own list
    assert loop.loop.run_until_complete(loop.run(params, raw_prompt=_prompt("1+2?"))).prompt_ids == outs[1].prompt_ids

    async def concurrently():  # as verl runs a batch's rows: all start before any rendering finishes
        return await asyncio.gather(*[loop.run(params, raw_prompt=_prompt(q)) for q in ("5+6?", "5+6?", "7+8?")])

    rendered.clear()
    outs = loop.loop.run_until_complete(concurrently())
    assert sorted(rendered) == ["5+6?", "7+8?"] and outs[0].prompt_ids == outs[1].prompt_ids != outs[2].prompt_ids
