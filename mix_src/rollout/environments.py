"""Tool-use environments in one file: a researcher subclasses :class:`ToolEnv` to bring a multi-turn task (items,
tools, an expert episode per item replayed by mix_src.rollout.agent_loop_tools, a score, an evaluation) and registers
it with ``@register_environment("name")`` (the rows' data_source; the file goes in ``mix.plugins``). The methods mapped
to Atropos / Trinity-RFT: mix_src/AGENTS_TOOLS.md. :func:`compute_score` (verl's custom-reward signature) scores the
rows by their environment; ``tools()`` returns plain functions for verl's ``@function_tool``
(``rollout.multi_turn.function_tool_path``; see ``recipes/toy_calculator/tools.py``). Registry entries are
self-describing (:mod:`mix_src.extend`); environments run on both trainer bases unless they say otherwise.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from mix_src.extend import Registry

# The environment a row belongs to is its data_source, not a config key: nothing is selected in the config.
ENVIRONMENTS: Registry[Callable[..., "ToolEnv"]] = Registry("tool environment", "data_source",
                                                           selected=lambda config: [])


def register_environment(name: str, **kw):
    """``@register_environment("name", bases=..., why_not=..., check=..., reads=...)`` on a ToolEnv subclass."""

    def deco(cls):
        cls.name = name
        return ENVIRONMENTS.register(name, **kw)(cls)

    return deco


def get_environment(name: str) -> "ToolEnv":
    return ENVIRONMENTS.get(name)()


class ToolEnv:
    """Base class of a tool-use environment. Override the methods marked *required*. Items are dicts with at
    least ``"question"`` (str) and ``"answer"`` (the ground truth, str)."""

    name: str = ""  # set by @register_environment
    system_prompt: Optional[str] = None

    # ---- required
    def items(self, split: str, n: int, seed: int) -> list[dict]:
        """*Required.* ``n`` items of ``split`` ("train", "heldout", "ood"), deterministic for ``seed``."""
        raise NotImplementedError

    def tools(self) -> list[Callable]:
        """*Required.* The tool functions (Google docstring + type hints, as verl's ``@function_tool`` needs)."""
        raise NotImplementedError

    def expert_episode(self, item: dict) -> Optional[list[dict]]:
        """*Required.* The expert's episode for ``item``: assistant turns (the raw text the model emits, tool
        calls in the parser's format) and ``{"role": "tool", "content": ...}`` results, or None (no guidance)."""
        raise NotImplementedError

    def score(self, item: dict, response: str) -> dict:
        """*Required.* ``{"score": float, ...}`` for a finished episode's decoded response (tool results
        included, as verl decodes the response)."""
        raise NotImplementedError

    # ---- provided
    def prompt(self, item: dict) -> list[dict]:
        """Chat messages of the prompt (system prompt, then the question)."""
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": item["question"]}]

    def evaluate(self, items: list[dict], responses: list[str]) -> dict:
        """Mean of every score key over ``items`` (Atropos ``evaluate``; Trinity's eval workflow)."""
        scores = [self.score(it, r) for it, r in zip(items, responses)]
        return {k: sum(s[k] for s in scores) / max(len(scores), 1) for k in (scores[0] if scores else {})}

    def episode_length(self, episode: list[dict], tokenizer, hf_model_type: Optional[str] = "qwen2") -> int:
        """Response tokens the episode takes in the agent loop, laid out by verl's Continuous-Token builder for
        ``hf_model_type`` exactly as :mod:`mix_src.rollout.agent_loop_tools` replays it: assistant turns + EOS, and
        each tool result rendered by the chat template with the next generation prompt."""
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        builder = getattr(self, "_builders", {}).get(id(tokenizer))
        if builder is None:
            builder = create_continuous_token_builder(tokenizer, hf_model_type=hf_model_type)
            self._builders = {id(tokenizer): builder}
        msgs = [{"role": "user", "content": "q"}]
        runtime = builder.build_initial_tokens(msgs)
        start = len(runtime)
        for m in episode:
            if m["role"] == "assistant":
                ids = tokenizer.encode(m["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
                runtime = builder.merge_assistant_tokens(runtime, ids).token_ids
                msgs = msgs + [{"role": "assistant", "content": m["content"]}]
            else:
                new = msgs + [{"role": "tool", "content": m["content"]}]
                runtime = builder.merge_context_tokens(msgs, new, runtime).token_ids
                msgs = new
        return len(runtime) - start

    def rows(self, split: str, n: int, seed: int, tokenizer=None, max_response_length: Optional[int] = None):
        """verl parquet rows for ``split`` and a stats dict: ``{"rows", "dropped_too_long", "no_expert"}``; with
        ``tokenizer`` and ``max_response_length``, an item whose episode takes more response tokens is dropped."""
        rows, stats = [], {"rows": 0, "dropped_too_long": 0, "no_expert": 0}
        for i, item in enumerate(self.items(split, n, seed)):
            episode = self.expert_episode(item)
            if episode is None:
                stats["no_expert"] += 1
            elif (tokenizer is not None and max_response_length is not None
                  and self.episode_length(episode, tokenizer) > max_response_length):
                stats["dropped_too_long"] += 1
                continue
            rows.append({
                "data_source": self.name,
                "prompt": self.prompt(item),
                "ability": "tool_use",
                "reward_model": {"style": "rule", "ground_truth": str(item["answer"])},
                "extra_info": {"split": split, "index": i, "item": json.dumps(item)},
                "target": json.dumps(episode) if episode is not None else "",
            })
        stats["rows"] = len(rows)
        return rows, stats


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl custom reward for environment rows: the registered environment named by ``data_source`` scores."""
    env = get_environment(data_source)
    item = json.loads((extra_info or {}).get("item") or "{}") or {"answer": ground_truth}
    item.setdefault("answer", ground_truth)
    return env.score(item, solution_str)
