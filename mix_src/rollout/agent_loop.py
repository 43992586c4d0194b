"""Prefix-guided agent loop ``prefix_guided``: ``prefix + generate(prompt + prefix)`` with ``prefix =
target_ids[:floor(ratio * len)]`` (:func:`mix_src.algo.prefix.build_prefix`; the algorithm: mix_src/README.md).

Registered with verl's ``@register`` wherever imported (verl's AgentLoopWorker imports it through ``data.custom_cls``
-> :mod:`mix_src.trainer.dataset`; stock verl through ``mix_src/config/agent_loops.yaml``). Row fields:
``raw_prompt``; ``target`` (``""`` = none); ``prefix_ratio`` (absent in validation); ``rollout_seed``
(:mod:`mix_src.algo.seeding`); on verl's V1 trainer (one run per sample, ``session_id`` 0..n-1) the prompt's
``prefix_ratios`` and ``rollout_seeds``. A prefix that fills the response (ratio 1.0) makes **no server call**
(LUFFY generated a discarded continuation); its ``min/max_global_steps`` are the dispatching step - 1 (V1 casts
these to int, ``verl/trainer/ppo/v1/trainer_base.py`` 1897). Prefix tokens have rollout log-prob 0.0 (kept out of
rollout metrics). ``extra_fields``: ``prefix_token_mask`` (uint8, response length), ``prefix_ratio``,
``prefix_truncated`` (cut to the response length). ``max_tokens`` is clamped to the room after prompt + prefix; a
row with no room answers with its prefix alone, where verl's servers raise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Optional
from uuid import uuid4

import numpy as np

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.utils.profiler import simple_timer

from mix_src.algo.prefix import build_prefix
from mix_src.algo.seeding import fallback_seed

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))


# extra_fields a served row gets from verl's servers and server client (global_steps: every server, e.g.
# vllm_async_server.py:689; num_cached_tokens: vllm_async_server.py:704; min/max_global_steps: llm_server.py:161);
# None on a row that made no server call.
SERVER_EXTRA_KEYS = ("global_steps", "min_global_steps", "max_global_steps", "num_cached_tokens")
# Distinct prompts whose token ids a reused loop instance keeps (cleared when full).
PROMPT_CACHE_SIZE = 4096
# The model context per (path, hf_config_path, override_config), where rollout.max_model_len is null.
_MODEL_CONTEXT: dict[tuple, Optional[int]] = {}


def row_value(kwargs: dict[str, Any], name: str) -> Any:
    """The row's ``kwargs[name]``; on verl's V1 trainer (one list per prompt, ``name + "s"``) the session's item."""
    value = kwargs.get(name)
    if value is None and kwargs.get(name + "s") is not None:
        value = kwargs[name + "s"][int(kwargs["session_id"])]
    return value


def row_target(kwargs: dict[str, Any]) -> Any:
    """The row's target: on verl's V1 trainer with ``mix.data.use_target_lst`` the session's drawn demonstration
    (``prefix_targets``, one per session: mix_src/trainer/v1.py ``_next_train_batch``), else ``target`` (the legacy
    base writes each row's draw there)."""
    drawn = kwargs.get("prefix_targets")
    if drawn is not None and kwargs.get("session_id") is not None:
        return drawn[int(kwargs["session_id"])]
    return kwargs.get("target")


@register("prefix_guided")
class PrefixGuidedAgentLoop(AgentLoopBase):
    """Single-turn agent loop whose response may start with a prefix of the off-policy target."""

    # no per-row state on self: one instance serves every row (mix_src.rollout.agent_loop_worker)
    reusable = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_length = int(self.rollout_config.response_length)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._prompt_cache: dict[str, asyncio.Future] = {}

    async def prompt_token_ids(self, messages: list) -> list[int]:
        """verl's ``ct_build_initial_tokens(messages)``, once per distinct prompt (its n samples await one task)."""
        try:
            key = json.dumps(messages, sort_keys=True)
        except TypeError:  # not plain JSON (e.g. image objects): no caching
            return await self.ct_build_initial_tokens(messages)
        task = self._prompt_cache.get(key)
        if task is None:
            if len(self._prompt_cache) >= PROMPT_CACHE_SIZE:
                self._prompt_cache.clear()
            task = self._prompt_cache[key] = asyncio.ensure_future(self.ct_build_initial_tokens(messages))
        try:
            return list(await task)
        except BaseException:
            self._prompt_cache.pop(key, None)  # a failed rendering is not kept
            raise

    def target_prefix_ids(self, target: Any, ratio: float) -> list[int]:
        """Token ids of ``floor(ratio * len(target + EOS))`` leading target tokens (empty if no target)."""
        if ratio <= 0.0 or not isinstance(target, str) or not target:
            return []
        target_ids = self.tokenizer.encode(target, add_special_tokens=False)
        return list(build_prefix(target_ids, ratio, self.eos_token_id))

    def max_model_len(self) -> Optional[int]:
        """``rollout.max_model_len``; if null (resolved on the driver by :mod:`mix_src.config.model_context`, but not
        by stock verl's entry point or for an uncached hub id), the model's context, once per process; else None."""
        value = getattr(self.rollout_config, "max_model_len", None)
        if value:
            return int(value)
        model = self.config.actor_rollout_ref.get("model") if hasattr(self.config.actor_rollout_ref, "get") else None
        path = model.get("path") if model else None
        if not path:
            return None
        key = (str(path), str(model.get("hf_config_path")), str(model.get("override_config")))
        if key not in _MODEL_CONTEXT:
            from mix_src.config.model_context import model_context_length

            try:
                _MODEL_CONTEXT[key] = model_context_length(model, local_files_only=False)
            except Exception as e:  # noqa: BLE001
                logger.warning("prefix_guided: no max_model_len and the model context is unreadable (%s): no clamp", e)
                _MODEL_CONTEXT[key] = None
        return _MODEL_CONTEXT[key]

    def request_seed(self, kwargs: dict[str, Any], priority: int) -> int:
        """The row's sampling seed (vLLM's ``SamplingParams.seed``): the trainer's ``rollout_seed``, else one from the
        row's position (verl's ``priority``, e.g. in validation); see :mod:`mix_src.algo.seeding`."""
        seed = row_value(kwargs, "rollout_seed")
        if seed is not None:
            return int(seed)
        rollout_seed = int(getattr(self.rollout_config, "seed", None) or 0)  # verl's default: 42
        if kwargs.get("session_id") is not None:  # V1 sets no priority: the row's data index and its sample
            return fallback_seed(rollout_seed, int(kwargs.get("index", 0) or 0), int(kwargs["session_id"]))
        return fallback_seed(rollout_seed, priority)

    @staticmethod
    def deterministic_request_id(kwargs: dict[str, Any], priority: int) -> str:
        """verl's ``det-{priority}`` (single_turn_agent_loop.py); on V1, where every request has priority 0,
        the data index and sample keep concurrent ids distinct (vLLM refuses a running request's id)."""
        if kwargs.get("session_id") is not None:
            return f"det-{int(kwargs.get('index', 0) or 0)}-{int(kwargs['session_id'])}"
        return f"det-{priority}"

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> AgentLoopOutput:
        priority = int(priority)  # may arrive as np.int64 from the batch's non-tensor fields
        sampling_params = {**sampling_params, "seed": self.request_seed(kwargs, priority)}
        prompt_ids = await self.prompt_token_ids(list(kwargs["raw_prompt"]))

        ratio = float(row_value(kwargs, "prefix_ratio") or 0.0)
        prefix_ids = self.target_prefix_ids(row_target(kwargs), ratio)
        truncated = len(prefix_ids) > self.response_length
        prefix_ids = prefix_ids[: self.response_length]
        ends_with_eos = bool(prefix_ids) and prefix_ids[-1] == self.eos_token_id

        metrics: dict[str, Any] = {}
        gen_ids: list[int] = []
        gen_logprobs = None
        # Same keys on every row, served or not: DataProto.concat asserts equal keys across worker chunks.
        extra: dict[str, Any] = dict.fromkeys(SERVER_EXTRA_KEYS)
        max_tokens = self.response_length - len(prefix_ids)
        max_model_len = self.max_model_len()
        if max_model_len:  # the server's room: vLLM max_model_len - context, SGLang one less (async_sglang_server.py)
            sglang = getattr(self.rollout_config, "name", None) == "sglang"
            max_tokens = min(max_tokens, max_model_len - len(prompt_ids) - len(prefix_ids) - int(sglang))
        if max_tokens > 0 and not ends_with_eos:  # a whole target (+EOS) needs no generation at all
            full_determinism = getattr(self.rollout_config, "full_determinism", False)
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(
                    request_id=self.deterministic_request_id(kwargs, priority) if full_determinism else uuid4().hex,
                    prompt_ids=prompt_ids + prefix_ids, sampling_params={**sampling_params, "max_tokens": max_tokens},
                    priority=priority)  # fmt: skip
            gen_ids = list(out.token_ids)[:max_tokens]
            gen_logprobs = list(out.log_probs)[:max_tokens] if out.log_probs else None
            extra.update(out.extra_fields or {})
            metrics["num_preempted"] = out.num_preempted if out.num_preempted is not None else -1
        elif kwargs.get("global_steps") is not None:  # no server call: the policy version at dispatch
            version = int(kwargs["global_steps"]) - 1
            extra.update(global_steps=version, min_global_steps=version, max_global_steps=version)

        response_ids = prefix_ids + gen_ids
        response_logprobs = None  # verl stacks rollout log-probs only if every row has them: one rule for all rows
        if self.rollout_config.calculate_log_probs:
            response_logprobs = [0.0] * len(prefix_ids) + (gen_logprobs or [0.0] * len(gen_ids))
        prefix_mask = (np.arange(len(response_ids)) < len(prefix_ids)).astype(np.uint8)
        extra.update(prefix_token_mask=prefix_mask, prefix_ratio=ratio, prefix_truncated=truncated)
        extra.update(turn_scores=[], tool_rewards=[])  # same schema as verl's single/tool agent loops

        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids, response_mask=[1] * len(response_ids),
                               response_logprobs=response_logprobs, num_turns=2, metrics=AgentLoopMetrics(**metrics),
                               extra_fields=extra)  # fmt: skip
