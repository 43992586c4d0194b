"""Symbolic grading with math-verify, run **inside grading worker processes** (:mod:`mix_src.rewards.pool`), whose
deadline kills the process: math-verify's SIGALRM timeouts (main thread only, and blind to long C-level work such
as ``9^{9^{9^9}}``) are off (``parsing_timeout=None``, ``timeout_seconds=None``).
"""

from __future__ import annotations

import functools
import logging


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str):
    """Parse a ground truth the way LUFFY does (``parse("$" + gt + "$")``); a ground truth that already
    contains ``$`` or ``\\boxed`` is parsed as it is."""
    from math_verify import parse

    text = ground_truth.strip()
    wrapped = text if ("$" in text or "\\boxed" in text) else f"${text}$"
    gold = parse(wrapped, parsing_timeout=None)
    if not gold and wrapped != text:
        gold = parse(text, parsing_timeout=None)
    return gold


@functools.lru_cache(maxsize=1)
def _pred_config():
    # The last \boxed{} outranks "the final answer is ..." (math-verify's default: the reverse; Open-R1 uses priority 0
    # too), as math_verify_reward's in-process shortcuts, which read the last \boxed{} only.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def grade_math(answer: str, ground_truth: str) -> bool:
    """True when math-verify finds the answer equivalent to the ground truth. A ground truth math-verify
    cannot parse raises ``ValueError`` (the caller counts the row as ungradable, not as a wrong answer)."""
    from math_verify import parse, verify

    gold = _parse_gold(ground_truth)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth[:80]!r}")
    pred = parse(answer, extraction_config=_pred_config(), parsing_timeout=None)
    return bool(pred) and bool(verify(gold, pred, timeout_seconds=None))


# One of each common answer shape: grading them once in the zygote warms the LaTeX parser's DFA cache
# and sympy's lazy imports for every forked worker (about 30% less CPU on a fresh worker's first items).
_WARMUP = [("so \\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"), ("$x \\in (1, 2]$", "(1,2]"),
           ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"), ("\\boxed{(x+1)^2}", "x^2+2x+1"), ("\\boxed{0.25}", "\\frac{1}{4}"),
           ("\\boxed{[1,2]}", "(1,2]"), ("\\boxed{\\frac{3}{5}}", "\\frac{5}{3}"), ("\\boxed{3\\pi}", "3\\pi"),
           ("\\boxed{30^\\circ}", "30"), ("\\boxed{\\text{Monday}}", "\\text{Monday}"), ("\\boxed{(1,2)}", "(1,2)"),
           ("\\boxed{x=3}", "3"), ("The final answer is $-\\dfrac{7}{2}$.", "-3.5")]


def warmup() -> None:
    """Import math-verify and grade one answer of each common shape, so forked workers start warm."""
    # with its timeouts off, math-verify warns that "you must provide the logic for timeout interruption": the pool does
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for answer, gold in _WARMUP:
        grade_math(answer, gold)
