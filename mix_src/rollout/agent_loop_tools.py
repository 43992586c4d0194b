"""Prefix-guided multi-turn, tool-calling rollouts (``prefix_guided_tool``): verl's ``ToolAgentLoop``
(``verl/experimental/agent_loop/tool_agent_loop.py``: tools, parser, state machine) started from a replayed prefix of
the row's expert episode (``target``, JSON assistant/tool messages), ``floor(ratio * A)`` of its ``A`` assistant tokens
(:func:`plan_prefix`). The episode format, the prefix rule, the overridden states and the masks:
mix_src/AGENTS_TOOLS.md. ``extra_fields`` as :mod:`mix_src.rollout.agent_loop`.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop

from mix_src.rollout.agent_loop import SERVER_EXTRA_KEYS, PrefixGuidedAgentLoop, row_target, row_value


class ExpertEpisodeError(ValueError):
    """An expert episode that is not a list of assistant/tool messages starting with an assistant turn."""


def parse_episode(target: Any) -> list[dict[str, str]]:
    """The row's expert episode: ``[]`` for no target, else its messages (JSON string or list); raises
    :class:`ExpertEpisodeError` naming what is wrong (roles, order, content type)."""
    if target is None or (isinstance(target, str) and not target.strip()):
        return []
    try:
        episode = json.loads(target) if isinstance(target, str) else list(target)
    except json.JSONDecodeError as e:
        raise ExpertEpisodeError(f"the row's target is not a JSON expert episode ({e}): {target[:80]!r}...; build rows "
                                 "with mix_src.rollout.environments.ToolEnv.rows") from e
    if not isinstance(episode, list):
        raise ExpertEpisodeError(f"expert episode must be a JSON list of messages, got {type(episode).__name__}")
    for i, msg in enumerate(episode):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("assistant", "tool") or not isinstance(msg.get("content"), str):
            raise ExpertEpisodeError(f"expert episode message {i}: want role assistant|tool with str content, got {msg!r}")
        if role == "tool" and i == 0:
            raise ExpertEpisodeError("expert episode must start with an assistant turn, got a tool message first")
    return episode


def plan_prefix(turn_lengths: Sequence[int], ratio: float) -> tuple[int, int]:
    """Where a ratio-``ratio`` prefix of an episode's assistant tokens ends.

    turn_lengths: (K,) token counts of the K assistant turns (EOS included), in order.
    Returns ``(n_full, head)``: the first ``n_full`` assistant turns are whole in the prefix (with the tool
    results that follow them), then ``head`` tokens (0 <= head < turn_lengths[n_full]) of turn ``n_full``.
    ``n_full == K`` means the whole episode (``head == 0``)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"prefix ratio must be in [0, 1], got {ratio}")
    n_tokens = int(np.floor(ratio * sum(turn_lengths)))
    for n_full, length in enumerate(turn_lengths):
        if n_tokens < length:
            return n_full, n_tokens
        n_tokens -= length
    return len(turn_lengths), 0


class _TurnHeadParser:
    """verl's tool parser, seeing the expert's head of the current turn before the model's continuation."""

    def __init__(self, parser, head_ids: list[int]):
        self.parser, self.head_ids = parser, list(head_ids)

    @property
    def stop_token_ids(self):
        return self.parser.stop_token_ids

    async def extract_tool_calls(self, responses_ids, tools=None):
        return await self.parser.extract_tool_calls(self.head_ids + list(responses_ids), tools)


@register("prefix_guided_tool")
class PrefixGuidedToolAgentLoop(ToolAgentLoop):
    """verl's tool agent loop whose episode may start with a replayed prefix of an expert episode."""

    # One instance per row (verl's default): the per-row plan and flags live on self during run().
    reusable = False

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs):
        self._ratio = float(row_value(kwargs, "prefix_ratio") or 0.0)
        self._episode = parse_episode(row_target(kwargs)) if self._ratio > 0 else []
        self._prefix_flags: list[int] = []  # aligned with agent_data.response_mask: 1 = expert assistant token
        self._turn_head: list[int] = []
        self._truncated = self._served = False
        sampling_params = {**sampling_params, "seed": PrefixGuidedAgentLoop.request_seed(self, kwargs, int(priority))}
        out = await super().run(sampling_params, priority=priority, **kwargs)

        n = len(out.response_ids)
        if self.rollout_config.calculate_log_probs:
            # verl stacks rollout log-probs only if every row has them: 0.0 on unserved tokens, as the single-turn loop
            lp = list(out.response_logprobs or [])
            out.response_logprobs = (lp + [0.0] * (n - len(lp)))[:n]
        flags = np.array((self._prefix_flags + [0] * n)[:n], dtype=np.uint8)
        extra = out.extra_fields
        extra.update({key: extra.get(key) for key in SERVER_EXTRA_KEYS})  # same keys on every row (DataProto.concat)
        if not self._served and kwargs.get("global_steps") is not None:
            version = int(kwargs["global_steps"]) - 1
            extra.update(global_steps=version, min_global_steps=version, max_global_steps=version)
        extra.update(prefix_token_mask=flags, prefix_ratio=self._ratio, prefix_truncated=self._truncated)
        return out

    def _track(self, new_mask_len: int, appended: int, expert: bool) -> None:
        """Keep the prefix flags aligned with verl's response mask after one merge."""
        appended = max(0, appended)  # a merge that trimmed tokens appended none
        keep = new_mask_len - appended
        flags = self._prefix_flags[:keep]
        flags += [0] * (keep - len(flags))
        self._prefix_flags = flags + [int(expert)] * appended

    async def _replay_assistant(self, agent_data: AgentData, ids: list[int]) -> bool:
        """Append expert tokens (response mask 1) cut to the room left in the response; True when cut."""
        room = self.response_length - len(agent_data.response_mask)
        self._truncated, ids = len(ids) > room, ids[:room]
        merge, mask, _ = await self.ct_merge_assistant_token(agent_data.prompt_ids, ids, agent_data.response_mask)
        agent_data.prompt_ids, agent_data.response_mask = merge.token_ids, mask
        self._track(len(mask), merge.appended_token_count, expert=True)
        return self._truncated

    async def _replay_tools(self, agent_data: AgentData, tool_msgs: list[dict]) -> bool:
        """Append recorded tool results (response mask 0); False when they do not fit the response."""
        previous = list(agent_data.messages)
        agent_data.messages.extend({"role": "tool", "content": m["content"]} for m in tool_msgs)
        schemas = getattr(agent_data, "_active_tool_schemas", self.tool_schemas)
        merge, mask, _ = await self.ct_merge_context_msg(previous, agent_data.messages, agent_data.prompt_ids,
                                                         agent_data.response_mask, None, tools=schemas)
        if len(mask) >= self.response_length:  # as verl's PROCESSING_TOOLS: a result that does not fit ends it
            return False
        agent_data.prompt_ids, agent_data.response_mask = merge.token_ids, mask
        self._track(len(mask), merge.appended_token_count, expert=False)
        agent_data.user_turns += 1
        return True

    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        state = await super()._handle_pending_state(agent_data, sampling_params)
        if not self._episode:
            return state
        eos = self.tokenizer.eos_token_id
        turns: list[tuple[list[int], list[dict]]] = []  # (assistant ids, tool messages after it)
        for msg in self._episode:
            if msg["role"] == "assistant":
                ids = list(self.tokenizer.encode(msg["content"], add_special_tokens=False))
                turns.append((ids if ids and ids[-1] == eos else ids + [eos], []))
            else:
                turns[-1][1].append(msg)
        n_full, head = plan_prefix([len(t[0]) for t in turns], self._ratio)
        active = getattr(agent_data, "_active_tools", self.tools)
        schemas = [tool.tool_schema for tool in active.values()]
        for ids, tool_msgs in turns[:n_full]:
            if await self._replay_assistant(agent_data, ids):  # the prefix does not fit the response: stop the episode
                return AgentState.TERMINATED
            agent_data.assistant_turns += 1
            content, calls = await self.tool_parser.extract_tool_calls(ids, schemas)
            agent_data.tool_calls = calls
            agent_data.messages.append(self._build_assistant_message(content, agent_data))
            if tool_msgs and not await self._replay_tools(agent_data, tool_msgs):
                self._truncated = True
                return AgentState.TERMINATED
        agent_data.tool_calls = []
        if n_full == len(turns):  # the whole expert episode: no generation
            return AgentState.TERMINATED
        if head:
            ids = turns[n_full][0][:head]
            if await self._replay_assistant(agent_data, ids):
                return AgentState.TERMINATED
            self._turn_head = ids
        if len(agent_data.response_mask) >= self.response_length:  # (a head that exactly fills it, too)
            return AgentState.TERMINATED
        return AgentState.GENERATING

    async def _handle_generating_state(self, agent_data: AgentData, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False) -> AgentState:
        pad = len(agent_data.response_mask) - len(agent_data.response_logprobs)
        if self.rollout_config.calculate_log_probs and pad > 0:  # expert / tool tokens: 0.0, verl's alignment holds
            agent_data.response_logprobs = list(agent_data.response_logprobs) + [0.0] * pad
        n_before = len(agent_data.response_mask)
        parser = self.tool_parser
        if self._turn_head:  # the model continues the expert's turn: parse the whole turn
            self.tool_parser = _TurnHeadParser(parser, self._turn_head)
            self._turn_head = []
        try:
            state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        finally:
            self.tool_parser = parser
        self._served = True
        self._track(len(agent_data.response_mask), len(agent_data.response_mask) - n_before, expert=False)
        return state

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        n_before = len(agent_data.response_mask)
        state = await super()._handle_processing_tools_state(agent_data)
        self._track(len(agent_data.response_mask), len(agent_data.response_mask) - n_before, expert=False)
        return state


def check_config(config) -> None:
    """Before Ray: refuse what this loop cannot honour, naming the key (called by mix_src.config.preflight)."""
    from omegaconf import OmegaConf

    if OmegaConf.select(config, "actor_rollout_ref.rollout.agent.default_agent_loop") != "prefix_guided_tool":
        return
    if OmegaConf.select(config, "mix.data.truncate_targets", default=False):
        raise ValueError("mix.data.truncate_targets=true with the prefix_guided_tool agent loop: a tool episode's "
                         "target is JSON and cutting it by tokens breaks it; drop too-long episodes at data prep "
                         "instead (mix_src.rollout.environments.ToolEnv.rows(max_response_length=...)) and set "
                         "mix.data.truncate_targets=false")
    if OmegaConf.select(config, "trainer.use_v1", default=False) and OmegaConf.select(
            config, "actor_rollout_ref.rollout.full_determinism", default=False):
        raise ValueError("actor_rollout_ref.rollout.full_determinism=true with prefix_guided_tool on "
                         "trainer.use_v1=true: verl's ToolAgentLoop names requests det-{priority} (tool_agent_loop.py "
                         "_make_request_id), and V1 runs a prompt's samples concurrently with priority 0, so the ids "
                         "collide; set full_determinism=false or trainer.use_v1=false")
