"""Toy tool-use environment: multiply a 3-digit by a 2-digit number, with a calculator tool.

The product is beyond what the tiny toy models compute in their heads; with the calculator it is one tool
call. Prompt: ``"347*58"``. Expert episode (hermes tool-call format, parsed by verl's ``HermesToolParser``)::

    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "347*58"}}</tool_call>
    tool:      20126
    assistant: 20126

Score: 1.0 when the last non-empty line of the decoded response is the product (``tool_calls`` counts the
``<tool_call>`` blocks, logged). Registered as environment ``toy_calculator`` (:mod:`mix_src.rollout.environments`);
load with ``mix.plugins=[scripts.experiments.toy_tasks.calculator]``; the tool file for verl is
``recipes/toy_calculator/tools.py``.
"""

from __future__ import annotations

import json
import random
import re

from mix_src.rollout.environments import ToolEnv, register_environment

_EXPR = re.compile(r"^\s*(\d{1,6})\s*([+\-*])\s*(\d{1,6})\s*$")


def calculator(expression: str) -> str:
    """Evaluate one integer operation.

    Args:
        expression: two non-negative integers joined by +, - or *, e.g. "347*58".
    """
    m = _EXPR.match(expression or "")
    if not m:
        return "error: want <int><op><int>"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def tool_call_text(expression: str) -> str:
    """The hermes tool call for ``expression`` (what verl's HermesToolParser parses)."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


@register_environment("toy_calculator")
class ToyCalculator(ToolEnv):
    """3-digit x 2-digit products (OOD: 3-digit x 3-digit)."""

    def items(self, split, n, seed):
        salt = {"train": 0, "heldout": 1, "ood": 2}[split]
        rng = random.Random(seed * 1000 + salt)
        hi_b = 999 if split == "ood" else 99
        seen, out = set(), []
        while len(out) < n:
            a, b = rng.randint(100, 999), rng.randint(10, hi_b)
            key = (a, b)
            # train and held-out are disjoint: held-out takes a odd, train a even
            if key in seen or (split == "train" and a % 2) or (split == "heldout" and not a % 2):
                continue
            seen.add(key)
            out.append({"question": f"{a}*{b}", "answer": str(a * b)})
        return out

    def tools(self):
        return [calculator]

    def expert_episode(self, item):
        result = calculator(item["question"])
        return [
            {"role": "assistant", "content": tool_call_text(item["question"])},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
        ]

    def score(self, item, response):
        lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
        correct = bool(lines) and lines[-1] == str(item["answer"])
        return {"score": float(correct), "acc": float(correct), "tool_calls": float(response.count("<tool_call>"))}
