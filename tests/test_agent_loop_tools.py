"""Prefix-guided multi-turn tool rollouts (mix_src/rollout/agent_loop_tools.py) and the environment API.

The loop runs verl's real ToolAgentLoop state machine, Continuous-Token builder, hermes parser and the
calculator FunctionTool; only the LLM server is scripted (it returns fixed token lists and records prompts).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from omegaconf import OmegaConf

from mix_src.rollout.agent_loop_tools import ExpertEpisodeError, parse_episode, plan_prefix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_prefix_counts_assistant_tokens_across_turns():
    assert plan_prefix([10, 5], 0.0) == (0, 0)
    assert plan_prefix([10, 5], 1.0) == (2, 0)  # the whole episode
    assert plan_prefix([10, 5], 10 / 15) == (1, 0)  # exactly the first turn: its tool results follow
    assert plan_prefix([10, 5], 0.5) == (0, 7)  # floor(7.5) tokens into turn 0
    assert plan_prefix([10, 5], 0.8) == (1, 2)  # 12 tokens: turn 0 whole, 2 of turn 1
    with pytest.raises(ValueError):
        plan_prefix([3], 1.5)


def test_parse_episode_refuses_malformed_episodes():
    assert parse_episode("") == [] and parse_episode(None) == []
    ep = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "1"}]
    assert parse_episode(json.dumps(ep)) == ep
    with pytest.raises(ExpertEpisodeError, match="start with an assistant"):
        parse_episode(json.dumps([{"role": "tool", "content": "1"}]))
    with pytest.raises(ExpertEpisodeError, match="not a JSON expert episode"):
        parse_episode('[{"role": "assistant", "content": "<tool_call>{\\"na')  # a target cut by tokens
    with pytest.raises(ExpertEpisodeError, match="role assistant\\|tool"):
        parse_episode(json.dumps([{"role": "user", "content": "1"}]))


# --------------------------------------------------------------------------------------------- the loop
class ScriptedServer:
    """Stands in for verl's LLM server client: answers each call with the next scripted text (+ EOS)."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.prompts = tokenizer, list(replies), []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        from verl.workers.rollout.replica import TokenOutput

        self.prompts.append(list(prompt_ids))
        self.params = getattr(self, "params", []) + [dict(sampling_params)]
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


@pytest.fixture(scope="module")
def calc_tools():
    from verl.tools.function_tool import load_function_tools_from_path

    return load_function_tools_from_path(os.path.join(REPO, "recipes", "toy_calculator", "tools.py"))


def _loop(tokenizer, server, tools, response_length=200):
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    from mix_src.rollout.agent_loop_tools import PrefixGuidedToolAgentLoop
    from mix_src.trainer.dataset import RLHFDatasetWithTarget

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "response_length": response_length, "prompt_length": 64, "calculate_log_probs": True,
        "full_determinism": False, "seed": 0,
        "multi_turn": {"max_user_turns": 4, "max_assistant_turns": 4, "max_parallel_calls": 1,
                       "max_tool_response_length": 64, "tool_response_truncate_side": "right", "format": "hermes"},
    }}, "data": {}})  # fmt: skip
    return PrefixGuidedToolAgentLoop(
        trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer, processor=None,
        dataset_cls=RLHFDatasetWithTarget, data_config=DictConfigWrap(cfg.data), hf_model_type="qwen2",
        tools=ToolListWrap(tools),
    )


def _episode():
    from mix_src.rollout.environments import get_environment

    env = get_environment("toy_calculator")
    item = {"question": "964*59", "answer": "56876"}
    return env, item, env.expert_episode(item)


def _run(loop, ratio, episode):
    coro = loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "964*59"}],
                    target=json.dumps(episode), prefix_ratio=ratio)  # fmt: skip
    return loop.loop.run_until_complete(coro)


def _turn_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def test_whole_episode_replayed_without_generation(tokenizer, calc_tools):
    env, item, episode = _episode()
    server = ScriptedServer(tokenizer, [])
    out = _run(_loop(tokenizer, server, calc_tools), 1.0, episode)
    assert server.prompts == []  # ratio 1.0: no server call
    t1, t2 = _turn_ids(tokenizer, episode[0]["content"]), _turn_ids(tokenizer, episode[2]["content"])
    resp, mask = out.response_ids, out.response_mask
    prefix = out.extra_fields["prefix_token_mask"].tolist()
    # turn 1 as recorded, then the tool block (mask 0), then turn 2 as recorded
    assert resp[: len(t1)] == t1 and resp[-len(t2):] == t2
    tool_block = resp[len(t1): len(resp) - len(t2)]
    assert "tool\n56876" in tokenizer.decode(tool_block) and tokenizer.decode(tool_block).endswith("assistant\n")
    assert mask == [1] * len(t1) + [0] * len(tool_block) + [1] * len(t2)
    assert prefix == mask  # every trained token is the expert's
    assert out.response_logprobs == [0.0] * len(resp)  # every row has rollout log-probs (verl stacks all or none)
    assert out.extra_fields["prefix_truncated"] is False and out.extra_fields["prefix_ratio"] == 1.0
    assert env.score(item, tokenizer.decode(resp, skip_special_tokens=True))["score"] == 1.0


def test_prefix_at_a_turn_boundary_replays_the_recorded_tool_result(tokenizer, calc_tools):
    _, _, episode = _episode()
    t1, t2 = _turn_ids(tokenizer, episode[0]["content"]), _turn_ids(tokenizer, episode[2]["content"])
    server = ScriptedServer(tokenizer, ["56876"])
    out = _run(_loop(tokenizer, server, calc_tools), len(t1) / (len(t1) + len(t2)), episode)
    assert len(server.prompts) == 1
    assert tokenizer.decode(server.prompts[0]).endswith("<|im_start|>tool\n56876<|im_end|>\n<|im_start|>assistant\n")
    prefix, mask = out.extra_fields["prefix_token_mask"].tolist(), out.response_mask
    gen = _turn_ids(tokenizer, "56876")
    assert out.response_ids[-len(gen):] == gen and mask[-len(gen):] == [1] * len(gen)
    assert prefix == [1] * len(t1) + [0] * (len(mask) - len(t1))  # the model's answer is on-policy
    # rollout log-probs: 0.0 on expert/tool tokens, the server's on generated ones
    assert out.response_logprobs[: len(t1)] == [0.0] * len(t1) and out.response_logprobs[-len(gen):] == [-0.5] * len(gen)


def test_prefix_ending_inside_a_tool_call_runs_the_real_tool(tokenizer, calc_tools):
    _, _, episode = _episode()
    t1 = _turn_ids(tokenizer, episode[0]["content"])
    t2 = _turn_ids(tokenizer, episode[2]["content"])
    head = 30  # inside the JSON of the tool call: '<tool_call>{"name": "calculato'
    text1 = episode[0]["content"]
    # the model completes the call with *another* expression: the real calculator must answer it
    rest = text1[head:].replace("964*59", "964*58")
    server = ScriptedServer(tokenizer, [rest, "55912"])
    out = _run(_loop(tokenizer, server, calc_tools), head / (len(t1) + len(t2)), episode)
    assert len(server.prompts) == 2
    assert server.prompts[0][-head:] == t1[:head]  # the expert head, verbatim, ends the first prompt
    assert tokenizer.decode(server.prompts[1]).endswith("tool\n55912<|im_end|>\n<|im_start|>assistant\n")  # 964*58
    prefix = out.extra_fields["prefix_token_mask"].tolist()
    assert prefix[:head] == [1] * head and sum(prefix) == head
    assert out.response_mask[:head] == [1] * head
    assert out.extra_fields["tool_rewards"] == [0.0] and out.num_turns >= 3  # one real tool call (verl records its reward)


def test_truncated_episode_is_cut_and_flagged(tokenizer, calc_tools):
    _, _, episode = _episode()
    server = ScriptedServer(tokenizer, [])
    out = _run(_loop(tokenizer, server, calc_tools, response_length=40), 1.0, episode)
    assert server.prompts == [] and len(out.response_ids) == 40
    assert out.extra_fields["prefix_truncated"] is True
    assert out.extra_fields["prefix_token_mask"].tolist() == [1] * 40


def test_no_prefix_is_verls_tool_loop(tokenizer, calc_tools):
    _, _, episode = _episode()
    server = ScriptedServer(tokenizer, [episode[0]["content"], "56876"])
    out = _run(_loop(tokenizer, server, calc_tools), 0.0, episode)
    assert len(server.prompts) == 2 and out.extra_fields["prefix_token_mask"].sum() == 0
    assert "tool\n56876" in tokenizer.decode(out.response_ids)  # the real tool answered


def test_v1_kwargs_and_row_seed(tokenizer, calc_tools):
    """verl's V1 trainer sends per-prompt lists and a session id; the row's seed reaches the server."""
    _, _, episode = _episode()
    t1, t2 = _turn_ids(tokenizer, episode[0]["content"]), _turn_ids(tokenizer, episode[2]["content"])
    server = ScriptedServer(tokenizer, ["56876"])
    loop = _loop(tokenizer, server, calc_tools)
    coro = loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "964*59"}],
                    target=json.dumps(episode), prefix_ratios=[0.0, len(t1) / (len(t1) + len(t2))],
                    rollout_seeds=[11, 12], session_id=1, index=0)  # fmt: skip
    out = loop.loop.run_until_complete(coro)
    assert len(server.prompts) == 1 and server.params[0]["seed"] == 12
    assert out.extra_fields["prefix_token_mask"].sum() == len(t1)


# --------------------------------------------------------------------------------------- environments
def test_environment_rows_drop_episodes_that_do_not_fit_with_a_count(tokenizer):
    from mix_src.rollout.environments import ENVIRONMENTS, get_environment

    env = get_environment("toy_calculator")
    assert ENVIRONMENTS.describe("toy_calculator").bases == ("legacy", "v1")
    episode = env.expert_episode({"question": "964*59", "answer": "56876"})
    need = env.episode_length(episode, tokenizer)
    rows, stats = env.rows("train", 5, 0, tokenizer=tokenizer, max_response_length=need)
    assert stats == {"rows": 5, "dropped_too_long": 0, "no_expert": 0}
    rows, stats = env.rows("train", 5, 0, tokenizer=tokenizer, max_response_length=need - 1)
    assert stats["dropped_too_long"] == 5 and rows == []
    rows, _ = env.rows("heldout", 3, 0)
    assert {r["data_source"] for r in rows} == {"toy_calculator"} and json.loads(rows[0]["target"])[1]["role"] == "tool"


def test_episode_length_matches_the_agent_loop(tokenizer, calc_tools):
    env, _, episode = _episode()
    out = _run(_loop(tokenizer, ScriptedServer(tokenizer, []), calc_tools), 1.0, episode)
    assert env.episode_length(episode, tokenizer) == len(out.response_ids)


def test_compute_score_dispatches_on_data_source():
    from mix_src.rollout.environments import compute_score

    s = compute_score("toy_calculator", "<tool_call>x</tool_call>\ntool\n42\nassistant\n42", "42")
    assert s["score"] == 1.0 and s["tool_calls"] == 1.0
    assert compute_score("toy_calculator", "41", "42")["score"] == 0.0


# --------------------------------------------------------------------------------------------- e2e (Ray)
# V1 (sync): verl's replay buffer filters groups itself and takes no max_num_gen_batches (recipes/README.md)
BASES = {"legacy": ["algorithm.filter_groups.max_num_gen_batches=2"],
         "v1": ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync", "algorithm.filter_groups.max_num_gen_batches=0"]}


@pytest.mark.ray
@pytest.mark.parametrize("base", sorted(BASES))
def test_guided_tool_episodes_train_two_steps_with_filter_groups(tiny_assets, tmp_path, base):
    """python -m mix_src.main_mix_ppo on the toy calculator through the real agent loop (hermes parser,
    calculator function tool, env reward), grpo_split and filter groups on, on both trainer bases: each group has
    one whole expert episode (ratio 1.0: 2 assistant turns + 1 recorded tool result, always correct) and one
    on-policy episode of the random model (always wrong), so every group is kept."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from e2e import MIX_CPU, run_verl, tiny_overrides

    sys.path.insert(0, os.path.join(REPO, "recipes", "toy_calculator"))
    from prepare import prepare

    data = prepare(tiny_assets["tokenizer"], str(tmp_path / "data"), n_train=8, n_eval=4, max_response_length=128)
    assets = {**tiny_assets, "train": data["train"]["path"], "val": data["heldout"]["path"]}
    overrides = MIX_CPU + tiny_overrides(
        assets, steps=2, n=2, batch_size=2, prompt_length=32, response_length=128,
        reward=["reward.custom_reward_function.path=pkg://mix_src.rollout.environments",
                "reward.custom_reward_function.name=compute_score"],
    ) + [
        "mix.plugins=[scripts.experiments.toy_tasks.calculator]",
        "actor_rollout_ref.rollout.agent.default_agent_loop=prefix_guided_tool",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={REPO}/recipes/toy_calculator/tools.py",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "mix.n_prefix=1", "mix.min_prefix_ratio=1.0", "mix.max_prefix_ratio=1.0",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.adv_estimator=grpo_split", *BASES[base],
    ]  # fmt: skip
    result = run_verl("mix_src.main_mix_ppo", overrides, tmp_path, timeout=420)
    assert [m["step"] for m in result.metrics] == [1, 2]
    for m in result.metrics:
        assert m["batch/off_solved"] == 1.0  # the replayed expert episodes score 1 under the env's reward
        if base == "legacy":
            assert m["train/num_kept_prompts"] == 2
        else:  # verl's replay buffer evicts zero-std groups and logs how many samples it dropped
            assert m.get("training/filter_groups/evicted_samples", 0) == 0
        assert m["num_turns/max"] == 4  # prompt + 2 expert assistant turns + 1 replayed tool turn
        assert np.isfinite(m["actor/pg_loss"]) and np.isfinite(m["actor/off_pg_loss"])
        # expert tokens are about half the trained tokens: tool-result tokens are not counted as trained
        assert 0 < m["batch/prefix_token_frac"] < 1


def test_config_refusals_before_ray():
    from mix_src.rollout.agent_loop_tools import check_config

    base = {"actor_rollout_ref": {"rollout": {"agent": {"default_agent_loop": "prefix_guided_tool"},
                                              "full_determinism": False}},
            "mix": {"data": {"truncate_targets": False}}, "trainer": {"use_v1": False}}  # fmt: skip
    check_config(OmegaConf.create(base))
    bad = OmegaConf.merge(base, {"mix": {"data": {"truncate_targets": True}}})
    with pytest.raises(ValueError, match="mix.data.truncate_targets=true"):
        check_config(bad)
    bad = OmegaConf.merge(base, {"trainer": {"use_v1": True}, "actor_rollout_ref": {"rollout": {"full_determinism": True}}})
    with pytest.raises(ValueError, match="full_determinism=true"):
        check_config(bad)
    check_config(OmegaConf.merge(bad, {"actor_rollout_ref": {"rollout": {"agent": {"default_agent_loop": "prefix_guided"}}}}))


# ----------------------------------------------------------------------------- the toy's HF evaluator
class _ScriptedHF:
    """Stands in for an HF model in scripts/experiments/toy_calculator.run_episodes: turn k of every row is reply k."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.turn = tok, replies, 0

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kw):
        import torch

        rows = []
        for x in input_ids.tolist():
            q = self.tok.decode(x).split("user\n")[1].split("<|im_end|>")[0]
            rows.append(self.tok.encode(self.replies[self.turn](q), add_special_tokens=False) + [eos_token_id])
        self.turn += 1
        width = max(map(len, rows))
        return torch.cat([input_ids, torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])], 1)


def test_toy_evaluator_plays_the_agent_loops_episode(tmp_path):
    """The evaluator of the toy table runs the real calculator on the model's call and lays the episode out
    as the agent loop does (same length as ToolEnv.episode_length); a wrong call gets the tool's error."""
    from scripts.experiments.toy_tasks.calculator import calculator, tool_call_text
    from scripts.experiments import toy_calculator as tc

    tok = tc.build_tokenizer(str(tmp_path / "tok"))
    env = tc._env()
    items = [{"question": "964*59", "answer": "56876"}, {"question": "123*45", "answer": "5535"}]
    good = _ScriptedHF(tok, [tool_call_text, calculator])
    res = tc.run_episodes(good, tok, items)
    assert [r["acc"] for r in res] == [1.0, 1.0] and [r["tool_calls"] for r in res] == [1.0, 1.0]
    assert "tool\n56876" in res[0]["response"]
    assert [r["response_tokens"] for r in res] == [env.episode_length(env.expert_episode(it), tok) for it in items]
    head = _ScriptedHF(tok, [lambda q: "56000"])  # answers without the tool: one turn, wrong
    assert [r["acc"] for r in tc.run_episodes(head, tok, items[:1])] == [0.0] and head.turn == 1
    bad = _ScriptedHF(tok, [lambda q: "<tool_call>{oops</tool_call>", lambda q: "1"])
    r = tc.run_episodes(bad, tok, items[:1])[0]
    assert "error: bad tool call" in r["response"] and r["acc"] == 0.0
